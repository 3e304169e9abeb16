"""load_runner, the front of pipeline/runners/: what auto picks and why, what it refuses before a runner opens, and
the contract every backend keeps on real artifacts (PyTorch's answers, the reader's refusals passed on as they are).
Each runner's own behaviour is tested in the file named after its module."""

from __future__ import annotations

import os
import resource
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.runner_feeds import cnn_batch, text_batch
from tests.helpers.runner_folders import BACKENDS, FP32_RTOL, MODELS, copy_folder
from trt_pipeline.pipeline.core.compare import compare_outputs
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.trt_module import gpu_present
from trt_pipeline.pipeline.folder.graph_io import load_reference
from trt_pipeline.pipeline.folder.layout import SERVED_CHOICE
from trt_pipeline.pipeline.runners import load_runner

# --------------------------------------------------------------------------- results


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_runner_matches_pytorch_reference(runners, folders, model, backend):
    runner = runners[model, backend]
    cases = load_reference(folders[model] / "reference.npz")
    assert len(cases) >= 3
    for inputs, expected in cases:
        results = compare_outputs(expected, runner.infer(inputs), rtol=FP32_RTOL)
        assert all(c.ok for c in results.values()), {n: c.as_record() for n, c in results.items()}


@pytest.mark.parametrize("model", MODELS)
def test_onnxruntime_and_torch_runners_agree(runners, model):
    feeds = [cnn_batch(5, seed=3)] if model == "tiny_cnn" else [text_batch(5, seq=3, seed=3), text_batch(7, 64)]
    for feed in feeds:
        ort_out, torch_out = runners[model, "onnxruntime"].infer(feed), runners[model, "torch"].infer(feed)
        assert set(ort_out) == {spec.name for spec in runners[model, "onnxruntime"].outputs}
        results = compare_outputs(torch_out, ort_out, rtol=FP32_RTOL)
        assert all(c.ok for c in results.values()), {n: c.as_record() for n, c in results.items()}


def test_contract_attributes(runners):
    runner = runners["text_classifier", "onnxruntime"]
    assert runner.backend == "onnxruntime"
    assert [(s.name, s.dtype, s.shape) for s in runner.inputs] == [
        ("input_ids", np.dtype("int64"), (-1, -1)),
        ("attention_mask", np.dtype("float32"), (-1, -1)),
    ]
    assert [(s.name, s.shape) for s in runner.outputs] == [("logits", (-1, 4)), ("tokens", (-1, -1, 8))]
    assert runner.max_batch == 32
    assert "CPUExecutionProvider" in runner.description
    assert runners["tiny_cnn", "torch"].backend == "torch"
    assert "cpu" in runners["tiny_cnn", "torch"].description or gpu_present()


def test_auto_picks_a_backend_and_says_why(folders, caplog):
    with caplog.at_level("INFO", logger="trt_pipeline.pipeline.runners"), load_runner(folders["tiny_cnn"]) as runner:
        assert "picked because auto:" in runner.description
        assert runner.description in caplog.text
        if not gpu_present():
            assert runner.backend == "onnxruntime"
            assert "no NVIDIA GPU" in runner.description
            # onnxruntime-gpu lists the CUDA provider as available even here; it must not be chosen.
            assert "CUDAExecutionProvider" not in runner.session.get_providers()


def test_auto_without_engine_plan_says_so(folders, tmp_path):
    folder = copy_folder(folders["tiny_cnn"], tmp_path)
    (folder / "engine.plan").unlink()
    with load_runner(folder) as runner:
        assert runner.backend == "onnxruntime"
        assert "has no engine.plan" in runner.description


def _truncate(graph: Path, other: Path) -> None:
    graph.write_bytes(graph.read_bytes()[:100])


def _swap(graph: Path, other: Path) -> None:
    shutil.copy(other, graph)


def _fifo(graph: Path, other: Path) -> None:
    graph.unlink()
    os.mkfifo(graph)


def _dev_zero(graph: Path, other: Path) -> None:
    graph.unlink()
    graph.symlink_to("/dev/zero")


@pytest.mark.parametrize("backend", ["onnxruntime", "onnxruntime-cuda"])
@pytest.mark.parametrize(
    ("damage", "refusal"),
    [
        (_truncate, "is not the file this folder's build wrote"),
        (_swap, "is not the file"),
        (_fifo, "is not a regular file but a FIFO"),  # "is missing": it is there
        (_dev_zero, "is not a regular file but a device file"),
    ],
    ids=["truncated", "swapped", "fifo", "dev-zero"],
)
def test_the_readers_refusal_of_a_graph_is_the_one_message(folders, tmp_path, backend, damage, refusal):
    # It was wrapped as "ONNX Runtime cannot load ...: PipelineError: ..." with a second fix saying the build wrote the
    # graph this way (its sha256 matches): the opposite of the reader's finding.
    folder = copy_folder(folders["tiny_cnn"], tmp_path)
    damage(folder / "model.onnx", folders["text_classifier"] / "model.onnx")
    options = {"device": "cpu"} if backend == "onnxruntime-cuda" else {}
    with pytest.raises(PipelineError, match=refusal) as caught:
        load_runner(folder, backend, **options)
    assert "ONNX Runtime" not in caught.value.problem and "PipelineError" not in caught.value.problem
    assert (
        caught.value.fix.startswith("rebuild the folder: make_engine(Settings(")
        and "sha256 matches" not in caught.value.fix
    )


@pytest.mark.parametrize(
    ("backend", "name"),
    [("onnxruntime", "model.onnx"), ("onnxruntime-cuda", "model.onnx"), ("auto", "reference.npz")],  # auto: its check
)
def test_a_file_of_another_size_is_refused_before_any_byte_is_copied(folders, tmp_path, backend, name):
    """A 1 GiB sparse file in place of an artifact was copied whole into the temporary folder (3.2 GB written for a
    graph) before its size was compared.  The size comes first: with writes limited to 16 MiB (RLIMIT_FSIZE), a copy
    would fail with EFBIG (Python ignores SIGXFSZ) and be blamed on the temporary folder."""
    folder = copy_folder(folders["tiny_cnn"], tmp_path)
    (folder / SERVED_CHOICE).unlink(missing_ok=True)  # auto checks afresh, reading reference.npz
    os.truncate(folder / name, 1 << 30)
    options = {"device": "cpu"} if backend == "onnxruntime-cuda" else {}
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, hard))
    try:
        with pytest.raises(PipelineError) as caught:
            load_runner(folder, backend, **options)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert f"{name} is not the file this folder's build wrote: 1073741824 bytes where the build wrote" in str(
        caught.value
    )


# --------------------------------------------------------------------------- load_runner refusals


def test_load_runner_refuses_a_missing_folder_and_unknown_backend(folders, tmp_path):
    with pytest.raises(PipelineError, match="does not exist") as caught:
        load_runner(tmp_path / "engines" / "nothing-fp16")
    assert "make_engine(Settings(model=" in str(caught.value)
    with pytest.raises(PipelineError, match="unknown runner backend 'tflite'"):
        load_runner(folders["tiny_cnn"], "tflite")
    with pytest.raises(PipelineError, match="not an artifact folder"):
        load_runner(tmp_path)


def test_engine_runner_refuses_a_corrupted_or_truncated_plan(folders, tmp_path):
    folder = copy_folder(folders["tiny_cnn"], tmp_path)
    plan = (folder / "engine.plan").read_bytes()
    corrupted = bytearray(plan)
    corrupted[len(plan) // 2] ^= 0xFF
    for broken in (bytes(corrupted), plan[: len(plan) // 2]):
        (folder / "engine.plan").write_bytes(broken)
        with pytest.raises(PipelineError, match="truncated, corrupted or replaced") as caught:
            load_runner(folder, "tensorrt")
        assert 'make_engine(Settings(model="tests.helpers.toy_models:tiny_cnn", precision="fp32"' in str(caught.value)
    (folder / "engine.plan").unlink()
    with pytest.raises(PipelineError, match="engine.plan is missing"):
        load_runner(folder, "tensorrt")


def test_runner_modules_import_without_gpu_or_tensorrt():
    import importlib

    for name in ("base", "onnxruntime", "torch", "tensorrt", "device_memory"):
        importlib.import_module(f"trt_pipeline.pipeline.runners.{name}")
    import trt_pipeline

    assert trt_pipeline.load_runner is load_runner
