"""Artifact folders of the toy models that the runner tests share (session-scoped: each is built once per run):
fp32 tiny_cnn and text_classifier, tiny_cnn in FP16, and tiny_cnn calibrated to INT8; and one ONNX Runtime and one
PyTorch runner per fp32 folder, for the tests that only read."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.runner_feeds import cnn_batch
from trt_pipeline.pipeline.core.settings import Settings
from trt_pipeline.pipeline.runners import load_runner
from trt_pipeline.pipeline.stages.sequence import make_engine

MODELS = {
    "tiny_cnn": "tests.helpers.toy_models:tiny_cnn",
    "text_classifier": "tests.helpers.toy_models:text_classifier",
}


@pytest.fixture(scope="session")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """fp32 artifact folders (ONNX, reference.npz, engine.plan built ahead of time by tensorrt_rtx)."""
    root = tmp_path_factory.mktemp("engines")
    return {
        name: make_engine(Settings(model=model, precision="fp32", out_root=root, builder="tensorrt_rtx"))
        for name, model in MODELS.items()
    }


@pytest.fixture(scope="session")
def int8_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_cnn calibrated on 32 random images: model.int8.onnx (TensorRT) and the graphs for ORT's CPU kernels."""
    root = tmp_path_factory.mktemp("int8")
    np.save(root / "calib.npy", cnn_batch(32, seed=1)["input"])
    settings = Settings(model=MODELS["tiny_cnn"], precision="int8", out_root=root, calib=root / "calib.npy")
    return make_engine(replace(settings, calib_samples=32, calib_batch=16))


@pytest.fixture(scope="session")
def fp16_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_cnn in FP16: model.fp16.onnx beside model.onnx, both past their gates."""
    root = tmp_path_factory.mktemp("fp16")
    return make_engine(Settings(model=MODELS["tiny_cnn"], precision="fp16", out_root=root, builder="tensorrt_rtx"))


def copy_folder(folder: Path, tmp_path: Path) -> Path:
    """A copy of a shared folder that a test may change."""
    return Path(shutil.copytree(folder, tmp_path / folder.name))


def edit_manifest(folder: Path, edit) -> None:
    """Change a copied folder's manifest.json in place: `edit` takes the parsed JSON and changes it."""
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


FP32_RTOL = 1e-4  # same graph, same inputs: only float reassociation between PyTorch and ONNX Runtime


BACKENDS = ("onnxruntime", "torch")


@pytest.fixture(scope="session")
def runners(folders: dict[str, Path]):
    """One ONNX Runtime and one PyTorch runner per model, shared by the read-only tests."""
    made = {(name, backend): load_runner(folder, backend) for name, folder in folders.items() for backend in BACKENDS}
    yield made
    for runner in made.values():
        runner.close()
