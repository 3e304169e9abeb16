"""An ONNX file read and written field by field, in protobuf's wire format, so that the weights are never parsed.

Parsing a graph of one file holds its weights twice (the file's bytes and the message); serializing one holds them
twice again.  The graph's initializers are fields of the GraphProto inside the ModelProto, each a TensorProto whose
raw_data is one length-delimited field: this module skips that field when reading (`without_weights`) and copies it
block by block from the data file when writing a graph of one file (`write_inline`).  Only the main graph's
initializers are touched; everything else is copied as it is.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx

# Field numbers in onnx.proto: ModelProto.graph, GraphProto.initializer, TensorProto.raw_data.
GRAPH, INITIALIZER, RAW_DATA = 7, 5, 9
_LENGTH_DELIMITED = 2
_BLOCK = 16 << 20  # bytes copied at a time


@dataclass(frozen=True)
class Span:
    """`length` bytes of the file `path` from `offset`: a tensor's data, copied into the written file."""

    path: Path
    offset: int
    length: int


Part = bytes | Span
Data = bytes | mmap.mmap
Rewrite = Callable[[Data, int, int], list[Part] | None]


def without_weights(path: Path, large: int) -> bytes:
    """The ModelProto in `path` without the raw_data of its graph's initializers of `large` bytes or more, every
    other byte as it is.  Read through a memory map, so the skipped weights are not read at all."""
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            return b""
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:

            def raw_data(data: Data, start: int, end: int) -> list[Part] | None:
                return None if end - start >= large else [data[start:end]]

            def tensor(data: Data, start: int, end: int) -> list[Part]:
                return _rewritten(data, start, end, {RAW_DATA: raw_data})

            def graph(data: Data, start: int, end: int) -> list[Part]:
                return _rewritten(data, start, end, {INITIALIZER: tensor})

            return b"".join(part for part in _rewritten(data, 0, len(data), {GRAPH: graph}) if isinstance(part, bytes))


def write_inline(model: onnx.ModelProto, base: Path, path: Path) -> None:
    """Write `model` (loaded without its external data, which lives in files under `base`) at `path` as one file,
    each initializer's data copied into it from its data file a block at a time."""
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    def tensor(data: Data, start: int, end: int) -> list[Part]:
        import onnx

        proto = onnx.TensorProto.FromString(data[start:end])  # no weights inside: its data is external
        if not uses_external_data(proto):
            return [data[start:end]]
        info = ExternalDataInfo(proto)
        source = base / info.location
        offset = info.offset or 0
        length = info.length if info.length is not None else source.stat().st_size - offset
        proto.ClearField("external_data")
        proto.ClearField("data_location")
        return [proto.SerializeToString(), _tag(RAW_DATA) + _varint_bytes(length), Span(source, offset, length)]

    def graph(data: Data, start: int, end: int) -> list[Part]:
        return _rewritten(data, start, end, {INITIALIZER: tensor})

    serialized = model.SerializeToString()
    _write(_rewritten(serialized, 0, len(serialized), {GRAPH: graph}), path)


def _write(parts: list[Part], path: Path) -> None:
    with open(path, "wb") as out:
        for part in parts:
            if isinstance(part, bytes):
                out.write(part)
                continue
            with open(part.path, "rb") as source:
                source.seek(part.offset)
                copy(source, out, part.length)


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
    return part.length if isinstance(part, Span) else len(part)


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
