"""Stage 5: a graph on disk against PyTorch's outputs (reference.npz) through ONNX Runtime."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.compare import compare_outputs
from pipeline.errors import PipelineError
from pipeline.export import load_reference

# Tolerances on max |onnx - torch| relative to the output's largest magnitude.
# FP32 graphs differ from PyTorch by reassociation only (measured ~1e-6 on ResNet-50);
# FP16 carries 10-bit mantissas through ~50 layers; INT8 is judged by accuracy (`make accuracy`),
# not here: the reference inputs are N(0, 1) noise, and noise outside the calibrated input range is
# clipped by the first QuantizeLinear (the digits model, calibrated on pixels in [-1, 1], measured
# 0.58 of the output scale; ResNet-18 on photographs 0.024).  At 1.0 this only catches a broken
# graph: NaN, garbage, a wrong per-channel axis.
RTOL = {"fp32": 1e-3, "fp16": 3e-2, "int8": 1.0}


def onnxruntime_session(
    onnx_path: Path,
    providers: list[str] | None = None,
    *,
    intra_op_threads: int | None = None,
    allow_spinning: bool = True,
):
    """An ONNX Runtime session; the CPU provider unless told otherwise (our parity reference).

    intra_op_threads: None keeps ORT's default (one per physical core).  allow_spinning=False makes idle
    intra-op threads sleep instead of spinning, which frees the cores for other requests' threads.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: ORT warns about every unused initializer
    if intra_op_threads is not None:
        options.intra_op_num_threads = intra_op_threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
    return ort.InferenceSession(str(onnx_path), options, providers=providers or ["CPUExecutionProvider"])


def check_parity(onnx_path: Path, reference_path: Path, *, precision: str) -> dict:
    """Run every reference case through the graph; raise PipelineError past the tolerance.

    A float16 graph runs as the engine stores it (every float16 tensor rounded, overflow to inf:
    pipeline/float16.py), not as ONNX Runtime's CPU provider would run it (in float32 throughout).
    """
    from pipeline.float16 import faithful_session

    session = faithful_session(onnx_path) if precision == "fp16" else onnxruntime_session(onnx_path)
    names = [o.name for o in session.get_outputs()]
    rtol = RTOL[precision]
    cases: list[dict[str, Any]] = []
    for inputs, expected in load_reference(reference_path):
        actual = dict(zip(names, session.run(names, inputs), strict=True))
        results = compare_outputs(expected, actual, rtol=rtol)
        batch = int(next(iter(inputs.values())).shape[0])
        cases.append({"batch": batch, "outputs": {n: c.as_record() for n, c in results.items()}})
        failed = {n: c for n, c in results.items() if not c.ok}
        if failed:
            name, worst = next(iter(failed.items()))
            problem = (
                f"{onnx_path.name} disagrees with PyTorch at batch {batch} on output {name!r}: max abs error "
                f"{worst.max_abs:.3g} is {worst.max_rel:.3g} of the output scale {worst.scale:.3g} "
                f"(tolerance {rtol:g} for {precision})"
            )
            raise _parity_error(onnx_path, inputs, precision, problem)
    worst_rel = max(o["max_rel"] for case in cases for o in case["outputs"].values())
    worst_abs = max(o["max_abs"] for case in cases for o in case["outputs"].values())
    batches = sorted({case["batch"] for case in cases})
    faithful = " (float16 as the engine stores it)" if precision == "fp16" else ""
    return {
        "summary": f"{onnx_path.name}{faithful} vs PyTorch at batch {batches}: max abs {worst_abs:.3g}, "
        f"max rel {worst_rel:.3g} (tolerance {rtol:g})",
        "evaluation": "float16 storage: every float16 tensor rounded as the engine stores it" if faithful else "",
        "rtol": rtol,
        "max_abs": worst_abs,
        "max_rel": worst_rel,
        "cases": cases,
    }


def _parity_error(onnx_path: Path, inputs: dict, precision: str, problem: str) -> PipelineError:
    """The error for a failing gate, naming the first node that goes wrong and the option that fixes it."""
    from pipeline.diagnose import first_bad_node_text
    from pipeline.precision import GRAPH_NAMES

    fp32 = onnx_path.parent / GRAPH_NAMES["fp32"]
    if precision == "fp32" or not fp32.is_file():
        return PipelineError(
            problem,
            "inspect the graph with the ONNX Runtime runner; an unsupported op or a mismatched preprocessing "
            "is the usual cause",
        )
    where = first_bad_node_text(fp32, onnx_path, inputs, precision)
    if precision == "fp16":
        fix = (
            "keep the node named above in FP32: KEEP_FP32=<node or op type> (--keep-fp32); leave the automatic "
            "FP32 fallback on (no NO_AUTO_FP32 / --no-auto-fp32); the whole table: python -m pipeline diagnose "
            f"{onnx_path.parent}"
        )
    else:
        fix = f"calibrate on data like the served inputs (CALIB=...); python -m pipeline diagnose {onnx_path.parent}"
    return PipelineError(f"{problem}; {where}", fix)
