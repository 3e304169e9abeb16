"""The Open Inference Protocol (KServe v2, Triton's protocol), the parts both front ends share.

REST (`rest.py`) and gRPC (`grpc_service.py`) each parse their own wire form into the same pieces:
per input a name, a datatype ("FP32", "INT64", ...), a shape and either typed values (JSON "data",
gRPC `contents`) or raw little-endian bytes (Triton's binary extension, gRPC `raw_input_contents`).
`decode_inputs` checks them against the model and builds the feed; `select_outputs` reads which
outputs the client wants.  Every mistake is a ServeError with the HTTP status the protocol gives it
(gRPC maps it to its own code) and a message naming what was expected.

Every declared shape is checked against the model before any data is read, so a shape of 2**40
items is refused without allocating anything, and raw bytes are viewed in place, never copied.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.errors import PipelineError
from ..core.settings import mention
from ..folder.graph_io import GraphTensor
from ..folder.manifest import Manifest
from ..runners.base import BATCH_AXIS, TensorSpec, check_feed, max_batch, refuse_non_finite_images, tensor_specs
from ..triton.repository import TRITON_DTYPES, model_name

# numpy dtype name -> the protocol's datatype: Triton's model-config type without its TYPE_ prefix.
DATATYPES = {numpy: triton.removeprefix("TYPE_") for numpy, triton in TRITON_DTYPES.items()}
# The one version served: the Triton repository writer files the model as <repo>/<name>/1/ too.
VERSION = "1"
RETRY_AFTER = {"Retry-After": "1"}
# A request whose client went away before the answer (a cancelled gRPC call, a REST body cut short): nginx's
# "client closed request", counted apart from the server's own failures (500).
CLIENT_GONE = 499

# The numpy kinds typed values may parse to for each kind of tensor: a float tensor takes integers too,
# an integer tensor takes only integers (1.5 would be truncated silently), a bool tensor only true/false.
_ACCEPTED_KINDS = {"f": "iuf", "i": "iu", "u": "iu", "b": "b"}


class ServeError(Exception):
    """A request answered without outputs: its HTTP status (gRPC maps it to a code) and a message saying
    what was expected, or what to do (retry later, send less)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        self.status = status
        self.message = message
        self.headers = headers or {}
        super().__init__(message)


def bad_request(message: str) -> ServeError:
    return ServeError(400, message)


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
    # {integer input: rows of the table it indexes}, for ids that feed an embedding's Gather directly; filled
    # once the runner loads (Service.load reads it from the graph with embedding_rows).
    vocabularies: dict[str, int] = field(default_factory=dict)
    # A detector (POSTPROCESS=nms): its float inputs must be finite (runners.base.refuse_non_finite_images).
    detects: bool = False

    @classmethod
    def from_manifest(cls, manifest: Manifest, name: str | None = None, max_items: int | None = None) -> ModelIO:
        profile_max = max_batch(manifest)
        if max_items is not None and max_items > profile_max:
            raise PipelineError(
                f"max batch {max_items} is larger than the profile's max batch {profile_max}",
                f"give --max-batch {profile_max} or less, or rebuild with a larger {mention(batch='min:opt:max')}",
            )
        model = cls(
            name=name or model_name(manifest),
            inputs=tensor_specs(manifest, "inputs"),
            outputs=tensor_specs(manifest, "outputs"),
            max_items=max_items or profile_max,
            shared_axes=_shared_axes(manifest.inputs),
            detects=manifest.nms() is not None,
        )
        for spec in [*model.inputs, *model.outputs]:
            if spec.dtype.name not in DATATYPES:
                raise PipelineError(
                    f"{spec.name!r} has dtype {spec.dtype}, which the inference protocol has no datatype for",
                    "cast it in the model to a numeric type (float32, int64, bool, ...) and rebuild",
                )
        return model

    @property
    def input_names(self) -> list[str]:
        return [spec.name for spec in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [spec.name for spec in self.outputs]


def _shared_axes(tensors: Sequence[GraphTensor]) -> dict[str, list[tuple[str, int]]]:
    uses: dict[str, list[tuple[str, int]]] = {}
    for tensor in tensors:
        for axis, dim in enumerate(tensor.shape):
            if axis != BATCH_AXIS and isinstance(dim, str):
                uses.setdefault(dim, []).append((tensor.name, axis))
    return {dim: places for dim, places in uses.items() if len(places) > 1}


def datatype(spec: TensorSpec) -> str:
    return DATATYPES[spec.dtype.name]


def check_model(model: ModelIO, name: str, version: str) -> None:
    """404 unless `name` (and `version`, where given) is the model served here."""
    if name != model.name:
        raise ServeError(404, f"no model {name!r} is served here; this server serves {model.name!r}")
    if version not in ("", VERSION):
        raise ServeError(404, f"model {name!r} has no version {version!r}; this server serves version {VERSION}")


def tensor_metadata(specs: list[TensorSpec]) -> list[dict]:
    """The protocol's tensor metadata: name, datatype, shape with -1 for dynamic dims (the batch included)."""
    return [{"name": spec.name, "datatype": datatype(spec), "shape": list(spec.shape)} for spec in specs]


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class InputTensor:
    """One input as the wire declared it: typed `values` (JSON data, gRPC contents) or `raw` bytes."""

    name: str
    datatype: str
    shape: Any  # as sent: decode_inputs checks that it is a list of sizes
    values: Any = None
    raw: bytes | memoryview | None = None


def decode_inputs(model: ModelIO, tensors: Sequence[InputTensor]) -> tuple[dict[str, np.ndarray], int]:
    """(feed, items): every declared name, datatype and shape checked before any data is read."""
    specs = {spec.name: spec for spec in model.inputs}
    declared: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
    for tensor in tensors:
        if tensor.name in declared:
            raise bad_request(f"input {tensor.name!r} is given twice; give each of {model.input_names} once")
        spec = specs.get(tensor.name)
        if spec is not None and tensor.datatype != datatype(spec):
            raise bad_request(
                f"input {tensor.name!r} is declared {tensor.datatype}; the model takes {datatype(spec)} for it"
            )
        dtype = spec.dtype if spec is not None else np.dtype("float32")  # unknown names are refused just below
        declared[tensor.name] = (dtype, tuple(_shape(tensor)))
    items = check_shapes(model, declared)
    feed = {tensor.name: _array(specs[tensor.name], tensor) for tensor in tensors}
    check_ids(model, feed)
    if model.detects:
        try:
            refuse_non_finite_images(feed, model.inputs)
        except PipelineError as error:
            raise bad_request(f"{error.problem}; {error.fix}") from None
    return feed, items


def check_ids(model: ModelIO, feed: dict[str, np.ndarray]) -> None:
    """400 for token ids outside [0, rows) of the embedding they index: ONNX Gather reads -5 as the fifth row
    from the end (a silent wrong answer), and an id past the table fails the runner call."""
    for name, rows in model.vocabularies.items():
        ids = feed[name]
        if ids.size and (ids.min() < 0 or ids.max() >= rows):
            raise bad_request(
                f"input {name!r} has ids outside [0, {rows - 1}] (min {ids.min()}, max {ids.max()}): it indexes "
                f"an embedding of {rows} rows; give ids from the model's own vocabulary"
            )


def _shape(tensor: InputTensor) -> list[int]:
    shape = tensor.shape
    # bool is an int in Python: refuse it explicitly, as JSON's true is no dim size.
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise bad_request(f'input {tensor.name!r}: "shape" must be a list of integers, got {shape!r}')
    if any(d < 0 for d in shape):
        raise bad_request(f"input {tensor.name!r}: shape {shape} has a negative dim; give the actual sizes")
    return shape


def check_shapes(model: ModelIO, declared: dict[str, tuple[np.dtype, tuple[int, ...]]]) -> int:
    """Names, ranks, fixed dims, dim ranges and item count of a request, from its declared shapes alone."""
    try:
        items = check_feed(declared, model.inputs, describe=lambda _, dtype_and_shape: dtype_and_shape)
    except PipelineError as error:
        raise bad_request(f"{error.problem}; {error.fix}" if error.fix else error.problem) from None
    if items > model.max_items:
        raise bad_request(f"the request holds {items} items; send at most {model.max_items} per request")
    for dim, places in model.shared_axes.items():
        sizes = {f"{name}[{axis}]": declared[name][1][axis] for name, axis in places}
        if len(set(sizes.values())) > 1:
            raise bad_request(f"the inputs disagree on the size of dynamic dim {dim!r}: {sizes}; make them equal")
    return items


def _array(spec: TensorSpec, tensor: InputTensor) -> np.ndarray:
    if tensor.raw is not None:
        return array_from_raw(spec, tensor.shape, tensor.raw)
    if tensor.values is None:
        raise bad_request(
            f'input {spec.name!r} has no data: give its values (JSON "data", gRPC contents) or binary data'
        )
    return array_from_values(spec, tensor.shape, tensor.values)


def array_from_raw(spec: TensorSpec, shape: list[int], raw: bytes | memoryview) -> np.ndarray:
    """The bytes viewed as the tensor, no copy.  The protocol's binary data is little-endian, which is the
    byte order of every machine this runs on (x86-64, aarch64)."""
    expected = math.prod(shape) * spec.dtype.itemsize
    if len(raw) != expected:
        raise bad_request(
            f"input {spec.name!r}: shape {shape} of {datatype(spec)} is {expected} bytes; {len(raw)} were sent"
        )
    return np.frombuffer(raw, dtype=spec.dtype).reshape(shape)


def array_from_values(spec: TensorSpec, shape: list[int], values: Any) -> np.ndarray:
    """Typed values, flat or nested in row-major order (both are the protocol's), as the tensor."""
    try:
        parsed = np.array(values)
    except (ValueError, OverflowError):  # ragged nesting
        parsed = None
    if parsed is not None and parsed.dtype == object and all(type(item) in (int, float, bool) for item in parsed.flat):
        parsed = _wide_numbers(spec, parsed)
    if parsed is None or parsed.dtype.kind not in _ACCEPTED_KINDS.get(spec.dtype.kind, ""):
        raise bad_request(f"input {spec.name!r}: the data must be {_element_words(spec.dtype)} in row-major order")
    if spec.dtype.kind != "b" and _holds_bool(values):  # numpy reads true as 1 among numbers: a silent wrong value
        raise bad_request(
            f"input {spec.name!r}: the data holds true/false, which is no {datatype(spec)} value; send "
            f"{_element_words(spec.dtype)} only"
        )
    if parsed.size != math.prod(shape):
        raise bad_request(
            f"input {spec.name!r}: shape {shape} holds {math.prod(shape)} values; {parsed.size} were sent"
        )
    return _cast(spec, parsed).reshape(shape)


def _wide_numbers(spec: TensorSpec, parsed: np.ndarray) -> np.ndarray:
    """Numbers among which an integer needs more than 64 bits (numpy keeps them all as Python objects): as float64
    for a float datatype, whose range is checked as any number's; past any integer datatype's range, and float64's
    (2**1024 and more), they are out of range.  2**70 is a float32 (exactly: a power of two), as 1.2e21 is."""
    if spec.dtype.kind == "b":
        return parsed  # no true/false values: refused as such
    if spec.dtype.kind == "f":
        try:
            return parsed.astype(np.float64)
        except OverflowError:
            pass
    raise _out_of_range(spec)


def _out_of_range(spec: TensorSpec) -> ServeError:
    if spec.dtype.kind in "iu":
        limits = np.iinfo(spec.dtype)
        return bad_request(f"input {spec.name!r} has values outside {datatype(spec)}'s [{limits.min}, {limits.max}]")
    limit = float(np.finfo(spec.dtype).max)
    return bad_request(f"input {spec.name!r} has values beyond {datatype(spec)}'s range (|x| <= {limit:.4g})")


def _holds_bool(values: Any) -> bool:
    """Whether a JSON true or false is among the values, flat or nested (a level's types are gathered at C speed)."""
    level = values if isinstance(values, list) else [values]
    while level:
        kinds = set(map(type, level))
        if bool in kinds:
            return True
        level = (
            list(itertools.chain.from_iterable(item for item in level if type(item) is list)) if list in kinds else []
        )
    return False


def _element_words(dtype: np.dtype) -> str:
    words = {"f": "numbers", "i": "integers", "u": "non-negative integers", "b": "true/false values"}
    return words.get(dtype.kind, "values")


def _cast(spec: TensorSpec, parsed: np.ndarray) -> np.ndarray:
    if spec.dtype.kind in "iu" and parsed.size:
        limits = np.iinfo(spec.dtype)
        if parsed.min() < limits.min or parsed.max() > limits.max:
            raise _out_of_range(spec)
    with np.errstate(over="ignore"):  # an overflow to inf is reported below, with the range
        array = parsed.astype(spec.dtype)
    # NaN and infinities sent as such pass, as they do as binary data, over gRPC and through runner.infer (one
    # policy, README "Serving"); a finite number that only becomes inf in this datatype is out of its range.
    if spec.dtype.kind == "f" and np.any(np.isfinite(parsed) & ~np.isfinite(array)):
        raise _out_of_range(spec)
    return array


# --------------------------------------------------------------------------- outputs


@dataclass(frozen=True)
class OutputChoice:
    """An output to return, and whether as binary data (REST's binary extension; gRPC always sends raw)."""

    name: str
    binary: bool


def select_outputs(model: ModelIO, requested: Iterable[tuple[str, bool]], binary_default: bool) -> list[OutputChoice]:
    """The outputs named in the request (every output, in the model's order, when none is named)."""
    chosen = [OutputChoice(name, binary) for name, binary in requested]
    if not chosen:
        return [OutputChoice(name, binary_default) for name in model.output_names]
    names = [choice.name for choice in chosen]
    unknown = [name for name in names if name not in model.output_names]
    if unknown:
        raise bad_request(f"unknown outputs {unknown}; the model gives {model.output_names}")
    if len(set(names)) != len(names):
        raise bad_request(f"outputs {names} name one output twice; name each at most once")
    return chosen


def check_parameters(parameters: dict[str, Any], where: str) -> None:
    """Refuse the protocol's extensions this server does not implement, naming them, instead of ignoring them."""
    unsupported = {
        "shared_memory_region": "shared memory is not supported; send the data in the request",
        "classification": "the classification extension is not supported; ask for the raw output",
        "sequence_id": "sequence batching is not supported; this model is stateless",
    }
    for key, why in unsupported.items():
        if parameters.get(key):
            raise bad_request(f"{where}: {why}")


def timeout_from_parameters(parameters: dict[str, Any]) -> float | None:
    """The request's own "timeout" parameter in seconds (Triton reads it in microseconds); None where not given."""
    timeout = parameters.get("timeout")
    if timeout is None:
        return None
    if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout <= 0:
        raise bad_request(f'parameter "timeout" must be a positive number of microseconds, got {timeout!r}')
    return timeout / 1e6
