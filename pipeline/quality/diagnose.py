"""`trt-pipeline diagnose <folder>`: where a float16 or INT8 graph departs from the FP32 graph, layer by layer.

Both graphs run on the same inputs (an INT8 folder's calibration sample, else the first case of reference.npz)
with every intermediate tensor exposed; the float16 graph runs as the engine stores it (pipeline/stages/float16.py
faithful_copy), the INT8 graph with its Q/DQ as TensorRT computes them.  Each
tensor the two graphs share by name is compared as max |lower - fp32| over the FP32 tensor's
largest magnitude, in the FP32 graph's order, on the elements where FP32 is finite: an inf or NaN
that FP32 computes too (an attention mask's -inf, the softmax of a fully masked row) is the model's
own value, not a precision's error.  The report names the first node past the precision's
tolerance and the 10 worst, and lands in the folder as diagnosis.json / diagnosis.md; a failing
parity gate quotes its first line.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx

from ..core.errors import PipelineError
from ..folder.artifacts import write_bytes, write_json
from ..stages.float16 import faithful_copy, run_exposing_tensors

WORST = 10


@dataclass(frozen=True)
class LayerError:
    """How far one node's output in the lower-precision graph is from the FP32 graph's."""

    node: str
    op: str
    tensor: str
    max_abs: float
    scale: float
    rel: float  # max_abs / scale; inf where the lower graph has inf or NaN and FP32 a finite value

    def as_record(self) -> dict:
        return asdict(self)


def compare_layers(
    fp32_path: Path, lower_path: Path, inputs: dict[str, np.ndarray], precision: str
) -> list[LayerError]:
    """Every node output both graphs compute, in the FP32 graph's order, with its error."""
    fp32 = onnx.load(str(fp32_path))
    lower = onnx.load(str(lower_path))
    if precision == "fp16":
        lower = faithful_copy(lower)
    reference = run_exposing_tensors(fp32, inputs)
    # The TensorRT-shaped INT8 graph as TensorRT computes it, as its gates judge it (pipeline.stages.parity).
    actual = run_exposing_tensors(lower, inputs, simulate_qdq=precision == "int8")
    errors = []
    for node in fp32.graph.node:
        for name in node.output:
            if name in reference and name in actual and reference[name].shape == actual[name].shape:
                errors.append(_error(node, name, reference[name], actual[name]))
    return errors


def _error(node: onnx.NodeProto, name: str, expected: np.ndarray, actual: np.ndarray) -> LayerError:
    """The error on the elements FP32 computes as finite numbers.  Where FP32 itself holds inf or NaN (a -inf
    attention-mask constant and every tensor derived from it) there is nothing a precision could get wrong; an
    inf or NaN in the lower graph where FP32 is finite is overflow, the worst error there is."""
    finite = np.isfinite(expected)
    expected64, actual64 = expected[finite].astype(np.float64), actual[finite].astype(np.float64)
    scale = float(np.max(np.abs(expected64))) if expected64.size else 0.0
    if not np.all(np.isfinite(actual64)):
        return LayerError(node.name, node.op_type, name, float("inf"), scale, float("inf"))
    max_abs = float(np.max(np.abs(actual64 - expected64))) if expected64.size else 0.0
    return LayerError(node.name, node.op_type, name, max_abs, scale, max_abs / scale if scale > 0 else max_abs)


def node_tolerance(precision: str) -> float:
    """How far a node's output may be from FP32's, relative to its scale: FP16's parity tolerance; for INT8 its
    gate's level on the calibration data (INT8_MAX_ERROR), not the 1.0 of the smoke check on random inputs,
    under which no node of a refused graph would ever be named."""
    from ..stages.parity import INT8_MAX_ERROR, RTOL

    return INT8_MAX_ERROR if precision == "int8" else RTOL[precision]


def first_past(errors: list[LayerError], rtol: float) -> LayerError | None:
    return next((error for error in errors if error.rel > rtol), None)


def first_bad_node_text(fp32_path: Path, lower_path: Path, inputs: dict[str, np.ndarray], precision: str) -> str:
    """One sentence for a failing gate: the first node past tolerance, or that none is (the error builds up)."""
    errors = compare_layers(fp32_path, lower_path, inputs, precision)
    first = first_past(errors, node_tolerance(precision))
    if first is None:
        return "no single node is past the tolerance: the error builds up over many (trt-pipeline diagnose)"
    return f"the first node past it is {first.node!r} ({first.op}): {_describe(first)}"


def _describe(error: LayerError) -> str:
    if error.rel == float("inf"):
        return f"its output {error.tensor!r} holds inf or NaN (FP32's largest value there: {error.scale:.3g})"
    return f"{error.tensor!r} is off by {error.max_abs:.3g}, {error.rel:.3g} of its scale {error.scale:.3g}"


# --------------------------------------------------------------------------- the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "folder", type=Path, help="an artifact folder built for fp16 or int8 (engines/<model>-<precision>)"
    )


def main(args: argparse.Namespace) -> int:
    report = diagnose_folder(args.folder)
    print(markdown(report))
    return 0


def diagnose_folder(folder: Path) -> dict:
    """Compare the folder's graph with its FP32 graph (on _inputs); write diagnosis.json/.md."""
    from ..folder.manifest import FP32_GRAPH, engine_graph, require_manifest

    manifest = require_manifest(folder)
    precision = manifest.precision or "unknown"
    if precision not in ("fp16", "int8"):
        raise PipelineError(
            f"{folder} holds a {precision} graph: there is no lower precision to compare with FP32",
            "diagnose a folder built with PRECISION=fp16 or PRECISION=int8",
        )
    inputs, data = _inputs(folder, precision)
    errors = compare_layers(folder / FP32_GRAPH, folder / engine_graph(precision), inputs, precision)
    first = first_past(errors, node_tolerance(precision))
    report = {
        "folder": str(folder),
        "precision": precision,
        "rtol": node_tolerance(precision),
        "data": data,
        "batch": int(next(iter(inputs.values())).shape[0]),
        "compared": len(errors),
        "first_past_tolerance": first.as_record() if first else None,
        "worst": [error.as_record() for error in sorted(errors, key=lambda e: -e.rel)[:WORST]],
    }
    write_json(Path(folder) / "diagnosis.json", report)
    write_bytes(Path(folder) / "diagnosis.md", markdown(report).encode())
    return report


def _inputs(folder: Path, precision: str) -> tuple[dict[str, np.ndarray], str]:
    """(inputs, what they are): an INT8 folder's calibration sample, where it kept one (reference.npz's inputs are
    random, and the input's Q/DQ clips what lies outside the calibrated range), else the first reference case."""
    from ...calibration.int8 import calibration_sample
    from ..folder.graph_io import load_reference
    from ..folder.manifest import REFERENCE

    sample = calibration_sample(folder) if precision == "int8" else None
    if sample is not None:
        return sample, "the first calibration rows the INT8 gate judged (held out from calibration where it could)"
    return load_reference(Path(folder) / REFERENCE)[0][0], "the first reference case"


def markdown(report: dict) -> str:
    first = report["first_past_tolerance"]
    lines = [
        f"# Diagnosis: {report['folder']} ({report['precision']} against FP32)",
        "",
        f"{report['compared']} tensors compared on {report['data']} (batch {report['batch']}); "
        f"tolerance {report['rtol']:g} of each tensor's FP32 scale.",
        "",
        f"First node past the tolerance: **{first['node']}** ({first['op']}), {first['rel']:.3g} of its scale."
        if first
        else "No node is past the tolerance.",
        "",
        f"| the {WORST} worst | op | tensor | max abs error | FP32 scale | relative |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {e['node']} | {e['op']} | {e['tensor']} | {e['max_abs']:.3g} | {e['scale']:.3g} | {e['rel']:.3g} |"
        for e in report["worst"]
    ]
    return "\n".join(lines) + "\n"
