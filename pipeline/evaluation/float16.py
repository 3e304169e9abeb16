"""Float16 as the engine computes it: a faithful evaluation copy of a float16 graph.

ONNX Runtime's CPU provider has float16 kernels for almost nothing: it runs each float16 node in
float32 behind inserted Casts and then drops the cast pairs between nodes, so a float16 graph run
there never rounds or overflows between layers.  A strongly typed TensorRT engine stores every
float16 tensor as float16.  `faithful_copy` rewrites a float16 graph into a float32 one in which
every tensor that is float16 in the original passes through Cast(float16) -> Cast(float32): ONNX
Runtime keeps such a lossy pair (checked: 1e5 becomes inf, 0.1234567 becomes 0.12344), so each
tensor carries exactly the float16 value the engine stores (rounding, overflow to inf), while each
op computes in float32 (as TensorRT's float16 kernels accumulate in float32).

The float16 weights stay as they are, each read through a Cast to float32 (exact: float16 widens losslessly), which
ONNX Runtime folds when it opens the session: the copy is read without its weights and written beside them
(pipeline.folder.graph_files), so no copy of the weights is made in Python or on disk.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..core.sessions import onnxruntime_session
from ..folder.graph_files import graph_beside, graph_without_weights, save_graph


def faithful_copy(fp16_model: onnx.ModelProto) -> onnx.ModelProto:
    """A float32 graph storing every float16 tensor of `fp16_model` as float16 (see the module docstring).  Its
    weights are `fp16_model`'s, wherever they are (in it, or referenced on disk)."""
    model = onnx.ModelProto()
    model.CopyFrom(fp16_model)
    float16 = _float16_tensors(model)
    graph = model.graph
    widened = {
        init.name: f"{init.name}__float32" for init in graph.initializer if init.data_type == TensorProto.FLOAT16
    }
    # Each float16 weight read through a Cast to float32 (exact), first, so every reader finds it made.
    nodes = [helper.make_node("Cast", [name], [wide], to=TensorProto.FLOAT) for name, wide in widened.items()]
    _read_widened(graph.node, widened)
    for node in graph.node:
        _float32_attributes(node)
        rounded = [name for name in node.output if name in float16]
        for name in rounded:
            node.output[list(node.output).index(name)] = f"{name}__float32"
        nodes.append(node)
        for name in rounded:  # the value the engine stores: float16, then read back as float32
            nodes.append(helper.make_node("Cast", [f"{name}__float32"], [f"{name}__float16"], to=TensorProto.FLOAT16))
            nodes.append(helper.make_node("Cast", [f"{name}__float16"], [name], to=TensorProto.FLOAT))
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.value_info[:]
    return model


def _read_widened(nodes, widened: dict[str, str]) -> None:
    """Every input of `nodes` (and of their subgraphs, which may read the outer graph's weights) that names a
    widened weight reads its float32 Cast instead."""
    for node in nodes:
        for index, name in enumerate(node.input):
            if name in widened:
                node.input[index] = widened[name]
        for attribute in node.attribute:
            for subgraph in [attribute.g, *attribute.graphs] if attribute.HasField("g") else attribute.graphs:
                _read_widened(subgraph.node, widened)


def _float16_tensors(model: onnx.ModelProto) -> set[str]:
    """Names of the tensors that are float16 (the node outputs among them are what is rounded)."""
    return {name for name, kind in element_types(model).items() if kind == TensorProto.FLOAT16}


def element_types(model: onnx.ModelProto) -> dict[str, int]:
    """Each tensor's element type (TensorProto's) by ONNX's shape inference: the inputs, the weights (their dims alone
    are read: a graph without its weights will do) and the node outputs it types."""
    graph = onnx.shape_inference.infer_shapes(model).graph
    typed = {value.name: value.type.tensor_type.elem_type for value in [*graph.input, *graph.value_info, *graph.output]}
    return {**{init.name: init.data_type for init in graph.initializer}, **typed}


def _float32_attributes(node: onnx.NodeProto) -> None:
    """Constants and Cast targets of float16 become float32 (the pair after the node does the rounding)."""
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_type == TensorProto.FLOAT16:
            value = numpy_helper.to_array(attribute.t).astype(np.float32)
            attribute.t.CopyFrom(numpy_helper.from_array(value, attribute.t.name))
        elif node.op_type == "Cast" and attribute.name == "to" and attribute.i == TensorProto.FLOAT16:
            attribute.i = TensorProto.FLOAT


def faithful_session(fp16: Path | bytes):
    """An ONNX Runtime session over the faithful copy of the float16 graph `fp16` (a file, its weights mapped from
    disk, or its bytes)."""
    if isinstance(fp16, bytes):
        with tempfile.TemporaryDirectory(prefix="faithful-fp16.") as folder:
            copy = Path(folder) / "faithful.onnx"
            save_graph(faithful_copy(onnx.load_model_from_string(fp16)), copy)
            return onnxruntime_session(copy)  # the session holds the graph in memory; the file can go
    fp16 = Path(fp16)
    with graph_beside(faithful_copy(graph_without_weights(fp16)), fp16.parent) as copy:
        return onnxruntime_session(copy, pack_weights=False)
