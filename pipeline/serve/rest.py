"""REST bodies of the inference protocol: JSON tensors and Triton's binary tensor data extension.

A request is a JSON object {"id", "parameters", "inputs": [...], "outputs": [...]}; each input is
{"name", "datatype", "shape", "data": [values, flat or nested in row-major order]}.  With the binary
extension the JSON is only the first `Inference-Header-Content-Length` bytes of the body, an input
carries "parameters": {"binary_data_size": n} instead of "data", and its raw little-endian bytes follow
the JSON in the order of the inputs.  An output comes back as binary data when the request asks for it
(the output's "binary_data" parameter, else the request's "binary_data_output"); the response then
carries the same header, and its Content-Type is application/octet-stream.  `Content-Encoding: gzip` or
`deflate` bodies are inflated, never past the body limit.

Non-finite JSON outputs are written as the strings "NaN", "Infinity", "-Infinity" (JSON has no such
numbers; numpy reads them back).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from .protocol import (
    DATATYPES,
    VERSION,
    InputTensor,
    ModelIO,
    ServeError,
    bad_request,
    check_parameters,
    datatype,
    decode_inputs,
    select_outputs,
    timeout_from_parameters,
)
from .service import InferRequest

JSON = "application/json"
BINARY = "application/octet-stream"
HEADER_LENGTH = "Inference-Header-Content-Length"

_REQUEST_KEYS = {"id", "parameters", "inputs", "outputs"}
_INPUT_KEYS = {"name", "datatype", "shape", "parameters", "data"}
_OUTPUT_KEYS = {"name", "parameters"}
# zlib window bits for each Content-Encoding a client may send (tritonclient's request_compression_algorithm).
_ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


# --------------------------------------------------------------------------- requests


def inflate(body: bytes, encoding: str | None, limit: int) -> bytes:
    """The body as sent, or inflated for Content-Encoding gzip/deflate; 413 past `limit` bytes inflated."""
    encoding = (encoding or "identity").strip().lower()
    if encoding == "identity":
        return body
    if encoding not in _ENCODINGS:
        raise ServeError(415, f"Content-Encoding {encoding!r} is not accepted; send gzip, deflate or none")
    inflater = zlib.decompressobj(_ENCODINGS[encoding])
    try:
        inflated = inflater.decompress(body, limit + 1)
    except zlib.error as error:
        raise bad_request(f"the body is not valid {encoding} ({error})") from None
    if len(inflated) > limit:  # a small compressed body can inflate to far more than the limit
        raise ServeError(413, f"the body inflates to more than the limit of {limit} bytes (send fewer items)")
    if not inflater.eof:
        raise bad_request(f"the {encoding} body is truncated")
    return inflated


def parse_infer_request(body: bytes, header_length: str | None, model: ModelIO, max_json: int) -> InferRequest:
    """A checked InferRequest from a REST body (and its Inference-Header-Content-Length header, if any); 413 where
    its JSON is over `max_json` bytes."""
    header, binary = _split(body, header_length)
    if len(header) > max_json:
        raise ServeError(
            413,
            f"the request's JSON is {len(header)} bytes; the limit for JSON is {max_json} (send the tensors as "
            "binary data, tritonclient's default, or raise --max-json-mib)",
        )
    document = _json_object(header, model)
    parameters = _parameters(document, "the request")
    check_parameters(parameters, "the request")
    inputs = document.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise bad_request(f'"inputs" must be a non-empty list; {_example(model)}')
    feed, items = decode_inputs(model, list(_input_tensors(inputs, binary)))
    binary_default = parameters.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise bad_request(f'parameter "binary_data_output" must be true or false, got {binary_default!r}')
    return InferRequest(
        feed,
        items,
        select_outputs(model, _requested_outputs(document.get("outputs", []), binary_default), binary_default),
        id=_request_id(document),
        timeout_s=timeout_from_parameters(parameters),
    )


def _split(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    """(JSON header, binary data after it): all JSON without the header, else the first n bytes."""
    if header_length is None:
        return body, memoryview(b"")
    if not header_length.strip().isdigit() or int(header_length) > len(body):
        raise bad_request(
            f"{HEADER_LENGTH} is {header_length!r}: it must be the byte length of the JSON header, at most "
            f"the body's {len(body)} bytes"
        )
    length = int(header_length)
    return body[:length], memoryview(body)[length:]


def _json_object(header: bytes, model: ModelIO) -> dict:
    try:
        document = json.loads(header)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise bad_request(f"the request is not valid JSON ({error}); {_example(model)}") from None
    if not isinstance(document, dict):
        raise bad_request(f"the request must be a JSON object; {_example(model)}")
    _refuse_unknown_keys(document, _REQUEST_KEYS, "the request")
    return document


def _example(model: ModelIO) -> str:
    first = model.inputs[0]
    shape = [1, *(max(d, 1) for d in first.shape[1:])]
    return (
        f'expected {{"inputs": [{{"name": "{first.name}", "datatype": "{datatype(first)}", "shape": {shape}, '
        f'"data": [...]}}, ...]}} with inputs {model.input_names}'
    )


def _refuse_unknown_keys(entry: dict, known: set[str], where: str) -> None:
    unknown = sorted(set(entry) - known)
    if unknown:
        raise bad_request(f"{where} has unknown fields {unknown}; the protocol's are {sorted(known)}")


def _parameters(entry: dict, where: str) -> dict[str, Any]:
    parameters = entry.get("parameters", {})
    if not isinstance(parameters, dict):
        raise bad_request(f'"parameters" of {where} must be a JSON object, got {parameters!r}')
    return parameters


def _tensor_parameters(entry: dict, keys: Any, where: str) -> dict[str, Any]:
    """An input or output entry's "parameters", after refusing keys the protocol does not define there."""
    _refuse_unknown_keys(entry, keys, where)
    parameters = _parameters(entry, where)
    check_parameters(parameters, where)
    return parameters


def _input_tensors(inputs: list, binary: memoryview) -> Iterator[InputTensor]:
    """Each input, its binary data (if any) cut from `binary` in input order; all of it must be claimed."""
    offset = 0
    for number, entry in enumerate(inputs):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise bad_request(f'input {number} must be an object with a "name", "datatype", "shape" and "data"')
        where = f"input {entry['name']!r}"
        parameters = _tensor_parameters(entry, _INPUT_KEYS, where)
        size = parameters.get("binary_data_size")
        raw = None
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise bad_request(f'{where}: "binary_data_size" must be a byte count, got {size!r}')
            if "data" in entry:
                raise bad_request(f'{where} has both "data" and binary data; give one')
            if offset + size > len(binary):
                raise bad_request(f"{where} claims {size} bytes of binary data; {len(binary) - offset} are left")
            raw, offset = binary[offset : offset + size], offset + size
        datatype_name = entry.get("datatype")
        if not isinstance(datatype_name, str):
            raise bad_request(f'{where}: "datatype" must be one of {sorted(set(DATATYPES.values()))}')
        yield InputTensor(entry["name"], datatype_name, entry.get("shape"), entry.get("data"), raw)
    if offset != len(binary):
        raise bad_request(
            f"{len(binary) - offset} bytes after the JSON header belong to no input; give each binary input "
            '"parameters": {"binary_data_size": <bytes>} and send exactly those bytes'
        )


def _requested_outputs(outputs: Any, binary_default: bool) -> Iterator[tuple[str, bool]]:
    """(name, as binary data?) of each output named: its "binary_data" parameter, else the request's
    "binary_data_output", as Triton reads them."""
    if not isinstance(outputs, list):
        raise bad_request(f'"outputs" must be a list of {{"name": ...}} objects, got {outputs!r}')
    for entry in outputs:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise bad_request(f'each of "outputs" must be an object with a "name", got {entry!r}')
        where = f"output {entry['name']!r}"
        parameters = _tensor_parameters(entry, _OUTPUT_KEYS, where)
        binary = parameters.get("binary_data", binary_default)
        if not isinstance(binary, bool):
            raise bad_request(f'{where}: "binary_data" must be true or false, got {binary!r}')
        yield entry["name"], binary


def _request_id(document: dict) -> str:
    request_id = document.get("id", "")
    if not isinstance(request_id, str):
        raise bad_request(f'"id" must be a string, got {request_id!r}')
    return request_id


# --------------------------------------------------------------------------- responses


def encode_response(model: ModelIO, request: InferRequest, outputs: dict[str, np.ndarray]) -> tuple[bytes, dict]:
    """(body, headers): the JSON response, followed by the binary outputs' bytes where any was asked for."""
    entries, chunks = [], []
    for choice in request.outputs:
        array = outputs[choice.name]
        entry: dict[str, Any] = {
            "name": choice.name,
            "datatype": DATATYPES[array.dtype.name],
            "shape": list(array.shape),
        }
        if choice.binary:
            raw = np.ascontiguousarray(array).tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = _json_values(array.ravel())
        entries.append(entry)
    document: dict[str, Any] = {"model_name": model.name, "model_version": VERSION, "outputs": entries}
    if request.id:
        document["id"] = request.id
    header = json.dumps(document).encode()
    if not chunks:
        return header, {"content-type": JSON}
    return header + b"".join(chunks), {"content-type": BINARY, HEADER_LENGTH: str(len(header))}


def _json_values(array: np.ndarray) -> list:
    """A list; NaN and infinities become the strings "NaN", "Infinity", "-Infinity", as in protobuf's JSON
    mapping, because JSON has no such numbers (np.array(data, dtype=np.float32) reads them back)."""
    if array.dtype.kind != "f" or np.all(np.isfinite(array)):
        return array.tolist()
    values = array.astype(object)
    values[np.isnan(array)] = "NaN"
    values[np.isposinf(array)] = "Infinity"
    values[np.isneginf(array)] = "-Infinity"
    return values.tolist()
