"""The HTTP service, for real: `python -m pipeline serve` in its own process on 127.0.0.1, the ONNX Runtime
runner serving tiny_cnn artifacts built by make_engine, real HTTP clients.  Every wait has a timeout and
every server process is terminated, whatever the test does."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from pipeline.compare import compare
from pipeline.runners import load_runner
from pipeline.settings import BatchProfile, Settings
from pipeline.stages import make_engine

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"  # loopback only, always
MODEL = "toy_models-tiny_cnn"
INFER = f"/v1/models/{MODEL}/infer"
MAX_BATCH = 32
ITEM_SHAPE = (3, 16, 16)
NPY = {"content-type": "application/x-npy"}
# Batched and lone runs of a conv may sum in a different order; distinct inputs differ by ~1e-1.
RTOL = 1e-5


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("engines")
    batch = BatchProfile(1, 8, MAX_BATCH)
    return make_engine(Settings(model="tests.toy_models:tiny_cnn", precision="fp32", batch=batch, out_root=out))


@pytest.fixture(scope="module")
def runner(folder: Path):
    with load_runner(folder, backend="onnxruntime") as loaded:
        yield loaded


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def served(folder: Path, *options: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """A `python -m pipeline serve` process on a free loopback port, ready; always terminated on exit."""
    port = free_port()
    command = [sys.executable, "-m", "pipeline", "serve", str(folder), "--host", HOST, "--port", str(port)]
    process = subprocess.Popen(
        [*command, "--log-level", "warning", *options], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    url = f"http://{HOST}:{port}"
    try:
        wait_ready(url, process)
        yield url, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        if process.stdout is not None:
            process.stdout.close()


def wait_ready(url: str, process: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            output = process.stdout.read().decode() if process.stdout else ""
            pytest.fail(f"the server exited with {process.returncode} before it was ready:\n{output}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    pytest.fail(f"{url} was not ready within {timeout_s} s")


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[str]:
    with served(folder) as (url, _):
        yield url


def items(seed: int, count: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, *ITEM_SHAPE), dtype=np.float32)


def json_body(batch: np.ndarray) -> dict:
    return {"inputs": {"input": {"dtype": "float32", "data": batch.tolist()}}}


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def logits_of(response: httpx.Response) -> np.ndarray:
    """The outputs of a 200 response, in either form."""
    assert response.status_code == 200, response.text
    if response.headers["content-type"] == "application/x-npy":
        return np.load(io.BytesIO(response.content), allow_pickle=False)
    document = response.json()
    assert document["model_name"] == MODEL
    logits = document["outputs"]["logits"]
    assert logits["dtype"] == "float32"
    array = np.array(logits["data"], dtype=np.float32)
    assert list(array.shape) == logits["shape"]
    return array


def metric(url: str, name: str) -> float:
    """One sample's value from /metrics, e.g. 'serve_requests_total{status="200"}'."""
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


# --------------------------------------------------------------------------- load


CLIENTS = 32
REQUESTS = 2000


async def _load(url: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """CLIENTS concurrent clients sending REQUESTS requests in all, each with its own items (1-3), half JSON
    and half .npy; returns (inputs, outputs) for every request."""
    results: list[tuple[np.ndarray, np.ndarray]] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for number in range(REQUESTS):
        queue.put_nowait(number)
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:

        async def one_client() -> None:
            while not queue.empty():
                number = queue.get_nowait()
                batch = items(seed=number, count=1 + number % 3)
                if number % 2:
                    response = await client.post(INFER, content=npy_bytes(batch), headers=NPY)
                else:
                    response = await client.post(INFER, json=json_body(batch))
                results.append((batch, logits_of(response)))

        await asyncio.wait_for(asyncio.gather(*(one_client() for _ in range(CLIENTS))), timeout=90)
    return results


def test_concurrent_clients_each_get_exactly_their_own_rows(server: str, runner) -> None:
    served_before = metric(server, 'serve_requests_total{status="200"}')
    results = asyncio.run(_load(server))
    assert len(results) == REQUESTS
    for batch, outputs in results:
        alone = runner.infer({"input": batch})["logits"]
        assert compare(alone, outputs, rtol=RTOL).ok, "a response does not match its own input run alone"
    # The tolerance tells rows apart: another request's rows would be far outside it.
    first, second = results[0][1][0], results[1][1][0]
    assert not compare(first, second, rtol=RTOL).ok
    assert metric(server, 'serve_requests_total{status="200"}') - served_before == REQUESTS
    # Requests really were gathered: fewer runner calls than requests.
    assert metric(server, "serve_batch_requests_sum") > metric(server, "serve_batch_requests_count")
    assert httpx.get(f"{server}/ready", timeout=5).status_code == 200


# --------------------------------------------------------------------------- endpoints


def test_health_ready_metadata_and_metrics(server: str) -> None:
    assert httpx.get(f"{server}/health", timeout=5).json() == {"status": "up"}
    assert httpx.get(f"{server}/ready", timeout=5).json() == {"status": "ready", "model": MODEL}
    described = httpx.get(f"{server}/v1/models/{MODEL}", timeout=5).json()
    assert described["inputs"] == [{"name": "input", "dtype": "float32", "shape": [-1, 3, 16, 16]}]
    assert described["max_items"] == MAX_BATCH and "onnxruntime" in described["runner"]
    text = httpx.get(f"{server}/metrics", timeout=5).text
    for family in ("serve_requests_total", "serve_request_seconds_bucket", "serve_batch_items_bucket"):
        assert family in text
    assert "serve_queue_depth" in text


def test_multi_item_request_in_both_forms(server: str, runner) -> None:
    batch = items(seed=7, count=MAX_BATCH)
    expected = runner.infer({"input": batch})["logits"]
    by_json = logits_of(httpx.post(f"{server}{INFER}", json=json_body(batch), timeout=10))
    by_npy = logits_of(httpx.post(f"{server}{INFER}", content=npy_bytes(batch), headers=NPY, timeout=10))
    assert compare(expected, by_json, rtol=RTOL).ok and compare(expected, by_npy, rtol=RTOL).ok
    buffer = io.BytesIO()
    np.savez(buffer, input=batch)
    response = httpx.post(f"{server}{INFER}", content=buffer.getvalue(), headers={"content-type": "application/x-npz"})
    assert response.headers["content-type"] == "application/x-npz"
    with np.load(io.BytesIO(response.content), allow_pickle=False) as outputs:
        assert compare(expected, outputs["logits"], rtol=RTOL).ok


def _forged_npy() -> bytes:
    """A .npy header promising 2**40 items, followed by 16 bytes."""
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (1099511627776, 3, 16, 16), }"
    header = header.ljust(118) + "\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + bytes(16)


def _npz(**arrays: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]
    return buffer.getvalue()


ONE = items(seed=1, count=1)
JSON_TYPE = {"content-type": "application/json"}
BAD_REQUESTS = {
    "malformed JSON": (b'{"inputs": [', JSON_TYPE, 400, "not valid JSON"),
    "no inputs object": (json.dumps({"data": 1}).encode(), JSON_TYPE, 422, 'no "inputs" object'),
    "wrong tensor name": (
        json.dumps({"inputs": {"image": {"dtype": "float32", "data": ONE.tolist()}}}).encode(),
        JSON_TYPE,
        422,
        "unknown inputs ['image']; the model takes ['input']",
    ),
    "missing tensor": (json.dumps({"inputs": {}}).encode(), JSON_TYPE, 422, "missing ['input']"),
    "wrong shape": (json.dumps(json_body(ONE[:, :2])).encode(), JSON_TYPE, 422, "expected (-1, 3, 16, 16)"),
    "wrong declared dtype": (
        json.dumps({"inputs": {"input": {"dtype": "float16", "data": ONE.tolist()}}}).encode(),
        JSON_TYPE,
        422,
        "the model takes float32",
    ),
    "ragged data": (
        json.dumps({"inputs": {"input": {"dtype": "float32", "data": [[1.0], [1.0, 2.0]]}}}).encode(),
        JSON_TYPE,
        422,
        "nested lists of numbers of equal lengths",
    ),
    "strings for numbers": (
        json.dumps({"inputs": {"input": {"dtype": "float32", "data": [["a"]]}}}).encode(),
        JSON_TYPE,
        422,
        "nested lists of numbers",
    ),
    "beyond float32": (
        json.dumps(json_body(ONE)).replace(str(float(ONE[0, 0, 0, 0])), "1e39", 1).encode(),
        JSON_TYPE,
        422,
        "not finite float32",
    ),
    "too many items": (npy_bytes(items(seed=2, count=MAX_BATCH + 1)), NPY, 422, f"send at most {MAX_BATCH}"),
    "wrong binary dtype": (npy_bytes(ONE.astype(np.float64)), NPY, 422, "dtype float64, expected float32"),
    "not a .npy": (b"\x93NUMPY garbage", NPY, 400, "not a .npy array"),
    "forged .npy header": (_forged_npy(), NPY, 400, "its header promises"),
    "pickled objects": (npy_bytes(np.array([{"a": 1}], dtype=object)), NPY, 422, "pickles are never loaded"),
    ".npz with a wrong name": (_npz(pixels=ONE), {"content-type": "application/x-npz"}, 422, "unexpected ['pixels']"),
    "not a .npz": (b"PK\x03\x04 nothing", {"content-type": "application/x-npz"}, 400, "not a .npz archive"),
    "unsupported content type": (b"1,2,3", {"content-type": "text/csv"}, 415, "send one of application/json"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS), ids=list(BAD_REQUESTS))
def test_bad_input_gets_4xx_saying_what_was_expected(server: str, case: str) -> None:
    body, headers, status, message = BAD_REQUESTS[case]
    response = httpx.post(f"{server}{INFER}", content=body, headers=headers, timeout=10)
    assert response.status_code == status, response.text
    assert message in response.json()["detail"]
    # ...and the service keeps serving.
    assert logits_of(httpx.post(f"{server}{INFER}", content=npy_bytes(ONE), headers=NPY, timeout=10)).shape == (1, 10)


def test_unknown_model_is_404_naming_the_served_one(server: str) -> None:
    response = httpx.post(f"{server}/v1/models/resnet50/infer", json=json_body(ONE), timeout=10)
    assert response.status_code == 404
    assert f"this server serves '{MODEL}'" in response.json()["detail"]


# --------------------------------------------------------------------------- limits: 413, 503, 504


@pytest.fixture(scope="module")
def strict_server(folder: Path) -> Iterator[str]:
    """A server whose batch window (2 s) outlasts its timeout (0.5 s): a lone small request always times
    out, a full batch (32 items) goes at once.  Queue of 4 requests, bodies up to 0.2 MiB."""
    options = ("--max-wait-ms", "2000", "--timeout-s", "0.5", "--queue-size", "4", "--max-body-mib", "0.2")
    with served(folder, *options) as (url, _):
        yield url


def test_oversized_body_is_413(strict_server: str) -> None:
    too_big = npy_bytes(items(seed=3, count=MAX_BATCH)) * 3  # 288 KiB
    response = httpx.post(f"{strict_server}{INFER}", content=too_big, headers=NPY, timeout=10)
    assert response.status_code == 413
    assert f"the body is {len(too_big)} bytes; the limit is 209715" in response.json()["detail"]


def test_timeout_is_504_and_the_rows_go_to_no_one(strict_server: str, runner) -> None:
    late = httpx.post(f"{strict_server}{INFER}", content=npy_bytes(ONE), headers=NPY, timeout=10)
    assert late.status_code == 504
    assert "no answer within the service's 0.5 s timeout" in late.json()["detail"]
    full = items(seed=4, count=MAX_BATCH)
    answered = logits_of(httpx.post(f"{strict_server}{INFER}", content=npy_bytes(full), headers=NPY, timeout=10))
    assert answered.shape == (MAX_BATCH, 10)
    assert compare(runner.infer({"input": full})["logits"], answered, rtol=RTOL).ok


def test_full_queue_is_503_with_retry_after(strict_server: str) -> None:
    def post(_: int) -> httpx.Response:
        return httpx.post(f"{strict_server}{INFER}", content=npy_bytes(ONE), headers=NPY, timeout=10)

    async def burst() -> list[httpx.Response]:
        return await asyncio.gather(*(asyncio.to_thread(post, n) for n in range(12)))

    responses = asyncio.run(burst())
    statuses = Counter(response.status_code for response in responses)
    # At most 4 are admitted (and time out: the window outlasts the timeout); the rest are turned away.
    assert set(statuses) <= {503, 504} and statuses[503] >= 1, statuses
    refused = next(response for response in responses if response.status_code == 503)
    assert refused.headers["retry-after"] == "1"
    assert "the queue holds 4" in refused.json()["detail"]
    assert httpx.get(f"{strict_server}/ready", timeout=5).status_code == 200


# --------------------------------------------------------------------------- graceful shutdown


def test_sigterm_finishes_requests_in_flight_and_refuses_new_ones(folder: Path, runner) -> None:
    with served(folder, "--max-wait-ms", "1500") as (url, process):
        batch = items(seed=5, count=2)
        answer: dict[str, httpx.Response] = {}
        sender = threading.Thread(
            target=lambda: answer.update(
                r=httpx.post(f"{url}{INFER}", content=npy_bytes(batch), headers=NPY, timeout=20)
            )
        )
        sender.start()
        deadline = time.monotonic() + 10
        while metric(url, "serve_queue_depth") < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert metric(url, "serve_queue_depth") == 1, "the request never reached the queue"
        process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=5)
        sender.join(timeout=20)
        assert not sender.is_alive()
        assert compare(runner.infer({"input": batch})["logits"], logits_of(answer["r"]), rtol=RTOL).ok
        # uvicorn re-raises the signal once it has shut down gracefully, so the exit reads as SIGTERM.
        assert process.wait(timeout=20) in (0, -signal.SIGTERM)


# --------------------------------------------------------------------------- fuzzing from the OpenAPI schema

FUZZ_EXAMPLES = 40  # per operation; the run takes seconds


def test_fuzzing_from_the_openapi_schema_finds_no_5xx(folder: Path, tmp_path: Path) -> None:
    """schemathesis, every check (no 5xx, statuses/content types/bodies as documented, schema-violating
    requests rejected, valid ones accepted), from the schema the server publishes."""
    # At most 2 items per request keeps each generated body small (768 numbers an item).
    with served(folder, "--max-batch", "2") as (url, _):
        command = [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json", "--checks", "all"]
        options = ["--max-examples", str(FUZZ_EXAMPLES), "--seed", "1", "--generation-database", "none", "-w", "1"]
        reports = ["--request-timeout", "30", "--report", "json,ndjson", "--report-dir", str(tmp_path), "--no-color"]
        run = subprocess.run([*command, *options, *reports], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-4000:]
    report = json.loads(next(tmp_path.glob("json-*.json")).read_text())
    assert report["failures"] == [] and report["errors"] == []
    assert report["operations"]["tested"] == 5 and report["test_cases"]["generated"] >= 50
    statuses = Counter(
        event["status_code"]
        for line in next(tmp_path.glob("ndjson-*.ndjson")).read_text().splitlines()
        for event in _responses(json.loads(line))
    )
    print(f"\nfuzz: {report['test_cases']['generated']} cases, responses by status {dict(sorted(statuses.items()))}")
    assert statuses[200] > 0 and not [status for status in statuses if status >= 500]


def _responses(event: object) -> Iterator[dict]:
    """Every recorded response in one NDJSON event, wherever it is nested."""
    if isinstance(event, dict):
        if "status_code" in event:
            yield event
        for value in event.values():
            yield from _responses(value)
    elif isinstance(event, list):
        for value in event:
            yield from _responses(value)
