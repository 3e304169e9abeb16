"""The inference protocol over gRPC: Triton's `inference.GRPCInferenceService`, from the protos tritonclient ships.

ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata, ModelConfig and ModelInfer are served;
every other method of the service answers UNIMPLEMENTED.  ModelInfer takes inputs as `raw_input_contents`
(what tritonclient sends; one per input, in input order) or as typed `contents`, and always answers with
`raw_output_contents`.  Requests go to the same Service as REST: the same checks, batcher, runner and
metrics.  A ServeError's HTTP status becomes the matching gRPC code (503 UNAVAILABLE, 504 DEADLINE_EXCEEDED).
A client's deadline bounds the request like the service's own timeout; a cancelled call leaves the queue.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from ..core.errors import PipelineError
from .config import ServeConfig
from .protocol import (
    CLIENT_GONE,
    DATATYPES,
    VERSION,
    InputTensor,
    ServeError,
    bad_request,
    check_model,
    check_parameters,
    decode_inputs,
    select_outputs,
    timeout_from_parameters,
)
from .service import InferRequest, Service

# HTTP statuses of ServeError -> gRPC codes, as Triton maps its errors to both.
GRPC_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
# The typed field of InferTensorContents for each datatype; FP16 and BF16 have none and travel only as raw bytes.
CONTENTS_FIELDS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The service's gRPC front end; methods not defined here answer UNIMPLEMENTED (the generated base)."""

    def __init__(self, service: Service):
        self.service = service

    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerLiveResponse(live=self.service.failure is None)

    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerReadyResponse(ready=self.service.ready)

    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        # A model this server does not serve is not ready, not an error: Triton answers ready=false too, and
        # tritonclient's is_model_ready() then returns False rather than raising (REST says 404, Triton 400).
        try:
            check_model(self.service.model, request.name, request.version)
        except ServeError:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=self.service.ready)

    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return json_format.ParseDict(self.service.server_metadata(), pb.ServerMetadataResponse())

    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._check_model(request.name, request.version, context)
        return json_format.ParseDict(self.service.model_metadata(), pb.ModelMetadataResponse())

    async def ModelConfig(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._check_model(request.name, request.version, context)
        return pb.ModelConfigResponse(config=self.service.model_config())

    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        arrived = time.perf_counter()
        status = 500  # an unexpected exception propagates and is answered INTERNAL
        try:
            response = await self._infer(request, context.time_remaining(), arrived)
            status = 200
            return response
        except ServeError as error:
            status = error.status
            await context.abort(GRPC_CODES[error.status], error.message)
        except asyncio.CancelledError:
            status = CLIENT_GONE
            raise
        finally:
            self.service.count("grpc", status, arrived)

    async def _infer(self, request: Any, deadline_s: float | None, arrived: float) -> Any:
        check_model(self.service.model, request.model_name, request.model_version)
        if not self.service.ready:
            raise self.service.not_ready()
        # Off the event loop, as REST decodes: typed contents of a large message are many Python objects.
        parsed = await asyncio.to_thread(parse_infer_request, request, self.service, deadline_s)
        return infer_response(self.service, parsed, await self.service.infer(parsed, arrived))

    async def _check_model(self, name: str, version: str, context: grpc.aio.ServicerContext) -> None:
        try:
            check_model(self.service.model, name, version)
        except ServeError as error:
            await context.abort(GRPC_CODES[error.status], error.message)


def parse_infer_request(request: Any, service: Service, deadline_s: float | None) -> InferRequest:
    """A checked InferRequest from a ModelInferRequest; the client's deadline (if any) is its timeout."""
    model = service.model
    parameters = _parameters(request.parameters)
    check_parameters(parameters, "the request")
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise bad_request(
            f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs; give one per input, in input order, "
            "or none (typed contents)"
        )
    tensors = []
    for number, tensor in enumerate(request.inputs):
        check_parameters(_parameters(tensor.parameters), f"input {tensor.name!r}")
        if raw and tensor.HasField("contents") and tensor.contents.ListFields():
            # Served from the raw bytes, the typed values were ignored without a word; Triton refuses it too.
            raise bad_request(
                f"input {tensor.name!r} has both typed contents and raw_input_contents; give its values in one of "
                "them (raw_input_contents for every input, or typed contents for every input)"
            )
        values = _typed_contents(tensor) if not raw else None
        tensors.append(
            InputTensor(tensor.name, tensor.datatype, list(tensor.shape), values, raw[number] if raw else None)
        )
    feed, items = decode_inputs(model, tensors)
    requested = []
    for output in request.outputs:
        check_parameters(_parameters(output.parameters), f"output {output.name!r}")
        requested.append((output.name, True))
    timeouts = [t for t in (timeout_from_parameters(parameters), deadline_s) if t is not None]
    return InferRequest(
        feed,
        items,
        select_outputs(model, requested, binary_default=True),
        id=request.id,
        timeout_s=min(timeouts) if timeouts else None,
    )


def _parameters(parameters: Any) -> dict[str, Any]:
    """A protobuf map<string, InferParameter> as plain values."""
    return {
        key: getattr(value, value.WhichOneof("parameter_choice") or "string_param") for key, value in parameters.items()
    }


def _typed_contents(tensor: Any) -> list | None:
    """The tensor's typed values, or None when it has none (the protocol then wants raw contents)."""
    field = CONTENTS_FIELDS.get(tensor.datatype)
    if field is None or not tensor.HasField("contents"):
        return None
    return list(getattr(tensor.contents, field))


def infer_response(service: Service, request: InferRequest, outputs: dict) -> Any:
    response = pb.ModelInferResponse(model_name=service.model.name, model_version=VERSION, id=request.id)
    for choice in request.outputs:
        array = outputs[choice.name]
        response.outputs.add(name=choice.name, datatype=DATATYPES[array.dtype.name], shape=list(array.shape))
        # tritonclient reads raw_output_contents[i] as outputs[i]: same order.
        response.raw_output_contents.append(array.tobytes())
    return response


class RefuseUndecodable(grpc.aio.ServerInterceptor):
    """Each unary method's request decoded so that bytes protobuf cannot parse are answered INVALID_ARGUMENT, naming
    the message expected; grpc answered them UNKNOWN "Unexpected <class DecodeError>"."""

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None or handler.request_deserializer is None:
            return handler
        return handler._replace(
            request_deserializer=_decoding(handler.request_deserializer),
            unary_unary=_refusing_undecodable(handler.unary_unary, details.method),
        )


@dataclass(frozen=True)
class _Undecodable:
    error: str


def _decoding(parse: Any) -> Any:
    def decode(raw: bytes) -> Any:
        try:
            return parse(raw)
        except DecodeError as error:
            return _Undecodable(str(error))

    return decode


def _refusing_undecodable(behavior: Any, method: str) -> Any:
    async def refusing(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request to {method} is not a valid protobuf message ({request.error}); send the message the "
                "method takes, serialized (tritonclient.grpc does)",
            )
        answer = behavior(request, context)  # the generated base's UNIMPLEMENTED methods are not coroutines
        return await answer if inspect.isawaitable(answer) else answer

    return refusing


# Calls past the limit the server takes (ServeConfig.max_connections, grpc's maximum_concurrent_rpcs) are answered
# RESOURCE_EXHAUSTED with grpc's reason ("Concurrent RPC limit exceeded!") only once grpc's Python layer has taken
# them; two limits of grpc's core act before that, with no reason, and are set BURST_FACTOR times above it:
# - the calls a connection may open (HTTP/2 streams): one past it is reset (RST_STREAM REFUSED_STREAM), which
#   tritonclient showed as UNAVAILABLE "Stream removed": 177 of 300 calls one channel sent at once, when this limit
#   was 100, and a burst of 2500 past 2024;
# - the calls the core holds until the Python layer asks for the next (grpc.server.max_pending_requests, 1000 by
#   default, and its hard limit, 3000): past the first, a share of the calls that arrive is cancelled (CANCELLED,
#   no reason), past the second every one: 33 of a burst of 1500 calls on one channel.
# The Python layer asks for calls one at a time, so a burst waits there however short each call is.
BURST_FACTOR = 8
# A peer that vanished (no FIN: a crashed host, a dropped route) is found by a ping unanswered in KEEPALIVE_TIMEOUT_S.
KEEPALIVE_TIME_S = 60
KEEPALIVE_TIMEOUT_S = 20


def server_options(config: ServeConfig) -> list[tuple[str, int]]:
    """What one gRPC client, slow or hostile, may hold: the message size, the handshake's time, an idle
    connection, a connection's age (a trickled message included), the streams of one connection and the calls
    waiting to be taken (BURST_FACTOR)."""
    read_ms = round(config.read_timeout_s * 1000)
    return [
        ("grpc.max_receive_message_length", config.max_body_bytes),
        ("grpc.max_send_message_length", -1),
        # gRPC sets SO_REUSEPORT by default, so a second server would share a busy port silently.
        ("grpc.so_reuseport", 0),
        # A connection must finish its HTTP/2 handshake as a REST request its head: within the read timeout.
        ("grpc.server_handshake_timeout_ms", read_ms),
        # A connection with no call for that long is closed (GOAWAY; a channel reconnects on its next call).
        ("grpc.max_connection_idle_ms", read_ms),
        ("grpc.max_connection_age_ms", round(config.connection_age_s * 1000)),
        ("grpc.max_connection_age_grace_ms", read_ms + round(config.timeout_s * 1000)),
        ("grpc.max_concurrent_streams", config.max_connections * BURST_FACTOR),
        ("grpc.server.max_pending_requests", config.max_connections * BURST_FACTOR),
        ("grpc.server.max_pending_requests_hard_limit", config.max_connections * BURST_FACTOR),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_S * 1000),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_S * 1000),
    ]


async def start_grpc_server(service: Service, host: str, port: int) -> grpc.aio.Server:
    """The gRPC front end listening on host:port, on the running event loop (the one REST's batcher uses)."""
    server = grpc.aio.server(
        options=server_options(service.config),
        interceptors=[RefuseUndecodable()],
        # Calls past it are refused at once with RESOURCE_EXHAUSTED (grpc's own answer), as REST answers 503.
        maximum_concurrent_rpcs=service.config.max_connections,
    )
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(service), server)
    address = f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise PipelineError(f"cannot listen for gRPC on {address} (the port is taken?)", "give a free --grpc-port")
    await server.start()
    return server
