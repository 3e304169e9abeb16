"""A graph's files: the .onnx, and past protobuf's 2 GB the one data file beside it that holds its weights.

A protobuf message stops at 2 GiB, so a graph with more weights keeps them as external data (onnx's
docs/ExternalData.md): here always in one file per graph, `<graph>.data` (model.onnx.data), in the graph's own
folder.  A graph with fewer weights stays one file, as every tool reads it.  (A scratch graph, which no folder
keeps, has its data file whatever its size, and one written beside the graph it changes references the weights it
keeps in that graph's files: write_graph.)  Every graph of a folder is written
through `atomic_graph`, which moves the graph and its data file into place together; `data_files` names the data
files a graph refers to and refuses a reference that leaves the graph's folder.  onnx is imported on first use
only: the folder's readers import this module.

The weights are touched as few times as a stage needs them: `graph_without_weights` reads a graph with each large
initializer a reference to where its bytes lie (a graph of one file references itself), `write_graph` writes such
a graph with its weights copied, or converted, one tensor at a time, and `graph_beside` puts a changed copy of it
(outputs exposed, Casts added) beside the weights it references, where ONNX Runtime maps them instead of reading
them into memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..core.errors import PipelineError
from .artifacts import sha256_file, temporary_name
from .onnx_wire import (
    Convert,
    Converted,
    external_span,
    read_span,
    tensor_bytes,
    without_weights,
    write_held,
    write_inline,
    write_part,
)

if TYPE_CHECKING:
    import onnx

# Weights past this many bytes go to the data file: protobuf's 2 GiB less room for the graph's nodes.  Module-level
# so that the tests can force small graphs through the external-data paths.
EXTERNAL_DATA_BYTES = 2**31 - 2**28
# Tensors smaller than this stay inside the graph, as onnx's size_threshold keeps them: shapes, axes, scalars.
INLINE_TENSOR_BYTES = 1024
# The element types stored as numpy holds them (fixed size, little-endian): initializer_array reads their bytes as
# they lie; the others (bfloat16, float8, 4-bit, strings) onnx's numpy_helper converts.
_PLAIN_TYPES = (1, 2, 3, 4, 5, 6, 7, 10, 11, 12, 13)  # TensorProto: FLOAT ... INT64, FLOAT16, DOUBLE, UINT32, UINT64
# Each tensor's offset in the data file is a multiple of this, so the file can be mapped tensor by tensor.
ALIGNMENT = 4096


def data_file_name(graph: Path) -> str:
    """The name of the file beside `graph` that holds its weights when it has external data."""
    return f"{Path(graph).name}.data"


def remove_graph(graph: Path) -> None:
    """Delete `graph` and its data file (the folder's one name for it), where they are: read from neither, so a
    graph half-written or of an earlier build goes too."""
    for path in (Path(graph), Path(graph).with_name(data_file_name(graph))):
        path.unlink(missing_ok=True)


def data_files(graph: Path) -> list[Path]:
    """The files `graph`'s external data lives in (none for a graph of one file), each inside the graph's folder."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors, uses_external_data

    graph = Path(graph)
    model = onnx.load_model_from_string(without_weights(graph, INLINE_TENSOR_BYTES))
    locations = dict.fromkeys(ExternalDataInfo(t).location for t in _get_all_tensors(model) if uses_external_data(t))
    return [_inside(graph, location) for location in locations]


def _inside(graph: Path, location: str) -> Path:
    """The data file `location` names, refused unless it is a plain file name in `graph`'s folder."""
    path = graph.parent / location
    if Path(location).name != location or location in ("", ".", "..") or path.is_symlink():
        raise PipelineError(
            f"{graph} keeps weights in {location!r}, outside its own folder; a graph's external data must be a "
            "file beside it (the folder's checks and copies cover only those)",
            f"save the graph with its weights beside it: onnx.save_model(model, path, save_as_external_data=True, "
            f"location={data_file_name(graph)!r})",
        )
    if not path.is_file():
        raise PipelineError(
            f"{graph} keeps weights in {location}, which is not a file beside it",
            "copy the graph together with its data file, or export it again",
        )
    return path


def graph_without_weights(graph: Path) -> onnx.ModelProto:
    """The graph's nodes, inputs, outputs and initializers (name, type, dims), each initializer of
    INLINE_TENSOR_BYTES or more an external reference to where its bytes lie, none of them read: in its data file,
    or, for a graph of one file, in the graph file itself (ONNX's external data names a file, an offset and a
    length, and any file will do).  Locations are relative to the graph's folder.  What shape inference, the checks
    and a graph's inputs and outputs need, read at the size of the graph, not of its weights; what the writers
    (write_graph) stream the weights from, tensor by tensor; what ONNX Runtime maps the weights from instead of
    copying them (graph_beside).  Small initializers (shapes, axes) are loaded wherever they are; subgraphs (If,
    Loop) and Constant nodes are kept whole."""
    import onnx
    from onnx.external_data_helper import (
        ExternalDataInfo,
        _get_all_tensors,
        load_external_data_for_tensor,
        uses_external_data,
    )

    graph = Path(graph)
    skipped: list[tuple[int, int, int]] = []
    model = onnx.load_model_from_string(without_weights(graph, INLINE_TENSOR_BYTES, skipped))
    for tensor in _get_all_tensors(model):
        if uses_external_data(tensor) and (ExternalDataInfo(tensor).length or 0) < INLINE_TENSOR_BYTES:
            load_external_data_for_tensor(tensor, str(graph.parent))
    for index, offset, length in skipped:
        set_location(model.graph.initializer[index], graph.name, offset, length)
    return model


def initializer_array(tensor: onnx.TensorProto, base: Path) -> np.ndarray:
    """An initializer's values, read from where they lie: one graph_without_weights left external (its file under
    `base`) read once into an array of its own; numpy_helper.to_array (which takes any other) reads it into the
    message and copies it out again (162 weights read so: 3.8 s of the 0.6 GB MLP's INT8 stage)."""
    from onnx import helper, numpy_helper
    from onnx.external_data_helper import uses_external_data

    if not uses_external_data(tensor) or tensor.data_type not in _PLAIN_TYPES or sys.byteorder != "little":
        return numpy_helper.to_array(tensor, str(base))
    span = external_span(tensor, base)
    values = read_span(span)
    if len(values) != span.length:
        raise ValueError(f"{span.path} ends {span.length - len(values)} bytes short of tensor {tensor.name!r}")
    return np.frombuffer(values, helper.tensor_dtype_to_np_dtype(tensor.data_type)).reshape(tuple(tensor.dims))


def graph_files(graph: Path) -> list[Path]:
    """The graph and its data files: what a copy of it must carry."""
    return [Path(graph), *data_files(graph)]


def weight_bytes(model: onnx.ModelProto) -> int:
    """The bytes of the graph's initializers, whether held inside it or in external data (counted from their type
    and dims, so a tensor whose type a conversion changed counts at its new size)."""
    # External, or a typed field (float_data, int64_data, ...): counted from its type and dims.
    return sum(len(t.raw_data) if t.HasField("raw_data") else tensor_bytes(t) for t in model.graph.initializer)


def save_graph(model: onnx.ModelProto, path: Path, *, scratch: bool = False) -> None:
    """Write `model` (its weights in memory) at `path`: one file, or past EXTERNAL_DATA_BYTES the graph and its
    data file.  The weights are dropped from `model` as they are written (to either).  scratch: a
    graph no folder keeps (one calibration or ONNX Runtime reads once), written with its data file whatever its
    size: shape inference by path and ONNX Runtime then read it without parsing its weights (ONNX Runtime's
    quantizer, which wrote the INT8 graphs before calibration/qdq_write.py did, inferred shapes by path on every
    graph it was given: 15 s of its 53 s at 0.6 GB with graphs of one file)."""
    import onnx

    if not scratch and weight_bytes(model) <= EXTERNAL_DATA_BYTES:
        write_held(model, path, INLINE_TENSOR_BYTES)
        return
    location = data_file_name(path)
    Path(path).with_name(location).unlink(missing_ok=True)  # onnx appends to an existing one
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=location,
        size_threshold=INLINE_TENSOR_BYTES,
    )


def write_graph(
    model: onnx.ModelProto,
    base: Path,
    path: Path,
    convert: dict[str, Convert] | None = None,
    *,
    scratch: bool = False,
) -> None:
    """Write `model`, whose large tensors are external references to files under `base` (graph_without_weights,
    then changed), at `path` as this module's rule says: one file up to EXTERNAL_DATA_BYTES of weights, else the
    graph and `<graph>.data`; scratch: with its data file whatever its size (save_graph says why), and where it is
    written in the folder of weights it keeps, referencing them there (_referenced_beside).  Each tensor is copied from
    where it lies a block at a time; one named in `convert` (an initializer whose values the caller changed: float32
    to float16, weight rows smoothed) is written as its function returns each block.  A block in memory at a time,
    never the model's weights.  `path` names a new graph: one rewritten in place would lose the weights it reads."""
    import onnx
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    path, base, convert = Path(path), Path(base), convert or {}
    external = [tensor for tensor in _get_all_tensors(model) if uses_external_data(tensor)]
    if len(external) > sum(uses_external_data(tensor) for tensor in model.graph.initializer):
        _load_into(model, external, base, convert)  # external tensors in subgraphs or nodes: no exporter writes them
        save_graph(model, path, scratch=scratch)
    elif not scratch and weight_bytes(model) <= EXTERNAL_DATA_BYTES:
        write_inline(model, base, path, convert)
    else:
        copied = _referenced_beside(external, base, path, convert) if scratch else external
        if copied:  # a graph with no large tensor to copy has no data file to write
            _write_data_file(copied, base, path, convert)
        onnx.save(model, str(path))


def _referenced_beside(tensors: list, base: Path, path: Path, convert: dict[str, Convert]) -> list:
    """Point each tensor of `tensors` (external references under `base`) that is not converted and lies in a file of
    `path`'s own folder at that file, where the scratch graph at `path` references it; return the others, to copy.
    A graph that changes a few tensors of another (bias correction: the biases) and is written beside it writes
    none of the weights it keeps."""
    copied = []
    for tensor in tensors:
        span = external_span(tensor, base)
        if tensor.name in convert or span.path.parent.resolve() != path.parent.resolve():
            copied.append(tensor)
        else:
            set_location(tensor, span.path.name, span.offset, span.length)
    return copied


def _load_into(model: onnx.ModelProto, tensors: list, base: Path, convert: dict[str, Convert]) -> None:
    for tensor in tensors:
        raw = read_span(external_span(tensor, base))
        function = convert.get(tensor.name)
        del tensor.external_data[:]
        tensor.data_location = 0  # TensorProto.DEFAULT
        tensor.raw_data = function(raw, 0) if function is not None else raw


def _write_data_file(tensors: list, base: Path, path: Path, convert: dict[str, Convert]) -> None:
    """Every tensor in `tensors` (external references under `base`) copied, or converted, into `<path>.data`, each
    at an offset that is a multiple of ALIGNMENT; the tensors then name their place there."""
    target = path.with_name(data_file_name(path))
    with open(target, "wb") as out:
        for tensor in tensors:
            out.write(b"\0" * (-out.tell() % ALIGNMENT))
            offset = out.tell()
            span = external_span(tensor, base)
            function = convert.get(tensor.name)
            part = Converted(span, tensor_bytes(tensor), function) if function is not None else span
            length = write_part(part, out)
            set_location(tensor, target.name, offset, length)


def gather_weights(path: Path) -> None:
    """Store the graph at `path` as this module's rule says, whatever the exporter wrote: one file up to
    EXTERNAL_DATA_BYTES of weights, else every external tensor in `<graph>.data` (TorchScript writes one file
    per tensor past 2 GB), copied a block at a time, never all the weights in memory at once."""
    path = Path(path)
    sources = data_files(path)
    model = graph_without_weights(path)
    external = weight_bytes(model) > EXTERNAL_DATA_BYTES
    if sources == ([path.with_name(data_file_name(path))] if external else []):
        return  # already so
    with atomic_graph(path) as temporary:
        write_graph(model, path.parent, temporary)
    for source in sources:
        if source.name != data_file_name(path) or not external:
            source.unlink(missing_ok=True)


def copy_graph(source: Path, final: Path) -> None:
    """Copy the graph at `source` to `final` with its data file, stored as this module's rule says and named after
    `final` (atomic_graph: both appear together or not at all)."""
    source = Path(source)
    with atomic_graph(final) as temporary:
        for file in graph_files(source):
            shutil.copyfile(file, temporary.parent / file.name)
        os.replace(temporary.with_name(source.name), temporary)
        gather_weights(temporary)  # its data file named after it


def graph_digest(graph: Path) -> str:
    """The sha256 of a graph's file, and for a graph with a data file, over its files' sha256: what identifies its
    nodes and its weights both (a cache keyed on the graph file alone would not see new weights)."""
    files = graph_files(graph)
    if len(files) == 1:
        return sha256_file(files[0])
    listing = "".join(f"{file.name}:{sha256_file(file)}\n" for file in files)
    return hashlib.sha256(listing.encode()).hexdigest()


@contextlib.contextmanager
def graph_beside(model: onnx.ModelProto, folder: Path) -> Iterator[Path]:
    """`model`, whose large tensors are external references to files of `folder` (graph_without_weights, then
    changed: outputs exposed, Casts added), written into `folder` under a temporary name, so that ONNX Runtime opens
    it by path and maps the weights where they lie: none copied, none written.  Removed on exit (a killed run's is
    removed by the next build, as every temporary is)."""
    import onnx

    path = Path(folder) / temporary_name(Path(folder) / f"derived-{next(_DERIVED)}.onnx")
    try:
        onnx.save(model, str(path))
        yield path
    finally:
        path.unlink(missing_ok=True)


_DERIVED = itertools.count()


def set_location(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    """Make `tensor` an external reference to `length` bytes of the file `location` from `offset`."""
    from onnx import TensorProto

    del tensor.external_data[:]
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)


@contextlib.contextmanager
def atomic_graph(final: Path) -> Iterator[Path]:
    """Yield a path named like `final` in a private folder beside it; if the block succeeds, move the graph
    written there, with its data file where it has one, into place (the data file first, so the graph never
    names weights that are not there yet) and remove a data file of the graph it replaced that it no longer has.
    Named as artifacts.atomic_path's temporaries are, so the next build removes what a killed one left."""
    final = Path(final)
    staging = final.with_name(temporary_name(final))
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging / final.name
        data, final_data = staging / data_file_name(final), final.with_name(data_file_name(final))
        if data.is_file():
            os.replace(data, final_data)
            os.replace(staging / final.name, final)
        else:
            os.replace(staging / final.name, final)
            final_data.unlink(missing_ok=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
