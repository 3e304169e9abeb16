"""`import trt_pipeline` and every module work with no GPU and no TensorRT, pycuda or CUDA bindings; serving an ONNX
graph imports nothing of the build."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trt_pipeline.pipeline.settings import BatchProfile, Settings
from trt_pipeline.pipeline.stages import make_engine

ROOT = Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter where the GPU-only packages cannot be imported at all.
BARE_IMPORT = textwrap.dedent(
    """
    import importlib, pkgutil, sys

    BLOCKED = ("tensorrt", "tensorrt_rtx", "pycuda", "cuda", "cupy")

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is blocked: this test proves it is not needed at import time")

    sys.meta_path.insert(0, Blocker())
    import trt_pipeline
    from trt_pipeline import pipeline
    assert "torch" not in sys.modules, "import trt_pipeline must stay light (torch loads on first use)"
    imported = []
    for package_name in ("trt_pipeline.pipeline", "trt_pipeline.models", "trt_pipeline.calibration"):
        package = importlib.import_module(package_name)
        for module in pkgutil.walk_packages(package.__path__, package_name + "."):
            if module.name.endswith("__main__"):
                continue  # running it would start the command line
            importlib.import_module(module.name)
            imported.append(module.name)
    print(len(imported), "modules")
    """
)


def test_every_module_imports_without_gpu_packages():
    result = subprocess.run([sys.executable, "-c", BARE_IMPORT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.split()[0]) >= 10


# Runs in a fresh interpreter: load the ONNX Runtime runner, run one inference, list what the build would import.
RUNTIME = textwrap.dedent(
    """
    import sys
    import numpy as np
    from trt_pipeline.pipeline.runners import load_runner

    with load_runner(sys.argv[1], backend="onnxruntime") as runner:
        logits = runner.infer({"input": np.zeros((2, 3, 16, 16), np.float32)})["logits"]
    assert logits.shape == (2, 10)
    BUILD_PACKAGES = ("torch", "onnx", "onnxsim")
    BUILD_SUBPACKAGES = ("trt_pipeline.models", "trt_pipeline.calibration")
    STAGES = ("export", "prepare", "stages", "check", "simplify", "precision", "float16", "parity", "build")
    build = {f"trt_pipeline.pipeline.{name}" for name in STAGES}
    loaded = [m for m in sys.modules if m.split(".")[0] in BUILD_PACKAGES or m.startswith(BUILD_SUBPACKAGES)]
    print(" ".join(sorted([*loaded, *(m for m in sys.modules if m in build)])))
    """
)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("engines")
    settings = Settings(model="tests.toy_models:tiny_cnn", precision="fp32", batch=BatchProfile(1, 2, 4), out_root=out)
    return make_engine(settings)


def test_the_onnxruntime_runner_imports_no_build_stage(tiny_folder):
    result = subprocess.run(
        [sys.executable, "-c", RUNTIME, str(tiny_folder)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [], f"the runtime imported: {result.stdout}"
