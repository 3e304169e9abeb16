"""Calibration data read from .npy, .npz, a callable or a folder of images (calibration/readers.py), and every kind of
bad calibration input refused with its fix."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.helpers.digits_int8 import BATCH, SAMPLES, digit_pngs
from trt_pipeline.calibration.readers import graph_inputs, read_calibration_data
from trt_pipeline.models.digits import PREPROCESS
from trt_pipeline.models.spec import ImagePreprocess
from trt_pipeline.pipeline.core.errors import PipelineError


def test_readers_agree_on_npy_npz_and_callable(fp32, split, tmp_path):
    inputs = graph_inputs(fp32)
    arrays = split.train_inputs[:SAMPLES]
    np.savez(tmp_path / "named.npz", input=arrays)
    sources = [tmp_path / "named.npz", lambda: (arrays[i : i + 10] for i in range(0, SAMPLES, 10))]
    np.save(tmp_path / "plain.npy", arrays)
    sources.append(tmp_path / "plain.npy")
    digests = set()
    for source in sources:
        data = read_calibration_data(source, inputs, PREPROCESS, samples=SAMPLES, batch=BATCH)
        assert data.samples == SAMPLES and len(data.batches) == SAMPLES // BATCH
        digests.add(data.digest)
    assert len(digests) == 1


@pytest.mark.parametrize(
    ("make_source", "preprocess", "message"),
    [
        (lambda d, s: d.mkdir() or d, PREPROCESS, "contains no .jpg/.jpeg/.png images"),
        (lambda d, s: _broken_png(d), PREPROCESS, "cannot be read"),
        (lambda d, s: _save(d / "x.npy", s.train_inputs[:64, :, :4]), PREPROCESS, r"has shape \[64, 1, 4, 8\]"),
        (lambda d, s: _save(d / "x.npy", s.train_inputs[:64].astype(np.float64)), PREPROCESS, "is float64"),
        (lambda d, s: _save(d / "x.npy", s.train_inputs[:64, 0]), PREPROCESS, r"has shape \[64, 8, 8\]"),
        (lambda d, s: _save(d / "x.npy", s.train_inputs[: BATCH - 1]), PREPROCESS, "fewer than one batch of 32"),
        (lambda d, s: digit_pngs(s, d, 4), None, "declares no image preprocessing"),
        (lambda d, s: digit_pngs(s, d, 4), ImagePreprocess(), r"preprocess to \[3, 224, 224\]"),
        (lambda d, s: _savez_unnamed_pair(d / "x.npz", s.train_inputs), PREPROCESS, "missing"),
        (lambda d, s: d / "absent", PREPROCESS, "does not exist"),
        (lambda d, s: _save(d / "x.npy", np.full((64, 1, 8, 8), np.nan, np.float32)), PREPROCESS, "NaN"),
    ],
    ids=[
        "empty-folder",
        "unreadable-image",
        "wrong-shape",
        "wrong-dtype",
        "wrong-rank",
        "fewer-than-a-batch",
        "folder-without-preprocess",
        "preprocess-not-matching-input",
        "npz-missing-input",
        "missing-path",
        "nan",
    ],
)
def test_bad_calibration_data_is_a_clear_error(fp32, split, tmp_path, make_source, preprocess, message):
    source = make_source(tmp_path / "calib", split)
    with pytest.raises(PipelineError, match=message) as error:
        read_calibration_data(source, graph_inputs(fp32), preprocess, samples=SAMPLES, batch=BATCH)
    assert error.value.fix


def _broken_png(folder: Path) -> Path:
    folder.mkdir()
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    return folder


def _save(path: Path, array: np.ndarray) -> Path:
    path.parent.mkdir(exist_ok=True)
    np.save(path, array)
    return path


def _savez_unnamed_pair(path: Path, array: np.ndarray) -> Path:
    """A .npz of two arrays named "a" and "b": neither is the model's input name."""
    path.parent.mkdir(exist_ok=True)
    np.savez(path, a=array, b=array)
    return path
