"""INT8: FP32 graph + calibration data -> model.int8.onnx with calibrated Q/DQ pairs (the precision's one module;
FP16's is pipeline/stages/fp16.py).  Its records are calibration/int8_records.py's; the data comes in read and
split once per run (calibration/holdout.py read_calibration -> CalibrationParts).

make_int8_graph composes the steps, each a function from typed values to a typed value:
  keep_sample          the first rows the agreement gate judges, kept in the cache folder (SAMPLE) for diagnose
  build_candidates     per calibration method and smoothing alpha, scales, ranges and input means fit on the fit
                       rows (from the cache, or from one pass over them per graph, whatever the methods:
                       calibration/ranges.py on the FP32 graph, and one more for the maxima that give
                       calibration/smooth.py's scales, then on each smoothed graph) and its Q/DQ graph, made as
                       judging asks for it -> Candidate each
  judge_candidates     each judged on the held-out rows with its biases corrected where that helps
                       (calibration/bias.py), the best kept -> Search
  search_float         the op where the held-out error starts tried in float (calibration/float_search.py) -> Search
  write_int8_graphs    the Q/DQ graph for TensorRT (model.int8.onnx) and, from the same ranges, one for ONNX
                       Runtime's kernels per kind of CPU (pipeline.folder.layout: with VNNI or without; see
                       calibration/qdq_cpu.py) -> Int8Graphs
  int8_result          the manifest's record (method and options, what was smoothed, samples, batches, the data's
                       sha256, the split and the fit rows' sha256, the cache's verdict and file, each graph's Q/DQ
                       structure) and the stage's line -> Int8Result
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx

from ..pipeline.core.errors import no_room
from ..pipeline.core.sessions import opens_at, opens_like, probed_level, ran_like
from ..pipeline.evaluation.agreement import Judge
from ..pipeline.folder.artifacts import scratch_folder, write_npz
from ..pipeline.folder.graph_files import (
    copy_graph,
    graph_digest,
    graph_without_weights,
    remove_graph,
    write_graph,
)
from ..pipeline.folder.layout import CACHE_FOLDER, SAMPLE
from ..pipeline.folder.records import worst_output
from .bias import correct_biases, corrected_path
from .cache import CacheLookup, cache_key, cache_path, load_ranges, save_ranges
from .float_search import search_float
from .holdout import CalibrationParts
from .int8_records import (
    QDQ_GRAPH,
    CalibrationConfig,
    Candidate,
    CpuGraph,
    Fitted,
    Int8Graphs,
    Int8Result,
    Search,
)
from .qdq import quantize_qdq
from .qdq_cpu import WEIGHT_FORMS, WEIGHTS_FOR, Uint8Rounding, quantize_for_cpu
from .qdq_write import TENSORRT
from .quantizable import quantizable_graph
from .ranges import Alike, collect_statistics
from .readers import CalibrationData, Feed
from .share import compute_shapes, int8_share, macs_by_op
from .smooth import (
    smooth_graph,
    smoothable,
    smoothed_tensors,
    smoothing_boundary,
    smoothing_record,
    smoothing_scales,
)

# The first rows the agreement gate judges (pipeline/folder/layout.py SAMPLE), SAMPLE_ROWS of them.
SAMPLE_ROWS = 8
CORRECTED_QDQ_GRAPH = "model.qdq.corrected.onnx"  # beside a candidate's QDQ_GRAPH: it with its biases corrected


@dataclass(frozen=True)
class _Cached:
    """One candidate's cache file, its key, and what looking it up found."""

    file: Path
    key: str
    lookup: CacheLookup


def make_int8_graph(
    fp32_path: Path,
    out_path: Path,
    calibration: CalibrationParts,
    *,
    config: CalibrationConfig,
    cache_folder: Path,
    cpu_out_paths: dict[str, Path] | None = None,
    judge: Judge | None = None,
    scratch: Path | None = None,
) -> Int8Result:
    """Calibrate (or reuse cached ranges) on `calibration` (read against `fp32_path`'s inputs) and write the Q/DQ
    graph (and the CPU-shaped ones to `cpu_out_paths`, by kind of CPU, when given).  Several candidates
    (config.methods x config.smooth_alphas), a `judge` and held-out rows: each candidate is built and judged on the
    held-out rows, the best kept.  scratch: where the candidates' graphs go (kept by the caller, for the result's
    chosen candidate); by default a folder beside `out_path`, removed on return (artifacts.scratch_folder says why
    there)."""
    keep_sample(calibration, cache_folder)
    with contextlib.ExitStack() as stack:
        keep_chosen = scratch is not None  # the caller reads the kept candidate's graphs after
        scratch = scratch or stack.enter_context(scratch_folder(out_path, "int8-scratch"))
        stack.callback(_remove_beside, fp32_path)
        fits = fit_candidates(fp32_path, calibration, config, cache_folder, scratch, judged=judge is not None)
        search = judge_candidates(build_candidates(fits, calibration.fit, config, scratch), calibration, judge, scratch)
        search = search_float(search, calibration, config, judge, scratch / "float")
        written = write_int8_graphs(search, out_path, cpu_out_paths or {}, keep_chosen=keep_chosen)
    for candidate in search.tried:  # every graph of the stage is written: its int8 weights need not stay in memory
        candidate.weights.clear()
    return int8_result(fp32_path, config, calibration, search, written, fits.fp32_outputs)


def keep_sample(parts: CalibrationParts, cache_folder: Path) -> None:
    """The first SAMPLE_ROWS rows the agreement gate judges (held out, or all where none are), kept in the cache
    folder (SAMPLE) for calibration_sample's readers."""
    judged = (parts.held_out or parts.fit).batches[0]
    write_npz(cache_folder / SAMPLE, {name: array[:SAMPLE_ROWS] for name, array in judged.items()})


@dataclass(frozen=True)
class Fits:
    """What the candidates are built from: the (method, alpha) pairs worth one, each one's cache file, what the fit
    rows gave each alpha, and the FP32 graph's outputs on the fit rows where the maxima pass kept them
    (Int8Result.fp32_fit_outputs)."""

    choices: list[tuple[str, float | None]]
    cached: dict[tuple[str, float | None], _Cached]
    fitted: dict[float | None, Fitted]
    fp32_outputs: list[Feed] | None


def fit_candidates(
    fp32_path: Path,
    parts: CalibrationParts,
    config: CalibrationConfig,
    cache_folder: Path,
    scratch: Path,
    *,
    judged: bool,
) -> Fits:
    """The (method, alpha) pairs worth a candidate (_choices; the first of each where none can be judged), and their
    ranges, scales and means from the cache or from as few passes over the fit rows as the misses allow
    (_fit_smoothings), the smoothed graphs in folders of `scratch`."""
    choices = _choices(fp32_path, config, judged=judged and parts.held_out is not None)
    digest = graph_digest(fp32_path)  # once: the sha256 of every weight (0.45 s a choice at 0.6 GB)
    cached = {(m, a): _cached(digest, parts, config, m, a, cache_folder) for m, a in choices}
    fitted, fp32_outputs = _fit_smoothings(fp32_path, parts.fit, cached, scratch)
    return Fits(choices, cached, fitted, fp32_outputs)


def build_candidates(fits: Fits, fit: CalibrationData, config: CalibrationConfig, scratch: Path) -> Iterator[Candidate]:
    """A candidate per choice of `fits`, each in a folder of `scratch`.  Each Q/DQ graph is made as the next
    candidate is asked for, so that judging holds two at a time, not all of them (a quarter of the weights each)."""
    for index, (method, alpha) in enumerate(fits.choices):
        entry, fitted = fits.cached[(method, alpha)], fits.fitted[alpha]
        yield _candidate(method, alpha, entry, fitted, fit, config, scratch / str(index))


def judge_candidates(
    candidates: Iterable[Candidate], parts: CalibrationParts, judge: Judge | None, scratch: Path
) -> Search:
    """Each candidate judged on the held-out rows as it would be served: its biases corrected where that lowers the
    error (the correction can reverse a near-tie: docs/precision.md); the one with the lowest error kept (the first
    on ties, and where nothing can be judged).  The graphs of a candidate that loses are removed before the next
    is made."""
    tried: list[Candidate] = []
    best: Candidate | None = None
    levels: dict[tuple[Path, str], str] = {}  # (calibrated graph, its Q/DQ graph's ops) -> the level found
    for candidate in candidates:
        if judge is not None and parts.held_out is not None:
            ops = _ops_digest(candidate.qdq)
            if (candidate.calibrated, ops) in levels:
                opens_at(candidate.qdq, levels[candidate.calibrated, ops])
            candidate = _correct_biases(candidate, parts.held_out.batches, judge)
            level = probed_level(candidate.qdq)
            if level is not None:
                levels[candidate.calibrated, ops] = level
        tried.append(candidate)
        if best is None or _held_out_error(candidate) < _held_out_error(best):
            lost, best = best, candidate
        else:
            lost = candidate
        if lost is not None:  # its Q/DQ graphs are never read again
            shutil.rmtree(lost.qdq.parent, ignore_errors=True)
    assert best is not None  # _choices gives one candidate at least
    chosen = _with_corrected_graph(best, scratch)
    _remove_others(tuple(tried), chosen, scratch)
    macs = macs_by_op(*compute_shapes(chosen.calibrated, {k: v[:1] for k, v in parts.fit.batches[0].items()}))
    return Search(tuple(tried), chosen, chosen.means if chosen.held_out else None, macs)


def _ops_digest(graph: Path) -> str:
    """What a Q/DQ graph's session opening depends on: its nodes and its initializers' names, types and shapes, not
    their values.  The candidates of one calibrated graph differ in their ranges alone (the scales' values), so the
    level the first one's crash probe found holds for the next, which then needs no probe of its own (0.13 s a
    graph on EfficientNet-Lite0; a losing candidate's files are gone before the next is judged: kept by digest)."""
    model = graph_without_weights(graph)
    digest = hashlib.sha256()
    for node in model.graph.node:
        digest.update(node.SerializeToString())
    for tensor in model.graph.initializer:
        digest.update(f"{tensor.name}:{tensor.data_type}:{list(tensor.dims)};".encode())
    return digest.hexdigest()


def _held_out_error(candidate: Candidate) -> float:
    return candidate.judged.error_mean if candidate.judged else 0.0


def write_int8_graphs(
    search: Search, out_path: Path, cpu_out_paths: dict[str, Path], *, keep_chosen: bool
) -> Int8Graphs:
    """The kept candidate's Q/DQ graph to `out_path` and, from its ranges, a graph for each kind of CPU in
    `cpu_out_paths` (those that cannot be made are recorded, not written).  Unless `keep_chosen`,
    its copy in the scratch goes once written: the CPU graphs are made from its FP32 graph, and the 1.1B LM's
    1.3 GB Q/DQ graph was there twice while they were."""
    chosen = search.chosen
    copy_graph(chosen.qdq, out_path)
    if chosen.held_out is not None:  # judged: opened and run here, as the gate opens and runs model.int8.onnx
        ran_like(out_path, chosen.qdq)
    if not keep_chosen:
        remove_graph(chosen.qdq)
    cpu = {kind: _cpu_graph(chosen, path, kind, search.means) for kind, path in cpu_out_paths.items()}
    return Int8Graphs(out_path.name, cpu, int8_share(out_path, search.macs))


def int8_result(
    fp32_path: Path,
    config: CalibrationConfig,
    parts: CalibrationParts,
    search: Search,
    written: Int8Graphs,
    fp32_outputs: list[Feed] | None,
) -> Int8Result:
    """The stage's result: the manifest's calibration record and the line it prints, and the FP32 graph's outputs
    on the fit rows where calibration computed them."""
    calibration = _calibration_record(fp32_path, config, parts, search, written)
    summary = _summary(parts, search, written, calibration["collect_seconds"])
    return Int8Result(calibration, search.chosen.structure, written.cpu, summary, search.chosen, fp32_outputs)


def _calibration_record(
    fp32_path: Path, config: CalibrationConfig, parts: CalibrationParts, search: Search, written: Int8Graphs
) -> dict:
    """What the manifest's `calibration` says: the kept candidate's options and smoothing, the data and its split,
    the cache, the share of the compute in INT8, and how the candidate was chosen."""
    chosen, tried = search.chosen, search.tried
    calibration = {
        **config.options(chosen.method, chosen.alpha),
        "smoothing": _smoothing_record(fp32_path, chosen.scales, chosen.alpha),
        "source": parts.data.description,
        "samples": parts.data.samples,
        "batch": parts.batch,
        "batches": len(parts.data.batches),
        "data_sha256": parts.data.digest,
        "split": parts.split.as_json(),
        "fit_sha256": parts.fit.digest,
        "cache": chosen.lookup.status,
        "cache_file": str(chosen.cache_file),
        # Every candidate of an alpha carries the passes its graph took: counted once per alpha.
        "collect_seconds": round(sum({c.alpha: c.collect_seconds for c in tried}.values()), 3),
        "collect_passes": sum({c.alpha: c.collect_passes for c in tried}.values()),
        "quantizer": _quantizer_name(),
    }
    calibration["int8_share"] = {**written.share, "float_ops": list(chosen.float_ops)}
    if chosen.bias_correction is not None:
        calibration["bias_correction"] = chosen.bias_correction
    if search.float_search is not None:
        calibration["float_search"] = search.float_search
    if len(tried) > 1:
        calibration["search"] = {
            "candidates": [candidate.as_record() for candidate in tried],
            "kept": {"method": chosen.method, "smooth_alpha": chosen.alpha},
            "chosen_on": f"the {parts.held_out.samples if parts.held_out else 0} held-out calibration rows (the gate "
            f"then judges the kept graph on the same rows: a pick of {len(tried)}, not an independent test)",
        }
    return calibration


def _summary(parts: CalibrationParts, search: Search, written: Int8Graphs, collect_seconds: float) -> str:
    """The stage's line: what was kept and why, how the ranges were had, and each CPU graph's kernels."""
    chosen, tried, status = search.chosen, search.tried, search.chosen.lookup.status
    verdict = "cached ranges" if status == "hit" else f"calibrated in {collect_seconds:.1f} s ({status})"
    summary = (
        f"{written.engine}: {chosen.method} on {parts.fit.samples} of {parts.data.samples} samples "
        f"({len(parts.split.held_out)} held out for the gate){_how_kept(chosen, tried, written.share)}, {verdict}; "
        f"{chosen.structure['quantized_ops']} ops with Q/DQ inputs, {chosen.structure['per_channel_weights']} "
        "per-channel weights"
    )
    for kind, graph in written.cpu.items():
        if graph.failed is not None:
            summary += f"; {graph.graph} ({kind}) not written: {graph.failed}"
            continue
        kernels = graph.details["int8_kernels"] + graph.details["float_kernels"]
        summary += (
            f"; {graph.graph} ({kind}): {graph.details['int8_kernels']} of {kernels} as ONNX Runtime int8 kernels"
        )
    return summary


def _how_kept(chosen: Candidate, tried: tuple[Candidate, ...], share: dict) -> str:
    """What the kept candidate smoothed, corrected and left in float, and what it was picked among."""
    smoothed = f", {len(chosen.scales)} activations smoothed (alpha {chosen.alpha:g})" if chosen.alpha else ""
    if len(tried) > 1:
        errors = "; ".join(f"{c.label} {c.judged.error_mean:.3g}" for c in tried if c.judged)
        smoothed += f" (the lowest held-out error of {len(tried)}: {errors})"
    if chosen.bias_correction and chosen.bias_correction["kept"]:
        smoothed += f", biases corrected for weight rounding ({chosen.bias_correction['ops']} ops)"
    if chosen.float_ops:
        smoothed += (
            f", {', '.join(chosen.float_ops)} left in float ({share['int8_compute_share']:.2%} of the compute INT8)"
        )
    return smoothed


def _choices(fp32_path: Path, config: CalibrationConfig, *, judged: bool) -> list[tuple[str, float | None]]:
    """The (method, alpha) pairs worth a graph each: every method where they can be judged, with every alpha where
    the graph also has something to smooth; else the first of each."""
    methods, alphas = config.methods, config.smooth_alphas
    if not judged:
        return [(methods[0], alphas[0])]
    if len(alphas) > 1 and not smoothable(quantizable_graph(fp32_path)):
        alphas = alphas[:1]
    return [(method, alpha) for method in methods for alpha in alphas]


def _cached(
    graph: str, parts: CalibrationParts, config: CalibrationConfig, method: str, alpha: float | None, folder: Path
) -> _Cached:
    """The cache file of one method's and smoothing alpha's ranges fit on the fit rows of the FP32 graph whose
    graph_digest is `graph`, and what it holds."""
    # Keyed on the fit rows' own sha256: ranges fit on all rows (before the split, or another split) never match.
    fit = parts.fit
    options = {**config.options(method, alpha), "samples": fit.samples, "batch": parts.batch}
    key = cache_key(graph, fit.digest, options)
    file = cache_path(folder, method, key)
    lookup = load_ranges(file, key, recalibrate=config.recalibrate)
    if lookup.status.startswith("corrupted"):
        print(f"note: calibration cache {file} is {lookup.status}; recalibrating")
    return _Cached(file, key, lookup)


def _fit_smoothings(
    fp32_path: Path, fit: CalibrationData, cached: dict[tuple[str, float | None], _Cached], scratch: Path
) -> tuple[dict[float | None, Fitted], list[Feed] | None]:
    """Each smoothing alpha's Fitted, and the FP32 graph's outputs on the fit rows where the maxima pass kept them
    (ranges.GraphOutputs), from as few passes over the fit rows as the cache's misses allow (one per graph,
    and one for the maxima: calibration/ranges.py): the unsmoothed graph's for its methods' ranges and means and for
    the channel maxima the smoothing scales come from, then each smoothed graph's for its methods' ranges and means.
    Those take passes of their own: the scales are known only once the first graph's are over, and smoothing moves
    every tensor after a smoothed op (by float rounding); the tensors before them are the unsmoothed graph's, their
    ranges reused (ranges.Alike).  An alpha with a method in the cache takes its scales from there; a method in the
    cache needs no ranges measured."""
    model = quantizable_graph(fp32_path)
    groups = smoothable(model)
    by_alpha: dict[float | None, dict[str, _Cached]] = {}
    for (method, alpha), entry in cached.items():
        by_alpha.setdefault(alpha, {})[method] = entry
    unscaled = [alpha for alpha, entries in by_alpha.items() if alpha is not None and groups and not _hit(entries)]
    fitted: dict[float | None, Fitted] = {}
    if None in by_alpha or unscaled:
        maxima_of = list(groups) if unscaled else []
        # Where a smoothed graph is to be measured, the values its changed part reads are kept for it.
        keep = smoothing_boundary(model, groups) if len(by_alpha) > 1 and groups else []
        fitted[None] = _fitted(fp32_path, fit, {}, by_alpha.get(None, {}), scratch / "unsmoothed", maxima_of, keep=keep)
    maxima = fitted[None].maxima if None in fitted else {}
    unsmoothed = {m: e.lookup.ranges or fitted[None].ranges[m] for m, e in by_alpha.get(None, {}).items()}
    shared = fitted[None].shared if None in fitted else None
    for alpha, entries in by_alpha.items():
        if alpha is not None:
            scales = _scales(model, groups, maxima, alpha, _hit(entries), fp32_path.parent)
            changed = smoothed_tensors(model, scales)
            alike = Alike(unsmoothed, changed, shared) if changed is not None else None
            fitted[alpha] = _fitted(fp32_path, fit, scales, entries, scratch / f"alpha-{alpha:g}", alike=alike)
    outputs = fitted[None].outputs if None in fitted else None
    if None not in by_alpha and None in fitted:  # the unsmoothed graph measured the maxima alone: charged to theirs
        first, maxima_pass = unscaled[0], fitted.pop(None)
        passes, seconds = fitted[first].passes + maxima_pass.passes, fitted[first].seconds + maxima_pass.seconds
        fitted[first] = replace(fitted[first], passes=passes, seconds=round(seconds, 3))
    return fitted, outputs


def _hit(entries: dict[str, _Cached]) -> CacheLookup | None:
    """The first cache hit among one alpha's methods (each holds the alpha's scales and means), None if none."""
    return next((entry.lookup for entry in entries.values() if entry.lookup.ranges is not None), None)


def _scales(
    model: onnx.ModelProto,
    groups: dict,
    maxima: dict[str, np.ndarray],
    alpha: float,
    hit: CacheLookup | None,
    base: Path,
) -> dict[str, np.ndarray]:
    """A smoothing alpha's scales: the cache's where it has the alpha, else from the unsmoothed graph's maxima and
    the weights (`model`'s, on disk under `base`)."""
    if hit is not None:
        return hit.smoothing or {}
    return smoothing_scales(model, groups, maxima, alpha, base) if groups else {}


def _fitted(
    fp32_path: Path,
    fit: CalibrationData,
    scales: dict[str, np.ndarray],
    entries: dict[str, _Cached],
    folder: Path,
    maxima_of: list[str] | None = None,
    alike: Alike | None = None,
    keep: list[str] | None = None,
) -> Fitted:
    """The graph smoothed with `scales` in `folder`, and the passes over `fit` on it for the ranges of the methods
    in `entries` the cache lacks (but those `alike` has), its means, and the channel maxima of `maxima_of`; no pass
    where nothing is lacking."""
    started = time.perf_counter()
    folder.mkdir(parents=True)
    calibrated = calibrated_graph(fp32_path, scales, folder / "model.calibrated.onnx")
    missing = [method for method, entry in entries.items() if entry.lookup.ranges is None]
    hit = _hit(entries)
    cached_means = (hit.means or {}) if hit else {}
    if not missing and not maxima_of:
        return Fitted(scales, calibrated, {}, cached_means, {}, 0, 0.0)
    statistics = collect_statistics(
        calibrated, fit, missing, maxima_of=maxima_of or [], means=bool(missing), alike=alike, keep=keep or ()
    )
    means = statistics.means if missing else cached_means
    seconds = round(time.perf_counter() - started, 3)
    return Fitted(
        scales,
        calibrated,
        statistics.ranges,
        means,
        statistics.maxima,
        statistics.passes,
        seconds,
        statistics.shared,
        outputs=statistics.outputs,
    )


def _candidate(
    method: str,
    alpha: float | None,
    entry: _Cached,
    fitted: Fitted,
    fit: CalibrationData,
    config: CalibrationConfig,
    scratch: Path,
) -> Candidate:
    """One method's and smoothing alpha's candidate: its ranges from the cache or `fitted` (then cached), its Q/DQ
    graph in `scratch` (QDQ_GRAPH)."""
    scratch.mkdir(parents=True)
    ranges = entry.lookup.ranges
    if ranges is None:
        ranges = fitted.ranges[method]
        record = {"source": fit.description, "samples": fit.samples, **config.options(method, alpha)}
        save_ranges(entry.file, entry.key, ranges, record, fitted.scales, fitted.means)
    qdq = scratch / QDQ_GRAPH
    return Candidate(
        method=method,
        alpha=alpha,
        calibrated=fitted.calibrated,
        ranges=ranges,
        scales=fitted.scales,
        means=fitted.means,
        lookup=entry.lookup,
        cache_file=entry.file,
        collect_seconds=fitted.seconds,
        collect_passes=fitted.passes,
        qdq=qdq,
        structure=quantize_qdq(fitted.calibrated, qdq, ranges, weights=fitted.weights),
        weights=fitted.weights,
        shifts=fitted.shifts,
    )


def _correct_biases(candidate: Candidate, held_out: list[dict[str, np.ndarray]], judge: Judge) -> Candidate:
    """The candidate judged on the held-out rows, with its Q/DQ graph's Conv/Gemm/MatMul biases corrected for the
    rounding of their weights where that lowers the held-out error (calibration/bias.py, same ranges, same
    weights; its FP32 graph's are corrected once it is kept: _with_corrected_graph), and the record of both
    errors.  The corrected Q/DQ graph is written beside the candidate's and references its int8 weights there."""
    outputs = judge(candidate.qdq, held_out)
    qdq = candidate.qdq.with_name(CORRECTED_QDQ_GRAPH)
    correction = correct_biases(
        candidate.calibrated, candidate.qdq, candidate.means, quantized_out=qdq, shifts=candidate.shifts
    )
    opens_like(qdq, candidate.qdq)  # the judge probed that graph: this one differs in biases alone
    corrected_outputs = judge(qdq, held_out)
    (_, judged), (_, agreement) = worst_output(outputs), worst_output(corrected_outputs)
    kept = agreement.error_mean < judged.error_mean
    record = {
        **correction,
        "held_out_error_mean": {"before": _number(judged.error_mean), "corrected": _number(agreement.error_mean)},
        "held_out_cosine_min": {"before": _number(judged.cosine_min), "corrected": _number(agreement.cosine_min)},
        "kept": kept,
        "chosen_on": "the held-out calibration rows, as the method and smoothing pick",
    }
    if not kept:
        return replace(candidate, held_out=outputs, bias_correction=record)
    return replace(candidate, qdq=qdq, held_out=corrected_outputs, bias_correction=record)


def _with_corrected_graph(candidate: Candidate, scratch: Path) -> Candidate:
    """The candidate with its FP32 graph's biases corrected as its Q/DQ graph's are, where they are (the CPU graphs
    and the float search are made from it).  Written for the kept candidate alone: judging corrects the Q/DQ graphs
    only (their int8 rounding is read from the corrected Q/DQ graph: its weights are the candidate's)."""
    if not candidate.bias_correction or not candidate.bias_correction["kept"]:
        return candidate
    corrected = corrected_path(candidate.calibrated, None)
    correct_biases(candidate.calibrated, candidate.qdq, candidate.means, corrected, shifts=candidate.shifts)
    return replace(candidate, calibrated=corrected, uncorrected=candidate.calibrated)


def _remove_others(tried: tuple[Candidate, ...], chosen: Candidate, scratch: Path) -> None:
    """Delete the smoothed graphs the kept candidate does not use (the weights each; the losing candidates' own
    folders went as they lost): what follows reads the kept candidate's alone."""
    kept = {chosen.calibrated.parent, chosen.fp32_equal.parent}
    for folder in {candidate.fp32_equal.parent for candidate in tried} - kept:
        if _in_scratch(folder, scratch):  # not the artifact folder's FP32 graph
            shutil.rmtree(folder, ignore_errors=True)


def _in_scratch(path: Path, scratch: Path) -> bool:
    """Whether `path` lies in the stage's scratch folder (not in the artifact folder, whose FP32 graph a candidate
    may calibrate from)."""
    return path.resolve().is_relative_to(scratch.resolve())


def _remove_beside(source: Path) -> None:
    """Delete the corrected graphs corrected_path puts beside `source` (the artifact folder's FP32 graph), where
    there are any."""
    for kind in (None, *WEIGHTS_FOR):
        remove_graph(corrected_path(source, kind))


def _number(value: float) -> float:
    return float(f"{value:.6g}")


def calibration_sample(folder: Path) -> dict[str, np.ndarray] | None:
    """The calibration rows an int8 folder kept (SAMPLE), or None where it has none."""
    path = Path(folder) / CACHE_FOLDER / SAMPLE
    if not path.is_file():
        return None
    with np.load(path) as sample:
        return {name: sample[name] for name in sample.files}


def calibrated_graph(fp32_path: Path, scales: dict[str, np.ndarray], out_path: Path) -> Path:
    """The graph calibration runs on and every quantization starts from (the stage, a budget's trials, from a
    cache's scales too): the FP32 file itself where nothing is smoothed (every step reads it as quantizable_graph
    does: its weights where they lie, its Constant nodes as initializers), else the FP32 graph smoothed with `scales`
    (calibration/smooth.py) written to `out_path` with its data file, each weight copied or smoothed as it is
    written.  A copy of the 1.2 GB MLP's graph took 4 s, and the disk its weights take, for 3 Constant nodes."""
    if not scales:
        return fp32_path
    smoothed, on_disk = smooth_graph(quantizable_graph(fp32_path), scales)
    write_graph(smoothed, fp32_path.parent, out_path, convert=on_disk, scratch=True)
    return out_path


def _smoothing_record(fp32_path: Path, scales: dict[str, np.ndarray], alpha: float | None) -> dict | None:
    if alpha is None:
        return None
    groups = smoothable(quantizable_graph(fp32_path)) if scales else {}
    return smoothing_record(groups, scales, alpha)


def _cpu_graph(chosen: Candidate, path: Path, kind: str, means: dict[str, np.ndarray] | None) -> CpuGraph:
    """One CPU-shaped graph, or why it cannot be made (quantize_static's graph, written by qdq_write.py, which
    fails where ORT fails and refuses what it does not reproduce); where the engine's graph has its biases corrected,
    this one has them corrected for its own weights' rounding (uint8 weights round otherwise than int8, computed
    without a graph: qdq_cpu.Uint8Rounding), every op's: it quantizes them all.

    These graphs are optional (the engine is built from model.int8.onnx; a CPU without its graph runs that one),
    so their failure is recorded and printed, never raised: it must not lose the TensorRT graph already written.
    A disk without room for them is the exception: the user's to fix, and a build gone on without them would
    serve the slower Q/DQ graph on a CPU.
    """
    weights = WEIGHTS_FOR[kind]
    # The CPU graphs quantize every op: ONNX Runtime's quantizer, told to leave EfficientNet-Lite0's first
    # depthwise conv in float, wrote a graph whose stem Clip was off by 12x its scale under ORT's int8 kernels.
    try:
        # U8S8's weights round as TensorRT's (int8 symmetric, per channel): the alpha's, quantized already.
        tensorrt_rounding = WEIGHT_FORMS[weights] == TENSORRT.weights
        if chosen.uncorrected is None or means is None or tensorrt_rounding:
            # No correction, or one for the very weights this graph rounds: chosen.calibrated's biases fit it.
            quantized = chosen.weights if tensorrt_rounding else None
            record = quantize_for_cpu(
                chosen.calibrated, path, chosen.ranges, weights=weights, quantized_weights=quantized
            )
            return CpuGraph(path.name, record)
        assert weights == "u8u8", weights  # WEIGHTS_FOR's one form besides TensorRT's
        rounding = Uint8Rounding(chosen.uncorrected, chosen.ranges)
        corrected = corrected_path(chosen.uncorrected, kind)
        correction = correct_biases(chosen.uncorrected, rounding, means, corrected)
        # The corrected graph's weights are the uncorrected one's: rounded once, for the correction and the graph.
        record = quantize_for_cpu(corrected, path, chosen.ranges, weights=weights, quantized_weights=rounding.weights)
        return CpuGraph(path.name, {**record, "bias_correction": correction})
    except Exception as error:  # the writer's ValueError/RuntimeError, shape inference's and ORT's session's errors
        if no_room(error):  # a disk without room is no graph that cannot be made: the stage stops with the fix
            raise
        return CpuGraph(path.name, {}, failed=f"{type(error).__name__}: {error}")


def _quantizer_name() -> str:
    import onnxruntime

    # Every INT8 graph is quantize_static's, written without it (calibration/qdq_write.py, byte for byte).
    return (
        f"onnxruntime {onnxruntime.__version__} quantize_static's QDQ graphs, written by calibration/qdq_write.py "
        "(per-channel weights; TensorRT's symmetric QInt8, the CPU graphs' QUInt8 activations and int32 biases)"
    )
