"""Shared test setup: the `gpu` marker skips, with the reason, wherever the engine cannot run.

Availability is computed once per session (the first time a gpu-marked test is collected) from
what is really usable: an NVIDIA GPU and driver, a TensorRT module that imports (not the stubs'
empty package), and a device-memory layer (pycuda or cuda-python).
"""

from __future__ import annotations

import functools

import pytest


@functools.cache
def gpu_skip_reason() -> str | None:
    """None where gpu tests can run here, else why not (shown in pytest's skip summary)."""
    from pipeline.errors import PipelineError
    from pipeline.runners.device_memory import available_layers
    from pipeline.trt_module import gpu_present, import_trt

    if not gpu_present():
        return "no NVIDIA GPU/driver on this machine (libcuda.so.1 missing or cuInit failed)"
    try:
        import_trt("auto")
    except PipelineError as error:
        return f"a GPU is present but no TensorRT runtime imports: {error.problem}"
    if not available_layers():
        return "a GPU is present but neither pycuda nor cuda-python (cuda.bindings) imports"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    reason = gpu_skip_reason() if gpu_items else None
    if reason is not None:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))
