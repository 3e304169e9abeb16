"""An ONNX file read and written field by field, in protobuf's wire format, so that the weights are never parsed.

Parsing a graph of one file holds its weights twice (the file's bytes and the message); serializing one holds them
twice again.  The graph's initializers are fields of the GraphProto inside the ModelProto, each a TensorProto whose
raw_data is one length-delimited field: this module skips that field when reading (`without_weights`, which can say
where each skipped field lies in the file) and copies it block by block from where it lies when writing a graph of
one file (`write_inline`; a tensor may be converted on the way, a block at a time), or writes it from the message
that holds it, byte for byte as onnx.save would (`write_held`).  Only the main graph's initializers are touched;
everything else is copied as it is.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import onnx

# Field numbers in onnx.proto: ModelProto.graph, GraphProto.initializer, TensorProto.raw_data and .external_data,
# StringStringEntryProto.key and .value.
GRAPH, INITIALIZER, RAW_DATA, EXTERNAL_DATA, KEY, VALUE = 7, 5, 9, 13, 1, 2
_LENGTH_DELIMITED = 2
_BLOCK = 16 << 20  # bytes copied at a time


@dataclass(frozen=True)
class Span:
    """`length` bytes of the file `path` from `offset`: a tensor's data, copied into the written file."""

    path: Path
    offset: int
    length: int


# Converts a tensor's bytes (float32 to float16, weight rows scaled): applied a block at a time, so that a tensor of
# any size is converted in bounded memory; the second argument is where the block starts in the tensor, in bytes.
Convert = Callable[[bytes, int], bytes]


@dataclass(frozen=True)
class Converted:
    """The `length` bytes `convert` makes of a tensor's bytes at `source`."""

    source: Span
    length: int
    convert: Convert


Part = bytes | Span | Converted
Data = bytes | mmap.mmap
Rewrite = Callable[[Data, int, int], list[Part] | None]


def without_weights(graph: Path | bytes, large: int, skipped: list[tuple[int, int, int]] | None = None) -> bytes:
    """The ModelProto in the file `graph` (or in these bytes) without the raw_data of its graph's initializers of
    `large` bytes or more, every other byte as it is.  A file is read through a memory map, so the skipped weights
    are not read at all.  `skipped`, when given, receives (the initializer's index in the graph, the offset of its
    raw_data in the file, its length) for each field left out."""
    if isinstance(graph, bytes):
        return _without_weights(graph, large, skipped)
    with open(graph, "rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            return b""
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _without_weights(data, large, skipped)


def _without_weights(data: Data, large: int, skipped: list[tuple[int, int, int]] | None) -> bytes:
    index = -1

    def raw_data(data: Data, start: int, end: int) -> list[Part] | None:
        if end - start < large:
            return [data[start:end]]
        if skipped is not None:
            skipped.append((index, start, end - start))
        return None

    def tensor(data: Data, start: int, end: int) -> list[Part]:
        nonlocal index
        index += 1
        return _rewritten(data, start, end, {RAW_DATA: raw_data})

    def graph(data: Data, start: int, end: int) -> list[Part]:
        return _rewritten(data, start, end, {INITIALIZER: tensor})

    return b"".join(part for part in _rewritten(data, 0, len(data), {GRAPH: graph}) if isinstance(part, bytes))


def external_locations(path: Path) -> set[str]:
    """The files the main graph's initializers keep their weights in (their external data's "location"), read from
    the wire without onnx and without reading the weights: what a reader that does not import onnx checks a graph
    against before ONNX Runtime opens it."""
    locations: set[str] = set()

    def entry(data: Data, start: int, end: int) -> list[Part]:
        fields = dict(_fields(data, start, end))
        if bytes(fields.get(KEY, b"")) == b"location":
            locations.add(bytes(fields.get(VALUE, b"")).decode("utf-8", "replace"))
        return []

    def tensor(data: Data, start: int, end: int) -> list[Part]:
        return _rewritten(data, start, end, {EXTERNAL_DATA: entry, RAW_DATA: lambda *_: None})

    def graph(data: Data, start: int, end: int) -> list[Part]:
        return _rewritten(data, start, end, {INITIALIZER: tensor})

    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size:
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
                _rewritten(data, 0, len(data), {GRAPH: graph})
    return locations


def _fields(data: Data, start: int, end: int) -> Iterator[tuple[int, Data]]:
    """(field number, value bytes) of each length-delimited field of the message in data[start:end]."""
    position = start
    while position < end:
        field, wire, value_start, value_end = _field(data, position)
        if wire == _LENGTH_DELIMITED:
            yield field, data[value_start:value_end]
        position = value_end


def write_inline(model: onnx.ModelProto, base: Path, path: Path, convert: dict[str, Convert] | None = None) -> None:
    """Write `model` (loaded without its external data, which lives in files under `base`) at `path` as one file,
    each initializer's data copied into it from where it lies a block at a time; an initializer named in `convert`
    is written as its function returns each block, sized as the tensor's data type and dims say."""
    from onnx.external_data_helper import uses_external_data

    def tensor(data: Data, start: int, end: int) -> list[Part]:
        import onnx

        proto = onnx.TensorProto.FromString(data[start:end])  # no weights inside: its data is external
        if not uses_external_data(proto):
            return [data[start:end]]
        span = external_span(proto, base)
        proto.ClearField("external_data")
        proto.ClearField("data_location")
        function = (convert or {}).get(proto.name)
        part: Part = span if function is None else Converted(span, tensor_bytes(proto), function)
        return [proto.SerializeToString(), _tag(RAW_DATA) + _varint_bytes(_size(part)), part]

    def graph(data: Data, start: int, end: int) -> list[Part]:
        return _rewritten(data, start, end, {INITIALIZER: tensor})

    serialized = model.SerializeToString()
    _write(_rewritten(serialized, 0, len(serialized), {GRAPH: graph}), path)


def write_held(model: onnx.ModelProto, path: Path, large: int) -> None:
    """Write `model`, its weights held in it, at `path`: the bytes onnx.save writes, without serializing the weights.
    Protobuf's encoder copies every byte of a message as it grows its buffer: a 144 MB Q/DQ graph took 0.41 s to
    serialize.  Each initializer's raw_data of `large` bytes or more is taken out of the message (and left out of it,
    as save_graph's data files leave it) while the rest is serialized, then written from where it is held, in its
    place among the tensor's fields (the encoder writes them in the order of their numbers)."""
    held: dict[int, bytes] = {}
    for index, initializer in enumerate(model.graph.initializer):
        if initializer.HasField("raw_data"):
            raw = initializer.raw_data
            if len(raw) >= large:
                held[index] = raw
                initializer.ClearField("raw_data")
    serialized = model.SerializeToString()
    index = -1

    def tensor(data: Data, start: int, end: int) -> list[Part]:
        nonlocal index
        index += 1
        raw = held.get(index)
        return [data[start:end]] if raw is None else _with_raw_data(data, start, end, raw)

    def graph(data: Data, start: int, end: int) -> list[Part]:
        return _rewritten(data, start, end, {INITIALIZER: tensor})

    _write(_rewritten(serialized, 0, len(serialized), {GRAPH: graph}), path)


def _with_raw_data(data: Data, start: int, end: int, raw: bytes) -> list[Part]:
    """The TensorProto in data[start:end] with the field raw_data = `raw` before its first field numbered after it."""
    parts: list[Part] = []
    position = start
    field_bytes = _tag(RAW_DATA) + _varint_bytes(len(raw))
    while position < end:
        field, _, _, value_end = _field(data, position)
        if field > RAW_DATA and field_bytes:
            parts += [field_bytes, raw]
            field_bytes = b""
        parts.append(data[position:value_end])
        position = value_end
    return parts + ([field_bytes, raw] if field_bytes else [])


def external_span(tensor: onnx.TensorProto, base: Path) -> Span:
    """Where the external data of `tensor` lies: its file under `base`, offset and length."""
    from onnx.external_data_helper import ExternalDataInfo

    info = ExternalDataInfo(tensor)
    source = base / info.location
    offset = info.offset or 0
    return Span(source, offset, info.length if info.length is not None else source.stat().st_size - offset)


def tensor_bytes(tensor: onnx.TensorProto) -> int:
    """The bytes of a tensor of fixed-size elements, from its data type and dims."""
    from onnx.helper import tensor_dtype_to_np_dtype

    return int(np.prod(tensor.dims, dtype=np.int64)) * np.dtype(tensor_dtype_to_np_dtype(tensor.data_type)).itemsize


def write_part(part: Span | Converted, out) -> int:
    """Write a tensor's bytes from where they lie (converted, for a Converted part) to `out`; return how many."""
    if isinstance(part, Span):
        with open(part.path, "rb") as source:
            source.seek(part.offset)
            return copy(source, out, part.length)
    written = 0
    with open(part.source.path, "rb") as source:
        source.seek(part.source.offset)
        for start in range(0, part.source.length, _BLOCK):
            block = part.convert(source.read(min(_BLOCK, part.source.length - start)), start)
            out.write(block)
            written += len(block)
    if written != part.length:
        raise ValueError(f"a converted tensor has {written} bytes, not the {part.length} its type says")
    return written


def read_span(span: Span) -> bytes:
    with open(span.path, "rb") as source:
        source.seek(span.offset)
        return source.read(span.length)


def _write(parts: list[Part], path: Path) -> None:
    with open(path, "wb") as out:
        for part in parts:
            if isinstance(part, bytes):
                out.write(part)
            else:
                write_part(part, out)


def copy(source, out, length: int | None) -> int:
    """Copy `length` bytes (all that is left where None) from `source` to `out`, a block at a time; return how many."""
    copied = 0
    while length is None or copied < length:
        block = source.read(_BLOCK if length is None else min(_BLOCK, length - copied))
        if not block:
            break
        out.write(block)
        copied += len(block)
    return copied


def _rewritten(data: Data, start: int, end: int, rewrite: dict[int, Rewrite]) -> list[Part]:
    """The message in data[start:end] with each length-delimited field named in `rewrite` replaced by the parts its
    function returns for the field's bytes (None: the field left out)."""
    parts: list[Part] = []
    position = start
    while position < end:
        field, wire, value_start, value_end = _field(data, position)
        function = rewrite.get(field) if wire == _LENGTH_DELIMITED else None
        if function is None:
            parts.append(data[position:value_end])
        else:
            value = function(data, value_start, value_end)
            if value is not None:
                parts += [_tag(field) + _varint_bytes(sum(map(_size, value))), *value]
        position = value_end
    return parts


def _size(part: Part) -> int:
    return len(part) if isinstance(part, bytes) else part.length


def _tag(field: int) -> bytes:
    return _varint_bytes(field << 3 | _LENGTH_DELIMITED)


def _field(data: Data, position: int) -> tuple[int, int, int, int]:
    """(field number, wire type, start, end of its value) of the field at `position`."""
    tag, position = _varint(data, position)
    wire = tag & 7
    if wire == 0:
        return tag >> 3, wire, position, _varint(data, position)[1]
    if wire in (1, 5):
        return tag >> 3, wire, position, position + (8 if wire == 1 else 4)
    if wire != _LENGTH_DELIMITED:
        raise ValueError(f"protobuf wire type {wire} at byte {position}: not an ONNX model")
    length, position = _varint(data, position)
    return tag >> 3, wire, position, position + length


def _varint(data: Data, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
