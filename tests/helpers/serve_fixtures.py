"""What the service tests share, for real: `python -m trt_pipeline serve` in its own process on
127.0.0.1, the ONNX Runtime runner serving tiny_cnn (one FP32 image input) and text_classifier (INT64 ids +
FP32 mask, a dynamic "seq", two outputs) built by make_engine, and Triton's own clients, tritonclient.http and
tritonclient.grpc, unchanged.  Raw HTTP (httpx) only where a test sends what tritonclient never would.  Every
wait has a timeout, every load loop a bound, and every server process is terminated, whatever the test does."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from trt_pipeline.pipeline.core.settings import BatchProfile, Settings
from trt_pipeline.pipeline.runners import load_runner
from trt_pipeline.pipeline.stages.sequence import make_engine

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"  # loopback only, always
IMAGE_MODEL = "toy_models-tiny_cnn-fp32"
TEXT_MODEL = "toy_models-text_classifier-fp32"
MAX_BATCH = 32
TEXT_MAX_BATCH = 16
ITEM_SHAPE = (3, 16, 16)
# Batched and lone runs of a conv may sum in a different order; distinct inputs differ by ~1e-1.
RTOL = 1e-5
PROTOCOLS = ("http", "grpc")
# How a request travels: protocol, and for REST whether the tensors are JSON or Triton's binary data.
FORMS = {"http-json": ("http", False), "http-binary": ("http", True), "grpc": ("grpc", True)}


@pytest.fixture(scope="package")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="package")
def folder(engines: Path) -> Path:
    batch = BatchProfile(1, 8, MAX_BATCH)
    return make_engine(
        Settings(model="tests.helpers.toy_models:tiny_cnn", precision="fp32", batch=batch, out_root=engines)
    )


@pytest.fixture(scope="package")
def text_folder(engines: Path) -> Path:
    batch = BatchProfile(1, 4, TEXT_MAX_BATCH)
    settings = Settings(
        model="tests.helpers.toy_models:text_classifier", precision="fp32", batch=batch, out_root=engines
    )
    return make_engine(settings)


@pytest.fixture(scope="package")
def runner(folder: Path):
    with load_runner(folder, backend="onnxruntime") as loaded:
        yield loaded


@pytest.fixture(scope="package")
def text_runner(text_folder: Path):
    with load_runner(text_folder, backend="onnxruntime") as loaded:
        yield loaded


# --------------------------------------------------------------------------- servers and clients


@dataclass
class Server:
    http: str  # host:port, as tritonclient takes it
    grpc: str
    process: subprocess.Popen

    @property
    def url(self) -> str:
        return f"http://{self.http}"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def served(folder: Path, *options: str) -> Iterator[Server]:
    """A `python -m trt_pipeline serve` process on free loopback ports (REST and gRPC), ready; always terminated."""
    port, grpc_port = free_port(), free_port()
    command = [sys.executable, "-m", "trt_pipeline", "serve", str(folder), "--host", HOST, "--port", str(port)]
    command += ["--grpc-port", str(grpc_port), "--log-level", "warning", *options]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    server = Server(f"{HOST}:{port}", f"{HOST}:{grpc_port}", process)
    try:
        wait_ready(server)
        yield server
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


def wait_ready(server: Server, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            output = server.process.stdout.read().decode() if server.process.stdout else ""
            pytest.fail(f"the server exited with {server.process.returncode} before it was ready:\n{output}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{server.url}/v2/health/ready", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    pytest.fail(f"{server.url} was not ready within {timeout_s} s")


@pytest.fixture(scope="package")
def server(folder: Path) -> Iterator[Server]:
    with served(folder) as running:
        yield running


@pytest.fixture(scope="package")
def text_server(text_folder: Path) -> Iterator[Server]:
    """The text model with batching off: every request is its own runner call."""
    with served(text_folder, "--no-batching") as running:
        yield running


def client(server: Server, protocol: str):
    """tritonclient's own client for the protocol; use it in a `with` block (it closes its connections)."""
    if protocol == "http":
        return httpclient.InferenceServerClient(server.http)
    return grpcclient.InferenceServerClient(server.grpc)


def infer_input(protocol: str, name: str, array: np.ndarray, binary: bool = True, datatype: str | None = None):
    module = httpclient if protocol == "http" else grpcclient
    given = module.InferInput(name, list(array.shape), datatype or np_to_triton_dtype(array.dtype))
    if protocol == "http":
        given.set_data_from_numpy(array, binary_data=binary)
    else:
        given.set_data_from_numpy(array)  # gRPC always sends raw_input_contents
    return given


def requested_output(protocol: str, name: str, binary: bool = True):
    if protocol == "http":
        return httpclient.InferRequestedOutput(name, binary_data=binary)
    return grpcclient.InferRequestedOutput(name)


@contextlib.contextmanager
def clients(server: Server) -> Iterator[dict]:
    """One tritonclient client per protocol, as one user of the service holds them."""
    with client(server, "http") as http, client(server, "grpc") as grpc:
        yield {"http": http, "grpc": grpc}


def infer_logits(triton: dict, form: str, batch: np.ndarray) -> np.ndarray:
    protocol, binary = FORMS[form]
    outputs = [requested_output(protocol, "logits", binary)]
    result = triton[protocol].infer(IMAGE_MODEL, [infer_input(protocol, "input", batch, binary)], outputs=outputs)
    return result.as_numpy("logits")


def items(seed: int, count: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, *ITEM_SHAPE), dtype=np.float32)


def tokens(seed: int, count: int, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, attention_mask) of `count` items of `seq` tokens, the last ones padding."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 100, (count, seq), dtype=np.int64)
    mask = (np.arange(seq) < rng.integers(1, seq + 1, (count, 1))).astype(np.float32)
    return ids, mask


def metric(server: Server, family: str, **labels: str) -> float:
    """One sample's value from /metrics, e.g. metric(server, "serve_requests_total", protocol="http", ...)."""
    wanted = {f'{key}="{value}"' for key, value in labels.items()}
    for line in httpx.get(f"{server.url}/metrics", timeout=5).text.splitlines():
        name, _, rest = line.partition("{")
        if name == family and wanted <= set(rest.partition("}")[0].split(",")):
            return float(line.split()[-1])
    return 0.0


def refusal(call: Callable[[], object]) -> InferenceServerException:
    """The InferenceServerException a tritonclient call raises (and fails the test if it does not)."""
    with pytest.raises(InferenceServerException) as raised:
        call()
    return raised.value


ONE = items(seed=1, count=1)


def image_input_json(**fields: object) -> dict:
    return {"name": "input", "datatype": "FP32", "shape": [1, *ITEM_SHAPE], **fields}


ONE_DATA = ONE.ravel().tolist()
