"""The trained digits CNN that the INT8 tests share (session-scoped: each is made once per run): its data split, its
checked FP32 graph, the training rows as a .npy, and the INT8 graphs calibrated (max) on them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from trt_pipeline.calibration.holdout import read_calibration
from trt_pipeline.calibration.int8 import CACHE_FOLDER, make_int8_graph
from trt_pipeline.calibration.int8_records import CalibrationConfig, Int8Result
from trt_pipeline.models.digits import PREPROCESS, load_split
from trt_pipeline.pipeline.core.precision import Precision
from trt_pipeline.pipeline.core.settings import Settings
from trt_pipeline.pipeline.folder.layout import CPU_TARGETS, graph_record
from trt_pipeline.pipeline.stages.sequence import make_engine

SAMPLES, BATCH = 128, 32


def cpu_graph(kind: str) -> str:
    """The file of the INT8 graph for ONNX Runtime's kernels on this kind of CPU."""
    return graph_record(Precision.INT8, CPU_TARGETS[kind]).file


@pytest.fixture(scope="session")
def split():
    return load_split()


@pytest.fixture(scope="session")
def fp32(tmp_path_factory) -> Path:
    """The digits model's checked, simplified FP32 graph (the pipeline's own stages)."""
    out = tmp_path_factory.mktemp("engines")
    return make_engine(Settings(model="digits", precision="fp32", out_root=out)) / "model.onnx"


@pytest.fixture(scope="session")
def train_npy(split, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.npy"
    np.save(path, split.train_inputs)
    return path


@pytest.fixture(scope="session")
def int8(fp32, train_npy, tmp_path_factory) -> tuple[Path, Int8Result]:
    """model.int8.onnx (and the two CPU graphs beside it) calibrated (max) on the training split; its stage record."""
    folder = tmp_path_factory.mktemp("int8")
    record = make_int8_graph(
        fp32,
        folder / "model.int8.onnx",
        read_calibration(train_npy, fp32, PREPROCESS, samples=SAMPLES, batch=BATCH),
        config=CalibrationConfig(("max",)),
        cache_folder=folder / CACHE_FOLDER,
        cpu_out_paths={kind: folder / cpu_graph(kind) for kind in CPU_TARGETS},
    )
    return folder / "model.int8.onnx", record


def digit_pngs(split, folder: Path, count: int) -> Path:
    """Training digits written as 8-bit grayscale PNGs, as a user's image folder would hold them."""
    folder.mkdir(parents=True, exist_ok=True)
    pixels = np.round((split.train_inputs[:count, 0] * 0.5 + 0.5) * 255).astype(np.uint8)
    for index, image in enumerate(pixels):
        sub = folder / f"class{index % 3}"  # nested: the reader searches recursively
        sub.mkdir(exist_ok=True)
        Image.fromarray(image, mode="L").save(sub / f"{index:03d}.png")
    return folder
