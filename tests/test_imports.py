"""`import trt_pipeline` and every module work with no GPU and no TensorRT, pycuda or CUDA bindings; serving an ONNX
graph imports nothing of the build."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trt_pipeline.pipeline.core.settings import BatchProfile, Settings
from trt_pipeline.pipeline.stages.sequence import make_engine

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
    BUILD_SUBPACKAGES = (*BUILD_SUBPACKAGES, "trt_pipeline.pipeline.stages")  # every build stage lives there
    loaded = [m for m in sys.modules if m.split(".")[0] in BUILD_PACKAGES or m.startswith(BUILD_SUBPACKAGES)]
    print(" ".join(sorted(loaded)))
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


# The code's folders; trt_pipeline/ joins them into one package with links (setuptools follows them into the
# wheel), and its own __init__.py and __main__.py are the only files whose imports cross those links.
CODE_FOLDERS = ("pipeline", "models", "calibration")
# Copied as it is into a Triton model repository, where it imports the installed package by its full name.
RUNS_OUTSIDE_THE_PACKAGE = {"pipeline/triton/python_model.py"}


def _target(path: Path, node: ast.ImportFrom) -> tuple[Path, list[str]]:
    """Where a relative import points, from the importing file's own folder: the folder and the dotted rest."""
    base = path.parent
    for _ in range(node.level - 1):
        base = base.parent
    return base, (node.module or "").split(".") if node.module else []


def _file_of(base: Path, parts: list[str]) -> Path | None:
    """The file a module path names from `base`, or None.  The checkout's root stands for the package's root, whose
    own names live in trt_pipeline/__init__.py."""
    where = base.joinpath(*parts)
    candidates = [where.with_suffix(".py"), where / "__init__.py"] if parts else [where / "__init__.py"]
    if not parts and base == ROOT:
        candidates.append(ROOT / "trt_pipeline" / "__init__.py")
    return next((c for c in candidates if c.is_file()), None)


def _unresolved(path: Path) -> list[str]:
    problems = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            problems += [f"import {a.name}" for a in node.names if a.name.startswith("trt_pipeline.")]
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 0:
            if (node.module or "").split(".")[0] == "trt_pipeline":
                problems.append(f"from {node.module} import ...: absolute; name the file from where it stands")
            continue
        base, parts = _target(path, node)
        module = _file_of(base, parts)
        # `from . import name` may name a module beside it rather than a name in the package's __init__.py.
        names = [] if module and parts else [a.name for a in node.names if not _file_of(base, [*parts, a.name])]
        if module is None and (parts or names):
            problems.append(f"from {'.' * node.level}{node.module or ''} import ...: no file {base.joinpath(*parts)}")
        elif module is not None and any(
            p.is_symlink() for p in [module, *(ROOT / p for p in module.relative_to(ROOT).parents)]
        ):
            problems.append(f"from {'.' * node.level}{node.module or ''}: reached through a link")
    return [f"{path.relative_to(ROOT)}:{problem}" for problem in problems]


def test_every_internal_import_names_a_file_of_the_checkout_by_path_alone():
    """An import inside the code leads a reader (or a tool that does not follow links) to its file: relative, from
    the importing file's own folder."""
    files = [p for folder in CODE_FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]
    files = [p for p in files if p.relative_to(ROOT).as_posix() not in RUNS_OUTSIDE_THE_PACKAGE]
    assert len(files) > 50
    assert [problem for path in files for problem in _unresolved(path)] == []
