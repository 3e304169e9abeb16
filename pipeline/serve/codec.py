"""Request bodies to arrays and arrays to response bodies, with checks that tell a client what was expected.

Three forms, picked by the request's Content-Type; the response comes back in the same form:

- application/json: {"inputs": {"<name>": {"dtype": "float32", "data": <nested lists, items on axis 0>}}}
  -> {"model_name": ..., "outputs": {"<name>": {"dtype": ..., "shape": [...], "data": <nested lists>}}}.
  Non-finite outputs are written as the strings "NaN", "Infinity", "-Infinity" (JSON has no such numbers).
- application/x-npy: one .npy array, for a model with a single input -> one .npy (single output) or a .npz.
- application/x-npz: one array per input name (np.savez), how a multi-input model sends binary -> a .npz.

Bodies are parsed by hand (no np.load, no pickle): a .npy header is checked against the data that follows
before anything is allocated, so a forged header cannot make the server reserve memory it never receives.
"""

from __future__ import annotations

import io
import json
import math
import zipfile
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.errors import PipelineError
from pipeline.runners.base import BATCH_AXIS, TensorSpec, check_feed, max_batch, tensor_specs

JSON = "application/json"
NPY = "application/x-npy"
NPZ = "application/x-npz"
MEDIA_TYPES = (JSON, NPY, NPZ)

# The numpy kinds a JSON array may parse to for each kind of tensor: a float tensor takes JSON integers too,
# an integer tensor takes only integers (1.5 would be truncated silently), a bool tensor only true/false.
_ACCEPTED_KINDS = {"f": "iuf", "i": "iu", "u": "iu", "b": "b"}


class ServeError(Exception):
    """A request the service does not answer with outputs: an HTTP status and a message saying what was
    expected (or what to do: retry later, send less)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        self.status = status
        self.message = message
        self.headers = headers or {}
        super().__init__(message)


@dataclass(frozen=True)
class ModelIO:
    """What the served model takes and gives, read from the manifest (the runner reads the same records)."""

    name: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    max_items: int
    # Named dynamic dims (other than the batch) that several inputs share, e.g. "seq" on input_ids and
    # attention_mask: {dim name: [(input, axis), ...]}.  Sizes must agree, or the model fails inside a batch.
    shared_axes: dict[str, list[tuple[str, int]]] = field(default_factory=dict)

    @classmethod
    def from_manifest(cls, manifest: dict, name: str | None = None, max_items: int | None = None) -> ModelIO:
        profile_max = max_batch(manifest)
        if max_items is not None and max_items > profile_max:
            raise PipelineError(
                f"max batch {max_items} is larger than the profile's max batch {profile_max}",
                f"give --max-batch {profile_max} or less, or rebuild with a larger BATCH=min:opt:max",
            )
        return cls(
            name=name or manifest["model"]["name"],
            inputs=tensor_specs(manifest, "inputs"),
            outputs=tensor_specs(manifest, "outputs"),
            max_items=max_items or profile_max,
            shared_axes=_shared_axes(manifest["inputs"]),
        )

    @property
    def input_names(self) -> list[str]:
        return [spec.name for spec in self.inputs]


def _shared_axes(records: list[dict]) -> dict[str, list[tuple[str, int]]]:
    uses: dict[str, list[tuple[str, int]]] = {}
    for record in records:
        for axis, dim in enumerate(record["shape"]):
            if axis != BATCH_AXIS and isinstance(dim, str):
                uses.setdefault(dim, []).append((record["name"], axis))
    return {dim: places for dim, places in uses.items() if len(places) > 1}


# --------------------------------------------------------------------------- requests


def media_type(content_type: str | None) -> str:
    """The request's form, from its Content-Type (parameters such as charset ignored)."""
    kind = (content_type or "").split(";")[0].strip().lower()
    if kind not in MEDIA_TYPES:
        raise ServeError(
            415, f"Content-Type {kind or '(none)'!r} is not accepted; send one of {', '.join(MEDIA_TYPES)}"
        )
    return kind


def decode_request(body: bytes, kind: str, model: ModelIO, max_bytes: int) -> dict[str, np.ndarray]:
    """The request's arrays by input name; ServeError (4xx) when the body is malformed."""
    if kind == JSON:
        return _decode_json(body, model)
    if kind == NPY:
        if len(model.inputs) != 1:
            raise ServeError(
                415, f"a .npy body carries one array but the model takes {model.input_names}; send a .npz ({NPZ})"
            )
        return {model.inputs[0].name: decode_npy(body, "the body")}
    return _decode_npz(body, max_bytes)


def check_items(feed: dict[str, np.ndarray], model: ModelIO) -> int:
    """Names, dtypes, shapes and item count of a decoded request; returns its item count (rows on axis 0)."""
    try:
        items = check_feed(feed, model.inputs)
    except PipelineError as error:
        raise ServeError(422, str(error)) from None
    if items > model.max_items:
        raise ServeError(422, f"the request holds {items} items; send at most {model.max_items} per request")
    for dim, places in model.shared_axes.items():
        sizes = {f"{name}[{axis}]": feed[name].shape[axis] for name, axis in places}
        if len(set(sizes.values())) > 1:
            raise ServeError(422, f"the inputs disagree on the size of dynamic dim {dim!r}: {sizes}; make them equal")
    return items


def _decode_json(body: bytes, model: ModelIO) -> dict[str, np.ndarray]:
    try:
        document = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise ServeError(400, f"the body is not valid JSON ({error}); {_json_example(model)}") from None
    tensors = document.get("inputs") if isinstance(document, dict) else None
    if not isinstance(tensors, dict):
        raise ServeError(422, f'the JSON body has no "inputs" object; {_json_example(model)}')
    if len(document) > 1:
        raise ServeError(422, f"unknown fields {sorted(set(document) - {'inputs'})}; {_json_example(model)}")
    specs = {spec.name: spec for spec in model.inputs}
    unknown = sorted(set(tensors) - set(specs))
    if unknown:
        raise ServeError(422, f"unknown inputs {unknown}; the model takes {model.input_names}")
    return {name: _array_from_json(specs[name], tensor) for name, tensor in tensors.items()}


def _json_example(model: ModelIO) -> str:
    first = model.inputs[0]
    return (
        f'expected {{"inputs": {{"{first.name}": {{"dtype": "{first.dtype}", "data": [...]}}, ...}}}} '
        f"with inputs {model.input_names}"
    )


def _array_from_json(spec: TensorSpec, tensor: Any) -> np.ndarray:
    if not isinstance(tensor, dict) or set(tensor) != {"data", "dtype"}:
        raise ServeError(422, f'input {spec.name!r} must be an object {{"dtype": "{spec.dtype}", "data": [...]}}')
    if tensor["dtype"] != spec.dtype.name:
        raise ServeError(422, f"input {spec.name!r} is declared {tensor['dtype']!r}; the model takes {spec.dtype}")
    try:
        parsed = np.array(tensor["data"])
    except (ValueError, OverflowError):  # ragged nesting, or an integer beyond 64 bits
        parsed = None
    if parsed is None or parsed.dtype.kind not in _ACCEPTED_KINDS.get(spec.dtype.kind, ""):
        raise ServeError(
            422,
            f'input {spec.name!r}: "data" must be nested lists of {_element_words(spec.dtype)} '
            "of equal lengths at each level (items on the first level)",
        )
    return _cast(spec, parsed)


def _element_words(dtype: np.dtype) -> str:
    return {"f": "numbers", "i": "integers", "u": "non-negative integers", "b": "true/false"}.get(dtype.kind, "values")


def _cast(spec: TensorSpec, parsed: np.ndarray) -> np.ndarray:
    if spec.dtype.kind in "iu" and parsed.size:
        limits = np.iinfo(spec.dtype)
        if parsed.min() < limits.min or parsed.max() > limits.max:
            raise ServeError(422, f"input {spec.name!r} has values outside {spec.dtype}'s [{limits.min}, {limits.max}]")
    with np.errstate(over="ignore"):  # an overflow to inf is reported below, with the range
        array = parsed.astype(spec.dtype)
    if spec.dtype.kind == "f" and not np.all(np.isfinite(array)):
        limit = float(np.finfo(spec.dtype).max)
        raise ServeError(422, f"input {spec.name!r} has values that are not finite {spec.dtype} (|x| <= {limit:.4g})")
    return array


_NPY_HEADER_READERS = {
    (1, 0): np.lib.format.read_array_header_1_0,
    (2, 0): np.lib.format.read_array_header_2_0,
}


def decode_npy(data: bytes, what: str) -> np.ndarray:
    """One .npy array, its header checked against the bytes that follow before anything is allocated."""
    stream = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(stream)
        read_header = _NPY_HEADER_READERS.get(version)
        if read_header is None:
            raise ValueError(f"format version {version} (numpy.save writes 1.0)")
        shape, fortran_order, dtype = read_header(stream)
    except (ValueError, SyntaxError, TypeError) as error:
        raise ServeError(400, f"{what} is not a .npy array ({error}); write it with numpy.save") from None
    if dtype.hasobject:
        raise ServeError(422, f"{what} holds Python objects; send a numeric array (pickles are never loaded)")
    payload = data[stream.tell() :]
    expected = math.prod(shape) * dtype.itemsize if all(d >= 0 for d in shape) else -1
    if len(payload) != expected:
        raise ServeError(400, f"{what}: its header promises {expected} bytes of {dtype} {shape}, {len(payload)} follow")
    array = np.frombuffer(payload, dtype=dtype).reshape(shape, order="F" if fortran_order else "C")
    # Native byte order and a private, writable copy: the batcher concatenates these arrays.
    return np.ascontiguousarray(array, dtype=dtype.newbyteorder("="))


def _decode_npz(body: bytes, max_bytes: int) -> dict[str, np.ndarray]:
    try:
        archive = zipfile.ZipFile(io.BytesIO(body))
        members = archive.infolist()
    except (zipfile.BadZipFile, ValueError) as error:
        raise ServeError(400, f"the body is not a .npz archive ({error}); write it with numpy.savez") from None
    unpacked = sum(member.file_size for member in members)
    if unpacked > max_bytes:  # a compressed archive can unpack to far more than its body
        raise ServeError(413, f"the .npz unpacks to {unpacked} bytes; the limit is {max_bytes}")
    feed = {}
    with archive:
        for member in members:
            name = member.filename.removesuffix(".npy")
            try:
                data = archive.read(member)
            except (zipfile.BadZipFile, ValueError, NotImplementedError, RuntimeError, EOFError, zlib.error) as error:
                raise ServeError(400, f"member {member.filename!r} of the .npz cannot be read ({error})") from None
            feed[name] = decode_npy(data, f"member {member.filename!r} of the .npz")
    return feed


# --------------------------------------------------------------------------- responses


def encode_response(outputs: dict[str, np.ndarray], kind: str, model: ModelIO) -> tuple[bytes, str]:
    """(body, media type) for a request that came in form `kind`."""
    if kind == JSON:
        document = {
            "model_name": model.name,
            "outputs": {
                name: {"dtype": array.dtype.name, "shape": list(array.shape), "data": _json_values(array)}
                for name, array in outputs.items()
            },
        }
        return json.dumps(document).encode(), JSON
    buffer = io.BytesIO()
    if kind == NPY and len(outputs) == 1:
        np.save(buffer, next(iter(outputs.values())), allow_pickle=False)
        return buffer.getvalue(), NPY
    np.savez(buffer, **outputs)  # type: ignore[arg-type]  # mypy matches **outputs against allow_pickle: bool too
    return buffer.getvalue(), NPZ


def _json_values(array: np.ndarray) -> list:
    """Nested lists; NaN and infinities become the strings "NaN", "Infinity", "-Infinity", as in protobuf's
    JSON mapping, because JSON has no such numbers (np.array(data, dtype=np.float32) reads them back)."""
    if array.dtype.kind != "f" or np.all(np.isfinite(array)):
        return array.tolist()
    values = array.astype(object)
    values[np.isnan(array)] = "NaN"
    values[np.isposinf(array)] = "Infinity"
    values[np.isneginf(array)] = "-Infinity"
    return values.tolist()
