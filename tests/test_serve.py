"""The service, for real: `python -m trt_pipeline serve` in its own process on 127.0.0.1, the ONNX Runtime runner
serving tiny_cnn (one FP32 image input) and text_classifier (INT64 ids + FP32 mask, a dynamic "seq", two
outputs) built by make_engine, and Triton's own clients, tritonclient.http and tritonclient.grpc, unchanged.
Raw HTTP (httpx) only where a test sends what tritonclient never would.  Every wait has a timeout, every
load loop a bound, and every server process is terminated, whatever the test does."""

from __future__ import annotations

import contextlib
import gzip
import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from trt_pipeline.pipeline.cli import main as cli_main
from trt_pipeline.pipeline.core.compare import compare
from trt_pipeline.pipeline.core.settings import BatchProfile, Settings
from trt_pipeline.pipeline.folder.reader import open_folder
from trt_pipeline.pipeline.runners import load_runner
from trt_pipeline.pipeline.stages.sequence import make_engine
from trt_pipeline.pipeline.triton.repository import model_name, write_repository

ROOT = Path(__file__).resolve().parents[1]
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


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="module")
def folder(engines: Path) -> Path:
    batch = BatchProfile(1, 8, MAX_BATCH)
    return make_engine(Settings(model="tests.toy_models:tiny_cnn", precision="fp32", batch=batch, out_root=engines))


@pytest.fixture(scope="module")
def text_folder(engines: Path) -> Path:
    batch = BatchProfile(1, 4, TEXT_MAX_BATCH)
    settings = Settings(model="tests.toy_models:text_classifier", precision="fp32", batch=batch, out_root=engines)
    return make_engine(settings)


@pytest.fixture(scope="module")
def runner(folder: Path):
    with load_runner(folder, backend="onnxruntime") as loaded:
        yield loaded


@pytest.fixture(scope="module")
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


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[Server]:
    with served(folder) as running:
        yield running


@pytest.fixture(scope="module")
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


# --------------------------------------------------------------------------- health, metadata, config


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_live_ready_and_metadata(server: Server, folder: Path, protocol: str) -> None:
    with client(server, protocol) as triton:
        assert triton.is_server_live() and triton.is_server_ready()
        assert triton.is_model_ready(IMAGE_MODEL) and triton.is_model_ready(IMAGE_MODEL, "1")
        served = triton.get_server_metadata()
        model = triton.get_model_metadata(IMAGE_MODEL)
        if protocol == "grpc":
            served, model = (json_format.MessageToDict(m, preserving_proto_field_name=True) for m in (served, model))
    assert served["name"] == "trt-pipeline" and "binary_tensor_data" in served["extensions"]
    # One name everywhere: the Triton repository writer names the model the same way.
    assert model["name"] == IMAGE_MODEL == model_name(open_folder(folder).manifest)
    assert model["versions"] == ["1"] and model["platform"] == "onnxruntime_onnx"
    shapes = [int(d) for d in model["inputs"][0]["shape"]]
    assert (model["inputs"][0]["name"], model["inputs"][0]["datatype"], shapes) == ("input", "FP32", [-1, 3, 16, 16])
    assert [(o["name"], o["datatype"]) for o in model["outputs"]] == [("logits", "FP32")]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_config_is_the_triton_writers_with_the_services_limits(
    server: Server, folder: Path, protocol: str, tmp_path: Path
) -> None:
    with client(server, protocol) as triton:
        answered = triton.get_model_config(IMAGE_MODEL)
    # REST answers the config as JSON, gRPC as the ModelConfig message itself.
    as_message = json_format.ParseDict(answered, model_config_pb2.ModelConfig()) if protocol == "http" else None
    config = as_message or answered.config
    model_dir, _ = write_repository(folder, tmp_path, instance_kind="cpu")
    written = text_format.Parse((model_dir / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert config == written  # same name, platform, max batch, tensors, batch window, one CPU instance


def test_metrics_are_prometheus_text_labelled_by_model(server: Server) -> None:
    response = httpx.get(f"{server.url}/metrics", timeout=5)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    for family in ("serve_requests_total", "serve_request_seconds_bucket", "serve_batch_items_bucket"):
        assert family in response.text
    assert f'serve_queue_depth{{model="{IMAGE_MODEL}"}}' in response.text


def test_help_shows_client_code_for_both_protocols(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli_main(["serve", "--help"])
    shown = capsys.readouterr().out
    assert "tritonclient.http" in shown and "tritonclient.grpc" in shown and "--grpc-port" in shown


# --------------------------------------------------------------------------- inference


@pytest.mark.parametrize("form", list(FORMS))
def test_image_model_full_batch_in_each_form(server: Server, runner, form: str) -> None:
    batch = items(seed=7, count=MAX_BATCH)
    expected = runner.infer({"input": batch})["logits"]
    with clients(server) as triton:
        assert compare(expected, infer_logits(triton, form, batch), rtol=RTOL).ok


def test_json_in_binary_out_and_all_outputs_by_default(server: Server, runner) -> None:
    batch = items(seed=8, count=3)
    expected = runner.infer({"input": batch})["logits"]
    with client(server, "http") as triton:
        given = infer_input("http", "input", batch, binary=False)
        binary_out = triton.infer(IMAGE_MODEL, [given], outputs=[requested_output("http", "logits", binary=True)])
        every_output = triton.infer(IMAGE_MODEL, [given], model_version="1", request_id="r-7")
    assert binary_out.get_response()["outputs"][0]["parameters"]["binary_data_size"] == expected.nbytes
    assert every_output.get_response()["id"] == "r-7"
    for result in (binary_out, every_output):
        assert compare(expected, result.as_numpy("logits"), rtol=RTOL).ok


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_compressed_request_bodies(server: Server, runner, encoding: str) -> None:
    batch = items(seed=9, count=2)
    with client(server, "http") as triton:
        given = infer_input("http", "input", batch)
        result = triton.infer(IMAGE_MODEL, [given], request_compression_algorithm=encoding)
    assert compare(runner.infer({"input": batch})["logits"], result.as_numpy("logits"), rtol=RTOL).ok


@pytest.mark.parametrize("form", list(FORMS))
def test_text_model_int64_ids_two_inputs_two_outputs(text_server: Server, text_runner, form: str) -> None:
    protocol, binary = FORMS[form]
    ids, mask = tokens(seed=3, count=5, seq=11)
    expected = text_runner.infer({"input_ids": ids, "attention_mask": mask})
    given = [infer_input(protocol, "attention_mask", mask, binary), infer_input(protocol, "input_ids", ids, binary)]
    with client(text_server, protocol) as triton:
        both = triton.infer(TEXT_MODEL, given)
        only_logits = triton.infer(TEXT_MODEL, given, outputs=[requested_output(protocol, "logits", binary)])
    assert both.as_numpy("tokens").shape == (5, 11, 8)
    for name in ("logits", "tokens"):
        assert compare(expected[name], both.as_numpy(name), rtol=RTOL).ok
    assert only_logits.as_numpy("tokens") is None
    assert compare(expected["logits"], only_logits.as_numpy("logits"), rtol=RTOL).ok


def test_typed_grpc_contents_as_other_clients_send_them(text_server: Server, text_runner) -> None:
    """tritonclient always sends raw_input_contents; other clients send typed contents (int64_contents, ...)."""
    ids, mask = tokens(seed=4, count=2, seq=7)
    tensor = service_pb2.ModelInferRequest.InferInputTensor
    request = service_pb2.ModelInferRequest(
        model_name=TEXT_MODEL,
        inputs=[
            tensor(name="input_ids", datatype="INT64", shape=[2, 7], contents={"int64_contents": ids.ravel().tolist()}),
            tensor(
                name="attention_mask", datatype="FP32", shape=[2, 7], contents={"fp32_contents": mask.ravel().tolist()}
            ),
        ],
        outputs=[service_pb2.ModelInferRequest.InferRequestedOutputTensor(name="logits")],
    )
    with grpc.insecure_channel(text_server.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        response = stub.ModelInfer(request, timeout=10)
        del request.inputs[1].contents.fp32_contents[-1]
        with pytest.raises(grpc.RpcError) as short:
            stub.ModelInfer(request, timeout=10)
    [logits] = response.outputs
    answered = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(list(logits.shape))
    assert compare(text_runner.infer({"input_ids": ids, "attention_mask": mask})["logits"], answered, rtol=RTOL).ok
    assert short.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "shape [2, 7] holds 14 values; 13 were sent" in short.value.details()


def test_the_config_says_when_batching_is_off(text_server: Server) -> None:
    with client(text_server, "grpc") as triton:
        config = triton.get_model_config(TEXT_MODEL).config
    assert config.max_batch_size == TEXT_MAX_BATCH and not config.HasField("dynamic_batching")


def test_the_requests_binary_data_output_is_the_default_for_named_outputs(server: Server, runner) -> None:
    header = json.dumps(
        {
            "inputs": [_image_input(data=_DATA)],
            "outputs": [{"name": "logits"}],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    response = httpx.post(f"{server.url}/v2/models/{IMAGE_MODEL}/infer", content=header, timeout=10)
    length = int(response.headers["inference-header-content-length"])
    assert response.headers["content-type"] == "application/octet-stream"
    [output] = json.loads(response.content[:length])["outputs"]
    answered = np.frombuffer(response.content[length:], np.float32).reshape(output["shape"])
    assert compare(runner.infer({"input": ONE})["logits"], answered, rtol=RTOL).ok


# --------------------------------------------------------------------------- mistakes, through tritonclient


@dataclass(frozen=True)
class Mistake:
    model: str
    inputs: Callable[[str], list]  # protocol -> tritonclient inputs
    status: str  # the HTTP status; gRPC answers the matching code
    message: str
    version: str = ""
    outputs: tuple[str, ...] = ()


ONE = items(seed=1, count=1)
IDS, MASK = tokens(seed=2, count=2, seq=6)
GRPC_CODES = {"400": "StatusCode.INVALID_ARGUMENT", "404": "StatusCode.NOT_FOUND"}
MISTAKES = {
    "unknown model": Mistake(
        "resnet50", lambda p: [infer_input(p, "input", ONE)], "404", f"this server serves '{IMAGE_MODEL}'"
    ),
    "unknown version": Mistake(
        IMAGE_MODEL, lambda p: [infer_input(p, "input", ONE)], "404", "this server serves version 1", version="2"
    ),
    "wrong shape": Mistake(
        IMAGE_MODEL, lambda p: [infer_input(p, "input", ONE[..., :8])], "400", "expected (-1, 3, 16, 16)"
    ),
    "wrong datatype": Mistake(
        IMAGE_MODEL,
        lambda p: [infer_input(p, "input", ONE.astype(np.float64))],
        "400",
        "input 'input' is declared FP64; the model takes FP32",
    ),
    "wrong input name": Mistake(
        IMAGE_MODEL, lambda p: [infer_input(p, "image", ONE)], "400", "missing ['input']; unexpected ['image']"
    ),
    "too many items": Mistake(
        IMAGE_MODEL,
        lambda p: [infer_input(p, "input", items(seed=2, count=MAX_BATCH + 1))],
        "400",
        f"send at most {MAX_BATCH} per request",
    ),
    "unknown output": Mistake(
        IMAGE_MODEL, lambda p: [infer_input(p, "input", ONE)], "400", "unknown outputs ['probs']", outputs=("probs",)
    ),
    "missing input": Mistake(
        TEXT_MODEL, lambda p: [infer_input(p, "input_ids", IDS)], "400", "missing ['attention_mask']"
    ),
    "sequence beyond its range": Mistake(
        TEXT_MODEL,
        lambda p: [infer_input(p, "input_ids", np.zeros((1, 65), np.int64)), infer_input(p, "attention_mask", MASK)],
        "400",
        "size 65 on axis 1, outside the range [1, 64]",
    ),
    "inputs disagree on seq": Mistake(
        TEXT_MODEL,
        lambda p: [infer_input(p, "input_ids", IDS), infer_input(p, "attention_mask", MASK[:, :5])],
        "400",
        "disagree on the size of dynamic dim 'seq'",
    ),
    "ids below 0": Mistake(
        TEXT_MODEL,
        lambda p: [
            infer_input(p, "input_ids", np.concatenate([[[-5]], IDS[:1, 1:]], axis=1)),
            infer_input(p, "attention_mask", MASK[:1]),
        ],
        "400",
        "input 'input_ids' has ids outside [0, 99] (min -5",
    ),
    "ids past the vocabulary": Mistake(
        TEXT_MODEL,
        lambda p: [infer_input(p, "input_ids", IDS + 100), infer_input(p, "attention_mask", MASK)],
        "400",
        "an embedding of 100 rows",
    ),
    "int64 ids sent as int32": Mistake(
        TEXT_MODEL,
        lambda p: [infer_input(p, "input_ids", IDS.astype(np.int32)), infer_input(p, "attention_mask", MASK)],
        "400",
        "input 'input_ids' is declared INT32; the model takes INT64",
    ),
}


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("case", list(MISTAKES))
def test_mistakes_are_refused_naming_what_was_expected(
    server: Server, text_server: Server, protocol: str, case: str
) -> None:
    mistake = MISTAKES[case]
    target = text_server if mistake.model == TEXT_MODEL else server
    outputs = [requested_output(protocol, name) for name in mistake.outputs] or None
    with client(target, protocol) as triton:
        error = refusal(
            lambda: triton.infer(
                mistake.model, mistake.inputs(protocol), model_version=mistake.version, outputs=outputs
            )
        )
        # ...and the server keeps serving.
        assert triton.is_server_ready()
    assert str(error.status()) == (mistake.status if protocol == "http" else GRPC_CODES[mistake.status])
    assert mistake.message in error.message()


@pytest.mark.parametrize("form", list(FORMS))
def test_nan_and_inf_pass_through_in_every_form(server: Server, runner, form: str) -> None:
    # One policy for every path (README, "Serving"): NaN and infinities are the model's to read, as in runner.infer.
    batch = items(seed=7, count=2)
    batch[0, 0, 0, :3] = [np.nan, np.inf, -np.inf]
    with clients(server) as triton:
        answered = infer_logits(triton, form, batch)
    np.testing.assert_allclose(answered, runner.infer({"input": batch})["logits"], rtol=RTOL, equal_nan=True)
    assert np.isnan(answered[0]).all() and np.isfinite(answered[1]).all()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_unknown_model_metadata_and_readiness(server: Server, protocol: str) -> None:
    with client(server, protocol) as triton:
        error = refusal(lambda: triton.get_model_metadata("resnet50"))
        assert f"this server serves '{IMAGE_MODEL}'" in error.message()
        refusal(lambda: triton.get_model_config(IMAGE_MODEL, model_version="3"))
        # REST: a 404 (tritonclient reads any status but 200 as false); gRPC: ready=false, as Triton answers.
        assert not triton.is_model_ready("resnet50")


# --------------------------------------------------------------------------- mistakes tritonclient never sends


def _binary_request(header: dict, raw: bytes) -> tuple[bytes, dict]:
    text = json.dumps(header).encode()
    return text + raw, {"Inference-Header-Content-Length": str(len(text))}


def _image_input(**fields: object) -> dict:
    return {"name": "input", "datatype": "FP32", "shape": [1, *ITEM_SHAPE], **fields}


_DATA = ONE.ravel().tolist()
_RAW = ONE.tobytes()
BAD_BODIES: dict[str, tuple[bytes, dict, int, str]] = {
    "malformed JSON": (b'{"inputs": [', {}, 400, "not valid JSON"),
    "no inputs": (json.dumps({"outputs": []}).encode(), {}, 400, '"inputs" must be a non-empty list'),
    "unknown field": (
        json.dumps({"inputs": [_image_input(data=_DATA)], "input": 1}).encode(),
        {},
        400,
        "unknown fields ['input']",
    ),
    "data count differs from shape": (
        json.dumps({"inputs": [_image_input(data=_DATA[:-1])]}).encode(),
        {},
        400,
        "shape [1, 3, 16, 16] holds 768 values; 767 were sent",
    ),
    "nested data of the wrong nesting": (
        json.dumps({"inputs": [_image_input(data=[[1.0], [1.0, 2.0]])]}).encode(),
        {},
        400,
        "the data must be numbers",
    ),
    "strings for numbers": (
        json.dumps({"inputs": [_image_input(data=["a"] * 768)]}).encode(),
        {},
        400,
        "the data must be numbers",
    ),
    "beyond float32": (
        json.dumps({"inputs": [_image_input(data=[1e39] + _DATA[1:])]}).encode(),
        {},
        400,
        "beyond FP32's range",
    ),
    "shape of 2**40 items": (
        json.dumps({"inputs": [_image_input(shape=[2**40, *ITEM_SHAPE], data=[])]}).encode(),
        {},
        400,
        f"send at most {MAX_BATCH} per request",
    ),
    "binary size differs from shape": (
        *_binary_request({"inputs": [_image_input(parameters={"binary_data_size": len(_RAW) - 4})]}, _RAW[:-4]),
        400,
        "is 3072 bytes; 3068 were sent",
    ),
    "binary bytes nobody claims": (
        *_binary_request({"inputs": [_image_input(parameters={"binary_data_size": len(_RAW)})]}, _RAW + b"1234"),
        400,
        "4 bytes after the JSON header belong to no input",
    ),
    "binary claim beyond the body": (
        *_binary_request({"inputs": [_image_input(parameters={"binary_data_size": 2 * len(_RAW)})]}, _RAW),
        400,
        "claims 6144 bytes of binary data; 3072 are left",
    ),
    "header length beyond the body": (
        json.dumps({"inputs": []}).encode(),
        {"Inference-Header-Content-Length": "99999"},
        400,
        "must be the byte length of the JSON header",
    ),
    "shared memory": (
        json.dumps({"inputs": [_image_input(parameters={"shared_memory_region": "r"})]}).encode(),
        {},
        400,
        "shared memory is not supported",
    ),
    "unknown content encoding": (b"x", {"Content-Encoding": "br"}, 415, "send gzip, deflate or none"),
    "gzip bomb": (gzip.compress(bytes(100 * 2**20)), {"Content-Encoding": "gzip"}, 413, "inflates to more"),
}


@pytest.mark.parametrize("case", list(BAD_BODIES), ids=list(BAD_BODIES))
def test_malformed_bodies_get_the_protocols_error(server: Server, case: str) -> None:
    body, headers, status, message = BAD_BODIES[case]
    response = httpx.post(f"{server.url}/v2/models/{IMAGE_MODEL}/infer", content=body, headers=headers, timeout=10)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]


def test_unknown_paths_and_methods_answer_with_the_protocols_error(server: Server) -> None:
    missing = httpx.get(f"{server.url}/v1/models/{IMAGE_MODEL}", timeout=5)
    wrong_method = httpx.get(f"{server.url}/v2/models/{IMAGE_MODEL}/infer", timeout=5)
    assert (missing.status_code, wrong_method.status_code) == (404, 405)
    assert missing.json() == {"error": "Not Found"} and "error" in wrong_method.json()


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
    body = json.dumps({"inputs": [_image_input(data=_DATA)]}).encode()
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


# --------------------------------------------------------------------------- fuzzing from the OpenAPI schema

FUZZ_EXAMPLES = 40  # per operation; the run takes seconds


def test_fuzzing_from_the_openapi_schema_finds_no_5xx(folder: Path, tmp_path: Path) -> None:
    """schemathesis, every check (no 5xx, statuses/content types/bodies as documented, schema-violating
    requests rejected, valid ones accepted), from the schema the server publishes."""
    # At most 2 items per request keeps each generated body small (768 numbers an item).
    with served(folder, "--max-batch", "2") as server:
        command = [sys.executable, "-m", "schemathesis.cli", "run", f"{server.url}/openapi.json", "--checks", "all"]
        options = ["--max-examples", str(FUZZ_EXAMPLES), "--seed", "1", "--generation-database", "none", "-w", "1"]
        reports = ["--request-timeout", "30", "--report", "json,ndjson", "--report-dir", str(tmp_path), "--no-color"]
        run = subprocess.run([*command, *options, *reports], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-4000:]
    report = json.loads(next(tmp_path.glob("json-*.json")).read_text())
    assert report["failures"] == [] and report["errors"] == []
    assert report["operations"]["tested"] == 8 and report["test_cases"]["generated"] >= 80
    statuses = Counter(
        (operation, event["status_code"])
        for line in next(tmp_path.glob("ndjson-*.ndjson")).read_text().splitlines()
        for operation, event in _responses(json.loads(line))
    )
    print(f"\nfuzz: {report['test_cases']['generated']} cases, responses by operation and status {dict(statuses)}")
    infer = f"POST /v2/models/{IMAGE_MODEL}/infer"
    assert statuses[(infer, 200)] > 0 and statuses[(infer, 400)] > 0
    assert not [status for _, status in statuses if status >= 500]


def _responses(event: object, operation: str = "") -> Iterator[tuple[str, dict]]:
    """(operation, response) for every recorded response in one NDJSON event, wherever it is nested."""
    if isinstance(event, dict):
        operation = event["label"] if isinstance(event.get("label"), str) else operation
        if "status_code" in event:
            yield operation, event
        for value in event.values():
            yield from _responses(value, operation)
    elif isinstance(event, list):
        for value in event:
            yield from _responses(value, operation)


def test_nested_outputs_are_served_by_their_paths(engines: Path) -> None:
    """{"logits": a, "aux": (b, c)}: the service offers logits, aux.0 and aux.1, over both protocols, one by one or
    all, equal to the ONNX Runtime runner's."""
    settings = Settings(model="tests.toy_models:nested_outputs", precision="fp32", out_root=engines)
    nested = make_engine(settings)
    batch = np.random.default_rng(4).standard_normal((3, 6), dtype=np.float32)
    with load_runner(nested, "onnxruntime") as local:
        expected = local.infer({"x": batch})
    with served(nested) as server, clients(server) as triton:
        for protocol in PROTOCOLS:
            name = model_name(open_folder(nested).manifest)
            every = triton[protocol].infer(name, [infer_input(protocol, "x", batch)])
            only = triton[protocol].infer(
                name, [infer_input(protocol, "x", batch)], outputs=[requested_output(protocol, "aux.1")]
            )
            for output in ("logits", "aux.0", "aux.1"):
                assert compare(expected[output], every.as_numpy(output), rtol=RTOL).ok
            assert only.as_numpy("logits") is None and only.as_numpy("aux.1").shape == (3, 1)
