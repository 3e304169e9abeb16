"""Stage 5: a graph on disk against PyTorch's outputs (reference.npz) through ONNX Runtime."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.compare import Comparison, compare_outputs
from ..core.errors import PipelineError
from ..core.sessions import onnxruntime_session, probe_level
from ..folder.manifest import FP32_GRAPH, engine_graph
from .export import load_reference

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
INT8_MAX_ERROR = 0.2


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
    fp32_path: Path, int8_paths: list[Path], batches: list[dict[str, np.ndarray]], *, optional: Sequence[Path] = ()
) -> dict:
    """Each INT8 graph against the FP32 graph on calibration batches (FP32 run once for all of them);
    raise PipelineError past INT8_MAX_ERROR.  An `optional` graph past it is not an error: its record says
    "left_out" with the reason, for the caller to drop it (a CPU-shaped graph; the engine's graph stands in)."""
    reference = onnxruntime_session(fp32_path)
    names = [output.name for output in reference.get_outputs()]
    expected = [dict(zip(names, reference.run(names, feeds), strict=True)) for feeds in batches]
    count = int(sum(len(next(iter(feeds.values()))) for feeds in batches))
    graphs = {path.name: _int8_agreement(fp32_path, path, batches, expected, count) for path in int8_paths}
    for path in optional:
        try:
            graphs[path.name] = _int8_agreement(fp32_path, path, batches, expected, count)
        except PipelineError as refused:
            graphs[path.name] = {"summary": f"{path.name} left out: {refused.problem}", "left_out": refused.problem}
    return {
        "summary": "; ".join(record.pop("summary") for record in graphs.values()),
        "evaluation": "the calibration data (in-sample): each row's |int8 - fp32| / |fp32| and cosine",
        "gate": INT8_MAX_ERROR,
        "rows": count,
        "graphs": graphs,
    }


def _int8_agreement(
    fp32_path: Path, int8_path: Path, batches: list[dict[str, np.ndarray]], expected: list[dict], count: int
) -> dict:
    quantized = evaluation_session(int8_path, probe_feed={name: value[:1] for name, value in batches[0].items()})
    names = list(expected[0])
    rows: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {name: [] for name in names}
    for feeds, wanted in zip(batches, expected, strict=True):
        actual = dict(zip(names, quantized.run(names, feeds), strict=True))
        for name in names:
            rows[name].append(_row_errors(wanted[name], actual[name]))
    records = {name: _agreement_record(pairs) for name, pairs in rows.items()}
    worst_name = max(records, key=lambda name: records[name]["error_mean"])
    worst = records[worst_name]["error_mean"]
    if not worst <= INT8_MAX_ERROR:  # NaN fails too
        inputs = {name: value[:1] for name, value in batches[0].items()}
        where = _first_bad_node(fp32_path, int8_path, inputs, "int8")
        raise PipelineError(
            f"{int8_path.name} departs from FP32 on the calibration data: output {worst_name!r} is off by "
            f"{worst:.3g} of its norm on average over {count} rows (gate {INT8_MAX_ERROR}, cosine "
            f"{records[worst_name]['cosine_mean']:.4f}); {where}",
            "calibrate on more data like the served inputs (CALIB=..., CALIB_METHOD=percentile or entropy); "
            f"the table: trt-pipeline diagnose {int8_path.parent}",
        )
    return {
        "summary": f"{int8_path.name} vs FP32 on {count} calibration rows: off by {worst:.3g} of the output's "
        f"norm, cosine {records[worst_name]['cosine_mean']:.4f} (gate {INT8_MAX_ERROR})",
        "outputs": records,
    }


def _row_errors(expected: np.ndarray, actual: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: (|actual - expected| / |expected|, cosine), on the flattened row."""
    left = expected.reshape(len(expected), -1).astype(np.float64)
    right = actual.reshape(len(actual), -1).astype(np.float64)
    norm_left, norm_right = np.linalg.norm(left, axis=1), np.linalg.norm(right, axis=1)
    error = np.linalg.norm(right - left, axis=1) / np.maximum(norm_left, 1e-30)
    cosine = np.sum(left * right, axis=1) / np.maximum(norm_left * norm_right, 1e-30)
    return error, cosine


def _agreement_record(pairs: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    error = np.concatenate([pair[0] for pair in pairs])
    cosine = np.concatenate([pair[1] for pair in pairs])
    return {
        "error_mean": float(error.mean()),
        "error_max": float(error.max()),
        "cosine_mean": float(cosine.mean()),
        "cosine_min": float(cosine.min()),
    }


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
