"""On the GPU machine: the engines' outputs against ONNX Runtime FP32 on real photographs.

For each of engines/resnet50-{fp16,int8}: the 40 photos of `python -m calibration.photos`, with
ResNet-50's preprocessing, through the engine runner and through ONNX Runtime (CPU, FP32) on the
folder's model.onnx; per photo the cosine of the logits, the max |diff| relative to the largest
|logit|, and whether the top-1 class agrees.  Writes photos.json into OUT.

    python tools/device/photos.py ENGINES_ROOT PHOTOS_FOLDER OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from calibration.preprocess import IMAGE_SUFFIXES, load_image
from models.spec import ImagePreprocess
from pipeline.runners import load_runner


def photos(folder: Path) -> np.ndarray:
    paths = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    return np.stack([load_image(path, ImagePreprocess()) for path in paths])


def agreement(expected: np.ndarray, actual: np.ndarray) -> dict:
    cosine = np.sum(expected * actual, axis=1) / (np.linalg.norm(expected, axis=1) * np.linalg.norm(actual, axis=1))
    relative = np.max(np.abs(expected - actual), axis=1) / np.max(np.abs(expected), axis=1)
    return {
        "photos": len(expected),
        "cosine_min": float(cosine.min()),
        "cosine_mean": float(cosine.mean()),
        "max_rel_max": float(relative.max()),
        "top1_agreement": float(np.mean(expected.argmax(1) == actual.argmax(1))),
        "finite": bool(np.isfinite(actual).all()),
    }


def main(engines: Path, photo_folder: Path, out: Path) -> int:
    batch = photos(photo_folder)
    report: dict = {}
    for precision in ("fp16", "int8"):
        folder = engines / f"resnet50-{precision}"
        if not (folder / "engine.plan").is_file():
            report[precision] = {"error": f"{folder} has no engine.plan"}
            continue
        with load_runner(folder, "onnxruntime", graph="model.onnx") as reference:
            expected = reference.infer({"input": batch})["output"]
        with load_runner(folder, "tensorrt") as engine:
            actual = engine.infer({"input": batch})["output"]
            report[precision] = {"engine": engine.description, **agreement(expected, actual)}
    (out / "photos.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])))
