"""A real Triton Inference Server (the nvidia-pytriton wheel's tritonserver, pipeline/triton/server.py), used twice:

1. the scale-out repository form end to end: `python -m trt_pipeline triton --backend python` writes a repository
   whose model runs our runner inside Triton's Python backend, and tritonclient gets the runner's outputs from it;
2. the reference for the protocol: the same requests go to Triton (serving that repository) and to our service
   (serving the same artifact folder), and the answers are compared status by status, field by field.  Where
   they differ, the difference is listed in ALLOWED with the reason; anything else is our bug.

One tritonserver and one `python -m trt_pipeline serve` per module.  Skipped, with the reason, where the wheel is
not installed or its binary cannot load on this machine (it needs glibc 2.35+ and a shared libpython).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import json_format
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.helpers.serve_fixtures import (
    FORMS,
    IMAGE_MODEL,
    RTOL,
    TEXT_MODEL,
    Server,
    infer_input,
    items,
    requested_output,
    served,
    tokens,
)
from trt_pipeline.pipeline.cli import main as cli_main
from trt_pipeline.pipeline.triton.repository import ARTIFACTS
from trt_pipeline.pipeline.triton.server import TritonServer, running_triton, startup_problem

PROBLEM = startup_problem()
pytestmark = pytest.mark.skipif(PROBLEM is not None, reason=f"tritonserver cannot start here: {PROBLEM}")


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory, folder: Path, text_folder: Path) -> Path:  # noqa: F811
    """Both toy models in the python form, written by the command line as a user would."""
    repo = tmp_path_factory.mktemp("repository")
    for built in (folder, text_folder):
        assert cli_main(["triton", str(built), "--repo", str(repo), "--backend", "python"]) == 0
    return repo


@pytest.fixture(scope="module")
def triton(repository: Path) -> Iterator[TritonServer]:
    with running_triton(repository) as server:
        yield server


@pytest.fixture(scope="module")
def ours(folder: Path) -> Iterator[Server]:  # noqa: F811
    with served(folder) as server:
        yield server


def triton_client(address: TritonServer, protocol: str):
    return (
        httpclient.InferenceServerClient(address.http)
        if protocol == "http"
        else grpcclient.InferenceServerClient(address.grpc)
    )


# --------------------------------------------------------------------------- 1. the python form, end to end


def test_the_repository_holds_the_runners_files_and_model_py(repository: Path) -> None:
    version = repository / IMAGE_MODEL / "1"
    assert (version / "model.py").is_file()
    # What load_runner reads: auto times the servable graphs on the reference inputs; the simplified graph stays out.
    assert sorted(path.name for path in (version / ARTIFACTS).iterdir()) == [
        "engine.plan",
        "manifest.json",
        "model.onnx",
        "reference.npz",
    ]


@pytest.mark.parametrize("form", list(FORMS))
def test_triton_serves_the_runners_outputs(triton: TritonServer, runner, form: str) -> None:  # noqa: F811
    protocol, binary = FORMS[form]
    batch = items(seed=3, count=5)
    with triton_client(triton, protocol) as client:
        result = client.infer(
            IMAGE_MODEL,
            [infer_input(protocol, "input", batch, binary)],
            outputs=[requested_output(protocol, "logits", binary)],
        )
    np.testing.assert_allclose(result.as_numpy("logits"), runner.infer({"input": batch})["logits"], rtol=RTOL)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_two_inputs_int64_ids_and_a_requested_output(triton: TritonServer, text_runner, protocol: str) -> None:  # noqa: F811
    ids, mask = tokens(seed=4, count=3, seq=7)
    expected = text_runner.infer({"input_ids": ids, "attention_mask": mask})
    with triton_client(triton, protocol) as client:
        inputs = [infer_input(protocol, "input_ids", ids), infer_input(protocol, "attention_mask", mask)]
        both = client.infer(TEXT_MODEL, inputs)
        only_tokens = client.infer(TEXT_MODEL, inputs, outputs=[requested_output(protocol, "tokens")])
    for name in ("logits", "tokens"):
        np.testing.assert_allclose(both.as_numpy(name), expected[name], rtol=RTOL, atol=1e-6)
    assert only_tokens.as_numpy("logits") is None
    np.testing.assert_allclose(only_tokens.as_numpy("tokens"), expected["tokens"], rtol=RTOL, atol=1e-6)


def test_concurrent_requests_batched_by_triton_each_get_their_own_rows(triton: TritonServer, runner) -> None:  # noqa: F811
    """Triton's dynamic batcher hands model.py several requests at once; it runs them as one batch and splits."""
    batches = [items(seed=100 + number, count=1 + number % 3) for number in range(24)]

    def ask(batch: np.ndarray) -> np.ndarray:
        with httpclient.InferenceServerClient(triton.http) as client:
            return client.infer(IMAGE_MODEL, [infer_input("http", "input", batch)]).as_numpy("logits")

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, batches))
    for batch, answer in zip(batches, answers, strict=True):
        np.testing.assert_allclose(answer, runner.infer({"input": batch})["logits"], rtol=RTOL)


def test_requests_of_different_lengths_at_once_are_run_apart(triton: TritonServer, text_runner) -> None:  # noqa: F811
    cases = [tokens(seed=200 + number, count=2, seq=3 + number % 4) for number in range(12)]

    def ask(case: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        ids, mask = case
        with grpcclient.InferenceServerClient(triton.grpc) as client:
            inputs = [infer_input("grpc", "input_ids", ids), infer_input("grpc", "attention_mask", mask)]
            return client.infer(TEXT_MODEL, inputs).as_numpy("tokens")

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(ask, cases))
    for (ids, mask), answer in zip(cases, answers, strict=True):
        expected = text_runner.infer({"input_ids": ids, "attention_mask": mask})["tokens"]
        np.testing.assert_allclose(answer, expected, rtol=RTOL, atol=1e-6)


def test_the_runner_says_what_it_runs_in_tritons_log(triton: TritonServer) -> None:
    log = triton.log()
    assert f"{IMAGE_MODEL}: onnxruntime" in log and "picked because auto: no NVIDIA GPU" in log, log[-2000:]


# --------------------------------------------------------------------------- 2. Triton as the protocol's reference


ONE = np.ones((1, 3, 16, 16), np.float32)
_DATA = ONE.ravel().tolist()
_RAW = ONE.tobytes()
_HEADER = json.dumps(
    {
        "id": "b7",
        "inputs": [
            {"name": "input", "shape": [1, 3, 16, 16], "datatype": "FP32", "parameters": {"binary_data_size": 3072}}
        ],
        "outputs": [{"name": "logits", "parameters": {"binary_data": True}}],
    }
).encode()


def _infer_json(**fields: object) -> bytes:
    document = {"inputs": [{"name": "input", "shape": [1, 3, 16, 16], "datatype": "FP32", "data": _DATA}], **fields}
    return json.dumps(document).encode()


def _one_input(**fields: object) -> bytes:
    return json.dumps({"inputs": [{"name": "input", "shape": [1, 3, 16, 16], "datatype": "FP32", **fields}]}).encode()


INFER = f"/v2/models/{IMAGE_MODEL}/infer"
# name: (method, path, body, headers)
REST_CASES: dict[str, tuple[str, str, bytes | None, dict]] = {
    "live": ("GET", "/v2/health/live", None, {}),
    "ready": ("GET", "/v2/health/ready", None, {}),
    "server metadata": ("GET", "/v2", None, {}),
    "model metadata": ("GET", f"/v2/models/{IMAGE_MODEL}", None, {}),
    "model metadata, version 1": ("GET", f"/v2/models/{IMAGE_MODEL}/versions/1", None, {}),
    "model ready": ("GET", f"/v2/models/{IMAGE_MODEL}/ready", None, {}),
    "model config": ("GET", f"/v2/models/{IMAGE_MODEL}/config", None, {}),
    "unknown model metadata": ("GET", "/v2/models/resnet50", None, {}),
    "unknown version metadata": ("GET", f"/v2/models/{IMAGE_MODEL}/versions/2", None, {}),
    "unknown model ready": ("GET", "/v2/models/resnet50/ready", None, {}),
    "JSON infer": ("POST", INFER, _infer_json(id="a1"), {}),
    "JSON infer, requested output": ("POST", INFER, _infer_json(outputs=[{"name": "logits"}]), {}),
    "binary infer": ("POST", INFER, _HEADER + _RAW, {"Inference-Header-Content-Length": str(len(_HEADER))}),
    "wrong model name": ("POST", "/v2/models/resnet50/infer", _infer_json(), {}),
    "wrong shape": ("POST", INFER, _one_input(shape=[1, 3, 16, 8], data=_DATA[:384]), {}),
    "wrong dtype": ("POST", INFER, _one_input(datatype="INT64", data=[0] * 768), {}),
    "missing input": ("POST", INFER, json.dumps({"inputs": []}).encode(), {}),
    "unknown input": (
        "POST",
        INFER,
        json.dumps({"inputs": [{**json.loads(_infer_json())["inputs"][0], "name": "x"}]}).encode(),
        {},
    ),
    "unknown output": ("POST", INFER, _infer_json(outputs=[{"name": "probabilities"}]), {}),
    "malformed JSON": ("POST", INFER, b'{"inputs": [', {}),
}
# Where we answer otherwise than Triton, and why that is right (or harmless).  Anything not here must match.
ALLOWED = {
    # The protocol: "a 4xx status code indicating false"; 404 says which: this model is not served here.
    "unknown model ready": "status: ours 404, Triton 400",
    # A body that is not JSON is the client's mistake (the protocol's 400); Triton reports its parser's failure as
    # an internal error.  tritonclient never sends one.
    "malformed JSON": "status: ours 400, Triton 500",
}
# Fields that name the server or its backend, not the protocol: present in both, values ours.
SERVER_FIELDS = {"name", "version", "extensions"}


def _rest(base: str, case: str) -> httpx.Response:
    method, path, body, headers = REST_CASES[case]
    return httpx.request(method, base + path, content=body, headers=headers, timeout=30)


def _binary_parts(response: httpx.Response) -> tuple[dict, bytes]:
    length = int(response.headers["inference-header-content-length"])
    return json.loads(response.content[:length]), response.content[length:]


@pytest.mark.parametrize("case", list(REST_CASES))
def test_rest_answers_as_triton_does(ours: Server, triton: TritonServer, case: str) -> None:
    mine, theirs = _rest(ours.url, case), _rest(f"http://{triton.http}", case)
    if case in ALLOWED:
        assert (mine.status_code, theirs.status_code) in {(404, 400), (400, 500)}, ALLOWED[case]
        assert 400 <= mine.status_code < 500 and "error" in mine.json()
        return
    assert mine.status_code == theirs.status_code, (mine.text, theirs.text)
    if mine.status_code >= 400:  # the protocol's error: {"error": "<message>"}; the messages are each server's own
        assert set(mine.json()) == set(theirs.json()) == {"error"}
        return
    if not theirs.content:  # health and readiness answer with the status alone
        assert not mine.content
        return
    if "inference-header-content-length" in theirs.headers:
        (mine_header, mine_raw), (their_header, their_raw) = _binary_parts(mine), _binary_parts(theirs)
        assert mine_header == their_header
        np.testing.assert_allclose(np.frombuffer(mine_raw, np.float32), np.frombuffer(their_raw, np.float32), rtol=RTOL)
        return
    mine_json, their_json = mine.json(), theirs.json()
    if case == "server metadata":
        assert set(mine_json) == set(their_json) == SERVER_FIELDS
        assert set(mine_json["extensions"]) <= set(their_json["extensions"])
    elif case == "model config":
        _same_config(mine_json, their_json)
    else:
        _same_document(mine_json, their_json)


def _same_document(mine: dict, theirs: dict) -> None:
    """Equal, except the platform (the backend serving the model: ours ONNX Runtime, Triton's python) and output
    data, which are compared as numbers (JSON numbers print differently; float32 values are the same)."""
    assert set(mine) == set(theirs)
    for key in mine:
        if key == "platform":
            assert (mine[key], theirs[key]) == ("onnxruntime_onnx", "python")
        elif key == "outputs" and "model_name" in mine:
            for my_output, their_output in zip(mine[key], theirs[key], strict=True):
                my_data, their_data = my_output.pop("data", None), their_output.pop("data", None)
                assert my_output == their_output
                np.testing.assert_allclose(np.float32(my_data), np.float32(their_data), rtol=RTOL)
        else:
            assert mine[key] == theirs[key], key


def _same_config(mine: dict, theirs: dict) -> None:
    """The model's I/O and batching as Triton reads its config.pbtxt: the same; the backend is each server's."""
    tensor_fields = ("name", "data_type", "dims")
    for key in ("input", "output"):
        pick = [{field: tensor[field] for field in tensor_fields} for tensor in mine[key]]
        assert pick == [{field: tensor[field] for field in tensor_fields} for tensor in theirs[key]]
    assert mine["name"] == theirs["name"] and mine["max_batch_size"] == theirs["max_batch_size"]
    assert "dynamic_batching" in mine and "dynamic_batching" in theirs
    assert (mine.get("backend"), theirs["backend"]) == ("onnxruntime", "python")


def _grpc_infer(**fields: object) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=fields.get("model", IMAGE_MODEL), id="g1")
    for name, datatype, shape, raw in fields.get("inputs", [("input", "FP32", [1, 3, 16, 16], _RAW)]):
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        request.raw_input_contents.append(raw)
    for name in fields.get("outputs", []):
        request.outputs.add(name=name)
    return request


GRPC_CASES = {
    "live": ("ServerLive", service_pb2.ServerLiveRequest()),
    "ready": ("ServerReady", service_pb2.ServerReadyRequest()),
    "server metadata": ("ServerMetadata", service_pb2.ServerMetadataRequest()),
    "model ready": ("ModelReady", service_pb2.ModelReadyRequest(name=IMAGE_MODEL)),
    "unknown model ready": ("ModelReady", service_pb2.ModelReadyRequest(name="resnet50")),
    "model metadata": ("ModelMetadata", service_pb2.ModelMetadataRequest(name=IMAGE_MODEL)),
    "unknown model metadata": ("ModelMetadata", service_pb2.ModelMetadataRequest(name="resnet50")),
    "unknown version metadata": ("ModelMetadata", service_pb2.ModelMetadataRequest(name=IMAGE_MODEL, version="2")),
    "model config": ("ModelConfig", service_pb2.ModelConfigRequest(name=IMAGE_MODEL)),
    "infer": ("ModelInfer", _grpc_infer()),
    "infer, requested output": ("ModelInfer", _grpc_infer(outputs=["logits"])),
    "wrong model name": ("ModelInfer", _grpc_infer(model="resnet50")),
    "wrong shape": ("ModelInfer", _grpc_infer(inputs=[("input", "FP32", [1, 3, 16, 8], _RAW[:1536])])),
    "wrong dtype": ("ModelInfer", _grpc_infer(inputs=[("input", "INT64", [1, 3, 16, 16], bytes(768 * 8))])),
    "missing input": ("ModelInfer", _grpc_infer(inputs=[])),
    "unknown input": ("ModelInfer", _grpc_infer(inputs=[("x", "FP32", [1, 3, 16, 16], _RAW)])),
    "raw bytes short of the shape": ("ModelInfer", _grpc_infer(inputs=[("input", "FP32", [1, 3, 16, 16], _RAW[:100])])),
    "unknown output": ("ModelInfer", _grpc_infer(outputs=["probabilities"])),
}


def _grpc(address: str, case: str) -> tuple[str, dict, list[bytes]]:
    """(status code name, the response as a dict without raw contents, the raw output contents)."""
    method, request = GRPC_CASES[case]
    with grpc.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            response = getattr(stub, method)(request, timeout=30)
        except grpc.RpcError as error:
            return error.code().name, {}, []
    raw = list(getattr(response, "raw_output_contents", []))
    document = json_format.MessageToDict(response, preserving_proto_field_name=True)
    document.pop("raw_output_contents", None)
    return "OK", document, raw


@pytest.mark.parametrize("case", list(GRPC_CASES))
def test_grpc_answers_as_triton_does(ours: Server, triton: TritonServer, case: str) -> None:
    (my_code, mine, my_raw), (their_code, theirs, their_raw) = _grpc(ours.grpc, case), _grpc(triton.grpc, case)
    assert my_code == their_code, (mine, theirs)
    if case == "server metadata":
        assert set(mine) == set(theirs) == SERVER_FIELDS
        assert set(mine["extensions"]) <= set(theirs["extensions"])
    elif case == "model config":
        _same_config(mine["config"], theirs["config"])
    else:
        _same_document(mine, theirs)
    for my_bytes, their_bytes in zip(my_raw, their_raw, strict=True):
        np.testing.assert_allclose(
            np.frombuffer(my_bytes, np.float32), np.frombuffer(their_bytes, np.float32), rtol=RTOL
        )
