"""The dynamo exporter's graph (opset 18, the lowest it implements) in opset 17, the design's.

onnx's version converter (what torch.onnx falls back to for 18 -> 17) has no adapter for Pad and keeps Split's
num_outputs, so a graph with F.pad or chunk() stayed at 18 or failed the checker.  Opset 18 changed few operators
(onnx/docs/Changelog.md, version 18); each one here is rewritten in its opset 17 form where the node uses nothing
that form lacks, and named in a PipelineError where it does.  Every other operator has one definition in 17 and 18.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import onnx
from onnx import defs, helper, numpy_helper

from ..core.errors import PipelineError
from ..core.settings import mention

SOURCE, TARGET = 18, 17
# Reduce ops whose axes became an input in 18 (ReduceSum's did in 13); in 17 they take an axes attribute.
AXES_AS_ATTRIBUTE = (
    "ReduceMax", "ReduceMin", "ReduceMean", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
    "ReduceLogSumExp", "ReduceSumSquare",
)  # fmt: skip


INTEGER_TYPES = {
    onnx.TensorProto.INT8, onnx.TensorProto.INT16, onnx.TensorProto.INT32, onnx.TensorProto.INT64,
    onnx.TensorProto.UINT8, onnx.TensorProto.UINT16, onnx.TensorProto.UINT32, onnx.TensorProto.UINT64,
}  # fmt: skip


class Unconvertible(Exception):
    """A node that uses what its operator's opset 17 form lacks; the message says what."""


def convert_to_opset_17(model: onnx.ModelProto, base_dir: Path | None = None) -> onnx.ModelProto:
    """The model with each node of an operator changed in 18 in its 17 form, importing opset 17 (in place).
    `base_dir`: the folder of the model's external data, where it was loaded without it."""
    constants = _constants(model, base_dir)
    graphs = [model.graph.node, *(function.node for function in model.functions)]
    for nodes in graphs:
        for node in nodes:
            if node.domain in ("", "ai.onnx") and _changed_in_18(node.op_type):
                _convert(node, constants)
    for entry in [*model.opset_import, *(o for function in model.functions for o in function.opset_import)]:
        if entry.domain in ("", "ai.onnx"):
            entry.version = TARGET
    return model


def _changed_in_18(op_type: str) -> bool:
    return defs.get_schema(op_type, SOURCE).since_version == SOURCE


def _convert(node: onnx.NodeProto, constants: dict[str, list[int]]) -> None:
    adapter = ADAPTERS.get(node.op_type)
    try:
        if adapter is None:
            raise Unconvertible(f"{node.op_type} has no opset {TARGET} form")
        adapter(node, constants)
    except Unconvertible as error:
        raise PipelineError(
            f"the dynamo exporter's graph cannot be written in opset {TARGET}: node {node.name or node.output[0]!r}: "
            f"{error}",
            f"{mention(exporter='torchscript')} where that exporter takes the model, or export it yourself and pass "
            f"{mention(model='path/to/model.onnx')} (opset 17, dim 0 named as the batch)",
        ) from None


def _split(node: onnx.NodeProto, constants: dict[str, list[int]]) -> None:
    # Without sizes, opset 13's Split cuts the axis into as many equal parts as it has outputs: what num_outputs
    # asks for when the size divides.  One that does not divide fails the checks that follow, naming the node.
    _drop_attributes(node, "num_outputs")


def _pad(node: onnx.NodeProto, constants: dict[str, list[int]]) -> None:
    if len(node.input) > 3 and node.input[3]:
        raise Unconvertible("Pad with an axes input (opset 18) pads every axis in opset 17")
    del node.input[3:]


def _reduce(node: onnx.NodeProto, constants: dict[str, list[int]]) -> None:
    if any(a.name == "noop_with_empty_axes" and a.i for a in node.attribute):
        raise Unconvertible(f"{node.op_type} with noop_with_empty_axes=1 reduces every axis in opset 17")
    _drop_attributes(node, "noop_with_empty_axes")
    if len(node.input) > 1 and node.input[1]:
        if node.input[1] not in constants:
            raise Unconvertible(f"{node.op_type}'s axes are computed in the graph; opset 17 takes them as constants")
        node.attribute.append(helper.make_attribute("axes", constants[node.input[1]]))
    del node.input[1:]


def _resize(node: onnx.NodeProto, constants: dict[str, list[int]]) -> None:
    defaults = {"antialias": 0, "keep_aspect_ratio_policy": b"stretch"}
    for attribute in node.attribute:
        value = helper.get_attribute_value(attribute)
        if attribute.name == "axes" or attribute.name in defaults and value != defaults[attribute.name]:
            raise Unconvertible(f"Resize with {attribute.name}={value!r} (opset 18) has no opset 17 form")
    _drop_attributes(node, *defaults)


def _scatter(node: onnx.NodeProto, constants: dict[str, list[int]]) -> None:
    for attribute in node.attribute:
        if attribute.name == "reduction" and attribute.s in (b"max", b"min"):
            raise Unconvertible(f"{node.op_type} with reduction={attribute.s.decode()} is new in opset 18")


ADAPTERS: dict[str, Callable[[onnx.NodeProto, dict[str, list[int]]], None]] = {
    "Split": _split,
    "Pad": _pad,
    "Resize": _resize,
    "ScatterElements": _scatter,
    "ScatterND": _scatter,
    **dict.fromkeys(AXES_AS_ATTRIBUTE, _reduce),
}


def _drop_attributes(node: onnx.NodeProto, *names: str) -> None:
    kept = [attribute for attribute in node.attribute if attribute.name not in names]
    del node.attribute[:]
    node.attribute.extend(kept)


def _constants(model: onnx.ModelProto, base_dir: Path | None) -> dict[str, list[int]]:
    """Integer tensors the graph holds as initializers or Constant nodes, by name (a Reduce's axes); the float
    weights are not read."""
    tensors = {init.name: init for init in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            tensors[node.output[0]] = node.attribute[0].t
    folder = str(base_dir or "")
    return {
        name: [int(v) for v in numpy_helper.to_array(tensor, base_dir=folder).reshape(-1)]
        for name, tensor in tensors.items()
        if tensor.data_type in INTEGER_TYPES
    }
