"""Prepare what the GPU machine needs, in git-ignored folders of 64 MiB or less each (one per device call).

The GPU machine has no network and no TensorRT, pycuda or onnxsim (../shared/docs/GPU.md).  This
downloads the CPython 3.12 manylinux x86-64 wheels and the pycuda sdist from PyPI, splits the
95 MB tensorrt-rtx libs wheel across the two call folders, and builds a small engine here with
TensorRT-RTX's ahead-of-time defaults, so the device can answer whether such a plan runs on it:

    python tools/device/bundle.py          # -> .devbundle/a (first call), .devbundle/b (second call, + photos)
    python tools/device/bundle.py ort      # -> .devbundle/ort0 .. ort4: onnxruntime-gpu, one part per call

onnxruntime-gpu (255 MB, a CUDA 13 build) runs our graphs on a GPU whose TensorRT cannot run them; its CUDA
libraries come from the device's torch venv.  tools/device/run.sh is what the device runs with each folder (see
its header for the calls).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

from slim_wheel import slim

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / ".devbundle"
PART_BYTES = 60 << 20  # a folder plus the repository (under 3 MiB) stays under the 64 MiB a device call carries
RTX = "1.7.1.116"
ORT_GPU = "onnxruntime-gpu==1.31.1"
WHEELS = [f"tensorrt-rtx-cu13-libs=={RTX}", f"tensorrt-rtx-cu13-bindings=={RTX}", "onnxsim==0.8.1"]
# pycuda's own needs that the GPU machine's image lacks (numpy, typing-extensions, markupsafe are there).
PYCUDA_NEEDS = ["pytools", "platformdirs", "mako", "siphash24"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]


def download_wheels(names: list[str], into: Path) -> list[Path]:
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(into), *names]
    subprocess.run(command, check=True)
    return sorted(into.glob("*.whl"))


def build_pure_wheel(requirement: str, into: Path) -> None:
    """A wheel built here from an sdist: `tensorrt-rtx-cu13` itself is one, and it holds the `tensorrt_rtx` package."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(into), requirement], check=True)


def download_sdist(name: str, into: Path) -> Path:
    """The newest sdist of `name` from PyPI's JSON API (pip download would try to build it here)."""
    with urllib.request.urlopen(f"https://pypi.org/pypi/{name}/json", timeout=60) as answer:
        release = json.load(answer)
    url = next(file["url"] for file in release["urls"] if file["packagetype"] == "sdist")
    target = into / url.rsplit("/", 1)[1]
    with urllib.request.urlopen(url, timeout=300) as source, target.open("wb") as sink:
        shutil.copyfileobj(source, sink)
    return target


def split(path: Path, folders: list[Path]) -> str:
    """Write `path` as <name>.part<i> into folders[i], each folder's part filling it up to PART_BYTES with what it
    already holds (the last takes the rest); return its sha256."""
    data = path.read_bytes()
    rooms = [PART_BYTES - _size(folder) for folder in folders]
    if len(data) > sum(rooms):
        raise SystemExit(f"{path.name} is {len(data) >> 20} MiB: more than {len(folders)} parts of {PART_BYTES >> 20}")
    start = 0
    for index, (folder, room) in enumerate(zip(folders, rooms, strict=True)):
        end = start + room if index + 1 < len(folders) else len(data)
        (folder / f"{path.name}.part{index}").write_bytes(data[start:end])
        start = end
    path.unlink()
    return hashlib.sha256(data).hexdigest()


def _size(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.iterdir())


def bundle_onnxruntime_gpu() -> list[Path]:
    """onnxruntime-gpu with only Hopper's kernels (tools/device/slim_wheel.py) and onnxsim, which the folders'
    builds there need, in PART_BYTES folders, one a device call; SHA256SUMS travels with the first part."""
    scratch = BUNDLE / "scratch-ort"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    (wheel,) = download_wheels([ORT_GPU], scratch)
    slim_wheel = scratch / "slim" / wheel.name
    slim_wheel.parent.mkdir()
    kept, zeroed = slim(wheel, slim_wheel)
    print(f"onnxruntime-gpu with Hopper's kernels: kept {kept >> 20} MiB of cubins, zeroed {zeroed >> 20} MiB")
    first = BUNDLE / "ort0"
    shutil.rmtree(first, ignore_errors=True)
    first.mkdir(parents=True)
    download_wheels(WHEELS[2:], first)  # onnxsim
    after_first = slim_wheel.stat().st_size - (PART_BYTES - _size(first))
    folders = [first] + [BUNDLE / f"ort{index}" for index in range(1, 1 + -(-after_first // PART_BYTES))]
    for folder in folders[1:]:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    sha = split(slim_wheel, folders)
    (first / "SHA256SUMS").write_text(f"{sha}  {slim_wheel.name}\n")
    shutil.rmtree(scratch)
    return folders


def build_aot_engine(into: Path) -> None:
    """tiny_cnn at FP32 with TensorRT-RTX's default targets (8.0/8.6/8.9/12.0): does it run on SM 9.0?"""
    command = [sys.executable, "-m", "trt_pipeline", "all", "--model", "tests.helpers.toy_models:tiny_cnn"]
    command += ["--precision", "fp32", "--builder", "tensorrt_rtx", "--out", str(into / "aot")]
    subprocess.run(command, check=True, cwd=ROOT)


def main() -> int:
    if sys.argv[1:] == ["ort"]:
        return report(bundle_onnxruntime_gpu())
    first, second, scratch = BUNDLE / "a", BUNDLE / "b", BUNDLE / "scratch"
    for folder in (first, second, scratch):  # the onnxruntime-gpu parts (ort*) stay: they take their own command
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    (libs,) = download_wheels(WHEELS[:1], scratch)
    sha = split(libs, [first, second])
    (second / "SHA256SUMS").write_text(f"{sha}  {libs.name}\n")
    download_wheels(WHEELS[1:], second)
    build_pure_wheel(f"tensorrt-rtx-cu13=={RTX}", second)
    download_wheels(PYCUDA_NEEDS, first)
    download_sdist("pycuda", first)
    build_aot_engine(second)
    calibration_photos(scratch, second / "photos")
    shutil.rmtree(scratch)
    return report([first, second])


def calibration_photos(scratch: Path, into: Path) -> None:
    """`trt-pipeline calibration-images` as JPEG (4 MB instead of 17 MB of PNG, so they travel beside the rest):
    the INT8 folder the device builds (tools/device/ort_cuda.py) calibrates on them."""
    from PIL import Image

    pngs = scratch / "photos"
    subprocess.run([sys.executable, "-m", "trt_pipeline", "calibration-images", "--out", str(pngs)], check=True)
    into.mkdir(parents=True)
    for png in sorted(pngs.glob("*.png")):
        Image.open(png).convert("RGB").save(into / f"{png.stem}.jpg", quality=95)


def report(folders: list[Path]) -> int:
    for folder in folders:
        size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        print(f"{folder.relative_to(ROOT)}: {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
