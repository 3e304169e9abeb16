"""Image preprocessing, implemented once: calibration, the runner and the benchmark all call these.

A model declares its preprocessing as `ModelSpec.preprocess` (ImagePreprocess, in spec.py beside this file);
calibration must see exactly what inference sees, or the INT8 scales are fitted to the wrong
distribution.  The steps follow torchvision's classification recipe: resize the shorter side to
`resize` (bilinear), center-crop `crop` x `crop`, scale to 0..1, normalise per channel, HWC -> CHW.
A grayscale model gets one channel, normalised with the first entry of `mean` and `std`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..pipeline.core.errors import PipelineError
from .spec import ImagePreprocess

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


def image_shape(spec: ImagePreprocess) -> tuple[int, int, int]:
    """The model input one image becomes: (channels, crop, crop)."""
    return (1 if spec.grayscale else 3, spec.crop, spec.crop)


def load_image(path: Path, spec: ImagePreprocess) -> np.ndarray:
    """Read an image file and return it preprocessed: float32 (C, crop, crop)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.load()
            return preprocess_image(image, spec)
    except (UnidentifiedImageError, OSError, SyntaxError) as error:
        # Pillow raises OSError for truncated files and SyntaxError for some broken PNG chunks.
        raise PipelineError(
            f"calibration image {path} cannot be read ({error})",
            "remove or replace the file; only readable .jpg/.jpeg/.png images are used",
        ) from None


def preprocess_image(image, spec: ImagePreprocess) -> np.ndarray:
    """A PIL image -> float32 (C, crop, crop): resize the shorter side, center-crop, normalise."""
    from PIL import Image

    image = image.convert("L" if spec.grayscale else "RGB")
    width, height = image.size
    scale = spec.resize / min(width, height)
    resized = image.resize(
        (max(spec.crop, round(width * scale)), max(spec.crop, round(height * scale))), Image.Resampling.BILINEAR
    )
    left = (resized.width - spec.crop) // 2
    top = (resized.height - spec.crop) // 2
    cropped = resized.crop((left, top, left + spec.crop, top + spec.crop))
    pixels = np.asarray(cropped, dtype=np.float32) / 255.0
    return normalize(pixels if pixels.ndim == 3 else pixels[..., np.newaxis], spec)


def normalize(pixels: np.ndarray, spec: ImagePreprocess) -> np.ndarray:
    """HWC intensities in 0..1 -> normalised float32 CHW."""
    channels = pixels.shape[-1]
    mean = np.asarray(spec.mean[:channels], dtype=np.float32)
    std = np.asarray(spec.std[:channels], dtype=np.float32)
    return np.ascontiguousarray(((pixels - mean) / std).transpose(2, 0, 1), dtype=np.float32)
