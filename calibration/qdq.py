"""Q/DQ insertion as ONNX Runtime's quantizer does it, in the form TensorRT's strongly typed builder accepts.

The graph is quantize_static(QuantFormat.QDQ)'s, written by calibration/qdq_write.py from what is in memory (each
weight quantized once per smoothing alpha; tests/calibration/test_qdq.py holds it equal to quantize_static's), with:
  - QInt8 activations and weights, ActivationSymmetric/WeightSymmetric: every zero point is 0,
    as TensorRT requires;
  - per_channel=True: one weight scale per output channel (axis 0 for Conv and Gemm);
  - QuantizeBias=False: ORT would otherwise store biases as int32 behind a DequantizeLinear,
    which TensorRT rejects (it quantizes biases itself when it fuses them into the conv);
  - op_types_to_quantize = Conv/Gemm/MatMul and OpTypesToExcludeOutputQuantization for the same:
    Q/DQ sits on the inputs of weighted ops only.  That is NVIDIA's recommended placement: a conv's
    output stays float so TensorRT fuses conv+bias+ReLU+residual add into one INT8 kernel, and
    because the quantized activation's DequantizeLinear is shared, a residual branch that feeds
    both an Add and the next Conv reaches the Add through it (TensorRT then fuses the Add too).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ..pipeline.folder.graph_files import atomic_graph, save_graph
from .qdq_write import TENSORRT, QuantizedWeights, qdq_model
from .ranges import QUANTIZED_OPS


def quantize_qdq(
    fp32_path: Path,
    out_path: Path,
    ranges,
    *,
    exclude: Sequence[str] = (),
    weights: QuantizedWeights | None = None,
) -> dict:
    """Write the Q/DQ graph for `ranges` (ORT TensorsData) of `fp32_path` (as quantizable_graph reads it), the nodes
    named in `exclude` left in float; return its structure for the manifest.  weights: the Q/DQ of `fp32_path`'s
    weights, kept for every graph made from the same smoothing alpha's graph (its candidates, their bias-corrected
    graphs, the float search's tries); by default quantized for this graph alone."""
    with atomic_graph(out_path) as temporary:
        model = qdq_model(fp32_path, ranges, TENSORRT, weights or QuantizedWeights(), exclude)
        problems = qdq_problems(model)
        if problems:  # our own quantizer settings are wrong: a bug, not the user's mistake
            raise RuntimeError("the Q/DQ graph breaks TensorRT's rules:\n  " + "\n  ".join(problems))
        structure = qdq_structure(model)  # before save_graph, which moves the weights out past 2 GB
        save_graph(model, temporary)
    return structure


def qdq_problems(model: onnx.ModelProto) -> list[str]:
    """What TensorRT would reject: int32 DequantizeLinear, non-zero zero points, bad per-channel axes."""
    initializers = {init.name: init for init in model.graph.initializer}
    problems = []
    for node in model.graph.node:
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        data = initializers.get(node.input[0])
        if node.op_type == "DequantizeLinear" and data is not None and data.data_type == onnx.TensorProto.INT32:
            problems.append(f"{node.name}: DequantizeLinear on int32 {node.input[0]!r} (a quantized bias)")
        zero_point = initializers.get(node.input[2]) if len(node.input) > 2 else None
        if zero_point is not None and np.any(numpy_helper.to_array(zero_point) != 0):
            problems.append(f"{node.name}: zero point {node.input[2]!r} is not 0 (INT8 must be symmetric)")
        scale = numpy_helper.to_array(initializers[node.input[1]])
        if scale.size > 1:
            problems.extend(_per_channel_problems(node, scale, data))
    return problems


def qdq_structure(model: onnx.ModelProto) -> dict:
    """Counts that describe the Q/DQ graph (recorded in the manifest, checked by tests)."""
    initializers = {init.name: init for init in model.graph.initializer}
    dequantize = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    weights = [n for n in dequantize if n.input[0] in initializers]
    per_channel = [n for n in weights if numpy_helper.to_array(initializers[n.input[1]]).size > 1]
    quantize = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    quantized_ops = [n for n in model.graph.node if n.op_type in QUANTIZED_OPS]
    return {
        "quantized_ops": len(quantized_ops),
        "quantized_activations": len(quantize),
        "quantized_weights": len(weights),
        "per_channel_weights": len(per_channel),
        "opset": next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
    }


def _per_channel_problems(node: onnx.NodeProto, scale: np.ndarray, data: onnx.TensorProto | None) -> list[str]:
    if data is None:
        return [f"{node.name}: activation {node.input[0]!r} has {scale.size} scales; activations are per-tensor"]
    axis = next((a.i for a in node.attribute if a.name == "axis"), 1)  # ONNX's default axis is 1
    dims = list(data.dims)
    if scale.ndim != 1 or not -len(dims) <= axis < len(dims) or dims[axis] != scale.size:
        return [f"{node.name}: {scale.size} weight scales do not match axis {axis} of {node.input[0]!r} {dims}"]
    return []
