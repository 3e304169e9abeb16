"""The REST front end (FastAPI): the inference protocol's HTTP/REST endpoints, plus Prometheus metrics.

    GET  /v2/health/live                          200 while the process can serve (503 once loading failed)
    GET  /v2/health/ready                         200 once the runner is loaded and answered a warm-up request
    GET  /v2                                      server metadata: name, version, extensions
    GET  /v2/models/<name>[/versions/1]           model metadata: inputs and outputs, datatypes, shapes
    GET  /v2/models/<name>[/versions/1]/ready     200 once the model is ready
    GET  /v2/models/<name>[/versions/1]/config    Triton's model configuration (the extension tritonclient calls)
    POST /v2/models/<name>[/versions/1]/infer     JSON tensors, or Triton's binary tensor data (see rest.py)
    GET  /metrics                                 Prometheus text

Errors are {"error": "..."} with the protocol's status.  "Not ready" is 503 with Retry-After, not the 400
Triton gives: it is the status that says "retry later", and tritonclient, like a Kubernetes probe, reads any
status but 200 as false.  The runner loads on a background task after startup (see Service.load).  On SIGTERM
uvicorn stops accepting connections and lets the requests in flight finish; then the lifespan's exit stops the
batcher and closes the runner (pipeline.serve.server stops the gRPC front end alongside).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from .config import ServeConfig
from .protocol import CLIENT_GONE, ModelIO, ServeError, check_model
from .rest import HEADER_LENGTH, JSON, encode_response, inflate, parse_infer_request
from .schema import error_response, infer_openapi, metadata_schema, server_metadata_schema
from .service import InferRequest, Service

Endpoint = Callable[[Request], Awaitable[Response]]
Responses = dict[int | str, dict[str, Any]]  # FastAPI's `responses=` documentation


def create_app(folder: Path, config: ServeConfig | None = None, backend: str = "auto") -> FastAPI:
    """The app serving the artifact folder `folder`; reads only the manifest until startup."""
    service = Service(folder, config or ServeConfig(), backend)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(service.load(), name="load-runner")
        try:
            yield
        finally:
            await loading  # a load in a worker thread cannot be cancelled; let it finish, then close
            await service.close()

    app = FastAPI(
        title=f"{service.model.name} inference",
        description="The Open Inference Protocol (KServe v2) over one artifact folder (pipeline.serve).",
        lifespan=lifespan,
    )
    app.state.service = service
    app.add_exception_handler(HTTPException, _http_error)  # unknown paths, wrong methods: {"error": ...} too
    _health_routes(app, service)
    _model_routes(app, service)
    return app


def _json_error(error: ServeError) -> JSONResponse:
    return JSONResponse({"error": error.message}, status_code=error.status, headers=error.headers)


async def _http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)  # the only exception type it is registered for
    return JSONResponse({"error": str(error.detail)}, status_code=error.status_code, headers=error.headers)


def _health_routes(app: FastAPI, service: Service) -> None:
    not_ready: Responses = {"503": error_response("not ready: still loading (retry), or loading failed", retry=True)}
    status_only: Responses = {"200": {"description": "true (no body)"}}

    @app.get("/v2/health/live", response_class=Response, responses={**status_only, **not_ready})
    async def live() -> Response:
        """The process is up; 503 once loading the runner has failed (restart it)."""
        if service.failure:
            return _json_error(ServeError(503, service.failure))
        return Response()

    @app.get("/v2/health/ready", response_class=Response, responses={**status_only, **not_ready})
    async def ready() -> Response:
        """200 once the runner is loaded and answered a warm-up request."""
        return Response() if service.ready else _json_error(service.not_ready())

    @app.get(
        "/v2",
        responses={"200": {"description": "server metadata", "content": {JSON: {"schema": server_metadata_schema()}}}},
    )
    async def server_metadata() -> JSONResponse:
        """The server's name, version and the protocol extensions it implements."""
        return JSONResponse(service.server_metadata())

    @app.get("/metrics", response_class=Response, responses={"200": {"content": {"text/plain": {}}}})
    async def metrics() -> Response:
        """Prometheus text exposition."""
        content, content_type = service.metrics.render()
        return Response(content, media_type=content_type)


def _model_routes(app: FastAPI, service: Service) -> None:
    """Each model endpoint at /v2/models/<served name> (documented), and for any name and version (not
    documented: they answer 404 naming the served model, or the same as the documented one)."""
    unknown: Responses = {"404": error_response("no model (or version) of that name is served here")}

    async def metadata(request: Request) -> Response:
        """The model's inputs and outputs: names, datatypes, shapes (-1 for dynamic dims, the batch first)."""
        _check_model(service, request)
        return JSONResponse(service.model_metadata())

    async def model_ready(request: Request) -> Response:
        """200 once the model is loaded and answered a warm-up request."""
        _check_model(service, request)
        return Response() if service.ready else _json_error(service.not_ready())

    async def config(request: Request) -> Response:
        """Triton's model configuration, as `trt-pipeline triton` writes it, with this service's limits."""
        _check_model(service, request)
        return JSONResponse(model_config_json(service.model_config()))

    async def infer(request: Request) -> Response:
        """Run the model on the request's items; batched with concurrent requests."""
        arrived = time.perf_counter()
        status = 500  # an unexpected exception propagates and is answered 500
        try:
            response = await _infer(service, request, arrived)
            status = response.status_code
            return response
        except ServeError as error:
            status = error.status
            return _json_error(error)
        except ClientDisconnect:  # gone while sending its body: no one to answer, and no fault of the server
            status = CLIENT_GONE
            return Response(status_code=CLIENT_GONE)
        except asyncio.CancelledError:
            status = CLIENT_GONE
            raise
        finally:
            service.count("http", status, arrived)

    metadata_response: Responses = {
        "200": {"description": "model metadata", "content": {JSON: {"schema": metadata_schema()}}}
    }
    config_response: Responses = {
        "200": {"description": "Triton's ModelConfig as JSON", "content": {JSON: {"schema": {"type": "object"}}}}
    }
    routes: list[tuple[str, str, Endpoint, dict[str, Any]]] = [
        ("", "GET", metadata, {"responses": {**metadata_response, **unknown}}),
        ("/ready", "GET", model_ready, {"responses": {"200": {"description": "true (no body)"}, **unknown}}),
        ("/config", "GET", config, {"responses": {**config_response, **unknown}}),
        ("/infer", "POST", infer, {"openapi_extra": infer_openapi(service.model)}),
    ]
    for suffix, method, endpoint, documentation in routes:
        app.add_api_route(
            f"/v2/models/{service.model.name}{suffix}",
            _handling_errors(endpoint),
            methods=[method],
            response_class=Response,
            **documentation,
        )
    for suffix, method, endpoint, _ in routes:
        for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
            app.add_api_route(prefix + suffix, _handling_errors(endpoint), methods=[method], include_in_schema=False)


def _handling_errors(endpoint: Endpoint) -> Endpoint:
    """The endpoint, with a ServeError it raises answered as {"error": ...} and its status."""

    async def handled(request: Request) -> Response:
        try:
            return await endpoint(request)
        except ServeError as error:
            return _json_error(error)

    handled.__doc__ = endpoint.__doc__
    handled.__name__ = endpoint.__name__
    return handled


def _check_model(service: Service, request: Request) -> None:
    """404 unless the path names the served model (the documented routes name it in the path itself)."""
    name = request.path_params.get("name", service.model.name)
    check_model(service.model, name, request.path_params.get("version", ""))


async def _infer(service: Service, request: Request, arrived: float) -> Response:
    _check_model(service, request)
    if not service.ready:
        raise service.not_ready()
    header_length = request.headers.get(HEADER_LENGTH)
    config = service.config
    if header_length is None:  # all JSON, which costs far more to decode than binary data viewed in place
        what, limit, fix = "JSON body", config.max_json_bytes, _JSON_FIX
    else:
        what, limit, fix = "body", config.max_body_bytes, "send fewer items per request"
    body = await read_body(request, limit, what, fix, config.read_timeout_s)
    # Inflating and decoding run on a worker thread, so that a large body does not hold the event loop that
    # answers health checks and the other requests meanwhile (the JSON limit bounds how long it holds the GIL).
    parsed = await asyncio.to_thread(
        _decode, body, request.headers.get("content-encoding"), header_length, service.model, limit, config
    )
    outputs = await service.infer(parsed, arrived)
    content, headers = encode_response(service.model, parsed, outputs)
    return Response(content, headers=headers)


def _decode(
    body: bytes, encoding: str | None, header_length: str | None, model: ModelIO, limit: int, config: ServeConfig
) -> InferRequest:
    return parse_infer_request(inflate(body, encoding, limit), header_length, model, config.max_json_bytes)


_JSON_FIX = (
    "send the tensors as binary data (tritonclient: set_data_from_numpy(array, binary_data=True), its default), "
    "whose limit is --max-body-mib, or raise --max-json-mib"
)
# Answered before the body was all read: the rest of it would be taken for the next request, and a client still
# trickling bytes would keep the connection, so the answer closes it (uvicorn closes on this header).
_UNREAD_BODY = {"Connection": "close"}
# A body over its limit is still read, and dropped as it comes, up to this many bytes: http.client and tritonclient
# send the whole body before they read the answer, and a 413 sent before the body had all arrived reached them as a
# connection reset (a broken pipe, an empty exception) instead of its message.  Past it, or where the client waits to
# be told to send (Expect: 100-continue), the 413 goes at once and the connection closes.
DISCARD_MAX_BYTES = 1 << 30


async def read_body(request: Request, limit: int, what: str, fix: str, timeout_s: float) -> bytes:
    """The body, or 413 where it passes `limit` bytes (never more than `limit` of it held, DISCARD_MAX_BYTES read),
    and 408 when it has not all arrived within `timeout_s` (a client trickling bytes holds no connection)."""
    declared = request.headers.get("content-length", "")
    size = int(declared) if declared.isdigit() else 0
    waits = request.headers.get("expect", "").lower() == "100-continue"  # it sends the body only if asked to
    if size > limit and (size > DISCARD_MAX_BYTES or waits):
        raise _too_big(what, size, limit, fix, _UNREAD_BODY)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size <= limit:
                    chunks.append(chunk)
                elif size > DISCARD_MAX_BYTES:
                    raise _too_big(what, None, limit, fix, _UNREAD_BODY)
    except TimeoutError:
        if size > limit or declared.isdigit() and int(declared) > limit:
            raise _too_big(what, None, limit, fix, _UNREAD_BODY) from None
        raise ServeError(
            408,
            f"the body did not arrive within {timeout_s:g} s (the service's read timeout); send it at once",
            _UNREAD_BODY,
        ) from None
    if size > limit:  # read to its end: the connection serves the next request
        raise _too_big(what, size, limit, fix)
    return b"".join(chunks)


def _too_big(what: str, size: int | None, limit: int, fix: str, headers: dict[str, str] | None = None) -> ServeError:
    told = f"is {size} bytes; the limit is {limit}" if size is not None else f"is over the limit of {limit} bytes"
    return ServeError(413, f"the {what} {told} ({fix})", headers)


def model_config_json(config: Any) -> dict:
    """Triton's ModelConfig as the JSON Triton answers: protobuf's field names, but 64-bit integers as numbers
    (protobuf's JSON mapping writes them as strings; Triton converts them back, and clients read numbers)."""
    return _int64_as_numbers(config, json_format.MessageToDict(config, preserving_proto_field_name=True))


_INT64_TYPES = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}


def _int64_as_numbers(message: Any, document: dict) -> dict:
    for field in message.DESCRIPTOR.fields:
        if field.name not in document:
            continue
        value = getattr(message, field.name)
        if field.type in _INT64_TYPES:
            document[field.name] = list(value) if field.is_repeated else int(value)
        elif field.message_type is not None and not field.message_type.GetOptions().map_entry:
            if field.is_repeated:
                document[field.name] = [
                    _int64_as_numbers(m, d) for m, d in zip(value, document[field.name], strict=True)
                ]
            else:
                document[field.name] = _int64_as_numbers(value, document[field.name])
    return document
