"""OpenAPI pieces generated from the served model, precise enough to drive a property-based fuzzer.

The infer request schema describes the JSON form of the protocol (binary data is Triton's extension, which
OpenAPI cannot describe: its JSON header's length travels in a header).  For a model whose dims other than
the batch are all fixed (an image model), the schema is exact: one variant per item count, each naming every
input with its one datatype, its exact shape and exactly as many values as that shape holds, so every request
the schema allows is one the server accepts.  Where another dim is dynamic (a sequence length), a shape and
its data's length depend on each other in a way JSON Schema cannot say; the schema then gives each dim's
range and the server checks the agreement (400).  Every status each endpoint answers is documented.
"""

from __future__ import annotations

import math

import numpy as np

from ..runners.base import DYNAMIC, TensorSpec
from .protocol import VERSION, ModelIO, datatype
from .rest import BINARY, HEADER_LENGTH, JSON

ERROR = {
    "type": "object",
    "properties": {"error": {"type": "string", "description": "what was wrong and what was expected"}},
    "required": ["error"],
}
RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "string"}}}

# Statuses the infer endpoint answers besides 200, and when.
INFER_ERRORS = {
    "400": "the request is malformed or does not fit the model: names, datatypes, shapes, data, too many items",
    "404": "no model (or version) of that name is served here",
    "408": "the body did not all arrive within the service's read timeout",
    "413": "the body (or the inflated body, or its JSON) is larger than the limit",
    "415": "the Content-Encoding is not gzip, deflate or none",
    "500": "the runner failed on this request's data",
    "503": "not ready yet, shutting down, or the queue is full: retry after the Retry-After seconds",
    "504": "the request was not answered within the service's timeout (or its own); its rows were dropped",
}


def error_response(description: str, retry: bool = False) -> dict:
    response: dict = {"description": description, "content": {JSON: {"schema": ERROR}}}
    if retry:
        response["headers"] = RETRY_AFTER
    return response


def infer_openapi(model: ModelIO) -> dict:
    """The infer operation's requestBody and responses, for FastAPI's openapi_extra."""
    errors = {status: error_response(text, retry=status == "503") for status, text in INFER_ERRORS.items()}
    ok = {
        "description": "the outputs: JSON, or (with binary outputs asked for) the JSON header then the raw bytes",
        "headers": {
            HEADER_LENGTH: {"description": "length of the JSON header, when binary data follows it", "schema": {}}
        },
        "content": {
            JSON: {"schema": response_schema(model)},
            BINARY: {"schema": {"type": "string", "format": "binary"}},
        },
    }
    request = {"required": True, "content": {JSON: {"schema": request_schema(model)}}}
    return {"requestBody": request, "responses": {"200": ok, **errors}}


def request_schema(model: ModelIO) -> dict:
    if all(d != DYNAMIC for spec in model.inputs for d in spec.shape[1:]):
        return {"oneOf": [_request(model, items) for items in range(1, model.max_items + 1)]}
    return _request(model, None)


def _request(model: ModelIO, items: int | None) -> dict:
    """A request of exactly `items` items, or (None) of any item count with each dim within its range."""
    inputs = [_input(spec, items, model.max_items) for spec in model.inputs]
    # Parameters other than those named are passed over, as Triton passes them to a backend that does not read them.
    output_parameters = {"type": "object", "properties": {"binary_data": {"type": "boolean"}}}
    outputs = _closed({"name": {"enum": model.output_names}, "parameters": output_parameters}, ["name"])
    properties = {
        "id": {"type": "string"},
        "parameters": {"type": "object", "properties": {"binary_data_output": {"type": "boolean"}}},
        "inputs": {"type": "array", "prefixItems": inputs, "items": False, "minItems": len(inputs)},
        "outputs": {"type": "array", "items": outputs, "maxItems": len(model.outputs), "uniqueItems": True},
    }
    return _closed(properties, ["inputs"])


def _input(spec: TensorSpec, items: int | None, max_items: int) -> dict:
    element = _input_element(spec.dtype)
    if items is None:
        shape = _shape_ranges(spec, max_items)
        data: dict = {"type": "array", "items": element, "minItems": 1}
    else:
        dims = [items, *spec.shape[1:]]
        shape = {"enum": [dims]}
        data = {"type": "array", "items": element, "minItems": math.prod(dims), "maxItems": math.prod(dims)}
    properties = {"name": {"enum": [spec.name]}, "datatype": {"enum": [datatype(spec)]}, "shape": shape, "data": data}
    return _closed(properties, list(properties))


def _shape_ranges(spec: TensorSpec, max_items: int) -> dict:
    ranges = {axis: (low, high) for axis, low, high in spec.ranges}
    dims = []
    for axis, size in enumerate(spec.shape):
        low, high = (1, max_items) if axis == 0 else ranges.get(axis, (size, size) if size != DYNAMIC else (1, None))
        dims.append({"type": "integer", "minimum": low, **({"maximum": high} if high is not None else {})})
    return {"type": "array", "prefixItems": dims, "items": False, "minItems": len(dims)}


def response_schema(model: ModelIO) -> dict:
    outputs = {
        "type": "object",
        "properties": {
            "name": {"enum": model.output_names},
            "datatype": {"enum": [datatype(spec) for spec in model.outputs]},
            "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "data": {"type": "array", "items": _output_element()},
            "parameters": {"type": "object", "properties": {"binary_data_size": {"type": "integer", "minimum": 0}}},
        },
        "required": ["name", "datatype", "shape"],
    }
    properties = {
        "model_name": {"enum": [model.name]},
        "model_version": {"enum": [VERSION]},
        "id": {"type": "string"},
        "outputs": {"type": "array", "items": outputs, "minItems": 1},
    }
    return _closed(properties, ["model_name", "model_version", "outputs"])


def metadata_schema() -> dict:
    tensor = _closed(
        {
            "name": {"type": "string"},
            "datatype": {"type": "string"},
            "shape": {"type": "array", "items": {"type": "integer"}},
        },
        ["name", "datatype", "shape"],
    )
    tensors = {"type": "array", "items": tensor}
    properties = {
        "name": {"type": "string"},
        "versions": {"type": "array", "items": {"type": "string"}},
        "platform": {"type": "string"},
        "inputs": tensors,
        "outputs": tensors,
    }
    return _closed(properties, list(properties))


def server_metadata_schema() -> dict:
    properties = {
        "name": {"type": "string"},
        "version": {"type": "string"},
        "extensions": {"type": "array", "items": {"type": "string"}},
    }
    return _closed(properties, list(properties))


def _closed(properties: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def _input_element(dtype: np.dtype) -> dict:
    if dtype.kind == "b":
        return {"type": "boolean"}
    if dtype.kind in "iu":
        limits = np.iinfo(dtype)
        return {"type": "integer", "minimum": int(limits.min), "maximum": int(limits.max)}
    largest = float(np.finfo(dtype).max)
    return {"type": "number", "minimum": -largest, "maximum": largest}


def _output_element() -> dict:
    # A model can overflow to inf or give NaN; JSON has no such numbers, so they come as strings.
    return {
        "anyOf": [{"type": "number"}, {"type": "boolean"}, {"type": "string", "enum": ["NaN", "Infinity", "-Infinity"]}]
    }
