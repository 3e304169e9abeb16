"""The engine runner on a real GPU: deserialize, allocate, execute_v2, parity with ONNX Runtime, torch CUDA
inputs in place, threads, and freeing.  Skipped with the reason (tests/conftest.py) where no engine can run."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.concurrency import assert_each_thread_gets_its_own_result
from tests.helpers.runner_feeds import assert_close, cnn_batch, text_batch
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.settings import Settings
from trt_pipeline.pipeline.core.trt_module import describe_gpu
from trt_pipeline.pipeline.runners import load_runner
from trt_pipeline.pipeline.runners.device_memory import LAYERS, available_layers
from trt_pipeline.pipeline.runners.tensorrt import built_for
from trt_pipeline.pipeline.stages.sequence import make_engine

pytestmark = [pytest.mark.gpu, pytest.mark.engine]

# An fp32 engine may run its convolutions and matmuls in TF32 (10-bit mantissa), which TensorRT
# allows by default; ONNX Runtime on the CPU runs true fp32.
ENGINE_RTOL = 1e-2
MODELS = {
    "tiny_cnn": "tests.helpers.toy_models:tiny_cnn",
    "text_classifier": "tests.helpers.toy_models:text_classifier",
}


def _target_options(folder: Path) -> dict:
    """check_target=False only for an ahead-of-time engine whose recorded targets leave this GPU out
    (e.g. TensorRT-RTX's defaults on an H100, SM 9.0): then these tests find out whether it runs."""
    target = json.loads((folder / "manifest.json").read_text())["build"]["target"]
    gpu = describe_gpu(0)
    targets = built_for(target)
    if target.get("kind") == "ahead-of-time" and gpu and targets and gpu["compute_capability"] not in targets:
        return {"check_target": False}
    return {}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu-engines")
    return {
        name: make_engine(Settings(model=model, precision="fp32", out_root=root, builder="auto"))
        for name, model in MODELS.items()
    }


@pytest.fixture(scope="module")
def engines(folders):
    made = {name: load_runner(folder, "tensorrt", **_target_options(folder)) for name, folder in folders.items()}
    yield made
    for runner in made.values():
        runner.close()


@pytest.fixture(scope="module")
def references(folders):
    made = {name: load_runner(folder, "onnxruntime") for name, folder in folders.items()}
    yield made
    for runner in made.values():
        runner.close()


def test_engine_loads_with_its_description(engines):
    runner = engines["tiny_cnn"]
    assert runner.backend == "tensorrt"
    assert "engine on" in runner.description and "device memory via" in runner.description
    assert runner.max_batch == 32


@pytest.mark.parametrize("rows", [1, 8, 32, 70])  # 70: chunked into 32 + 32 + 6
def test_engine_matches_onnxruntime_at_batch(engines, references, rows):
    feed = cnn_batch(rows, seed=rows)
    actual = engines["tiny_cnn"].infer(feed)
    assert actual["logits"].shape == (rows, 10)
    assert_close(references["tiny_cnn"].infer(feed), actual, ENGINE_RTOL)


@pytest.mark.parametrize(("rows", "seq"), [(1, 1), (8, 12), (32, 64), (40, 5)])
def test_dynamic_sequence_and_two_outputs(engines, references, rows, seq):
    feed = text_batch(rows, seq, seed=seq)
    actual = engines["text_classifier"].infer(feed)
    assert actual["tokens"].shape == (rows, seq, 8)  # exactly the valid rows and columns, not max-shape buffers
    assert_close(references["text_classifier"].infer(feed), actual, ENGINE_RTOL)


def test_engine_refuses_bad_input(engines):
    with pytest.raises(PipelineError, match="input 'input' has dtype float64, expected float32"):
        engines["tiny_cnn"].infer({"input": np.zeros((2, 3, 16, 16))})


def test_torch_cuda_tensors_are_used_in_place(engines):
    import torch

    feed = cnn_batch(8, seed=11)
    on_gpu = {"input": torch.from_numpy(feed["input"]).cuda()}
    assert_close(engines["tiny_cnn"].infer(feed), engines["tiny_cnn"].infer(on_gpu), rtol=1e-6)
    chunked = {"input": torch.from_numpy(cnn_batch(40, seed=12)["input"]).cuda()}
    assert engines["tiny_cnn"].infer(chunked)["logits"].shape == (40, 10)
    with pytest.raises(PipelineError, match="non-contiguous CUDA tensor"):
        engines["tiny_cnn"].infer({"input": on_gpu["input"].transpose(2, 3)})


def test_concurrent_calls_from_other_threads(engines):
    runner = engines["text_classifier"]
    feeds = [text_batch(1 + t % 7, seq=3 + t, seed=t) for t in range(16)]
    assert_each_thread_gets_its_own_result(runner, feeds)


def test_runner_created_in_one_thread_serves_another(folders):
    folder = folders["tiny_cnn"]
    made: list = []
    creator = threading.Thread(target=lambda: made.append(load_runner(folder, "tensorrt", **_target_options(folder))))
    creator.start()
    creator.join()
    with made[0] as runner:
        assert runner.infer(cnn_batch(4))["logits"].shape == (4, 10)


def test_close_frees_device_memory(folders):
    import torch

    folder = folders["tiny_cnn"]
    with load_runner(folder, "tensorrt", **_target_options(folder)) as runner:
        runner.infer(cnn_batch(32))
    free_before, _ = torch.cuda.mem_get_info()
    for _ in range(5):
        with load_runner(folder, "tensorrt", contexts=3, **_target_options(folder)) as runner:
            runner.infer(cnn_batch(32))
    free_after, _ = torch.cuda.mem_get_info()
    assert free_before - free_after < 16 << 20  # five loads of three contexts each leave (almost) nothing behind
    with pytest.raises(PipelineError, match="this runner was closed"):
        runner.infer(cnn_batch(1))


EXECUTIONS = {
    "execute_v2": {"execution": "v2"},
    "execute_async_v3": {"execution": "v3"},
    "rtx_graphs": {"cuda_graphs": True},
}


@pytest.mark.parametrize("options", EXECUTIONS.values(), ids=EXECUTIONS.keys())
@pytest.mark.parametrize("layer", LAYERS)
def test_every_memory_layer_and_execution_agree(folders, references, layer, options):
    if layer not in available_layers():
        pytest.skip(f"{layer} does not import here (both are tried on the GPU machine: tools/device/run.sh)")
    folder = folders["text_classifier"]
    with load_runner(folder, "tensorrt", device_memory=layer, **options, **_target_options(folder)) as runner:
        # A shape repeated: CUDA graphs are captured after the first calls at a shape and replayed after that.
        for rows, seq in [(1, 1), (8, 12), (8, 12), (8, 12), (32, 64), (8, 12)]:
            feed = text_batch(rows, seq, seed=rows + seq)
            assert_close(references["text_classifier"].infer(feed), runner.infer(feed), ENGINE_RTOL)


def test_infer_on_device_writes_into_the_callers_tensors(engines):
    import torch

    runner = engines["tiny_cnn"]
    feed = cnn_batch(8, seed=5)
    inputs = {"input": torch.from_numpy(feed["input"]).cuda()}
    outputs = {"logits": torch.empty((8, 10), device="cuda")}
    assert runner.infer_on_device(inputs, outputs) is outputs
    assert_close(runner.infer(feed), {"logits": outputs["logits"].cpu().numpy()}, rtol=1e-6)
    with pytest.raises(PipelineError, match=r"this call writes float32 \(8, 10\)"):
        runner.infer_on_device(inputs, {"logits": torch.empty((4, 10), device="cuda")})
