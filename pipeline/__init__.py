"""Export-and-deploy pipeline: PyTorch model -> checked ONNX -> TensorRT engine -> runner.

The Python API mirrors the command line: one `Settings` object, and stages that
are plain functions from artifact to artifact.  Names load on first use, so
`import pipeline` needs neither a GPU, TensorRT nor even torch.
"""

from __future__ import annotations

import importlib

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

__all__ = sorted(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    return getattr(importlib.import_module(_API[name]), name)
