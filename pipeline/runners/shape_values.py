"""Shape values a CUDA kernel reads as data, made on the device inside the graph, so ONNX Runtime can capture it.

ONNX Runtime's CUDA provider writes Shape's and Size's outputs in host memory and runs the small integer nodes
computed from them on the CPU (fallback_cpu_capability.cc, GetCpuPreferredNodes: a node whose every input is such a
host value, a small initializer or a graph input).  Where a CUDA node reads one of those values as data, not at an
input its kernel takes from the host (Reshape's shape, Range's limit, ...), ONNX Runtime adds a Memcpy node, and a
session with any Memcpy node cannot capture a CUDA graph.  transformers 5's padding mask does this: it gathers the
attention mask at `batch * sequence + position`, the sequence length a Gather of a Shape; on an H200 a BERT and a
DistilBERT folder then ran without CUDA graphs (a plain CUDA session logged "1 Memcpy nodes are added").

CUDA's Range kernel takes start, limit and delta from the host and writes its output on the device, so
`Range(v, v + 1, 1)` is the value v made on the device by a kernel of the graph, with no Memcpy node.  This rewrite
puts one before each such read of a one-element integer value; the outputs stay the same bit for bit.

The placement is ONNX Runtime's rule as it reads (every node assumed to have a CUDA kernel, as every node of the
sweep's graphs has): a prediction from the graph alone, which the GPU's own verbose placement confirms.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np

# Outputs the CUDA provider's kernels write in host memory.
HOST_OUTPUTS = {"Shape", "Size"}
# Inputs the CUDA provider's kernels read from host memory (their InputMemoryType(OrtMemTypeCPUInput, i)): a host
# value there needs no copy, and keeps its node on the device.
HOST_INPUTS = {
    "Reshape": {1},
    "Expand": {1},
    "Unsqueeze": {1},
    "Squeeze": {1},
    "Slice": {1, 2, 3, 4},
    "ConstantOfShape": {0},
    "Tile": {1},
    "Range": {0, 1, 2},
    "TopK": {1},
    "Resize": {1, 2, 3},
    "Pad": {1, 2, 3},
    "OneHot": {1},
    "Split": {1},
    "ReduceSum": {1},
    "CumSum": {1},
    "Trilu": {1},
    "Clip": {1, 2},
    "NonMaxSuppression": {2, 3, 4},
    "Dropout": {1, 2},
    "Loop": {0, 1},
    "If": {0},
}
# ONNX Runtime keeps a node on the device when any input is one of these (its fallback skips half-precision nodes).
_HALF = {10, 16}  # TensorProto.FLOAT16, BFLOAT16
_SMALL_INITIALIZER = 100  # elements: ONNX Runtime's kSmallInitializerThreshold
_INTEGERS = {6: "int32", 7: "int64"}  # TensorProto element types Range's CUDA kernel takes, here


@dataclass(frozen=True)
class HostRead:
    """A host value `tensor` that the device node `node` reads as its input `index`: ONNX Runtime copies it."""

    tensor: str
    node: str
    index: int


def host_reads(model) -> list[HostRead]:  # noqa: ANN001 - onnx.ModelProto, imported lazily
    """Every read of a host value by a device node in `model`'s main graph, as ONNX Runtime's CUDA provider would
    place its nodes."""
    import onnx

    return [read for _, read in _reads(onnx.shape_inference.infer_shapes(model))]


def _reads(inferred) -> list[tuple[int, HostRead]]:  # noqa: ANN001
    """host_reads of a graph with its tensors' types inferred (the half-precision rule reads every input's type),
    each with the position of the reading node in the graph (names may be empty, or repeat)."""
    graph, types, sizes = inferred.graph, _element_types(inferred), _initializer_sizes(inferred)
    graph_inputs = {tensor.name for tensor in graph.input}
    host: set[str] = set()
    reads = []
    for position, node in enumerate(graph.node):
        if node.op_type == "Constant":
            continue  # ONNX Runtime turns it into an initializer
        kernel_host = HOST_INPUTS.get(node.op_type, set())
        if node.op_type in HOST_OUTPUTS or _runs_on_host(node, host, kernel_host, types, sizes, graph_inputs):
            host.update(node.output)
            continue
        reads += [
            (position, HostRead(name, node.name, index))
            for index, name in enumerate(node.input)
            if name in host and index not in kernel_host
        ]
    return reads


def _runs_on_host(node, host, kernel_host, types, sizes, graph_inputs) -> bool:  # noqa: ANN001
    """ONNX Runtime's rule: a node reached by a host value runs on the CPU when each input is a host value its
    kernel does not take from the host, a small initializer or a graph input, and none is half precision."""
    inputs = [(index, name) for index, name in enumerate(node.input) if name]
    if not any(name in host for _, name in inputs):
        return False
    for index, name in inputs:
        if types.get(name) in _HALF:
            return False
        if sizes.get(name, _SMALL_INITIALIZER + 1) <= _SMALL_INITIALIZER or name in graph_inputs:
            continue
        if name not in host or index in kernel_host:
            return False
    return True


def make_on_device(graph: Path) -> int:
    """Rewrite the graph file `graph` in place: each one-element int32/int64 host value a device node reads as
    data comes from a Range on the device instead.  Returns how many values were (0: the file is untouched).  The
    weights stay where they are: only the graph is read and written."""
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    inferred = onnx.shape_inference.infer_shapes(model)
    reads = _reads(inferred)
    if not reads:
        return 0
    shapes = _static_shapes(inferred)
    types = _element_types(inferred)
    made: dict[str, str] = {}
    nodes: list = []
    by_position: dict[int, list[HostRead]] = {}
    for position, read in reads:
        by_position.setdefault(position, []).append(read)
    for position, node in enumerate(model.graph.node):
        for read in by_position.get(position, []):
            shape = shapes.get(read.tensor)
            if shape is None or prod(shape) != 1 or types.get(read.tensor) not in _INTEGERS:
                continue  # a value of many elements, or of unknown shape: left to ONNX Runtime's copy
            if read.tensor not in made:
                made[read.tensor] = _range_copy(model, nodes, read.tensor, shape, _INTEGERS[types[read.tensor]])
            node.input[read.index] = made[read.tensor]
        nodes.append(node)
    if not made:
        return 0
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    onnx.save(model, str(graph))
    return len(made)


def _range_copy(model, nodes: list, tensor: str, shape: tuple[int, ...], dtype: str) -> str:  # noqa: ANN001
    """Append to `nodes` the nodes that make the one-element host `tensor` on the device; returns their output."""
    from onnx import helper, numpy_helper

    def constant(suffix: str, value: np.ndarray) -> str:
        name = f"{tensor}_on_device_{suffix}"
        model.graph.initializer.append(numpy_helper.from_array(value, name))
        return name

    scalar_shape = constant("scalar_shape", np.array([], dtype=np.int64))
    one = constant("one", np.array(1, dtype=dtype))
    shape_back = constant("shape", np.array(shape, dtype=np.int64))
    start, limit, ranged = (f"{tensor}_on_device_{step}" for step in ("start", "limit", "range"))
    output = f"{tensor}_on_device"
    nodes += [
        helper.make_node("Reshape", [tensor, scalar_shape], [start], name=f"{start}_reshape"),  # on the host
        helper.make_node("Add", [start, one], [limit], name=f"{limit}_add"),  # on the host
        helper.make_node("Range", [start, limit, one], [ranged], name=f"{ranged}_range"),  # writes on the device
        helper.make_node("Reshape", [ranged, shape_back], [output], name=f"{output}_reshape"),
    ]
    return output


def _element_types(model) -> dict[str, int]:  # noqa: ANN001
    graph = model.graph
    types = {info.name: info.type.tensor_type.elem_type for info in (*graph.input, *graph.value_info, *graph.output)}
    types.update({tensor.name: tensor.data_type for tensor in graph.initializer})
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            types[node.output[0]] = node.attribute[0].t.data_type
    return types


def _initializer_sizes(model) -> dict[str, int]:  # noqa: ANN001
    sizes = {tensor.name: prod(tensor.dims) for tensor in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            sizes[node.output[0]] = prod(node.attribute[0].t.dims)
    return sizes


def _static_shapes(model) -> dict[str, tuple[int, ...]]:  # noqa: ANN001
    shapes = {}
    graph = model.graph
    for info in (*graph.input, *graph.value_info, *graph.output):
        tensor_type = info.type.tensor_type
        if not tensor_type.HasField("shape"):
            continue
        dims = tensor_type.shape.dim
        if all(dim.HasField("dim_value") for dim in dims):
            shapes[info.name] = tuple(dim.dim_value for dim in dims)
    shapes.update({tensor.name: tuple(tensor.dims) for tensor in graph.initializer})
    return shapes
