"""Which extra (pyproject.toml's optional dependencies) installs a module, so a missing one is one clear error.

A runner needs only numpy and ONNX Runtime; building, serving, benchmarking and the demo data each come
with their own extra.  pyproject.toml owns the requirement strings: the fix printed here reads them back
from the installed package's metadata.
"""

from __future__ import annotations

import shlex
from importlib import metadata

from .errors import PipelineError

DISTRIBUTION = "trt-pipeline"

# top-level module -> the extra that installs it
EXTRA_OF_MODULE = {
    "onnxruntime": "cpu",
    "pycuda": "gpu",
    "torch": "build",
    "onnx": "build",
    "onnxsim": "build",
    "PIL": "build",
    "tqdm": "build",
    "tensorrt_rtx": "rtx",
    "tensorrt": "tensorrt",
    "fastapi": "serve",
    "uvicorn": "serve",
    "prometheus_client": "serve",
    "grpc": "serve",
    "tritonclient": "serve",
    "matplotlib": "bench",
    "sklearn": "demo",
    "skimage": "demo",
    "transformers": "hf",
}

# Said along with the fix, where the extra is one of a choice.
CHOICE = {
    "cpu": "on a machine with an NVIDIA GPU install the `gpu` extra instead (onnxruntime-gpu), never both",
    "rtx": "or, on a GPU machine, the full TensorRT: the `tensorrt` extra, from https://pypi.nvidia.com",
}


def requirements(extra: str) -> list[str]:
    """The requirement strings of an extra, as the installed package's metadata lists them."""
    try:
        listed = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:  # a checkout that was never installed
        return []
    marker = f'extra == "{extra}"'
    return [req.split(";")[0].strip() for req in listed if marker in req.replace("'", '"')]


def install_command(extra: str) -> str:
    """`pip install <its requirements>`; from a checkout, the extra itself (trt-pipeline is on no index)."""
    checkout = f"pip install -e '.[{extra}]' from a checkout"
    wanted = requirements(extra)
    if not wanted:
        return checkout
    return f"pip install {' '.join(shlex.quote(req) for req in wanted)}  (or {checkout})"


def missing_module_error(error: ModuleNotFoundError) -> PipelineError | None:
    """A PipelineError naming the extra that installs the module, or None for a module of no extra (a bug)."""
    module = (error.name or "").partition(".")[0]
    extra = EXTRA_OF_MODULE.get(module)
    if extra is None:
        return None
    fix = install_command(extra)
    if extra in CHOICE:
        fix += f"; {CHOICE[extra]}"
    return PipelineError(f"{module} is not installed: it comes with trt-pipeline's `{extra}` extra", fix)


def import_onnxruntime():
    """The onnxruntime module, or a PipelineError saying why not: missing, or broken by its two wheels.

    onnxruntime and onnxruntime-gpu install into one `onnxruntime` folder; removing one of the two
    leaves a folder without its __init__ (a namespace package with no InferenceSession), and
    `pip check` does not notice.
    """
    try:
        import onnxruntime
    except ModuleNotFoundError as error:
        if not _onnxruntime_wheels():
            raise missing_module_error(error) or error from None
        onnxruntime = None
    if onnxruntime is None or not hasattr(onnxruntime, "InferenceSession"):
        wheels = ", ".join(_onnxruntime_wheels()) or "no ONNX Runtime wheel"
        raise PipelineError(
            f"onnxruntime cannot be imported whole ({wheels} installed): the CPU and GPU wheels share one "
            "folder, and removing one of them breaks the other",
            "pip uninstall -y onnxruntime onnxruntime-gpu, then install one of them: the `cpu` extra "
            "(onnxruntime) or, on a machine with an NVIDIA GPU, the `gpu` extra (onnxruntime-gpu)",
        )
    return onnxruntime


def _onnxruntime_wheels() -> list[str]:
    installed = []
    for name in ("onnxruntime", "onnxruntime-gpu"):
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        installed.append(name)
    return installed
