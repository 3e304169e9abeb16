"""Where a lower-precision graph departs from the FP32 graph, node by node (`trt-pipeline diagnose`, a failing gate's
message, calibration's float search).

Both graphs run on the same inputs with every intermediate tensor exposed, the lower one evaluated as its record
says (pipeline/evaluation evaluation_session): a float16 graph as the engine stores it (the faithful copy), an INT8
graph with its Q/DQ as TensorRT computes them.  Each tensor the two graphs share by name is compared as
max |lower - fp32| over the FP32 tensor's largest magnitude, in the FP32 graph's order, on the elements where FP32
is finite: an inf or NaN that FP32 computes too (an attention mask's -inf, the softmax of a fully masked row) is
the model's own value, not a precision's error.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

from ..core.precision import Precision
from ..core.sessions import graph_level
from ..folder.graph_files import graph_without_weights
from ..folder.records import Evaluation, GraphRecord
from . import node_tolerance
from .float16 import element_types, faithful_copy
from .tensors import run_exposing_tensors


@dataclass(frozen=True)
class LayerError:
    """How far one node's output in the lower-precision graph is from the FP32 graph's."""

    node: str
    op: str
    tensor: str
    max_abs: float
    scale: float
    rel: float  # max_abs / scale; inf where the lower graph has inf or NaN and FP32 a finite value
    # A float16 graph's node that computes in float32 (kept in FP32): where it departs, what it reads departs.
    kept_fp32: bool = False

    def as_record(self) -> dict:
        return asdict(self)


def compare_layers(
    fp32_path: Path, lower_path: Path, inputs: dict[str, np.ndarray], graph: GraphRecord
) -> list[LayerError]:
    """Every node output both graphs compute, in the FP32 graph's order, with its error; the graph at `lower_path`
    evaluated as `graph` (its record) says."""
    return list(_layer_errors(fp32_path, lower_path, inputs, graph))


def first_node_past(
    fp32_path: Path, lower_path: Path, inputs: dict[str, np.ndarray], graph: GraphRecord
) -> LayerError | None:
    """compare_layers' first error past the node tolerance of `graph`'s precision, None where none is: the errors
    after it are not computed (on EfficientNet-Lite0's INT8 graph the error starts at its fourth Conv, and the 94
    errors took 0.47 s of the float search's 1.7)."""
    return first_past(_layer_errors(fp32_path, lower_path, inputs, graph), node_tolerance(graph.precision))


def _layer_errors(
    fp32_path: Path, lower_path: Path, inputs: dict[str, np.ndarray], graph: GraphRecord
) -> Iterator[LayerError]:
    fp32_path, lower_path = Path(fp32_path), Path(lower_path)
    fp32 = graph_without_weights(fp32_path)  # the weights stay on disk, mapped by ONNX Runtime
    lower = graph_without_weights(lower_path)
    simulate_qdq = graph.precision is Precision.INT8
    # A copy of a graph with more of its tensors as outputs opens at the level its file opens at (a float search
    # compares graphs the stage has judged or calibrated on: no probe); the faithful float16 copy is another graph.
    kept: set[str] = set()
    if graph.evaluation is Evaluation.FAITHFUL_FP16:
        kept = _float32_nodes(lower)
        lower, lower_level = faithful_copy(lower), None
    else:
        lower_level = graph_level(lower_path, simulate_qdq=simulate_qdq)
    # Every INT8 graph with its Q/DQ as TensorRT computes them (a CPU-shaped graph's Q/DQ not fused into its int8
    # kernels).  Only the tensors both graphs compute are exposed: exposing an INT8 graph's own too (its
    # DequantizeLinear outputs, its weights in float among them) made this the peak of a 1.1B LM's INT8 stage, 3.3x
    # its weights.  The lower graph runs first and its session goes before FP32's opens: an INT8 session holds its
    # weights dequantized.
    compared = {name for node in fp32.graph.node for name in node.output}
    actual = run_exposing_tensors(
        lower, inputs, simulate_qdq=simulate_qdq, weights=lower_path.parent, only=compared, level=lower_level
    )
    reference = run_exposing_tensors(
        fp32, inputs, weights=fp32_path.parent, only=set(actual), level=graph_level(fp32_path)
    )
    for node in fp32.graph.node:
        for name in node.output:
            if name in reference and name in actual and reference[name].shape == actual[name].shape:
                yield _error(node, name, reference[name], actual[name], node.name in kept)


def _float32_nodes(float16: onnx.ModelProto) -> set[str]:
    """The names of a float16 graph's nodes kept in FP32: nodes other than Casts whose float outputs are float32
    (element_types).  By name: the converter renames a kept
    node's output, and the tensor of the FP32 graph's name is its Cast to float16."""
    types = element_types(float16)
    kept = set()
    for node in float16.graph.node:
        floats = [types[name] for name in node.output if types.get(name) in (TensorProto.FLOAT, TensorProto.FLOAT16)]
        if node.op_type != "Cast" and floats and all(kind == TensorProto.FLOAT for kind in floats):
            kept.add(node.name)
    return kept


def _error(node: onnx.NodeProto, name: str, expected: np.ndarray, actual: np.ndarray, kept: bool) -> LayerError:
    """The error on the elements FP32 computes as finite numbers.  Where FP32 itself holds inf or NaN (a -inf
    attention-mask constant and every tensor derived from it) there is nothing a precision could get wrong; an
    inf or NaN in the lower graph where FP32 is finite is overflow, the worst error there is."""
    finite = np.isfinite(expected)
    if not finite.all():  # copies of the finite elements only where there are others (the copies cost 3x the rest)
        expected, actual = expected[finite], actual[finite]
    scale = float(np.abs(expected).max()) if expected.size else 0.0  # exact in the tensor's own float type
    if not np.isfinite(actual).all():
        return LayerError(node.name, node.op_type, name, float("inf"), scale, float("inf"), kept)
    # In float64: a float32 difference could round.  asarray: of two 0-d tensors np.subtract makes a numpy scalar,
    # which abs(out=) refuses (a DPT's parity failure crashed here, naming nothing).
    difference = np.asarray(np.subtract(actual, expected, dtype=np.float64))
    max_abs = float(np.abs(difference, out=difference).max()) if difference.size else 0.0
    return LayerError(node.name, node.op_type, name, max_abs, scale, max_abs / scale if scale > 0 else max_abs, kept)


def first_past(errors: Iterable[LayerError], rtol: float) -> LayerError | None:
    """The first of `errors` past `rtol` (those after it are not asked for: `errors` may compute each as it goes)."""
    return next((error for error in errors if error.rel > rtol), None)


def first_bad_node_text(first: LayerError | None) -> str:
    """One sentence for a failing gate: the first node past tolerance (first_node_past), or that none is (the error
    builds up)."""
    if first is None:
        return "no single node is past the tolerance: the error builds up over many (trt-pipeline diagnose)"
    kept = ", kept in FP32 already, so what it reads departs" if first.kept_fp32 else ""
    return f"the first node past it is {first.node!r} ({first.op}){kept}: {_describe(first)}"


def _describe(error: LayerError) -> str:
    if error.rel == float("inf"):
        return f"its output {error.tensor!r} holds inf or NaN (FP32's largest value there: {error.scale:.3g})"
    return f"{error.tensor!r} is off by {error.max_abs:.3g}, {error.rel:.3g} of its scale {error.scale:.3g}"
