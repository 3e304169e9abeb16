"""The service's protocol on both transports: health, metadata, config, metrics, and inference in every form."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from tests.helpers.serve_fixtures import (
    FORMS,
    IMAGE_MODEL,
    MAX_BATCH,
    ONE,
    ONE_DATA,
    PROTOCOLS,
    RTOL,
    TEXT_MAX_BATCH,
    TEXT_MODEL,
    Server,
    client,
    clients,
    image_input_json,
    infer_input,
    infer_logits,
    items,
    requested_output,
    served,
    tokens,
)
from trt_pipeline.pipeline.cli import main as cli_main
from trt_pipeline.pipeline.core.compare import compare
from trt_pipeline.pipeline.core.settings import Settings
from trt_pipeline.pipeline.folder.reader import open_folder
from trt_pipeline.pipeline.runners import load_runner
from trt_pipeline.pipeline.stages.sequence import make_engine
from trt_pipeline.pipeline.triton.repository import model_name, write_repository

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


def test_typed_contents_beside_raw_contents_are_refused_naming_the_input(text_server: Server) -> None:
    # The raw bytes were served and the typed values ignored without a word; Triton refuses such a request.
    ids, mask = tokens(seed=4, count=1, seq=5)
    tensor = service_pb2.ModelInferRequest.InferInputTensor
    request = service_pb2.ModelInferRequest(
        model_name=TEXT_MODEL,
        inputs=[
            tensor(name="input_ids", datatype="INT64", shape=[1, 5]),
            tensor(name="attention_mask", datatype="FP32", shape=[1, 5], contents={"fp32_contents": [0.0] * 5}),
        ],
        raw_input_contents=[ids.tobytes(), mask.astype(np.float32).tobytes()],
    )
    with grpc.insecure_channel(text_server.grpc) as channel, pytest.raises(grpc.RpcError) as refused:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input 'attention_mask' has both typed contents and raw_input_contents" in refused.value.details()


def test_the_config_says_when_batching_is_off(text_server: Server) -> None:
    with client(text_server, "grpc") as triton:
        config = triton.get_model_config(TEXT_MODEL).config
    assert config.max_batch_size == TEXT_MAX_BATCH and not config.HasField("dynamic_batching")


def test_the_requests_binary_data_output_is_the_default_for_named_outputs(server: Server, runner) -> None:
    header = json.dumps(
        {
            "inputs": [image_input_json(data=ONE_DATA)],
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


def test_nested_outputs_are_served_by_their_paths(engines: Path) -> None:
    """{"logits": a, "aux": (b, c)}: the service offers logits, aux.0 and aux.1, over both protocols, one by one or
    all, equal to the ONNX Runtime runner's."""
    settings = Settings(model="tests.helpers.toy_models:nested_outputs", precision="fp32", out_root=engines)
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
