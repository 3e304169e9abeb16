"""The graph every step of the INT8 stage reads (calibration, Q/DQ and CPU graphs, bias correction, the float
search): a graph file without its weights, its Constant nodes turned into initializers in memory, so that the FP32
graph itself is calibrated and quantized, not a copy of it with its weights (calibration.int8.calibrated_graph)."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import numpy_helper

from ..pipeline.folder.graph_files import graph_without_weights


def quantizable_graph(path: Path) -> onnx.ModelProto:
    """The graph file `path` without its weights (graph_without_weights: they stay where they lie), its Constant
    nodes as initializers."""
    model = graph_without_weights(path)
    constants_as_initializers(model.graph)
    return model


def constants_as_initializers(graph: onnx.GraphProto) -> int:
    """Turn Constant nodes (their `value` form) into initializers; return how many.  ORT's quantizer takes only
    initializers as constants: a weight the TorchScript exporter left in a Constant node (a conv of Wav2Vec2's
    feature extractor) is otherwise quantized as an activation (one per-tensor scale from its calibrated range,
    which percentile clips, instead of one exact scale per output channel), and an op reading a Constant (a
    transformer's attention-scale Mul, in the CPU graphs) needs a range for it and fails ("Quantization
    parameters are not specified for param .../Constant_7_output_0")."""
    constants = [
        node
        for node in graph.node
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value"
    ]
    for node in constants:
        graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(node.attribute[0].t), node.output[0]))
        graph.node.remove(node)
    return len(constants)
