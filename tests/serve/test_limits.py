"""The service against clients that cost it more than their requests: a body of 60 MB of JSON, clients that send
a byte every 2 s, clients that hang up mid-body.  Servers on 127.0.0.1 (tests.helpers.serve_fixtures.served); every
client loop is bounded by a deadline, and nothing asserts on speed."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.helpers.serve_fixtures import IMAGE_MODEL, Server, metric, served

READ_TIMEOUT_S = 3  # the guarded server's: a client trickling a byte every 2 s is cut off after it
PAUSE_S = 2.0
DEADLINE_S = 60.0  # bounds every loop; far beyond READ_TIMEOUT_S, never an expectation of speed
INFER = f"/v2/models/{IMAGE_MODEL}/infer"


@pytest.fixture(scope="module")
def guarded(folder: Path) -> Iterator[Server]:  # noqa: F811 (the fixture imported above)
    with served(folder, "--read-timeout-s", str(READ_TIMEOUT_S)) as running:
        yield running


def _huge_json(megabytes: int) -> bytes:
    """A request whose JSON is `megabytes` MB of numbers: what a client sending a big batch as JSON sends."""
    values = np.random.default_rng(0).standard_normal(megabytes * 1024 * 1024 // 20).tolist()
    request = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [len(values)], "data": values}]}
    return json.dumps(request).encode()


def _live_while(server: Server, busy: threading.Event) -> list[int]:
    """The statuses of /v2/health/live, asked again and again until `busy` clears (at most DEADLINE_S)."""
    statuses = []
    deadline = time.monotonic() + DEADLINE_S
    while busy.is_set() and time.monotonic() < deadline:
        statuses.append(httpx.get(f"{server.url}/v2/health/live", timeout=DEADLINE_S).status_code)
    return statuses


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_60_mb_json_body_is_413_naming_binary_data_and_health_keeps_answering(
    guarded: Server, declared: bool
) -> None:
    body = _huge_json(60)
    content = body if declared else iter([body[i : i + 65536] for i in range(0, len(body), 65536)])
    busy = threading.Event()
    busy.set()

    def send() -> httpx.Response:
        try:
            return httpx.post(guarded.url + INFER, content=content, timeout=DEADLINE_S)
        finally:
            busy.clear()

    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(send)
        statuses = _live_while(guarded, busy)
        response = sent.result(timeout=DEADLINE_S)
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert "the limit is 8388608" in error or "over the limit of 8388608" in error
    assert "send the tensors as binary data" in error and "--max-json-mib" in error
    assert set(statuses) <= {200}


def test_a_body_over_the_limit_is_read_so_the_client_reads_the_413(guarded: Server) -> None:
    # Answered before the body had all arrived, http.client got a connection reset (a broken pipe) and tritonclient an
    # empty exception: both send the whole body before they read the answer.
    host, port = guarded.http.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=DEADLINE_S)
    try:
        connection.request("POST", INFER, body=_huge_json(20), headers={"Content-Type": "application/json"})
        answer = connection.getresponse()
        assert answer.status == 413
        assert "the limit is 8388608 (send the tensors as binary data" in json.loads(answer.read())["error"]
        connection.request("GET", "/v2/health/ready")  # the body was read: the same connection serves on
        assert connection.getresponse().status == 200
    finally:
        connection.close()
    raw = np.zeros(70 * 1024 * 1024 // 4, np.float32)  # binary data over --max-body-mib (64)
    given = httpclient.InferInput("input", [1, *raw.shape], "FP32")
    given.set_data_from_numpy(raw[None])
    client = httpclient.InferenceServerClient(guarded.http, network_timeout=DEADLINE_S)
    with client, pytest.raises(InferenceServerException) as refused:
        client.infer(IMAGE_MODEL, [given])
    assert refused.value.status() == "413" and "the limit is 67108864" in refused.value.message()


def test_a_client_that_waits_to_be_told_to_send_is_answered_413_at_once(guarded: Server) -> None:
    # Not told to send a body that would only be read and dropped (the case above): its 413 comes first, then close.
    host, port = guarded.http.split(":")
    head = _head(100 * 1024 * 1024).replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n")
    with socket.create_connection((host, int(port)), timeout=DEADLINE_S) as connection:
        connection.sendall(head)  # and no body: it waits for "100 Continue", which must not come
        answer = connection.makefile("rb").read().decode()  # the server closes the connection after its answer
    assert answer.startswith("HTTP/1.1 413 ") and "the JSON body is 104857600 bytes" in answer


def test_a_binary_body_has_the_larger_limit(guarded: Server) -> None:
    # 12 MB of binary data, over the JSON limit but under --max-body-mib: refused only for its shape (400).
    raw = np.zeros(3 * 1024 * 1024, np.float32).tobytes()
    given = {"name": "input", "datatype": "FP32", "shape": [1, 3 * 1024 * 1024]}
    header = json.dumps({"inputs": [{**given, "parameters": {"binary_data_size": len(raw)}}]})
    response = httpx.post(
        guarded.url + INFER,
        content=header.encode() + raw,
        headers={"Inference-Header-Content-Length": str(len(header))},
        timeout=DEADLINE_S,
    )
    assert response.status_code == 400 and "expected (-1, 3, 16, 16)" in response.json()["error"]


# --------------------------------------------------------------------------- gRPC messages and streams


@pytest.mark.parametrize("method", ["ModelInfer", "ServerLive"])
def test_grpc_bytes_that_are_no_message_get_invalid_argument(guarded: Server, method: str) -> None:
    # grpc answered UNKNOWN "Unexpected <class 'google.protobuf.message.DecodeError'>".
    with grpc.insecure_channel(guarded.grpc) as channel:
        call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
        with pytest.raises(grpc.RpcError) as refused:
            call(b"\xff\xfe garbage \x00\x01", timeout=DEADLINE_S)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"the request to /inference.GRPCInferenceService/{method} is not a valid protobuf message" in (
            refused.value.details()
        )
        ready = service_pb2_grpc.GRPCInferenceServiceStub(channel).ServerReady(service_pb2.ServerReadyRequest())
        assert ready.ready


def test_a_burst_of_grpc_calls_on_one_channel_is_served_not_reset(guarded: Server) -> None:
    # 300 calls at once on one tritonclient channel, within --max-connections (1000): with 100 streams a connection,
    # 177 were reset (UNAVAILABLE "Stream removed (RST_STREAM ... error code 7)"), a reason no client can act on.
    calls = 300
    answers: list[str | None] = []
    done = threading.Event()

    def answered(result, error) -> None:
        answers.append(None if error is None else f"{error.status()} {error.message()}")
        if len(answers) == calls:
            done.set()

    batch = np.zeros((1, 3, 16, 16), np.float32)
    given = grpcclient.InferInput("input", list(batch.shape), "FP32")
    given.set_data_from_numpy(batch)
    with grpcclient.InferenceServerClient(guarded.grpc) as client:
        for _ in range(calls):
            client.async_infer(IMAGE_MODEL, [given], answered, client_timeout=DEADLINE_S)
        assert done.wait(DEADLINE_S)
    assert [answer for answer in answers if answer is not None] == []


def test_a_burst_past_a_thousand_grpc_calls_gets_answers_or_reasons(guarded: Server) -> None:
    # 2000 calls at once on one channel, past grpc's 1000 calls held before the server takes them: 33 of 1500 were
    # CANCELLED with no reason, and past the streams of a connection UNAVAILABLE "Stream removed".  Each is served,
    # or refused with a reason a client can act on: RESOURCE_EXHAUSTED past --max-connections, UNAVAILABLE busy.
    calls, deadline_s = 2000, 30.0
    request = service_pb2.ModelInferRequest(model_name=IMAGE_MODEL)
    request.inputs.add(name="input", datatype="FP32", shape=[1, 3, 16, 16])
    request.raw_input_contents.append(np.ones((1, 3, 16, 16), np.float32).tobytes())
    reasons = ("Concurrent RPC limit exceeded", "busy: ")

    async def burst() -> list[str]:
        async with grpc.aio.insecure_channel(guarded.grpc) as channel:
            infer = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer
            answers = await asyncio.gather(
                *(infer(request, timeout=deadline_s) for _ in range(calls)), return_exceptions=True
            )
        return [
            f"{answer.code().name}: {answer.details()}"
            for answer in answers
            if isinstance(answer, grpc.aio.AioRpcError) and not any(reason in answer.details() for reason in reasons)
        ]

    unexplained = asyncio.run(asyncio.wait_for(burst(), DEADLINE_S))
    assert not unexplained, Counter(unexplained)


# --------------------------------------------------------------------------- slow clients


def _trickle(server: Server, sent_at_once: bytes, trickled: bytes) -> bytes:
    """Send `sent_at_once`, then `trickled` a byte every PAUSE_S, until the server closes the connection;
    everything it answered.  Fails if the server still holds the connection after DEADLINE_S."""
    host, port = server.http.split(":")
    answered = b""
    with socket.create_connection((host, int(port)), timeout=DEADLINE_S) as connection:
        connection.sendall(sent_at_once)
        connection.settimeout(PAUSE_S)  # waiting for an answer is the pause between two bytes
        deadline = time.monotonic() + DEADLINE_S
        for byte in trickled:
            if time.monotonic() > deadline:
                break
            try:
                connection.sendall(bytes([byte]))
                while chunk := connection.recv(65536):
                    answered += chunk
                return answered  # recv gave b"": the server closed the connection
            except TimeoutError:
                continue  # nothing yet: send the next byte
            except (BrokenPipeError, ConnectionResetError):
                return answered
    pytest.fail(f"the server still held a connection trickling a byte every {PAUSE_S} s after {DEADLINE_S} s")


def _head(content_length: int) -> bytes:
    return (
        f"POST {INFER} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {content_length}\r\n\r\n"
    ).encode()


def test_slow_clients_are_cut_off_and_others_are_served(guarded: Server) -> None:
    endless = b"x" * 1000  # more bytes than the deadline leaves time to trickle
    slow_heads = [(b"", _head(10**6)[:-4] + b"\r\nX-Pad: " + endless)] * 3
    slow_bodies = [(_head(len(endless)), endless)] * 3
    with ThreadPoolExecutor(6) as pool:
        answers = [pool.submit(_trickle, guarded, *client) for client in slow_heads + slow_bodies]
        # Meanwhile the service answers everyone else.
        assert httpx.get(f"{guarded.url}/v2/health/ready", timeout=DEADLINE_S).status_code == 200
        heads, bodies = [a.result(timeout=2 * DEADLINE_S) for a in answers[:3]], [a.result() for a in answers[3:]]
    assert heads == [b""] * 3  # a head that never ends is closed without an answer
    for answered in bodies:  # a body that never ends is answered 408, and the connection closed
        assert answered.startswith(b"HTTP/1.1 408"), answered[:200]
        assert b"connection: close" in answered.lower() and b"the service's read timeout" in answered


# --------------------------------------------------------------------------- clients that hang up


def test_a_client_hanging_up_mid_body_is_not_counted_as_a_server_error(guarded: Server) -> None:
    before = {status: metric(guarded, "serve_requests_total", status=status) for status in ("499", "500")}
    host, port = guarded.http.split(":")
    with socket.create_connection((host, int(port)), timeout=DEADLINE_S) as connection:
        connection.sendall(_head(10_000) + b'{"inputs": [')
    deadline = time.monotonic() + DEADLINE_S
    while metric(guarded, "serve_requests_total", status="499") == before["499"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(guarded, "serve_requests_total", status="499") == before["499"] + 1
    assert metric(guarded, "serve_requests_total", status="500") == before["500"]
    assert httpx.get(f"{guarded.url}/v2/health/live", timeout=DEADLINE_S).status_code == 200


# --------------------------------------------------------------------------- what many clients, or gRPC ones, can hold

CROWD = 3  # the crowded server's --max-connections
CONNECTION_AGE_S = 2.0
CROWDED_READ_TIMEOUT_S = 2.0
CROWDED_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def crowded(folder: Path) -> Iterator[Server]:  # noqa: F811 (the fixture imported above)
    """Few connections, short gRPC connection lives, and a batch window that holds a lone call 1.5 s."""
    options = ["--max-connections", str(CROWD), "--connection-age-s", str(CONNECTION_AGE_S), "--max-wait-ms", "1500"]
    options += ["--read-timeout-s", str(CROWDED_READ_TIMEOUT_S), "--timeout-s", str(CROWDED_TIMEOUT_S)]
    with served(folder, *options) as running:
        yield running


def test_rest_connections_past_the_limit_get_503(crowded: Server) -> None:
    host, port = crowded.http.split(":")
    held = [socket.create_connection((host, int(port)), timeout=DEADLINE_S) for _ in range(CROWD)]
    try:
        time.sleep(0.5)  # the server has accepted them (uvicorn counts a connection from its first moment)
        refused = httpx.get(f"{crowded.url}/v2/health/live", timeout=DEADLINE_S)
        assert refused.status_code == 503, refused.text
    finally:
        for connection in held:
            connection.close()
    deadline = time.monotonic() + DEADLINE_S
    while httpx.get(f"{crowded.url}/v2/health/live", timeout=DEADLINE_S).status_code != 200:
        assert time.monotonic() < deadline, "the server still refused after the held connections closed"
        time.sleep(0.1)


def test_grpc_calls_past_the_limit_get_resource_exhausted(crowded: Server) -> None:
    request = service_pb2.ModelInferRequest(model_name=IMAGE_MODEL)
    request.inputs.add(name="input", datatype="FP32", shape=[1, 3, 16, 16])
    request.raw_input_contents.append(np.ones((1, 3, 16, 16), np.float32).tobytes())
    with grpc.insecure_channel(crowded.grpc) as channel:
        infer = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer
        held = [infer.future(request, timeout=DEADLINE_S) for _ in range(CROWD)]  # each waits in the batch window
        time.sleep(0.5)
        with pytest.raises(grpc.RpcError) as refused:
            infer(request, timeout=DEADLINE_S)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert all(len(call.result().raw_output_contents) == 1 for call in held)  # the held calls were served


_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame (RFC 9113 section 4.1)."""
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def _literal_headers(headers: dict[str, str]) -> bytes:
    """HPACK literals without indexing, names and values shorter than 127 bytes (RFC 7541 section 6.2.2)."""
    return b"".join(
        b"\x00" + bytes([len(name)]) + name.encode() + bytes([len(value)]) + value.encode()
        for name, value in headers.items()
    )


def _held_grpc_connection(server: Server, trickle: bool) -> float:
    """Seconds until the server closed a connection that completes the HTTP/2 handshake and then either stays
    silent or opens a ModelInfer call whose message trickles in a byte every 0.5 s.  Fails past DEADLINE_S."""
    host, port = server.grpc.split(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=DEADLINE_S) as connection:
        connection.sendall(_PREFACE + _frame(4, 0, 0))  # SETTINGS
        connection.recv(65536)  # the server's SETTINGS
        connection.sendall(_frame(4, 1, 0))  # SETTINGS ACK: a well-behaved peer, apart from its pace
        if trickle:
            headers = {
                ":method": "POST",
                ":scheme": "http",
                ":path": "/inference.GRPCInferenceService/ModelInfer",
                ":authority": server.grpc,
                "content-type": "application/grpc",
                "te": "trailers",
            }
            connection.sendall(_frame(1, 4, 1, _literal_headers(headers)))  # HEADERS, END_HEADERS, stream 1
            connection.sendall(_frame(0, 0, 1, b"\x00" + (1000).to_bytes(4, "big")))  # a 1000-byte message begins
        connection.settimeout(0.5)
        while time.monotonic() - started < DEADLINE_S:
            try:
                if trickle:
                    connection.sendall(_frame(0, 0, 1, b"\x00"))
                while connection.recv(65536):  # GOAWAY, PING...: read until the server closes
                    pass
                return time.monotonic() - started
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - started
    pytest.fail(f"the gRPC server still held the connection after {DEADLINE_S} s")


def test_an_idle_grpc_connection_is_closed_after_the_read_timeout(crowded: Server) -> None:
    assert _held_grpc_connection(crowded, trickle=False) >= CROWDED_READ_TIMEOUT_S * 0.9


def test_a_trickled_grpc_call_is_cut_at_the_connection_age(crowded: Server) -> None:
    """gRPC has no read timeout per message: the connection's age bounds it (age + grace for calls in flight)."""
    held = _held_grpc_connection(crowded, trickle=True)
    assert CONNECTION_AGE_S * 0.8 <= held <= DEADLINE_S
