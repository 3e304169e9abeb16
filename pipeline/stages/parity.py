"""Stage 5: a graph on disk against PyTorch's outputs (reference.npz) through ONNX Runtime, and INT8's agreement gate
on the calibration data; each graph evaluated as its record says (pipeline/evaluation)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.compare import Comparison, compare_outputs
from ..core.errors import PipelineError
from ..core.mentions import render
from ..core.precision import Precision
from ..core.settings import mention, mention_name
from ..evaluation import INT8_MAX_ERROR, RTOL, evaluation_session, graph_session, probe_graph
from ..evaluation.agreement import Fp32Reference, outputs_agreement
from ..evaluation.layers import first_bad_node_text, first_node_past
from ..folder.graph_io import load_reference
from ..folder.layout import FP32_GRAPH, graph_record
from ..folder.records import CalibrationSplit, Evaluation, GraphAgreement, GraphRecord, Int8Agreement, RowsAgreement

if TYPE_CHECKING:
    from .fp16_overflow import Case

# Held-out error past this multiple of in-sample error is "much worse": the rows the ranges never saw hold values
# past them (clipped) or patterns the fit rows lacked.  Rows drawn alike differ by sampling noise only: measured
# 0.96-1.56x (digits CNN on 64 and 256 rows of its training split, max / percentile / entropy; random-init
# ResNet-50 on the 40 photos of `make calibration-images`: 1.17x); narrow sets 3-48x (EfficientNet-Lite0 on those
# photos: 3.2x; digits on near-copies of one to three digits with a varied tail: 8-48x).  2x means at least half
# the held-out error is error the fit rows never showed.
MUCH_WORSE_RATIO = 2.0
# ... and only where the held-out error is noticeable at all: below it (cosine ~0.9998 at equal norms) a ratio
# compares two kinds of rounding noise, and no data would change what is served.
NOTICEABLE_ERROR = 0.02
# The rows the fix asks for at least: the default --calib-samples (a few hundred representative rows).
ADVISED_ROWS = 256


def check_parity(
    onnx_path: Path,
    reference_path: Path,
    *,
    graph: GraphRecord,
    against_fp32: Sequence[Case] = (),
) -> dict:
    """Run every reference case through `graph` (its record: pipeline.folder.layout), at `onnx_path`; raise
    PipelineError past the tolerance.

    The graph is evaluated as its record says (pipeline/evaluation): a float16 graph as the engine stores it (every
    float16 tensor rounded, overflow to inf), not as ONNX Runtime's CPU provider would run it (in float32
    throughout); the engine's INT8 graph with its Q/DQ as TensorRT computes them.  `against_fp32`: more inputs,
    which have no PyTorch outputs, judged against the FP32 graph beside the graph (model.onnx) at the same
    tolerance (fp16: the calibration runs with the largest activations).
    """
    reference = load_reference(reference_path)
    session = _gate_session(graph, onnx_path, reference[0][0])
    judged = _judged_cases(onnx_path, reference, against_fp32)
    cases = [_judge_case(session, graph, onnx_path, inputs, expected, label) for inputs, expected, label in judged]
    return _parity_record(onnx_path, graph, cases)


def _gate_session(graph: GraphRecord, onnx_path: Path, first_inputs: dict[str, np.ndarray]):
    """The graph's evaluation session, probed on the first reference inputs: a crash is contained, and the level
    it opens at is recorded for the runner (pipeline/core/sessions.py).  The faithful float16 copy is another
    graph than the one the runner serves: that one is probed as it is."""
    if graph.evaluation is Evaluation.FAITHFUL_FP16:
        probe_graph(onnx_path, first_inputs)
        return evaluation_session(graph, onnx_path)
    return evaluation_session(graph, onnx_path, probe_feed=first_inputs)


def _judge_case(session, graph: GraphRecord, onnx_path: Path, inputs: dict, expected: dict, label: str) -> dict:
    """One case's record; a PipelineError naming the first node that goes wrong where an output is past RTOL."""
    names = [output.name for output in session.get_outputs()]
    rtol = RTOL[graph.precision]
    actual = dict(zip(names, session.run(names, inputs), strict=True))
    results = compare_outputs(expected, actual, rtol=rtol)
    batch = int(next(iter(inputs.values())).shape[0])
    failed = {n: c for n, c in results.items() if not _passes(c, graph.precision)}
    if failed:
        name, worst = next(iter(failed.items()))
        against = f"PyTorch at batch {batch}" if label == "reference" else f"the FP32 graph on {label}"
        problem = (
            f"{onnx_path.name} disagrees with {against} on output {name!r}: max abs error "
            f"{worst.max_abs:.3g} is {worst.max_rel:.3g} of the output scale {worst.scale:.3g} "
            f"(tolerance {rtol:g} for {graph.precision})"
        )
        raise _parity_error(onnx_path, inputs, graph, problem)
    return {"batch": batch, "data": label, "outputs": {n: c.as_record() for n, c in results.items()}}


def _parity_record(onnx_path: Path, graph: GraphRecord, cases: list[dict[str, Any]]) -> dict:
    worst_rel = max(o["max_rel"] for case in cases for o in case["outputs"].values())
    worst_abs = max(o["max_abs"] for case in cases for o in case["outputs"].values())
    batches = sorted({case["batch"] for case in cases if case["data"] == "reference"})
    faithful = " (float16 as the engine stores it)" if graph.evaluation is Evaluation.FAITHFUL_FP16 else ""
    more = [case["data"] for case in cases if case["data"] != "reference"]
    also = f" and vs FP32 on {', '.join(more)}" if more else ""
    rtol = RTOL[graph.precision]
    judged = "smoke: fails on inf/NaN only" if graph.precision is Precision.INT8 else f"tolerance {rtol:g}"
    return {
        "summary": f"{onnx_path.name}{faithful} vs PyTorch at batch {batches}{also}: max abs {worst_abs:.3g}, "
        f"max rel {worst_rel:.3g} ({judged})",
        "evaluation": "float16 storage: every float16 tensor rounded as the engine stores it" if faithful else "",
        "rtol": rtol,
        "max_abs": worst_abs,
        "max_rel": worst_rel,
        "cases": cases,
    }


def _passes(comparison: Comparison, precision: Precision) -> bool:
    """Within tolerance; for INT8 on random inputs, finite (RTOL's comment says why)."""
    return math.isfinite(comparison.max_abs) if precision is Precision.INT8 else comparison.ok


def _judged_cases(
    onnx_path: Path, reference: list[tuple[dict, dict]], against_fp32: Sequence[Case]
) -> Iterator[tuple[dict[str, np.ndarray], dict[str, np.ndarray], str]]:
    """(inputs, expected outputs, "reference" or the case's label): PyTorch's reference cases, then each of
    `against_fp32` with the FP32 graph's outputs (run one case at a time)."""
    for inputs, expected in reference:
        yield inputs, expected, "reference"
    if against_fp32:
        fp32 = graph_session(onnx_path.parent / FP32_GRAPH)
        names = [output.name for output in fp32.get_outputs()]
        for case in against_fp32:
            yield case.feeds, dict(zip(names, fp32.run(names, case.feeds), strict=True)), case.label


def check_int8_agreement(
    fp32: Fp32Reference,
    int8_paths: list[Path],
    in_sample: list[dict[str, np.ndarray]],
    held_out: list[dict[str, np.ndarray]] | None = None,
    *,
    split: CalibrationSplit | None = None,
    strict: bool = False,
    optional: Mapping[Path, GraphRecord] | None = None,
    judged: Mapping[Path, dict[str, RowsAgreement]] | None = None,
) -> Int8Agreement:
    """Each INT8 graph for the engine (`int8_paths`, judged as TensorRT computes them) against the FP32 graph (`fp32`,
    whose outputs the stage's judge computed already on the held-out rows) on the rows its ranges were fit on
    (`in_sample`) and on rows they never saw (`held_out`; calibration/holdout.py); each INT8 graph is run here, on
    the file written.  Raise PipelineError past INT8_MAX_ERROR on the held-out rows (in-sample where none are
    given).  An `optional` graph (by path, with its record: a CPU-shaped graph, judged on ONNX Runtime's int8
    kernels) past it is not an error: its record says "left_out" with the reason, for the caller to drop it (the
    engine's graph stands in).  judged: a graph's outputs' agreement on the `held_out` rows computed already, by
    the INT8 stage's judge on the same bytes (the kept candidate's Q/DQ graph, copied to model.int8.onnx), taken
    as its held-out numbers: the graph runs here on the in-sample rows alone.

    Held-out error past MUCH_WORSE_RATIO times in-sample (or nothing held out) means the calibration set cannot
    stand for the served data: the record's "warning" says so with the fix, and `strict` refuses instead."""
    parts = {"in_sample": in_sample, **({"held_out": held_out} if held_out else {})}
    split = split or CalibrationSplit("none: every row judged in-sample", _count(in_sample))
    engine = graph_record(Precision.INT8)
    judged = judged or {}
    graphs = {path.name: _int8_agreement(fp32, path, engine, parts, split, judged.get(path)) for path in int8_paths}
    for path, graph in (optional or {}).items():
        try:
            graphs[path.name] = _int8_agreement(fp32, path, graph, parts, split, judged.get(path))
        except PipelineError as refused:
            graphs[path.name] = GraphAgreement({}, left_out=refused.problem)
    warning = _unrepresentative(graphs[int8_paths[0].name], split) if int8_paths else None
    if warning is not None and strict:
        raise PipelineError(*warning)
    return Int8Agreement(
        gate=INT8_MAX_ERROR,
        much_worse_ratio=MUCH_WORSE_RATIO,
        split=split,
        graphs=graphs,
        warning=render(f"{warning[0]}; fix: {warning[1]}") if warning else None,  # manifest text: worded now
        details={
            "summary": "; ".join(_agreement_summary(name, graph) for name, graph in graphs.items()),
            "evaluation": "the calibration data: each row's |int8 - fp32| / |fp32| and cosine, on the rows the ranges "
            "were fit on (in_sample) and on the rows held out from calibration (held_out: the gate's)",
        },
    )


def _count(batches: Sequence[dict[str, np.ndarray]]) -> int:
    return int(sum(len(next(iter(feeds.values()))) for feeds in batches))


def _int8_agreement(
    fp32: Fp32Reference,
    int8_path: Path,
    graph: GraphRecord,
    parts: dict[str, list[dict[str, np.ndarray]]],
    split: CalibrationSplit,
    held_out: dict[str, RowsAgreement] | None = None,
) -> GraphAgreement:
    """The INT8 graph on disk, run here on every part (but the held-out rows where their numbers are given),
    against FP32's outputs on it (each part's run once)."""
    for batches in parts.values():  # FP32's outputs had before the INT8 graph opens (Fp32Reference)
        fp32.outputs(batches)
    first = next(iter(parts.values()))[0]
    quantized = evaluation_session(graph, int8_path, probe_feed={name: value[:1] for name, value in first.items()})
    records = {
        part: held_out if part == "held_out" and held_out else outputs_agreement(quantized, batches, fp32)
        for part, batches in parts.items()
    }
    agreement = GraphAgreement(records["in_sample"], records.get("held_out", {}))
    _, worst = agreement.worst()
    if not worst.error_mean <= INT8_MAX_ERROR:  # NaN fails too
        raise _agreement_error(fp32.path, int8_path, graph, agreement, parts, split)
    return agreement


def _agreement_error(
    fp32_path: Path,
    int8_path: Path,
    graph: GraphRecord,
    agreement: GraphAgreement,
    parts: dict[str, list[dict[str, np.ndarray]]],
    split: CalibrationSplit,
) -> PipelineError:
    """The refusal of an INT8 graph past the gate: its numbers, why the data may be to blame, the first bad node."""
    name, worst = agreement.worst()
    inputs = {input_name: value[:1] for input_name, value in parts[agreement.judged_on][0].items()}
    where = first_bad_node_text(first_node_past(fp32_path, int8_path, inputs, graph))
    rows = "held-out calibration rows" if agreement.held_out else "calibration data"
    unrepresentative = _unrepresentative(agreement, split)
    why = f"; {unrepresentative[0]}" if unrepresentative and agreement.held_out else ""
    return PipelineError(
        f"{int8_path.name} departs from FP32 on the {rows}: output {name!r} is off by "
        f"{worst.error_mean:.3g} of its norm on average over {worst.rows} rows (gate {INT8_MAX_ERROR}, cosine "
        f"{worst.cosine_mean:.4f}){_in_sample_beside(agreement, name)}{why}; {where}",
        f"{_more_data(split)}, or another {mention_name('calib_method')} than the manifest's calibration.method "
        f"(max, percentile, entropy); the table: trt-pipeline diagnose {int8_path.parent}",
    )


def _in_sample_beside(graph: GraphAgreement, name: str) -> str:
    if not graph.held_out:
        return ""
    in_sample = graph.in_sample[name]
    return f"; in-sample, on the {in_sample.rows} rows its ranges were fit on: {in_sample.error_mean:.3g}"


def _unrepresentative(graph: GraphAgreement, split: CalibrationSplit) -> tuple[str, str] | None:
    """(problem, fix) where the calibration set cannot stand for served data: nothing could be held out, or the
    held-out rows are much worse than the rows the ranges were fit on (MUCH_WORSE_RATIO); else None."""
    if not split.held_out:
        return (
            f"the INT8 gate judged only the rows calibration was fit on ({split.rule}): it says nothing about inputs "
            "the ranges never saw",
            _more_data(split),
        )
    ratio = graph.held_out_ratio()
    name, held_out = graph.worst()
    if ratio is None or ratio <= MUCH_WORSE_RATIO or held_out.error_mean < NOTICEABLE_ERROR:
        return None
    return (
        f"INT8 is {ratio:.1f}x worse on the {held_out.rows} held-out calibration rows than on the "
        f"{graph.in_sample[name].rows} its ranges were fit on (output {name!r}: off by {held_out.error_mean:.3g} of "
        f"its norm vs {graph.in_sample[name].error_mean:.3g}, more than {MUCH_WORSE_RATIO:g}x): the calibration set "
        "is too small or too narrow to stand for the served inputs, whose values will fall outside its ranges",
        _more_data(split),
    )


def _more_data(split: CalibrationSplit) -> str:
    """The fix for calibration data that cannot stand for served inputs: how many rows, and how varied."""
    wanted = max(ADVISED_ROWS, 2 * split.rows)
    return (
        f"calibrate on at least {wanted} rows (now {split.rows}; {mention(calib_samples=wanted)} where the data has "
        "them) drawn as the served inputs are: other photos, scenes, documents, not more crops, mirrors or templates "
        f"of the ones already there ({mention(calib='...')})"
    )


def _agreement_summary(name: str, graph: GraphAgreement) -> str:
    if graph.left_out is not None:
        return f"{name} left out: {graph.left_out}"
    output, worst = graph.worst()
    in_sample = graph.in_sample[output]
    numbers = f"off by {worst.error_mean:.3g} of the output's norm, cosine {worst.cosine_mean:.4f}"
    if not graph.held_out:
        return f"{name} vs FP32 on {in_sample.rows} calibration rows, in-sample only: {numbers} (gate {INT8_MAX_ERROR})"
    return (
        f"{name} vs FP32 on {worst.rows} held-out calibration rows: {numbers} (gate {INT8_MAX_ERROR}); "
        f"in-sample on {in_sample.rows}: {in_sample.error_mean:.3g}, cosine {in_sample.cosine_mean:.4f}"
    )


def _parity_error(onnx_path: Path, inputs: dict, graph: GraphRecord, problem: str) -> PipelineError:
    """The error for a failing gate, naming the first node that goes wrong and the option that fixes it."""
    fp32 = onnx_path.parent / FP32_GRAPH
    if graph.precision is Precision.FP32 or not fp32.is_file():
        return PipelineError(
            problem,
            "inspect the graph with the ONNX Runtime runner; an unsupported op or a mismatched preprocessing "
            "is the usual cause",
        )
    first = first_node_past(fp32, onnx_path, inputs, graph)
    where = first_bad_node_text(first)
    if graph.precision is Precision.FP16 and first is not None and first.kept_fp32:
        cause = (
            "a value past float16's range overflows before it"
            if first.rel == float("inf")
            else "a mask that float16 rounds across its threshold departs wholly where it flips"
        )
        fix = (
            f"keep the nodes that compute its inputs in FP32 too ({mention(keep_fp32='<node or op type>')}; "
            f"trt-pipeline diagnose {onnx_path.parent} lists each node's error in the graph's order): {cause}; or "
            f"build {mention(precision=Precision.FP32)}"
        )
    elif graph.precision is Precision.FP16:
        fix = (
            f"keep the node named above in FP32: {mention(keep_fp32='<node or op type>')}; leave the automatic FP32 "
            f"fallback on (no {mention(auto_fp32=False)}); the whole table: trt-pipeline diagnose {onnx_path.parent}"
        )
    else:
        served = mention(calib="...")
        fix = f"calibrate on data like the served inputs ({served}); trt-pipeline diagnose {onnx_path.parent}"
    return PipelineError(f"{problem}; {where}", fix)
