"""A detector built with POSTPROCESS=nms, served: `python -m trt_pipeline serve` over REST (JSON and binary) and gRPC,
requests batched together by the service, and Triton Inference Server serving the repository `trt-pipeline triton`
writes, all return the runner's detections (classes and count as INT32, count [batch, 1]); and the example of
docs/detection.md runs as written against the service."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.detections import assert_same_detections
from tests.helpers.detector_models import scenes
from tests.helpers.serve_fixtures import FORMS, Server, client, infer_input, served
from trt_pipeline import load_runner
from trt_pipeline.pipeline.cli import main as cli_main
from trt_pipeline.pipeline.core.settings import Settings
from trt_pipeline.pipeline.postprocess.nms import OUTPUTS
from trt_pipeline.pipeline.stages.sequence import make_engine
from trt_pipeline.pipeline.triton.server import running_triton, startup_problem

ROOT = Path(__file__).resolve().parents[2]
NAME = "detector_models-yolo_detector-fp16"  # <model>-<precision>, as serve and the repository name it
DATATYPES = {"boxes": "FP32", "scores": "FP32", "classes": "INT32", "count": "INT32"}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The detector at FP16 with NMS, as docs/detection.md builds it (its calibration scenes made here)."""
    root = tmp_path_factory.mktemp("detector")
    np.save(root / "scenes.npy", scenes(96, seed=1).numpy())
    settings = Settings(
        model="tests.helpers.detector_models:yolo_detector",
        precision="fp16",
        batch="1:2:8",
        postprocess="nms",
        nms_candidates=200,
        nms_max_detections=20,
        calib=root / "scenes.npy",
        out_root=root / "engines",
    )
    return make_engine(settings.check())


@pytest.fixture(scope="module")
def runner(folder: Path):
    with load_runner(folder) as opened:
        yield opened


@pytest.fixture(scope="module")
def server(folder: Path, runner) -> Iterator[Server]:
    """Started after `runner` timed the graphs and cached its pick in the folder (served.json): both serve it."""
    with served(folder) as running:
        yield running


@pytest.mark.parametrize("form", list(FORMS))
def test_the_service_returns_the_runners_detections(server: Server, runner, form: str):
    protocol, binary = FORMS[form]
    images = scenes(5, seed=11).numpy()
    with client(server, protocol) as triton:
        metadata = triton.get_model_metadata(NAME)
        result = triton.infer(NAME, [infer_input(protocol, "images", images, binary)])
    outputs = metadata["outputs"] if protocol == "http" else [
        {"name": o.name, "datatype": o.datatype, "shape": list(o.shape)} for o in metadata.outputs
    ]  # fmt: skip
    assert {o["name"]: o["datatype"] for o in outputs} == DATATYPES
    assert next(o["shape"] for o in outputs if o["name"] == "count") == [-1, 1]
    answer = {name: result.as_numpy(name) for name in OUTPUTS}
    assert answer["count"].shape == (5, 1) and answer["classes"].dtype == np.int32
    assert_same_detections(answer, runner.infer({"images": images}))


def test_requests_batched_together_each_get_their_own_detections(server: Server, runner):
    """The service's dynamic batcher runs concurrent requests as one batch and splits every output on axis 0."""
    batches = [scenes(1 + number % 3, seed=200 + number).numpy() for number in range(18)]

    def ask(images: np.ndarray) -> dict[str, np.ndarray]:
        with client(server, "grpc") as triton:
            result = triton.infer(NAME, [infer_input("grpc", "images", images)])
            return {name: result.as_numpy(name) for name in OUTPUTS}

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(ask, batches))
    for images, answer in zip(batches, answers, strict=True):
        assert_same_detections(answer, runner.infer({"images": images}))


@pytest.mark.skipif(startup_problem() is not None, reason=f"tritonserver cannot start here: {startup_problem()}")
def test_triton_serves_the_runners_detections(folder: Path, tmp_path: Path):
    repo = tmp_path / "repository"
    assert cli_main(["triton", str(folder), "--repo", str(repo), "--backend", "python"]) == 0
    config = (repo / NAME / "config.pbtxt").read_text()
    assert re.search(r'name: "count"\s+data_type: TYPE_INT32\s+dims: 1\s', config) and "reshape" not in config
    images = scenes(3, seed=12).numpy()
    with running_triton(repo) as triton, client(triton, "http") as http:
        result = http.infer(NAME, [infer_input("http", "images", images)])
        # The runner inside Triton times the folder's graphs itself (auto): compare with the one it picked.
        graph = re.search(r"onnxruntime \S+ running (\S+) ", triton.log()).group(1)  # type: ignore[union-attr]
    answer = {name: result.as_numpy(name) for name in OUTPUTS}
    with load_runner(folder, backend="onnxruntime", graph=graph) as same:
        assert_same_detections(answer, same.infer({"images": images}))


def test_the_docs_example_reads_the_detections_from_the_service(server: Server, runner):
    text = (ROOT / "docs" / "detection.md").read_text()
    blocks = [block for block in re.findall(r"```python\n(.*?)```", text, re.S) if "tritonclient" in block]
    assert len(blocks) == 1
    example = blocks[0].replace("127.0.0.1:8000", server.http)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    shown = subprocess.run(
        [sys.executable, "-c", example], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert shown.returncode == 0, shown.stderr[-3000:]
    expected = runner.infer({"images": scenes(4).numpy()})
    lines = [
        f"image {image}: class {label} score {score:.3f} box {np.round(box, 1).tolist()}"
        for image in range(4)
        for box, score, label in zip(
            *(expected[name][image, : expected["count"][image, 0]] for name in ("boxes", "scores", "classes")),
            strict=True,
        )
    ]
    assert shown.stdout.splitlines() == lines and len(lines) > 4
