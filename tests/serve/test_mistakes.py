"""What the service refuses and how: mistakes sent through tritonclient, malformed bodies,
and fuzzing from the OpenAPI schema."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.helpers.serve_fixtures import (
    FORMS,
    IMAGE_MODEL,
    ITEM_SHAPE,
    MAX_BATCH,
    ONE,
    ONE_DATA,
    PROTOCOLS,
    RTOL,
    TEXT_MODEL,
    Server,
    client,
    clients,
    image_input_json,
    infer_input,
    infer_logits,
    items,
    refusal,
    requested_output,
    served,
    tokens,
)

# --------------------------------------------------------------------------- mistakes, through tritonclient


@dataclass(frozen=True)
class Mistake:
    model: str
    inputs: Callable[[str], list]  # protocol -> tritonclient inputs
    status: str  # the HTTP status; gRPC answers the matching code
    message: str
    version: str = ""
    outputs: tuple[str, ...] = ()


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


_RAW = ONE.tobytes()
BAD_BODIES: dict[str, tuple[bytes, dict, int, str]] = {
    "malformed JSON": (b'{"inputs": [', {}, 400, "not valid JSON"),
    "no inputs": (json.dumps({"outputs": []}).encode(), {}, 400, '"inputs" must be a non-empty list'),
    "unknown field": (
        json.dumps({"inputs": [image_input_json(data=ONE_DATA)], "input": 1}).encode(),
        {},
        400,
        "unknown fields ['input']",
    ),
    "data count differs from shape": (
        json.dumps({"inputs": [image_input_json(data=ONE_DATA[:-1])]}).encode(),
        {},
        400,
        "shape [1, 3, 16, 16] holds 768 values; 767 were sent",
    ),
    "nested data of the wrong nesting": (
        json.dumps({"inputs": [image_input_json(data=[[1.0], [1.0, 2.0]])]}).encode(),
        {},
        400,
        "the data must be numbers",
    ),
    "strings for numbers": (
        json.dumps({"inputs": [image_input_json(data=["a"] * 768)]}).encode(),
        {},
        400,
        "the data must be numbers",
    ),
    "beyond float32": (
        json.dumps({"inputs": [image_input_json(data=[1e39] + ONE_DATA[1:])]}).encode(),
        {},
        400,
        "beyond FP32's range",
    ),
    "shape of 2**40 items": (
        json.dumps({"inputs": [image_input_json(shape=[2**40, *ITEM_SHAPE], data=[])]}).encode(),
        {},
        400,
        f"send at most {MAX_BATCH} per request",
    ),
    "binary size differs from shape": (
        *_binary_request({"inputs": [image_input_json(parameters={"binary_data_size": len(_RAW) - 4})]}, _RAW[:-4]),
        400,
        "is 3072 bytes; 3068 were sent",
    ),
    "binary bytes nobody claims": (
        *_binary_request({"inputs": [image_input_json(parameters={"binary_data_size": len(_RAW)})]}, _RAW + b"1234"),
        400,
        "4 bytes after the JSON header belong to no input",
    ),
    "binary claim beyond the body": (
        *_binary_request({"inputs": [image_input_json(parameters={"binary_data_size": 2 * len(_RAW)})]}, _RAW),
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
        json.dumps({"inputs": [image_input_json(parameters={"shared_memory_region": "r"})]}).encode(),
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


def test_json_true_and_false_are_not_numbers(server: Server, text_server: Server) -> None:
    # numpy reads true as 1 among numbers: [0.5, true, ...] as FP32 data, or a token id true, got 200, a wrong answer.
    flat = ONE_DATA[:5] + [True] + ONE_DATA[6:]
    nested = [[ONE_DATA[:-1] + [False]]]
    for data in (flat, nested):
        body = {"inputs": [image_input_json(data=data)]}
        response = httpx.post(f"{server.url}/v2/models/{IMAGE_MODEL}/infer", json=body, timeout=10)
        assert response.status_code == 400, response.text
        assert (
            response.json()["error"]
            == "input 'input': the data holds true/false, which is no FP32 value; send numbers only"
        )
    ids, mask = tokens(seed=3, count=1, seq=4)
    inputs = [
        {"name": "input_ids", "datatype": "INT64", "shape": [1, 4], "data": [1, True, 3, 4]},
        {"name": "attention_mask", "datatype": "FP32", "shape": [1, 4], "data": mask.ravel().tolist()},
    ]
    response = httpx.post(f"{text_server.url}/v2/models/{TEXT_MODEL}/infer", json={"inputs": inputs}, timeout=10)
    assert (
        response.status_code == 400
        and "input 'input_ids': the data holds true/false, which is no INT64" in response.text
    )
    assert httpx.get(f"{server.url}/v2/health/ready", timeout=5).status_code == 200


def test_an_integer_beyond_64_bits_is_a_number_judged_by_the_datatypes_range(
    server: Server, text_server: Server, runner
) -> None:
    # numpy keeps 2**70 as a Python object, and the service called it "not numbers".  It is a float32 (a power of
    # two, as 1.2e21 would be); 2**1100 is beyond float32, and beyond 64-bit integers any integer is.
    url = f"{server.url}/v2/models/{IMAGE_MODEL}/infer"
    body = {"inputs": [image_input_json(data=[2**70, *ONE_DATA[1:]])], "outputs": [{"name": "logits"}]}
    response = httpx.post(url, json=body, timeout=10)
    assert response.status_code == 200, response.text
    sent = np.array([2.0**70, *ONE_DATA[1:]], np.float32).reshape(1, *ITEM_SHAPE)
    answered = np.array(response.json()["outputs"][0]["data"], np.float32)
    np.testing.assert_allclose(answered, runner.infer({"input": sent})["logits"].ravel(), rtol=RTOL)
    response = httpx.post(url, json={"inputs": [image_input_json(data=[-(2**1100), *ONE_DATA[1:]])]}, timeout=10)
    assert response.status_code == 400 and "input 'input' has values beyond FP32's range" in response.text
    ids, mask = tokens(seed=3, count=1, seq=4)
    inputs = [
        {"name": "input_ids", "datatype": "INT64", "shape": [1, 4], "data": [1, 2**70, 3, 4]},
        {"name": "attention_mask", "datatype": "FP32", "shape": [1, 4], "data": mask.ravel().tolist()},
    ]
    response = httpx.post(f"{text_server.url}/v2/models/{TEXT_MODEL}/infer", json={"inputs": inputs}, timeout=10)
    assert response.status_code == 400 and "input 'input_ids' has values outside INT64's [" in response.text


def test_unknown_paths_and_methods_answer_with_the_protocols_error(server: Server) -> None:
    missing = httpx.get(f"{server.url}/v1/models/{IMAGE_MODEL}", timeout=5)
    wrong_method = httpx.get(f"{server.url}/v2/models/{IMAGE_MODEL}/infer", timeout=5)
    assert (missing.status_code, wrong_method.status_code) == (404, 405)
    assert missing.json() == {"error": "Not Found"} and "error" in wrong_method.json()


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
