"""The INT8 stage: FP32 graph + calibration data -> model.int8.onnx with calibrated Q/DQ pairs.

read data -> hold out the rows the agreement gate judges (calibration/holdout.py) -> smoothing scales and ranges
fit on the other rows (from the cache, or measured on the FP32 graph: calibration/smooth.py, then
calibration/ranges.py on the smoothed graph) -> Q/DQ graph for TensorRT (model.int8.onnx) and, from the same
ranges, two for ONNX Runtime's CPU kernels (pipeline.folder.manifest.cpu_graphs: one for CPUs with VNNI, one for
those without; see calibration/qdq_cpu.py).  The record it returns goes to the manifest: method and options, what
was smoothed, samples, batches, the data's sha256, the split and the fit rows' sha256, the cache's verdict and
file, and each graph's Q/DQ structure.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx

from ..models.spec import ImagePreprocess
from ..pipeline.core.compute import COMPUTE_OPS
from ..pipeline.folder.artifacts import atomic_path, sha256_file, write_npz
from ..pipeline.folder.manifest import CalibrationSplit, RowsAgreement, engine_graph
from .bias import correct_biases, weight_input_means
from .cache import CacheLookup, cache_key, cache_path, load_ranges, save_ranges
from .holdout import split_rows
from .qdq import constants_as_initializers, quantize_qdq
from .qdq_cpu import WEIGHT_FORMS, WEIGHTS_FOR, quantize_for_cpu
from .ranges import collect_ranges, method_options
from .readers import CalibrationData, CalibrationSource, graph_inputs, read_calibration_data, rows_of
from .share import compute_shapes, int8_share, macs_by_op
from .smooth import channel_maxima, smooth_graph, smoothable, smoothing_options, smoothing_record, smoothing_scales

CACHE_FOLDER = "calibration"  # inside the artifact folder, beside model.int8.onnx
# The first rows the agreement gate judges (held out from calibration where the set allows it: where a gate refused,
# the rows it refused on), model-ready, kept in the cache folder: `trt-pipeline diagnose` compares an INT8 graph
# with FP32 on them (reference.npz's random inputs are clipped by the input's Q/DQ).
SAMPLE = "sample.npz"
SAMPLE_ROWS = 8
# After the pick of method and smoothing, the quantized op where the held-out error starts (the first node past the
# gate's level, traced back to its Conv/Gemm/MatMul) is tried in float, up to FLOAT_OPS_TRIED times.  It stays in
# float when the held-out error falls by FLOAT_MIN_GAIN or more and by at least FLOAT_GAIN_PER_SHARE times the share
# of the multiply-adds it takes out of INT8 (accuracy bought per compute given up), while INT8 still computes
# MIN_INT8_SHARE of them (ModelOpt leaves 0.33% of EfficientNet-Lite0 in float, its classifier).  On
# EfficientNet-Lite0 that is the first block's depthwise conv: 0.94% of the compute, a quarter of the error.
FLOAT_OPS_TRIED = 2
FLOAT_SEARCH_FROM = 0.05  # held-out error (of the output's norm) under which none is tried (ResNet-50 on photos: 0.025)
FLOAT_MIN_GAIN = 0.1
FLOAT_GAIN_PER_SHARE = 10.0
MIN_INT8_SHARE = 0.99
TENSORRT_WEIGHTS = ("QInt8", True, False)  # qdq.quantize_qdq's weights as a qdq_cpu.WEIGHT_FORMS entry
# The INT8 graphs for ONNX Runtime on the CPU, beside model.int8.onnx, by the kind of CPU they are for
# (pipeline.core.cpu.int8_cpu_kind); the runner on a CPU takes the one for its CPU.


@dataclass(frozen=True)
class CalibrationConfig:
    """The calibration part of Settings (CALIB_METHOD, --calib-samples, --calib-batch, --recalibrate, SMOOTH).

    methods: the calibration methods (calibration/ranges.py), each with each smoothing alpha a candidate graph;
    with a judge and held-out rows the one with the lower held-out error is kept, else the first (Settings:
    CALIB_METHOD=auto tries percentile and max).
    smooth_alphas: SmoothQuant's alphas for the activations MatMul/Gemm read (calibration/smooth.py; None: not
    smoothed), each a candidate graph; with a judge and held-out rows the one with the lower held-out error is kept,
    else the first.  Off unless asked for here; Settings (SMOOTH=auto) tries 0.9 and off for the pipeline.
    float_search: with a judge and held-out rows, try leaving the op where the held-out error starts in float
    (FLOAT_OPS_TRIED); on for the pipeline unless NO_FLOAT_SEARCH.
    """

    methods: tuple[str, ...] = ("percentile",)
    samples: int = 256
    batch: int = 16
    recalibrate: bool = False
    smooth_alphas: tuple[float | None, ...] = (None,)
    float_search: bool = False

    @classmethod
    def from_settings(cls, settings) -> CalibrationConfig:
        return cls(
            settings.calib_methods(),
            settings.calib_samples,
            settings.calib_batch,
            settings.recalibrate,
            settings.smooth_alphas(),
            settings.float_search,
        )

    @staticmethod
    def options(method: str, alpha: float | None) -> dict:
        """One candidate's calibrator options and smoothing: what the manifest records and the cache key covers."""
        return {**method_options(method), "smooth_alpha": alpha, **smoothing_options(alpha)}


# Judges a candidate INT8 graph on rows it never saw: (graph, batches) -> its worst output's agreement with FP32.
# The stage passes the agreement gate's own evaluation (pipeline/stages/parity.py), so the pick and the gate agree.
Judge = Callable[[Path, list[dict[str, np.ndarray]]], RowsAgreement]


@dataclass
class Candidate:
    """One way of quantizing the graph (a calibration method and a smoothing alpha): its calibrated FP32 graph,
    ranges and Q/DQ graph."""

    method: str
    alpha: float | None
    calibrated: Path
    ranges: object
    scales: dict[str, np.ndarray]
    lookup: CacheLookup
    cache_file: Path
    collect_seconds: float
    qdq: Path
    structure: dict
    held_out: RowsAgreement | None = None
    float_ops: tuple[str, ...] = ()
    # Where `calibrated` has every Conv/Gemm bias corrected (calibration/bias.py; the CPU graphs, which quantize
    # every op, are made from it): the graph before, FP32's equal, from which ops kept in float are quantized.
    uncorrected: Path | None = None
    bias_correction: dict | None = None  # the held-out errors before and after it, and whether it was kept

    def as_record(self) -> dict:
        """Its method, alpha and held-out numbers as compared (its biases corrected where that was kept)."""
        judged = self.held_out
        numbers = {"error_mean": judged.error_mean, "cosine_min": judged.cosine_min} if judged else {}
        held_out = {f"held_out_{k}": float(f"{v:.6g}") for k, v in numbers.items()}
        corrected = {"biases_corrected": self.bias_correction["kept"]} if self.bias_correction else {}
        return {"method": self.method, "smooth_alpha": self.alpha, **held_out, **corrected}

    @property
    def label(self) -> str:
        return f"{self.method}, {_alpha_text(self.alpha)}"


def make_int8_graph(
    fp32_path: Path,
    out_path: Path,
    source: CalibrationSource,
    *,
    preprocess: ImagePreprocess | None,
    config: CalibrationConfig,
    cache_folder: Path,
    cpu_out_paths: dict[str, Path] | None = None,
    judge: Judge | None = None,
) -> dict:
    """Calibrate (or reuse cached ranges) and write the Q/DQ graph (and the CPU-shaped ones to `cpu_out_paths`,
    by kind of CPU, when given); return the stage record.  Several candidates (config.methods x
    config.smooth_alphas), a `judge` and held-out rows: each candidate is built and judged on the held-out rows,
    the best kept."""
    data = read_calibration_data(
        source, graph_inputs(fp32_path), preprocess, samples=config.samples, batch=config.batch
    )
    parts = split_calibration(data, config.batch)
    judged = (parts.held_out or parts.fit).batches[0]
    write_npz(cache_folder / SAMPLE, {name: array[:SAMPLE_ROWS] for name, array in judged.items()})
    fit, split = parts.fit, parts.split
    choices = _choices(fp32_path, config, judged=judge is not None and bool(parts.held_out))
    measured: dict[float | None, dict[str, np.ndarray]] = {}  # smoothing scales by alpha: every method's the same
    with tempfile.TemporaryDirectory(prefix="int8.") as scratch:
        tried = [
            _candidate(fp32_path, fit, config, method, alpha, cache_folder, Path(scratch) / str(index), measured)
            for index, (method, alpha) in enumerate(choices)
        ]
        means_by_alpha: dict[float | None, dict[str, np.ndarray]] = {}  # the weights' input means by smoothing
        if judge is not None and parts.held_out is not None:
            # Each judged as it would be served: the correction can reverse a near-tie (docs/precision.md).
            tried = [
                _correct_biases(candidate, fit, means_by_alpha, parts.held_out.batches, judge, candidate.qdq.parent)
                for candidate in tried
            ]
        chosen = min(tried, key=lambda c: c.held_out.error_mean if c.held_out else 0.0)  # the first on ties
        macs = macs_by_op(*compute_shapes(chosen.calibrated, {k: v[:1] for k, v in fit.batches[0].items()}))
        means = means_by_alpha.get(chosen.alpha)
        float_search: dict | None = None
        if judge is not None and parts.held_out is not None and means is not None and config.float_search:
            chosen, float_search = _keep_float(
                chosen, means, parts.held_out.batches, judge, macs, Path(scratch) / "float"
            )
        with atomic_path(out_path) as temporary:
            shutil.copyfile(chosen.qdq, temporary)
        cpu_paths = (cpu_out_paths or {}).items()
        cpu = {kind: _cpu_graph(chosen, path, kind, means, Path(scratch) / kind) for kind, path in cpu_paths}
        share = int8_share(chosen.qdq, macs)
    options, scales = config.options(chosen.method, chosen.alpha), chosen.scales
    lookup, structure = chosen.lookup, chosen.structure
    cache_file, collect_seconds = chosen.cache_file, sum(c.collect_seconds for c in tried)
    calibration = {
        **options,
        "smoothing": _smoothing_record(fp32_path, scales, chosen.alpha),
        "source": data.description,
        "samples": data.samples,
        "batch": config.batch,
        "batches": len(data.batches),
        "data_sha256": data.digest,
        "split": split.as_json(),
        "fit_sha256": fit.digest,
        "cache": lookup.status,
        "cache_file": str(cache_file),
        "collect_seconds": collect_seconds,
        "quantizer": _quantizer_name(),
    }
    calibration["int8_share"] = {**share, "float_ops": list(chosen.float_ops)}
    if chosen.bias_correction is not None:
        calibration["bias_correction"] = chosen.bias_correction
    if float_search is not None:
        calibration["float_search"] = float_search
    if len(tried) > 1:
        calibration["search"] = {
            "candidates": [candidate.as_record() for candidate in tried],
            "kept": {"method": chosen.method, "smooth_alpha": chosen.alpha},
            "chosen_on": f"the {parts.held_out.samples if parts.held_out else 0} held-out calibration rows (the gate "
            f"then judges the kept graph on the same rows: a pick of {len(tried)}, not an independent test)",
        }
    smoothed = f", {len(scales)} activations smoothed (alpha {chosen.alpha:g})" if chosen.alpha else ""
    if len(tried) > 1:
        errors = "; ".join(f"{c.label} {c.held_out.error_mean:.3g}" for c in tried if c.held_out)
        smoothed += f" (the lowest held-out error of {len(tried)}: {errors})"
    if chosen.bias_correction and chosen.bias_correction["kept"]:
        smoothed += f", biases corrected for weight rounding ({chosen.bias_correction['ops']} ops)"
    if chosen.float_ops:
        smoothed += (
            f", {', '.join(chosen.float_ops)} left in float ({share['int8_compute_share']:.2%} of the compute INT8)"
        )
    verdict = "cached ranges" if lookup.status == "hit" else f"calibrated in {collect_seconds:.1f} s ({lookup.status})"
    summary = (
        f"{out_path.name}: {chosen.method} on {fit.samples} of {data.samples} samples "
        f"({len(split.held_out)} held out for the gate){smoothed}, {verdict}; "
        f"{structure['quantized_ops']} ops with Q/DQ inputs, {structure['per_channel_weights']} per-channel weights"
    )
    stage: dict = {"calibration": calibration, "qdq": structure}
    for kind, graph in cpu.items():
        if "failed" in graph:
            summary += f"; {graph['graph']} ({kind}) not written: {graph['failed']}"
            continue
        kernels = graph["int8_kernels"] + graph["float_kernels"]
        summary += f"; {graph['graph']} ({kind}): {graph['int8_kernels']} of {kernels} as ONNX Runtime int8 kernels"
    if cpu:
        stage["qdq_onnxruntime_cpu"] = cpu
    return {"summary": summary, **stage}


def _choices(fp32_path: Path, config: CalibrationConfig, *, judged: bool) -> list[tuple[str, float | None]]:
    """The (method, alpha) pairs worth a graph each: every method where they can be judged, with every alpha where
    the graph also has something to smooth; else the first of each."""
    methods, alphas = config.methods, config.smooth_alphas
    if not judged:
        return [(methods[0], alphas[0])]
    if len(alphas) > 1 and not smoothable(_quantizable_model(fp32_path)):
        alphas = alphas[:1]
    return [(method, alpha) for method in methods for alpha in alphas]


def _candidate(
    fp32_path: Path,
    fit: CalibrationData,
    config: CalibrationConfig,
    method: str,
    alpha: float | None,
    cache_folder: Path,
    scratch: Path,
    measured: dict[float | None, dict[str, np.ndarray]],
) -> Candidate:
    """One method's and smoothing alpha's graph: scales and ranges fit on `fit` (or from the cache), its Q/DQ graph
    in `scratch` under the engine graph's own name (the gate's evaluation simulates Q/DQ by that name).  `measured`:
    the scales measured so far by alpha, which this adds to (they depend on the data, not on the method)."""
    scratch.mkdir(parents=True)
    options = config.options(method, alpha)
    # Keyed on the fit rows' own sha256: ranges fit on all rows (before the split, or another split) never match.
    key = cache_key(sha256_file(fp32_path), fit.digest, {**options, "samples": fit.samples, "batch": config.batch})
    cache_file = cache_path(cache_folder, method, key)
    lookup = load_ranges(cache_file, key, recalibrate=config.recalibrate)
    ranges, scales, collect_seconds = lookup.ranges, lookup.smoothing, 0.0
    calibrated_path = scratch / "model.calibrated.onnx"
    if ranges is None or scales is None:
        if lookup.status.startswith("corrupted"):
            print(f"note: calibration cache {cache_file} is {lookup.status}; recalibrating")
        started = time.perf_counter()
        if alpha not in measured:
            measured[alpha] = _measure_smoothing(fp32_path, fit, alpha)
        scales = measured[alpha]
        calibrated = calibrated_graph(fp32_path, scales, calibrated_path)
        ranges = collect_ranges(calibrated, fit, method)
        collect_seconds = round(time.perf_counter() - started, 3)
        save_ranges(cache_file, key, ranges, {"source": fit.description, "samples": fit.samples, **options}, scales)
    else:
        calibrated = calibrated_graph(fp32_path, scales, calibrated_path)
    qdq = scratch / engine_graph("int8")
    structure = quantize_qdq(calibrated, qdq, ranges)
    return Candidate(method, alpha, calibrated, ranges, scales, lookup, cache_file, collect_seconds, qdq, structure)


def _correct_biases(
    candidate: Candidate,
    fit: CalibrationData,
    means_by_alpha: dict[float | None, dict[str, np.ndarray]],
    held_out: list[dict[str, np.ndarray]],
    judge: Judge,
    scratch: Path,
) -> Candidate:
    """The candidate judged on the held-out rows, with its Conv/Gemm/MatMul biases corrected for the rounding of
    their weights where that lowers the held-out error (calibration/bias.py, same ranges, same weights), and the
    record of both errors.  `means_by_alpha`: the weights' input means on `fit` by smoothing alpha, added to."""
    if candidate.alpha not in means_by_alpha:
        means_by_alpha[candidate.alpha] = weight_input_means(candidate.calibrated, fit)
    judged = judge(candidate.qdq, held_out)
    corrected, qdq, structure, correction = _quantized(candidate, (), means_by_alpha[candidate.alpha], scratch / "bias")
    agreement = judge(qdq, held_out)
    kept = agreement.error_mean < judged.error_mean
    record = {
        **(correction or {}),
        "held_out_error_mean": {"before": _number(judged.error_mean), "corrected": _number(agreement.error_mean)},
        "held_out_cosine_min": {"before": _number(judged.cosine_min), "corrected": _number(agreement.cosine_min)},
        "kept": kept,
        "chosen_on": "the held-out calibration rows, as the method and smoothing pick",
    }
    if not kept:
        return replace(candidate, held_out=judged, bias_correction=record)
    return replace(
        candidate,
        calibrated=corrected,
        qdq=qdq,
        structure=structure,
        held_out=agreement,
        uncorrected=candidate.calibrated,
        bias_correction=record,
    )


def _quantized(
    candidate: Candidate, exclude: tuple[str, ...], means: dict[str, np.ndarray] | None, scratch: Path
) -> tuple[Path, Path, dict, dict | None]:
    """(FP32 graph, Q/DQ graph, its structure, the bias correction's record) for the candidate's FP32 graph (before
    any correction) with the ops in `exclude` left in float, written in `scratch`; with `means`
    (bias.weight_input_means), its biases corrected for the rounding of the weights it quantizes, which are the
    candidate's Q/DQ graph's (the same weights, the same ranges)."""
    scratch.mkdir(parents=True)
    calibrated, qdq = candidate.uncorrected or candidate.calibrated, scratch / engine_graph("int8")
    correction = None
    if means is not None:
        corrected = scratch / "model.calibrated.onnx"
        correction = correct_biases(calibrated, candidate.qdq, means, corrected, skip=exclude)
        calibrated = corrected
    return calibrated, qdq, quantize_qdq(calibrated, qdq, candidate.ranges, exclude=exclude), correction


def _number(value: float) -> float:
    return float(f"{value:.6g}")


def _keep_float(
    chosen: Candidate,
    means: dict[str, np.ndarray],
    held_out: list[dict[str, np.ndarray]],
    judge: Judge,
    macs: dict[str, int],
    scratch: Path,
) -> tuple[Candidate, dict]:
    """(the candidate with the ops kept in float that earned it, the record of every op tried): see FLOAT_OPS_TRIED."""
    assert chosen.held_out is not None  # _correct_biases judged every candidate
    current, error = chosen, chosen.held_out.error_mean
    tried: list[dict] = []
    if error < FLOAT_SEARCH_FROM:
        return current, {"rule": f"not tried: held-out error {error:.3g} < {FLOAT_SEARCH_FROM}"}
    for attempt in range(FLOAT_OPS_TRIED):
        op = _where_error_starts(current, held_out[0])
        if op is None or op in current.float_ops:
            break
        float_ops = (*current.float_ops, op)
        correct = means if current.uncorrected else None
        _, path, structure, _ = _quantized(current, float_ops, correct, scratch / str(attempt))
        share = int8_share(path, macs)["int8_compute_share"]
        agreement = judge(path, held_out)
        gain = 1 - agreement.error_mean / error
        given_up = int8_share(current.qdq, macs)["int8_compute_share"] - share
        kept = gain >= max(FLOAT_MIN_GAIN, FLOAT_GAIN_PER_SHARE * given_up) and share >= MIN_INT8_SHARE
        tried.append(
            {
                "op": op,
                "held_out_error_mean": float(f"{agreement.error_mean:.6g}"),
                "held_out_cosine_min": float(f"{agreement.cosine_min:.6g}"),
                "int8_compute_share": float(f"{share:.6g}"),
                "kept_in_float": kept,
            }
        )
        if not kept:
            break
        current = replace(current, qdq=path, structure=structure, held_out=agreement, float_ops=float_ops)
        error = agreement.error_mean
    rule = (
        f"the quantized op where the held-out error starts, kept in float when that cuts it by {FLOAT_MIN_GAIN:.0%} "
        f"and by {FLOAT_GAIN_PER_SHARE:g}x the share of the compute it leaves in float, with {MIN_INT8_SHARE:.0%} of "
        f"the multiply-adds still INT8; up to {FLOAT_OPS_TRIED}, judged on the held-out rows"
    )
    return current, {"rule": rule, "tried": tried}


def _where_error_starts(candidate: Candidate, inputs: dict[str, np.ndarray]) -> str | None:
    """The Conv/Gemm/MatMul feeding the first node past the gate's level on these rows (trt-pipeline diagnose's
    first node), traced back through the ops between them; None where no node is past it."""
    from ..pipeline.quality.diagnose import compare_layers, first_past, node_tolerance

    fp32 = candidate.uncorrected or candidate.calibrated  # FP32's equal: corrected biases are no reference
    first = first_past(compare_layers(fp32, candidate.qdq, inputs, "int8"), node_tolerance("int8"))
    if first is None:
        return None
    model = onnx.load(str(candidate.calibrated))
    producer = {output: node for node in model.graph.node for output in node.output}
    node = next(node for node in model.graph.node if node.name == first.node)
    while node is not None and node.op_type not in COMPUTE_OPS:
        node = producer.get(node.input[0]) if node.input else None
    return node.name if node is not None else None


def _alpha_text(alpha: float | None) -> str:
    return f"alpha {alpha:g}" if alpha else "off"


@dataclass(frozen=True)
class CalibrationParts:
    """The calibration data cut by calibration/holdout.py: the rows ranges and smoothing are fit on, the rows the
    agreement gate judges them on (None where the set is too small to hold any out), and the split's record."""

    fit: CalibrationData
    held_out: CalibrationData | None
    split: CalibrationSplit


def split_calibration(data: CalibrationData, batch: int) -> CalibrationParts:
    """`data` cut into the rows calibration fits on and the rows it never sees (the same rows for every reader
    of the same data: the split depends on the row count alone)."""
    split = split_rows(data.samples)
    record = CalibrationSplit(split.rule, split.rows, tuple(int(row) for row in split.held_out))
    if not len(split.held_out):
        return CalibrationParts(data, None, record)
    fit = rows_of(data, split.fit, batch, f"the {len(split.fit)} rows fit on")
    held_out = rows_of(data, split.held_out, batch, f"the {len(split.held_out)} held-out rows")
    return CalibrationParts(fit, held_out, record)


def calibration_sample(folder: Path) -> dict[str, np.ndarray] | None:
    """The calibration rows an int8 folder kept (SAMPLE), or None where it has none."""
    path = Path(folder) / CACHE_FOLDER / SAMPLE
    if not path.is_file():
        return None
    with np.load(path) as sample:
        return {name: sample[name] for name in sample.files}


def calibrated_graph(fp32_path: Path, scales: dict[str, np.ndarray], out_path: Path) -> Path:
    """The graph calibration runs on and every quantization starts from (the stage, a budget's trials, from a
    cache's scales too): the FP32 graph with its Constant nodes as initializers (qdq.constants_as_initializers)
    and smoothed with `scales` (calibration/smooth.py), written to `out_path`; the FP32 file itself where that
    changes nothing."""
    model = onnx.load(str(fp32_path))
    if not constants_as_initializers(model.graph) and not scales:
        return fp32_path
    onnx.save(smooth_graph(model, scales), str(out_path))
    return out_path


def _quantizable_model(fp32_path: Path) -> onnx.ModelProto:
    """The FP32 graph as calibrated_graph starts it: its weights all initializers, so smoothing finds them all."""
    model = onnx.load(str(fp32_path))
    constants_as_initializers(model.graph)
    return model


def _measure_smoothing(fp32_path: Path, data: CalibrationData, alpha: float | None) -> dict[str, np.ndarray]:
    """The smoothing scales of every activation MatMul/Gemm reads with a constant weight ({} when alpha is None)."""
    if alpha is None:
        return {}
    model = _quantizable_model(fp32_path)
    groups = smoothable(model)
    return smoothing_scales(model, groups, channel_maxima(model, list(groups), data.batches), alpha) if groups else {}


def _smoothing_record(fp32_path: Path, scales: dict[str, np.ndarray], alpha: float | None) -> dict | None:
    if alpha is None:
        return None
    groups = smoothable(_quantizable_model(fp32_path)) if scales else {}
    return smoothing_record(groups, scales, alpha)


def _cpu_graph(chosen: Candidate, path: Path, kind: str, means: dict[str, np.ndarray] | None, scratch: Path) -> dict:
    """One CPU-shaped graph's record, or {"graph", "failed"} when ONNX Runtime's quantizer cannot make it; where
    the engine's graph has its biases corrected, this one has them corrected for its own weights' rounding (uint8
    weights round otherwise than int8), every op's: it quantizes them all.

    These graphs are optional (the engine is built from model.int8.onnx; a CPU without its graph runs that one),
    so their failure is recorded and printed, never raised: it must not lose the TensorRT graph already written.
    """
    weights = WEIGHTS_FOR[kind]
    # The CPU graphs quantize every op: ONNX Runtime's quantizer, told to leave EfficientNet-Lite0's first
    # depthwise conv in float, wrote a graph whose stem Clip was off by 12x its scale under ORT's int8 kernels.
    try:
        if chosen.uncorrected is None or means is None or WEIGHT_FORMS[weights] == TENSORRT_WEIGHTS:
            # No correction, or one for the very weights this graph rounds: chosen.calibrated's biases fit it.
            return {"graph": path.name, **quantize_for_cpu(chosen.calibrated, path, chosen.ranges, weights=weights)}
        scratch.mkdir(parents=True)
        quantize_for_cpu(chosen.uncorrected, scratch / path.name, chosen.ranges, weights=weights)
        corrected = scratch / "model.calibrated.onnx"
        correction = correct_biases(chosen.uncorrected, scratch / path.name, means, corrected)
        record = quantize_for_cpu(corrected, path, chosen.ranges, weights=weights)
        return {"graph": path.name, **record, "bias_correction": correction}
    except Exception as error:  # ORT's quantizer raises ValueError, KeyError, AssertionError, its Fail, ...
        return {"graph": path.name, "failed": f"{type(error).__name__}: {error}"}


def written_cpu_graphs(record: dict) -> dict[str, str]:
    """{kind of CPU: graph name} of the CPU-shaped graphs an int8 stage record says it wrote."""
    graphs = record.get("qdq_onnxruntime_cpu") or {}
    return {kind: graph["graph"] for kind, graph in graphs.items() if "failed" not in graph}


def _quantizer_name() -> str:
    import onnxruntime

    return f"onnxruntime {onnxruntime.__version__} quantize_static (QDQ, symmetric QInt8, per-channel weights)"
