"""Real photographs for calibrating image models, from files that registry packages ship.

scikit-image bundles a handful of colour photographs in its wheel (astronaut, coffee, chelsea the
cat, a rocket, a motorcycle pair, microscopy and telescope images) and scikit-learn two more (a
temple in China, a flower): no download.  Ten photos are too few for a calibration batch, so each
is also exported as its mirror image and as a mirrored pair of center crops (different scales of
the same scene after the model's resize): 40 images.  These are real-world pixel statistics, not
ImageNet; a deployed model should be calibrated on a few hundred images from its own data.

    trt-pipeline calibration-images [--out calibration/samples]     # `make calibration-images`
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..pipeline.folder.artifacts import atomic_path

DEFAULT_FOLDER = Path("calibration/samples")
CROP_FRACTION = 0.6


def _skimage(name: str) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        from skimage import data

        image = getattr(data, name)()
        return image[0] if isinstance(image, tuple) else image  # stereo_motorcycle: (left, right, disparity)

    return load


def _sklearn(index: int) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        from sklearn.datasets import load_sample_images

        return load_sample_images().images[index]

    return load


PHOTOS: dict[str, Callable[[], np.ndarray]] = {
    "astronaut": _skimage("astronaut"),
    "coffee": _skimage("coffee"),
    "chelsea": _skimage("chelsea"),
    "rocket": _skimage("rocket"),
    "motorcycle": _skimage("stereo_motorcycle"),
    "immunohistochemistry": _skimage("immunohistochemistry"),
    "hubble_deep_field": _skimage("hubble_deep_field"),
    "retina": _skimage("retina"),
    "china": _sklearn(0),
    "flower": _sklearn(1),
}


def views(image: np.ndarray) -> dict[str, np.ndarray]:
    """The photo, its mirror image, a center crop and the crop's mirror (all HWC uint8)."""
    height, width = image.shape[:2]
    crop_h, crop_w = int(height * CROP_FRACTION), int(width * CROP_FRACTION)
    top, left = (height - crop_h) // 2, (width - crop_w) // 2
    crop = image[top : top + crop_h, left : left + crop_w]
    return {"full": image, "mirror": image[:, ::-1], "crop": crop, "crop_mirror": crop[:, ::-1]}


def export_calibration_images(folder: Path) -> list[Path]:
    """Write every view of every photo as PNG into `folder`; returns the paths written."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, load in PHOTOS.items():
        for view, pixels in views(np.asarray(load())[..., :3]).items():
            path = folder / f"{name}-{view}.png"
            with atomic_path(path) as temporary:
                Image.fromarray(np.ascontiguousarray(pixels)).save(temporary, format="PNG")
            written.append(path)
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=DEFAULT_FOLDER, help="folder to write the PNG images to")


def main(args: argparse.Namespace) -> int:
    written = export_calibration_images(args.out)
    print(f"wrote {len(written)} calibration images ({len(PHOTOS)} photographs x 4 views) to {args.out}")
    return 0
