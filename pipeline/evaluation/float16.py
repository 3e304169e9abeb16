"""Float16 as the engine computes it: a faithful evaluation copy of a float16 graph.

ONNX Runtime's CPU provider has float16 kernels for almost nothing: it runs each float16 node in
float32 behind inserted Casts and then drops the cast pairs between nodes, so a float16 graph run
there never rounds or overflows between layers.  A strongly typed TensorRT engine stores every
float16 tensor as float16.  `faithful_copy` rewrites a float16 graph into a float32 one in which
every tensor that is float16 in the original passes through Cast(float16) -> Cast(float32): ONNX
Runtime keeps such a lossy pair (checked: 1e5 becomes inf, 0.1234567 becomes 0.12344), so each
tensor carries exactly the float16 value the engine stores (rounding, overflow to inf), while each
op computes in float32 (as TensorRT's float16 kernels accumulate in float32).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..core.sessions import onnxruntime_session


def faithful_copy(fp16_model: onnx.ModelProto) -> onnx.ModelProto:
    """A float32 graph storing every float16 tensor of `fp16_model` as float16 (see the module docstring)."""
    model = onnx.ModelProto()
    model.CopyFrom(fp16_model)
    float16 = _float16_tensors(model)
    graph = model.graph
    for initializer in graph.initializer:
        if initializer.data_type == TensorProto.FLOAT16:
            value = numpy_helper.to_array(initializer).astype(np.float32)  # exact: float16 widens losslessly
            initializer.CopyFrom(numpy_helper.from_array(value, initializer.name))
    nodes = []
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


def _float16_tensors(model: onnx.ModelProto) -> set[str]:
    """Names of the node outputs that are float16 (from shape inference on the float16 graph)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    typed = [*inferred.graph.value_info, *inferred.graph.output]
    return {value.name for value in typed if value.type.tensor_type.elem_type == TensorProto.FLOAT16}


def _float32_attributes(node: onnx.NodeProto) -> None:
    """Constants and Cast targets of float16 become float32 (the pair after the node does the rounding)."""
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_type == TensorProto.FLOAT16:
            value = numpy_helper.to_array(attribute.t).astype(np.float32)
            attribute.t.CopyFrom(numpy_helper.from_array(value, attribute.t.name))
        elif node.op_type == "Cast" and attribute.name == "to" and attribute.i == TensorProto.FLOAT16:
            attribute.i = TensorProto.FLOAT


def faithful_session(fp16: Path | bytes):
    """An ONNX Runtime session over the faithful copy of the float16 graph `fp16` (a file or its bytes)."""
    model = onnx.load_model_from_string(fp16) if isinstance(fp16, bytes) else onnx.load(str(fp16))
    with tempfile.TemporaryDirectory(prefix="faithful-fp16.") as folder:
        copy = Path(folder) / "faithful.onnx"
        onnx.save(faithful_copy(model), str(copy))
        return onnxruntime_session(copy)  # the session holds the graph in memory; the file can go
