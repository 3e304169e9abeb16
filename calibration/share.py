"""The share of a graph's compute that an INT8 Q/DQ graph runs in INT8: what quantizing gives, reported beside what
it costs in accuracy (winning accuracy by leaving half the graph in float is no win).

The compute is the multiply-adds of every Conv, Gemm and MatMul (pipeline/core/compute.py), attention's activation
x activation MatMuls too, with the shapes measured by running the FP32 graph once (ONNX's shape inference leaves a
transformer's shapes symbolic after its Shape/Reshape arithmetic).  An op runs in INT8 where both of its inputs come
from a DequantizeLinear, directly or through ops TensorRT moves a Q/DQ across (a quantized weight is often
DQ -> Transpose -> MatMul).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from ..pipeline.core.compute import COMPUTE_OPS, multiply_adds
from ..pipeline.core.sessions import UNOPTIMIZED
from ..pipeline.evaluation.tensors import tensor_values
from ..pipeline.folder.graph_files import graph_without_weights

SHAPE_OPS = ("Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze")


def compute_shapes(fp32: Path, feeds: dict[str, np.ndarray]) -> tuple[onnx.ModelProto, dict[str, tuple]]:
    """The FP32 graph, and the shapes of its Conv/Gemm/MatMul inputs and outputs when it runs on `feeds`."""
    model = graph_without_weights(fp32)  # the weights stay on disk: the run maps them
    weights = {tensor.name: tuple(tensor.dims) for tensor in model.graph.initializer}
    wanted = {
        name
        for node in model.graph.node
        if node.op_type in COMPUTE_OPS
        for name in (node.input[0], node.input[1], node.output[0])
        if name not in weights
    }
    # Shapes: the same at any level, and unoptimized there is nothing to probe.
    values = next(tensor_values(model, sorted(wanted), [feeds], weights=Path(fp32).parent, level=UNOPTIMIZED))
    return model, {**weights, **{name: tuple(value.shape) for name, value in values.items()}}


def macs_by_op(model: onnx.ModelProto, shapes: dict[str, tuple]) -> dict[str, int]:
    """Multiply-adds of each Conv/Gemm/MatMul, by node name."""
    return {node.name: multiply_adds(node, shapes) for node in model.graph.node if node.op_type in COMPUTE_OPS}


def int8_ops(graph: Path, names: set[str]) -> set[str]:
    """The compute ops (named as in the FP32 graph) both of whose inputs come from a DequantizeLinear, directly
    or through SHAPE_OPS: the ops TensorRT runs in INT8."""
    model = graph_without_weights(graph)
    producer = {output: node for node in model.graph.node for output in node.output}

    def dequantized(tensor: str) -> bool:
        node = producer.get(tensor)
        while node is not None and node.op_type in SHAPE_OPS:
            node = producer.get(node.input[0])
        return node is not None and node.op_type == "DequantizeLinear"

    return {
        node.name
        for node in model.graph.node
        if node.name in names and dequantized(node.input[0]) and dequantized(node.input[1])
    }


def int8_share(graph: Path, macs: dict[str, int]) -> dict:
    """{"ops_quantized": "k/n", "int8_compute_share": the quantized ops' multiply-adds over all}."""
    quantized = int8_ops(graph, set(macs))
    return {
        "ops_quantized": f"{len(quantized)}/{len(macs)}",
        "int8_compute_share": sum(macs[name] for name in quantized) / sum(macs.values()),
    }
