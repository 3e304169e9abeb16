"""trt-pipeline: a PyTorch model to a verified TensorRT engine, and a runner services import.

    from trt_pipeline import load_runner
    with load_runner("engines/resnet50-fp16") as runner:
        outputs = runner.infer({"input": images})

The command line is `trt-pipeline` (or `python -m trt_pipeline`); its subcommands mirror the
`make` targets.  The code lives in three subpackages, the repository's top-level folders:
`trt_pipeline.pipeline` (stages, runners, service), `trt_pipeline.models` (the model registry
and user models) and `trt_pipeline.calibration` (INT8).  One distribution-named package, so a
project with its own `models` or `pipeline` package keeps them.

Names load on first use: `import trt_pipeline` and the runners need neither a GPU, TensorRT
nor torch; the build stages import torch when called.
"""

from __future__ import annotations

import importlib
from importlib import metadata

try:
    __version__ = metadata.version("trt-pipeline")
except metadata.PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"

# The public API: name -> the module that defines it.
_API = {
    "load_runner": "trt_pipeline.pipeline.runners",
    "Settings": "trt_pipeline.pipeline.core.settings",
    "BatchProfile": "trt_pipeline.pipeline.core.settings",
    "PipelineError": "trt_pipeline.pipeline.core.errors",
    "make_engine": "trt_pipeline.pipeline.stages.sequence",
    "run_stage": "trt_pipeline.pipeline.stages.sequence",
    "prepare": "trt_pipeline.models.prepare",
    "export_onnx": "trt_pipeline.pipeline.stages.export",
    "check_onnx": "trt_pipeline.pipeline.stages.check",
    "simplify_onnx": "trt_pipeline.pipeline.stages.simplify",
    "check_parity": "trt_pipeline.pipeline.stages.parity",
    "convert_fp16": "trt_pipeline.pipeline.stages.fp16",
    "build_engine": "trt_pipeline.pipeline.stages.build",
    "compare": "trt_pipeline.pipeline.core.compare",
}

__all__ = sorted([*_API, "__version__"])


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'trt_pipeline' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    # help(trt_pipeline) and tab completion list the API, not only what has loaded so far.
    return sorted({*globals(), *_API})
