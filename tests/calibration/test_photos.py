"""The calibration photographs (calibration/photos.py), exported and ready for ResNet."""

from __future__ import annotations

import numpy as np

from trt_pipeline.calibration.photos import PHOTOS, export_calibration_images
from trt_pipeline.models.preprocess import load_image
from trt_pipeline.models.spec import ImagePreprocess


def test_calibration_photographs_export_and_preprocess_for_resnet(tmp_path):
    written = export_calibration_images(tmp_path)
    assert len(written) == 4 * len(PHOTOS) == 40
    image = load_image(written[0], ImagePreprocess())
    assert image.shape == (3, 224, 224) and image.dtype == np.float32
    assert -2.2 < image.min() < image.max() < 2.7  # ImageNet-normalised 0..255 pixels
