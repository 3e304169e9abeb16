"""MODEL=path/to/model.onnx: a graph the user exported, entering the pipeline at `check`.

There is no PyTorch model, so the reference is the given FP32 graph itself (run by ONNX Runtime on random
inputs): parity then measures the simplified, FP16 and INT8 graphs against it, and the manifest says so.

What the file must say, and what INPUT_SHAPE / DYNAMIC add:
  - dim 0 of every input is the batch and must be symbolic (BATCH= sets its range);
  - every other symbolic dim needs a range: DYNAMIC=NAME:AXIS=MIN:OPT:MAX (its dim_param becomes the engine
    profile's axis, shared by every input that names it), or a size from INPUT_SHAPE, which fixes it;
  - INPUT_SHAPE (dims without the batch) must agree with the file's fixed dims and dtypes;
  - a graph of another opset is converted to opset 17 (onnx.version_converter), or refused with the reason.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from ..core.errors import PipelineError
from ..core.mentions import render
from ..core.random_inputs import random_inputs
from ..core.settings import OPSET, BatchProfile, mention, mention_name
from ..evaluation import graph_session
from ..folder.artifacts import sha256_file, write_npz
from ..folder.graph_files import atomic_graph, data_files, graph_without_weights, save_graph

ONNX_SUFFIX = ".onnx"
REFERENCE_SOURCE = "the given FP32 ONNX graph, run by ONNX Runtime (no PyTorch model: MODEL is an ONNX file)"
INTEGER_HIGH = 9  # integer inputs take 0..9: valid token ids or indices for almost any model


def is_onnx_model(model: str) -> bool:
    return Path(model).suffix.lower() == ONNX_SUFFIX


@dataclass(frozen=True)
class GraphInput:
    name: str
    dtype: np.dtype
    dims: tuple[int | str, ...]  # an int is fixed, a str a symbolic dim's name


@dataclass(frozen=True)
class OnnxModel:
    """The file, its inputs, and the range of every symbolic dim besides the batch."""

    path: Path
    inputs: tuple[GraphInput, ...]
    axis_ranges: dict[str, tuple[int, int, int]]
    fixed: dict[tuple[str, int], int]  # (input, axis) -> size given by INPUT_SHAPE for a symbolic dim
    fingerprint: str
    outputs: tuple[str, ...]  # the graph's output names


def open_onnx_model(path: Path, input_shape: str | None, dynamic: str | None) -> OnnxModel:
    """Read the file's inputs and resolve every symbolic dim with INPUT_SHAPE / DYNAMIC (see the module doc)."""
    from ...models.inputs import DTYPES, parse_dynamic, parse_input_shape

    if not path.is_file():
        raise PipelineError(f"ONNX file {path} does not exist", f"check the path of {mention(model='<file>.onnx')}")
    try:
        model = graph_without_weights(path)
    except Exception as error:  # protobuf's DecodeError and friends: the bytes are not a graph
        raise PipelineError(f"{path} is not an ONNX model: {type(error).__name__}: {error}", None) from None
    data_files(path)  # weights only beside it, where its folder's copies and checks reach
    inputs = _graph_inputs(model)
    shapes = {shape.name: shape for shape in parse_input_shape(input_shape)} if input_shape else {}
    requests = parse_dynamic(dynamic) if dynamic else []
    names = [graph_input.name for graph_input in inputs]
    if len(shapes) == 1 and len(inputs) == 1 and next(iter(shapes)) not in names:
        shapes = {names[0]: next(iter(shapes.values()))}  # INPUT_SHAPE=3x224x224 names no input
    for name in [*shapes, *(request.input_name for request in requests)]:
        if name not in names:
            raise PipelineError(f"{path.name} has no input {name!r}", f"its inputs are {', '.join(names)}")
    fixed: dict[tuple[str, int], int] = {}
    for graph_input in inputs:
        _check_batch_axis(path, graph_input)
        shape = shapes.get(graph_input.name)
        if shape is not None:
            fixed.update(_apply_input_shape(path, graph_input, shape.dims, shape.dtype, DTYPES))
    ranges: dict[str, tuple[int, int, int]] = {}
    for request in requests:
        graph_input = inputs[names.index(request.input_name)]
        dim = graph_input.dims[request.axis] if request.axis < len(graph_input.dims) else None
        if not isinstance(dim, str):
            raise PipelineError(
                f"{mention_name('dynamic')} names {request.input_name} axis {request.axis}, which is "
                f"{'fixed at ' + str(dim) if dim is not None else 'not an axis'} in {path.name}",
                f"export the graph with that axis dynamic (a dim_param), or leave it out of {mention_name('dynamic')}",
            )
        size = fixed.pop((request.input_name, request.axis), None)
        bounds = request.bounds or ((1, size, size) if size else None)
        if bounds is None:
            raise PipelineError(
                f"{mention(dynamic=dynamic)} gives {request.input_name} axis {request.axis} no range",
                f"an ONNX file has no example sizes: give {mention(dynamic='NAME:AXIS=MIN:OPT:MAX')}",
            )
        if ranges.setdefault(dim, bounds) != bounds:
            raise PipelineError(
                f"{mention_name('dynamic')} gives the axis {dim!r} two ranges ({ranges[dim]} and {bounds}); "
                "inputs share it in the file",
                "give every input's axis of that name the same range",
            )
    _require_every_symbolic_dim(path, inputs, ranges, fixed)
    outputs = tuple(output.name for output in model.graph.output)
    return OnnxModel(path, tuple(inputs), ranges, fixed, _fingerprint(path, input_shape, dynamic), outputs)


def _graph_inputs(model: onnx.ModelProto) -> list[GraphInput]:
    initializers = {initializer.name for initializer in model.graph.initializer}
    inputs = []
    for value in model.graph.input:
        if value.name in initializers:
            continue  # old exporters list weights as inputs too
        tensor = value.type.tensor_type
        dims = tuple(
            d.dim_param if d.HasField("dim_param") else (d.dim_value if d.HasField("dim_value") else "")
            for d in tensor.shape.dim
        )
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type))
        inputs.append(GraphInput(value.name, dtype, dims))
    return inputs


def _check_batch_axis(path: Path, graph_input: GraphInput) -> None:
    if not graph_input.dims or not isinstance(graph_input.dims[0], str) or not graph_input.dims[0]:
        first = graph_input.dims[0] if graph_input.dims else "none (a scalar)"
        raise PipelineError(
            f"{path.name}: input {graph_input.name!r} has dim 0 {first!r}; the pipeline needs dim 0 to be a named "
            "symbolic batch dim",
            f"export with dynamic_axes={{{graph_input.name!r}: {{0: 'batch'}}}} (torch.onnx.export) or name the "
            "batch dim in the graph",
        )


def _apply_input_shape(
    path: Path, graph_input: GraphInput, dims: tuple[int, ...], dtype: Any, dtypes: dict
) -> dict[tuple[str, int], int]:
    """INPUT_SHAPE's sizes for this input's symbolic dims; a size or dtype that disagrees with the file is refused."""
    import torch

    wanted = torch.empty(0, dtype=dtype).numpy().dtype
    if len(dims) != len(graph_input.dims) - 1 or wanted != graph_input.dtype:
        raise PipelineError(
            f"{mention_name('input_shape')} gives {graph_input.name} dims {list(dims)} {wanted}, but {path.name} has "
            f"{list(graph_input.dims)} {graph_input.dtype} (dim 0 is the batch)",
            f"give {mention_name('input_shape')} without the batch, matching the file's rank and dtype",
        )
    fixed = {}
    for axis, (size, dim) in enumerate(zip(dims, graph_input.dims[1:], strict=True), start=1):
        if isinstance(dim, int) and dim != size:
            raise PipelineError(
                f"{mention_name('input_shape')} gives {graph_input.name} axis {axis} size {size}, but {path.name} "
                f"fixes it at {dim}",
                f"give {dim} there, or leave that input out of {mention_name('input_shape')}",
            )
        if isinstance(dim, str):
            fixed[(graph_input.name, axis)] = size
    return fixed


def _require_every_symbolic_dim(
    path: Path, inputs: list[GraphInput], ranges: dict[str, tuple[int, int, int]], fixed: dict[tuple[str, int], int]
) -> None:
    missing = [
        f"{graph_input.name} axis {axis} ({dim!r})" if dim else f"{graph_input.name} axis {axis} (unnamed)"
        for graph_input in inputs
        for axis, dim in enumerate(graph_input.dims)
        if axis > 0 and isinstance(dim, str) and dim not in ranges and (graph_input.name, axis) not in fixed
    ]
    if missing:
        example = missing[0].split(" (")[0].replace(" axis ", ":")
        raise PipelineError(
            f"{path.name} has symbolic dims besides the batch that need a range: {', '.join(missing)}",
            f"give each a range with {mention_name('dynamic')} (e.g. {mention(dynamic=f'{example}=1:64:128')}; "
            f"inputs naming the same dim share it) or a fixed size with {mention_name('input_shape')}",
        )


def _fingerprint(path: Path, input_shape: str | None, dynamic: str | None) -> str:
    files = "".join(f"{sha256_file(file)}\0" for file in [path, *data_files(path)])  # the weights beside it too
    payload = f"onnx:{files}input_shape:{input_shape or ''}\0dynamic:{dynamic or ''}"
    return hashlib.sha256(payload.encode()).hexdigest()


# ---------------------------------------------------------------- the stages it replaces


def import_onnx(source: OnnxModel, onnx_path: Path) -> dict:
    """The file as the folder's model.onnx: at opset 17, with the dims INPUT_SHAPE fixed set."""
    model = onnx.load(str(source.path))  # with its external data, saved as graph_files' rule says
    converted = _to_opset(model, source.path)
    for value in model.graph.input if converted is None else converted.graph.input:
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            size = source.fixed.get((value.name, axis))
            if size is not None:
                dim.Clear()
                dim.dim_value = size
    graph = converted or model
    warnings = [  # printed and recorded as they are: worded here
        render(
            f"{mention_name('input_shape')} fixes the sequence axis of the integer token input {name} at {size}: "
            f"the engine takes only that length; {mention(dynamic=f'{name}:1=1:{size}:{max(size, 512)}')} (without "
            f"{mention_name('input_shape')} for it) keeps it dynamic"
        )
        for (name, axis), size in source.fixed.items()
        if axis == 1 and _is_token_input(source, name)
    ]
    for warning in warnings:
        print(f"warning: {warning}", flush=True)
    with atomic_graph(onnx_path) as temporary:
        save_graph(graph, temporary)
    opset = _default_opset(model)
    note = f", converted from opset {opset}" if converted is not None else ""
    return {
        "summary": f"{onnx_path.name} from {source.path}{note}; reference: the given FP32 graph (no PyTorch)",
        "source": str(source.path),
        "source_opset": opset,
        "inputs": [graph_input.name for graph_input in source.inputs],
        "outputs": [output.name for output in graph.graph.output],
        "axis_ranges": {name: list(bounds) for name, bounds in source.axis_ranges.items()},
        "fixed_by_input_shape": {f"{name}:{axis}": size for (name, axis), size in source.fixed.items()},
        "warnings": warnings,
    }


def _is_token_input(source: OnnxModel, name: str) -> bool:
    graph_input = next(i for i in source.inputs if i.name == name)
    return len(graph_input.dims) == 2 and graph_input.dtype.kind in "iu"


def _default_opset(model: onnx.ModelProto) -> int | None:
    return next((entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx")), None)


def _to_opset(model: onnx.ModelProto, path: Path) -> onnx.ModelProto | None:
    """None when the graph is at opset 17 already, else the converted graph (or a PipelineError saying why not)."""
    opset = _default_opset(model)
    if opset == OPSET:
        return None
    try:
        return onnx.version_converter.convert_version(model, OPSET)
    except Exception as error:  # the converter raises RuntimeError / ConvertError with the adapter it lacks
        raise PipelineError(
            f"{path.name} imports opset {opset}; converting it to opset {OPSET} failed: {error}",
            f"export the graph at opset {OPSET} (torch.onnx.export(..., opset_version={OPSET}))",
        ) from None


def integer_ranges(onnx_path: Path, names: list[str]) -> dict[str, tuple[int, int]]:
    """Values for integer inputs the graph accepts: 0..9, fewer where the input indexes a smaller table (a Gather
    on a weight, e.g. 2 token types), and 0..1 for masks (a mask of 9 overflows BERT's (1 - mask) * min)."""
    model = graph_without_weights(onnx_path)
    rows = {initializer.name: initializer.dims[0] for initializer in model.graph.initializer if initializer.dims}
    ranges = {name: (0, 1 if "mask" in name.lower() else INTEGER_HIGH) for name in names}
    for node in model.graph.node:
        if node.op_type == "Gather" and node.input[1] in ranges and node.input[0] in rows:
            low, high = ranges[node.input[1]]
            ranges[node.input[1]] = (low, min(high, rows[node.input[0]] - 1))
    return ranges


def reference_cases(source: OnnxModel, batch: BatchProfile) -> list[tuple[int, dict[str, int]]]:
    """(batch, sizes of the ranged dims): the parity batches at each range's opt, and batch 2 at each max and at each
    min (a range the graph cannot take is refused here, not at run time)."""
    from .export import parity_batches, range_end_cases

    optimal = {name: bounds[1] for name, bounds in source.axis_ranges.items()}
    highs = {name: bounds[2] for name, bounds in source.axis_ranges.items()}
    lows = {name: bounds[0] for name, bounds in source.axis_ranges.items()}
    return [(size, optimal) for size in parity_batches(batch)] + range_end_cases(highs, lows)


def write_onnx_reference(source: OnnxModel, onnx_path: Path, batch: BatchProfile, path: Path) -> dict:
    """reference.npz from the imported FP32 graph itself, on random inputs at every case's sizes."""
    from .export import refused_sizes

    records = [
        {
            "name": graph_input.name,
            "dtype": graph_input.dtype,
            "shape": [
                source.fixed.get((graph_input.name, axis), dim) if axis else dim
                for axis, dim in enumerate(graph_input.dims)
            ],
        }
        for graph_input in source.inputs
    ]
    ranges = integer_ranges(onnx_path, [graph_input.name for graph_input in source.inputs])
    session = graph_session(onnx_path)
    outputs = [output.name for output in session.get_outputs()]
    arrays: dict[str, np.ndarray] = {}
    cases = reference_cases(source, batch)
    for index, (size, axis_sizes) in enumerate(cases):
        feed = random_inputs(records, size, seed=index, axis_sizes=axis_sizes, int_ranges=ranges)
        try:
            result = session.run(outputs, feed)
        except Exception as error:  # ORT's own exception types: the graph does not run at these sizes
            fix = f"narrow {mention_name('batch')} or the {mention_name('dynamic')} ranges to sizes the graph takes"
            raise refused_sizes(source.path.name, "ONNX Runtime", feed, error, fix) from None
        arrays.update({f"case{index}/in/{name}": value for name, value in feed.items()})
        arrays.update({f"case{index}/out/{name}": value for name, value in zip(outputs, result, strict=True)})
    write_npz(path, arrays)
    batches = sorted({size for size, _ in cases})
    return {"summary": f"{path.name}: the FP32 graph's own outputs (no PyTorch model) at batch sizes {batches}"}
