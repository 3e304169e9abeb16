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
    """Run every reference case through the graph; raise PipelineError past the tolerance."""
    session = onnxruntime_session(onnx_path)
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
            raise PipelineError(
                f"{onnx_path.name} disagrees with PyTorch at batch {batch} on output {name!r}: max abs error "
                f"{worst.max_abs:.3g} is {worst.max_rel:.3g} of the output scale {worst.scale:.3g} "
                f"(tolerance {rtol:g} for {precision})",
                "inspect the graph with the ONNX Runtime runner; an unsupported op or a mismatched "
                "preprocessing is the usual cause",
            )
    worst_rel = max(o["max_rel"] for case in cases for o in case["outputs"].values())
    worst_abs = max(o["max_abs"] for case in cases for o in case["outputs"].values())
    batches = sorted({case["batch"] for case in cases})
    return {
        "summary": f"{onnx_path.name} vs PyTorch at batch {batches}: max abs {worst_abs:.3g}, "
        f"max rel {worst_rel:.3g} (tolerance {rtol:g})",
        "rtol": rtol,
        "max_abs": worst_abs,
        "max_rel": worst_rel,
        "cases": cases,
    }
