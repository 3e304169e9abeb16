"""The service under load and at its limits: many clients, 413/503/504, graceful shutdown,
and refusals before serving."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.helpers.serve_fixtures import (
    FORMS,
    HOST,
    IMAGE_MODEL,
    MAX_BATCH,
    ONE,
    ONE_DATA,
    PROTOCOLS,
    ROOT,
    RTOL,
    Server,
    client,
    clients,
    free_port,
    image_input_json,
    infer_input,
    infer_logits,
    items,
    metric,
    refusal,
    served,
)
from trt_pipeline.pipeline.core.compare import compare

# --------------------------------------------------------------------------- load


CLIENTS = 32
REQUESTS_PER_CLIENT = 30  # 960 in all, a third in each form


def test_32_clients_each_get_exactly_their_own_rows(server: Server, runner) -> None:
    """32 tritonclient clients at once, each sending its own items (1-3 per request) in turn as REST JSON,
    REST binary and gRPC; every row of every answer is checked against the same items run alone."""
    served_before = {p: metric(server, "serve_requests_total", protocol=p, status="200") for p in PROTOCOLS}

    def one_client(number: int) -> list[tuple[np.ndarray, np.ndarray]]:
        results = []
        with clients(server) as triton:
            for request in range(REQUESTS_PER_CLIENT):
                seed = number * REQUESTS_PER_CLIENT + request
                batch = items(seed, count=1 + seed % 3)
                results.append((batch, infer_logits(triton, list(FORMS)[seed % len(FORMS)], batch)))
        return results

    with ThreadPoolExecutor(CLIENTS) as pool:
        answers = [pair for results in pool.map(one_client, range(CLIENTS), timeout=120) for pair in results]
    assert len(answers) == CLIENTS * REQUESTS_PER_CLIENT
    mixed_up = [
        n
        for n, (batch, got) in enumerate(answers)
        if not compare(runner.infer({"input": batch})["logits"], got, rtol=RTOL).ok
    ]
    assert mixed_up == [], f"{len(mixed_up)} answers do not match their own items run alone"
    # The tolerance tells rows apart: another request's rows would be far outside it.
    assert not compare(answers[0][1][0], answers[1][1][0], rtol=RTOL).ok
    served = {p: metric(server, "serve_requests_total", protocol=p, status="200") - served_before[p] for p in PROTOCOLS}
    assert served == {"http": 2 * len(answers) // 3, "grpc": len(answers) // 3}
    # Requests really were gathered: fewer runner calls than requests.
    gathered = metric(server, "serve_batch_requests_sum"), metric(server, "serve_batch_requests_count")
    assert gathered[0] > gathered[1]


# --------------------------------------------------------------------------- limits: 413, 503, 504


@pytest.fixture(scope="module")
def strict_server(folder: Path) -> Iterator[Server]:
    """A server whose batch window (2 s) outlasts its timeout (0.5 s): a lone small request always times
    out, a full batch (32 items) goes at once.  Queue of 4 requests, bodies up to 0.2 MiB."""
    options = ("--max-wait-ms", "2000", "--timeout-s", "0.5", "--queue-size", "4", "--max-body-mib", "0.2")
    with served(folder, *options) as running:
        yield running


def test_oversized_body_is_413(strict_server: Server) -> None:
    # 32 items as JSON text are some 500 KB, over the 0.2 MiB limit (as binary data they are 98 KB).
    with client(strict_server, "http") as triton:
        given = infer_input("http", "input", items(seed=3, count=MAX_BATCH), binary=False)
        error = refusal(lambda: triton.infer(IMAGE_MODEL, [given]))
    assert error.status() == "413" and "the limit is 209715" in error.message()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_timeout_is_504_and_the_rows_go_to_no_one(strict_server: Server, runner, protocol: str) -> None:
    with client(strict_server, protocol) as triton:
        error = refusal(lambda: triton.infer(IMAGE_MODEL, [infer_input(protocol, "input", ONE)]))
        full = items(seed=4, count=MAX_BATCH)
        answered = triton.infer(IMAGE_MODEL, [infer_input(protocol, "input", full)]).as_numpy("logits")
    assert str(error.status()) == ("504" if protocol == "http" else "StatusCode.DEADLINE_EXCEEDED")
    assert "no answer within the service's 0.5 s timeout" in error.message()
    assert compare(runner.infer({"input": full})["logits"], answered, rtol=RTOL).ok


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_requests_own_timeout_parameter_is_kept(server: Server, protocol: str) -> None:
    with client(server, protocol) as triton:
        error = refusal(lambda: triton.infer(IMAGE_MODEL, [infer_input(protocol, "input", ONE)], timeout=1))
    assert "no answer within the request's 1e-06 s timeout" in error.message()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_full_queue_is_503_unavailable(strict_server: Server, protocol: str) -> None:
    def attempt(_: int) -> str:
        with client(strict_server, protocol) as triton:
            return str(refusal(lambda: triton.infer(IMAGE_MODEL, [infer_input(protocol, "input", ONE)])).status())

    with ThreadPoolExecutor(12) as pool:
        statuses = Counter(pool.map(attempt, range(12), timeout=30))
    busy, late = ("503", "504") if protocol == "http" else ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED")
    # At most 4 wait in the queue at a time (and time out: the window outlasts the timeout); the rest are turned
    # away.  How many of each depends on how close together the 12 arrive on a loaded machine.
    assert set(statuses) <= {busy, late} and statuses[busy] >= 1, statuses


def test_busy_answer_says_when_to_retry(strict_server: Server) -> None:
    body = json.dumps({"inputs": [image_input_json(data=ONE_DATA)]}).encode()
    url = f"{strict_server.url}/v2/models/{IMAGE_MODEL}/infer"
    with ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(lambda _: httpx.post(url, content=body, timeout=10), range(12), timeout=30))
    refused = next(response for response in responses if response.status_code == 503)
    assert refused.headers["retry-after"] == "1" and "the queue holds 4" in refused.json()["error"]


# --------------------------------------------------------------------------- graceful shutdown


def test_sigterm_finishes_requests_in_flight_on_both_protocols_and_refuses_new_ones(folder: Path, runner) -> None:
    # A 3 s batch window: both requests are still queued when the signal comes.
    with served(folder, "--max-wait-ms", "3000") as server:
        batches = {"http": items(seed=5, count=2), "grpc": items(seed=6, count=3)}
        answers: dict[str, np.ndarray] = {}

        def send(protocol: str) -> None:
            with clients(server) as triton:
                answers[protocol] = infer_logits(
                    triton, "http-binary" if protocol == "http" else "grpc", batches[protocol]
                )

        senders = [threading.Thread(target=send, args=(protocol,)) for protocol in PROTOCOLS]
        for sender in senders:
            sender.start()
        deadline = time.monotonic() + 10
        while metric(server, "serve_queue_depth") < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert metric(server, "serve_queue_depth") == 2, "the requests never reached the queue"
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.url}/v2/health/live", timeout=5)
        with client(server, "grpc") as triton:
            refused = refusal(lambda: triton.infer(IMAGE_MODEL, [infer_input("grpc", "input", ONE)]))
        assert str(refused.status()) == "StatusCode.UNAVAILABLE"
        for sender in senders:
            sender.join(timeout=20)
        for protocol, batch in batches.items():
            assert compare(runner.infer({"input": batch})["logits"], answers[protocol], rtol=RTOL).ok
        # uvicorn re-raises the signal once it has shut down gracefully, so the exit reads as SIGTERM.
        assert server.process.wait(timeout=20) in (0, -signal.SIGTERM)


def test_a_busy_grpc_port_is_one_error_line(folder: Path) -> None:
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        command = [sys.executable, "-m", "trt_pipeline", "serve", str(folder), "--host", HOST, "--grpc-port", port]
        run = subprocess.run(
            [*command, "--port", str(free_port())], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
    assert run.returncode == 2 and "cannot listen for gRPC" in run.stderr and "Traceback" not in run.stderr


def test_an_unfinished_folder_is_refused_before_serving(folder: Path, tmp_path: Path) -> None:
    unfinished = tmp_path / folder.name
    shutil.copytree(folder, unfinished)
    manifest = json.loads((unfinished / "manifest.json").read_text())
    (unfinished / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    command = [sys.executable, "-m", "trt_pipeline", "serve", str(unfinished), "--host", HOST]
    run = subprocess.run(
        [*command, "--port", str(free_port()), "--grpc-port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2 and "holds an unfinished build" in run.stderr and "Traceback" not in run.stderr
