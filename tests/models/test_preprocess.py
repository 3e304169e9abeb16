"""Images preprocessed as a model declares (models/preprocess.py)."""

from __future__ import annotations

import numpy as np

from tests.helpers.digits_int8 import digit_pngs
from trt_pipeline.models.digits import PREPROCESS
from trt_pipeline.models.preprocess import load_image


def test_image_preprocessing_matches_the_arrays_inference_sees(split, tmp_path):
    """A digit saved as a PNG and read back by calibration equals the model-ready array (to 8-bit rounding)."""
    digit_pngs(split, tmp_path, 4)
    for index in range(4):
        image = load_image(tmp_path / f"class{index % 3}" / f"{index:03d}.png", PREPROCESS)
        assert image.shape == (1, 8, 8) and image.dtype == np.float32
        np.testing.assert_allclose(image, split.train_inputs[index], atol=2 / 255 / 0.5)
