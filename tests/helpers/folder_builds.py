"""The tiny_cnn fp32 folder that the folder tests share (session-scoped: built once per run), the settings that
build it, and ways to change a copy of it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from trt_pipeline.pipeline.core.settings import BatchProfile, Settings
from trt_pipeline.pipeline.stages.sequence import make_engine

TINY = "tests.helpers.toy_models:tiny_cnn"
OTHER = "tests.helpers.folder_models:other_tiny_cnn"
GATED = "tests.helpers.folder_models:gated_tiny_cnn"
REBUILD = 'make_engine(Settings(model="tests.helpers.toy_models:tiny_cnn", precision="fp32"'  # Python's words
# model.onnx's record in an fp32 folder's manifest (pipeline.folder.layout).
FP32_RECORD = {"file": "model.onnx", "precision": "fp32", "target": "engine", "evaluation": "plain"}
FP32_RECORD |= {"gate": "parity_fp32", "postprocess": "none"}


def settings(root: Path, model: str = TINY) -> Settings:
    return Settings(model=model, precision="fp32", batch=BatchProfile(1, 2, 4), out_root=root, builder="tensorrt_rtx")


@pytest.fixture(scope="session")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="session")
def built(root: Path) -> Path:
    """A finished tiny_cnn fp32 folder (ONNX, reference, engine.plan); tests change copies of it."""
    return make_engine(settings(root))


def edit_manifest(folder: Path, **entries) -> None:
    path = folder / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **entries}))


def feed(rows: int = 2) -> dict[str, np.ndarray]:
    return {"input": np.random.default_rng(0).standard_normal((rows, 3, 16, 16), dtype=np.float32)}


def lock_as(kind: str, lock: Path, victim: Path) -> None:
    """Put something other than a plain file of its own where the folder's build lock goes."""
    if kind == "symlink":
        lock.symlink_to(victim)
    elif kind == "dangling-symlink":
        lock.symlink_to(victim.with_name("created-through-the-link"))
    elif kind == "hard-link":
        os.link(victim, lock)
    elif kind == "directory":
        lock.mkdir()
    else:
        os.mkfifo(lock)


LOCK_KINDS = {
    "symlink": "a symbolic link",
    "dangling-symlink": "a symbolic link",
    "hard-link": "a file with 2 names (hard links)",
    "directory": "a directory",
    "fifo": "a FIFO",
}
