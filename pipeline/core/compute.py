"""How much arithmetic each node of a graph does: the one count behind FP16's "kept in FP32: x% of the compute" and
INT8's "share of the compute in INT8" (calibration/share.py)."""

from __future__ import annotations

import numpy as np
import onnx

# The ops whose multiply-adds dominate a network and that TensorRT runs in INT8 where their inputs are quantized.
COMPUTE_OPS = ("Conv", "Gemm", "MatMul")


def multiply_adds(node: onnx.NodeProto, shapes: dict[str, tuple]) -> int:
    """Conv: output elements x (input channels per group x kernel); Gemm/MatMul: output elements x the inner length
    (activation x activation MatMuls, attention's, too); any other node one per output element; 0 where the output's
    shape is unknown."""
    output = shapes.get(node.output[0]) if node.output else None
    if output is None:
        return 0
    size = int(np.prod(output))
    if node.op_type == "Conv" and len(node.input) > 1:
        return size * int(np.prod(shapes.get(node.input[1], (1, 1))[1:]))
    if node.op_type in ("MatMul", "Gemm") and len(node.input) > 1:
        left = shapes.get(node.input[0], (1,))
        transposed = any(a.name == "transA" and a.i for a in node.attribute)
        return size * int(left[-2] if transposed and len(left) >= 2 else left[-1])
    return size
