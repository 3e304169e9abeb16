"""Stage 5: a graph on disk against PyTorch's outputs (reference.npz) through ONNX Runtime."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.compare import Comparison, compare_outputs
from ..core.errors import PipelineError
from ..core.sessions import onnxruntime_session, probe_level
from ..folder.graph_io import load_reference
from ..folder.manifest import FP32_GRAPH, CalibrationSplit, GraphAgreement, Int8Agreement, RowsAgreement, engine_graph

if TYPE_CHECKING:
    from .float16 import Case

# Tolerances on max |onnx - torch| relative to the output's largest magnitude.
# FP32 graphs differ from PyTorch by reassociation only (measured ~1e-6 on ResNet-50);
# FP16 carries 10-bit mantissas through ~50 layers.  INT8 on the reference inputs is a smoke check
# only: they are N(0, 1) noise, and noise outside the calibrated input range is clipped by the first
# QuantizeLinear, so its error there measures the noise, not the graph (digits, calibrated on pixels in
# [-1, 1]: 0.58 of the output scale; a model whose float mask input gets noise: 0.97, with 0.007 on its
# calibration data).  So it fails only on inf or NaN; its error is recorded beside 1.0 for reference, and
# INT8's gate is check_int8_agreement, on the calibration data.
RTOL = {"fp32": 1e-3, "fp16": 3e-2, "int8": 1.0}
# INT8's gate, on the calibration data (inputs like the ones served): the mean over rows of
# |int8 - fp32| / |fp32| (Euclidean norms of each row's output).  It sees what a cosine cannot: a ReLU
# network with one weight scale off by 10x has all its outputs 10x too large and a cosine near 1.
# 0.2 is a cosine of 0.98 at equal norms; measured: digits 0.01 (see the manifest's agreement_int8).
# It judges the calibration rows held out from the ranges' fit (calibration/holdout.py), where there are any.
INT8_MAX_ERROR = 0.2
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


def check_parity(onnx_path: Path, reference_path: Path, *, precision: str, against_fp32: Sequence[Case] = ()) -> dict:
    """Run every reference case through the graph; raise PipelineError past the tolerance.

    A float16 graph runs as the engine stores it (every float16 tensor rounded, overflow to inf:
    pipeline/stages/float16.py), not as ONNX Runtime's CPU provider would run it (in float32 throughout).
    `against_fp32`: more inputs, which have no PyTorch outputs, judged against the FP32 graph beside the graph
    (model.onnx) at the same tolerance (fp16: the calibration runs with the largest activations).
    """
    from .float16 import faithful_session

    reference = load_reference(reference_path)
    first_inputs = reference[0][0]
    if precision == "fp16":
        probe_level(onnx_path, first_inputs)  # the graph the runner serves; the gate runs a faithful copy of it
        session = faithful_session(onnx_path)
    else:
        session = evaluation_session(onnx_path, probe_feed=first_inputs)
    names = [o.name for o in session.get_outputs()]
    rtol = RTOL[precision]
    cases: list[dict[str, Any]] = []
    for inputs, expected, label in _judged_cases(onnx_path, reference, against_fp32):
        actual = dict(zip(names, session.run(names, inputs), strict=True))
        results = compare_outputs(expected, actual, rtol=rtol)
        batch = int(next(iter(inputs.values())).shape[0])
        cases.append({"batch": batch, "data": label, "outputs": {n: c.as_record() for n, c in results.items()}})
        failed = {n: c for n, c in results.items() if not _passes(c, precision)}
        if failed:
            name, worst = next(iter(failed.items()))
            against = f"PyTorch at batch {batch}" if label == "reference" else f"the FP32 graph on {label}"
            problem = (
                f"{onnx_path.name} disagrees with {against} on output {name!r}: max abs error "
                f"{worst.max_abs:.3g} is {worst.max_rel:.3g} of the output scale {worst.scale:.3g} "
                f"(tolerance {rtol:g} for {precision})"
            )
            raise _parity_error(onnx_path, inputs, precision, problem)
    worst_rel = max(o["max_rel"] for case in cases for o in case["outputs"].values())
    worst_abs = max(o["max_abs"] for case in cases for o in case["outputs"].values())
    batches = sorted({case["batch"] for case in cases if case["data"] == "reference"})
    faithful = " (float16 as the engine stores it)" if precision == "fp16" else ""
    more = [case["data"] for case in cases if case["data"] != "reference"]
    also = f" and vs FP32 on {', '.join(more)}" if more else ""
    return {
        "summary": f"{onnx_path.name}{faithful} vs PyTorch at batch {batches}{also}: max abs {worst_abs:.3g}, "
        f"max rel {worst_rel:.3g} ({'smoke: fails on inf/NaN only' if precision == 'int8' else f'tolerance {rtol:g}'})",
        "evaluation": "float16 storage: every float16 tensor rounded as the engine stores it" if faithful else "",
        "rtol": rtol,
        "max_abs": worst_abs,
        "max_rel": worst_rel,
        "cases": cases,
    }


def _passes(comparison: Comparison, precision: str) -> bool:
    """Within tolerance; for INT8 on random inputs, finite (RTOL's comment says why)."""
    return math.isfinite(comparison.max_abs) if precision == "int8" else comparison.ok


def _judged_cases(
    onnx_path: Path, reference: list[tuple[dict, dict]], against_fp32: Sequence[Case]
) -> Iterator[tuple[dict[str, np.ndarray], dict[str, np.ndarray], str]]:
    """(inputs, expected outputs, "reference" or the case's label): PyTorch's reference cases, then each of
    `against_fp32` with the FP32 graph's outputs (run one case at a time)."""
    for inputs, expected in reference:
        yield inputs, expected, "reference"
    if against_fp32:
        fp32 = onnxruntime_session(onnx_path.parent / FP32_GRAPH)
        names = [output.name for output in fp32.get_outputs()]
        for case in against_fp32:
            yield case.feeds, dict(zip(names, fp32.run(names, case.feeds), strict=True)), case.label


def evaluation_session(onnx_path: Path, probe_feed: dict[str, np.ndarray] | None = None):
    """The session a gate judges a graph with: the TensorRT-shaped INT8 graph (model.int8.onnx) with its Q/DQ
    simulated as TensorRT computes them; ONNX Runtime's CPU-shaped graphs with ORT's own int8 kernels (what
    the runner serves); any other graph as is.  probe_feed: run once in a child first (pipeline/core/sessions.py)."""
    simulate_qdq = onnx_path.name == engine_graph("int8")
    return onnxruntime_session(onnx_path, simulate_qdq=simulate_qdq, probe_feed=probe_feed)


def check_int8_agreement(
    fp32_path: Path,
    int8_paths: list[Path],
    in_sample: list[dict[str, np.ndarray]],
    held_out: list[dict[str, np.ndarray]] | None = None,
    *,
    split: CalibrationSplit | None = None,
    strict: bool = False,
    optional: Sequence[Path] = (),
) -> dict:
    """Each INT8 graph against the FP32 graph on the rows its ranges were fit on (`in_sample`) and on rows they
    never saw (`held_out`; calibration/holdout.py); raise PipelineError past INT8_MAX_ERROR on the held-out rows
    (in-sample where none are given).  An `optional` graph past it is not an error: its record says "left_out"
    with the reason, for the caller to drop it (a CPU-shaped graph; the engine's graph stands in).

    Held-out error past MUCH_WORSE_RATIO times in-sample (or nothing held out) means the calibration set cannot
    stand for the served data: the record's "warning" says so with the fix, and `strict` refuses instead."""
    reference = onnxruntime_session(fp32_path)
    names = [output.name for output in reference.get_outputs()]
    parts = {"in_sample": in_sample, **({"held_out": held_out} if held_out else {})}
    expected = {
        part: [dict(zip(names, reference.run(names, feeds), strict=True)) for feeds in batches]
        for part, batches in parts.items()
    }
    split = split or CalibrationSplit("none: every row judged in-sample", _count(in_sample))
    graphs = {path.name: _int8_agreement(fp32_path, path, parts, expected, split) for path in int8_paths}
    for path in optional:
        try:
            graphs[path.name] = _int8_agreement(fp32_path, path, parts, expected, split)
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
        warning=f"{warning[0]}; fix: {warning[1]}" if warning else None,
        details={
            "summary": "; ".join(_agreement_summary(name, graph) for name, graph in graphs.items()),
            "evaluation": "the calibration data: each row's |int8 - fp32| / |fp32| and cosine, on the rows the ranges "
            "were fit on (in_sample) and on the rows held out from calibration (held_out: the gate's)",
        },
    ).as_json()


def int8_judge(fp32_path: Path) -> Callable[[Path, list[dict[str, np.ndarray]]], RowsAgreement]:
    """The gate's evaluation as a judge of candidate INT8 graphs (calibration/int8.py keeps the best on the
    held-out rows): (graph, batches) -> the worst output's agreement with the FP32 graph on those batches."""
    reference = onnxruntime_session(fp32_path)
    names = [output.name for output in reference.get_outputs()]
    expected: dict[int, list[dict]] = {}  # FP32 outputs, once per list of batches

    def judge(int8_path: Path, batches: list[dict[str, np.ndarray]]) -> RowsAgreement:
        wanted = expected.setdefault(
            id(batches), [dict(zip(names, reference.run(names, feeds), strict=True)) for feeds in batches]
        )
        records = _part_agreement(evaluation_session(int8_path), batches, wanted)
        return max(records.values(), key=lambda record: record.error_mean)

    return judge


def _count(batches: Sequence[dict[str, np.ndarray]]) -> int:
    return int(sum(len(next(iter(feeds.values()))) for feeds in batches))


def _int8_agreement(
    fp32_path: Path,
    int8_path: Path,
    parts: dict[str, list[dict[str, np.ndarray]]],
    expected: dict[str, list[dict]],
    split: CalibrationSplit,
) -> GraphAgreement:
    first = next(iter(parts.values()))[0]
    quantized = evaluation_session(int8_path, probe_feed={name: value[:1] for name, value in first.items()})
    records = {part: _part_agreement(quantized, batches, expected[part]) for part, batches in parts.items()}
    graph = GraphAgreement(records["in_sample"], records.get("held_out", {}))
    name, worst = graph.worst()
    if not worst.error_mean <= INT8_MAX_ERROR:  # NaN fails too
        judged = parts[graph.judged_on]
        inputs = {input_name: value[:1] for input_name, value in judged[0].items()}
        where = _first_bad_node(fp32_path, int8_path, inputs, "int8")
        rows = "held-out calibration rows" if graph.held_out else "calibration data"
        unrepresentative = _unrepresentative(graph, split)
        why = f"; {unrepresentative[0]}" if unrepresentative and graph.held_out else ""
        raise PipelineError(
            f"{int8_path.name} departs from FP32 on the {rows}: output {name!r} is off by "
            f"{worst.error_mean:.3g} of its norm on average over {worst.rows} rows (gate {INT8_MAX_ERROR}, cosine "
            f"{worst.cosine_mean:.4f}){_in_sample_beside(graph, name)}{why}; {where}",
            f"{_more_data(split)}, or another CALIB_METHOD than the manifest's calibration.method (max, percentile, "
            f"entropy); the table: trt-pipeline diagnose "
            f"{int8_path.parent}",
        )
    return graph


def _part_agreement(session, batches: list[dict[str, np.ndarray]], expected: list[dict]) -> dict[str, RowsAgreement]:
    names = list(expected[0])
    rows: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {name: [] for name in names}
    for feeds, wanted in zip(batches, expected, strict=True):
        actual = dict(zip(names, session.run(names, feeds), strict=True))
        for name in names:
            rows[name].append(_row_errors(wanted[name], actual[name]))
    return {name: _agreement_record(pairs) for name, pairs in rows.items()}


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
        f"calibrate on at least {wanted} rows (now {split.rows}; --calib-samples {wanted} where the data has them) "
        "drawn as the served inputs are: other photos, scenes, documents, not more crops, mirrors or templates of "
        "the ones already there (CALIB=...)"
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


def _row_errors(expected: np.ndarray, actual: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: (|actual - expected| / |expected|, cosine), on the flattened row."""
    left = expected.reshape(len(expected), -1).astype(np.float64)
    right = actual.reshape(len(actual), -1).astype(np.float64)
    norm_left, norm_right = np.linalg.norm(left, axis=1), np.linalg.norm(right, axis=1)
    error = np.linalg.norm(right - left, axis=1) / np.maximum(norm_left, 1e-30)
    cosine = np.sum(left * right, axis=1) / np.maximum(norm_left * norm_right, 1e-30)
    return error, cosine


def _agreement_record(pairs: list[tuple[np.ndarray, np.ndarray]]) -> RowsAgreement:
    error = np.concatenate([pair[0] for pair in pairs])
    cosine = np.concatenate([pair[1] for pair in pairs])
    return RowsAgreement(
        rows=len(error),
        error_mean=float(error.mean()),
        error_max=float(error.max()),
        cosine_mean=float(cosine.mean()),
        cosine_min=float(cosine.min()),
    )


def _first_bad_node(fp32_path: Path, lower_path: Path, inputs: dict, precision: str) -> str:
    from ..quality.diagnose import first_bad_node_text  # imported on failure only: it loads the whole graph

    return first_bad_node_text(fp32_path, lower_path, inputs, precision)


def _parity_error(onnx_path: Path, inputs: dict, precision: str, problem: str) -> PipelineError:
    """The error for a failing gate, naming the first node that goes wrong and the option that fixes it."""
    fp32 = onnx_path.parent / FP32_GRAPH
    if precision == "fp32" or not fp32.is_file():
        return PipelineError(
            problem,
            "inspect the graph with the ONNX Runtime runner; an unsupported op or a mismatched preprocessing "
            "is the usual cause",
        )
    where = _first_bad_node(fp32, onnx_path, inputs, precision)
    if precision == "fp16":
        fix = (
            "keep the node named above in FP32: KEEP_FP32=<node or op type> (--keep-fp32); leave the automatic "
            "FP32 fallback on (no NO_AUTO_FP32 / --no-auto-fp32); the whole table: trt-pipeline diagnose "
            f"{onnx_path.parent}"
        )
    else:
        fix = f"calibrate on data like the served inputs (CALIB=...); trt-pipeline diagnose {onnx_path.parent}"
    return PipelineError(f"{problem}; {where}", fix)
