"""OpenAPI pieces generated from the served model, precise enough to drive a property-based fuzzer.

The JSON request schema names every input, its one accepted dtype and the exact nesting of "data":
items between 1 and max_items on the first level, each fixed dim as minItems == maxItems, each named
dynamic dim within its range.  Every status the infer endpoint can answer is documented with its body.
"""

from __future__ import annotations

import numpy as np

from pipeline.runners.base import DYNAMIC, TensorSpec
from pipeline.serve.codec import JSON, NPY, NPZ, ModelIO

ERROR = {
    "type": "object",
    "properties": {"detail": {"type": "string", "description": "what was wrong and what was expected"}},
    "required": ["detail"],
}
BINARY = {"type": "string", "format": "binary"}

# Statuses the infer endpoint answers besides 200, and when.
INFER_ERRORS = {
    "400": "the body does not parse (malformed JSON, not a .npy/.npz)",
    "404": "no model of that name is served here",
    "413": "the body (or the unpacked .npz) is larger than the limit",
    "415": "the Content-Type is not one of application/json, application/x-npy, application/x-npz",
    "422": "wrong input names, dtypes, shapes, or too many items",
    "500": "the runner failed on this request's data",
    "503": "not ready yet, shutting down, or the queue is full: retry after the Retry-After seconds",
    "504": "the request was not answered within the service's timeout; its rows were dropped",
}


def infer_openapi(model: ModelIO) -> dict:
    """The operation's requestBody and responses, for FastAPI's openapi_extra."""
    request_content: dict = {JSON: {"schema": request_schema(model)}, NPZ: {"schema": BINARY}}
    if len(model.inputs) == 1:
        request_content[NPY] = {"schema": BINARY}
    errors = {
        status: {"description": text, "content": {JSON: {"schema": ERROR}}} for status, text in INFER_ERRORS.items()
    }
    ok = {
        "description": "the outputs, in the request's form (a .npy request to a multi-output model gets a .npz)",
        "content": {JSON: {"schema": response_schema(model)}, NPY: {"schema": BINARY}, NPZ: {"schema": BINARY}},
    }
    return {"requestBody": {"required": True, "content": request_content}, "responses": {"200": ok, **errors}}


def request_schema(model: ModelIO) -> dict:
    tensors = {spec.name: _input_schema(spec, model.max_items) for spec in model.inputs}
    return _closed_object({"inputs": _closed_object(tensors)})


def response_schema(model: ModelIO) -> dict:
    tensors = {spec.name: _output_schema(spec, model.max_items) for spec in model.outputs}
    return _closed_object({"model_name": {"type": "string", "enum": [model.name]}, "outputs": _closed_object(tensors)})


def _closed_object(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _input_schema(spec: TensorSpec, max_items: int) -> dict:
    data = _nested(spec, max_items, _input_element(spec.dtype))
    return _closed_object({"dtype": {"type": "string", "enum": [spec.dtype.name]}, "data": data})


def _output_schema(spec: TensorSpec, max_items: int) -> dict:
    shape = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": len(spec.shape)}
    shape["maxItems"] = len(spec.shape)
    return _closed_object(
        {
            "dtype": {"type": "string", "enum": [spec.dtype.name]},
            "shape": shape,
            "data": _nested(spec, max_items, _output_element(spec.dtype)),
        }
    )


def _nested(spec: TensorSpec, max_items: int, element: dict) -> dict:
    """Arrays nested once per dim, innermost first, around the element schema."""
    ranges = {axis: (low, high) for axis, low, high in spec.ranges}
    schema = element
    for axis in reversed(range(len(spec.shape))):
        schema = {"type": "array", "items": schema}
        if axis == 0:
            schema.update(minItems=1, maxItems=max_items)
        elif spec.shape[axis] != DYNAMIC:
            schema.update(minItems=spec.shape[axis], maxItems=spec.shape[axis])
        elif axis in ranges:
            schema.update(minItems=ranges[axis][0], maxItems=ranges[axis][1])
    return schema


def _input_element(dtype: np.dtype) -> dict:
    if dtype.kind == "b":
        return {"type": "boolean"}
    if dtype.kind in "iu":
        limits = np.iinfo(dtype)
        return {"type": "integer", "minimum": int(limits.min), "maximum": int(limits.max)}
    largest = float(np.finfo(dtype).max)
    return {"type": "number", "minimum": -largest, "maximum": largest}


def _output_element(dtype: np.dtype) -> dict:
    if dtype.kind == "b":
        return {"type": "boolean"}
    if dtype.kind in "iu":
        return {"type": "integer"}
    # A model can overflow to inf or give NaN; JSON has no such numbers, so they come as strings.
    return {"anyOf": [{"type": "number"}, {"type": "string", "enum": ["NaN", "Infinity", "-Infinity"]}]}
