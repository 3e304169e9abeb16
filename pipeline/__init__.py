"""Export-and-deploy pipeline: PyTorch model -> checked ONNX -> TensorRT engine -> runner.

The Python API mirrors the command line: one `Settings` object, and stages that
are plain functions from artifact to artifact.  Names load on first use, so
`import pipeline` needs neither a GPU, TensorRT nor even torch.
"""

from __future__ import annotations

import importlib
from importlib import metadata

try:
    __version__ = metadata.version("trt-pipeline")
except metadata.PackageNotFoundError:  # a checkout that was never installed
    __version__ = "0+unknown"

_API = {
    "PipelineError": "pipeline.errors",
    "Settings": "pipeline.settings",
    "BatchProfile": "pipeline.settings",
    "make_engine": "pipeline.stages",
    "run_stage": "pipeline.stages",
    "prepare": "pipeline.prepare",
    "export_onnx": "pipeline.export",
    "check_onnx": "pipeline.check",
    "simplify_onnx": "pipeline.simplify",
    "check_parity": "pipeline.parity",
    "convert_fp16": "pipeline.precision",
    "build_engine": "pipeline.build",
    "compare": "pipeline.compare",
    "load_runner": "pipeline.runners",
}

__all__ = sorted([*_API, "__version__"])


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    # help() and tab completion list the API, not only what has loaded so far.
    return sorted({*globals(), *_API})
