"""Shared test setup: the `gpu` and `engine` markers skip, with the reason, where their hardware is missing.

Availability is computed once per session (the first time a marked test is collected) from what
is really usable.  `gpu`: an NVIDIA GPU and driver and a device-memory layer (pycuda or
cuda-python).  `engine`: that, plus a TensorRT module that imports (not the stubs' empty package)
and runs engines on this GPU: TensorRT-RTX refuses Hopper (H100, H200) whatever the build targets.
"""

from __future__ import annotations

import functools

import pytest


@functools.cache
def gpu_skip_reason() -> str | None:
    """None where gpu tests can run here, else why not (shown in pytest's skip summary)."""
    from trt_pipeline.pipeline.core.trt_module import gpu_present
    from trt_pipeline.pipeline.runners.device_memory import available_layers

    if not gpu_present():
        return "no NVIDIA GPU/driver on this machine (libcuda.so.1 missing or cuInit failed)"
    if not available_layers():
        return "a GPU is present but neither pycuda nor cuda-python (cuda.bindings) imports"
    return None


@functools.cache
def engine_skip_reason() -> str | None:
    """None where a TensorRT engine can run on this machine's GPU, else why not."""
    from trt_pipeline.pipeline.core.errors import PipelineError
    from trt_pipeline.pipeline.core.trt_module import RTX_RUNTIME_TARGETS, describe_gpu, import_trt, is_rtx, rtx_runs_on

    reason = gpu_skip_reason()
    if reason is not None:
        return reason
    try:
        trt = import_trt("auto")
    except PipelineError as error:
        return f"a GPU is present but no TensorRT runtime imports: {error.problem}"
    gpu = describe_gpu(0) or {}
    capability = gpu.get("compute_capability", "?")
    if is_rtx(trt) and not rtx_runs_on(capability):
        return (
            f"{gpu.get('name')} (compute capability {capability}) does not run TensorRT-RTX engines (its runtime "
            f"runs on {', '.join(RTX_RUNTIME_TARGETS)} and later) and the full TensorRT is not installed"
        )
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for marker, reason_for in (("engine", engine_skip_reason), ("gpu", gpu_skip_reason)):
        marked = [item for item in items if item.get_closest_marker(marker)]
        reason = reason_for() if marked else None
        if reason is not None:
            for item in marked:
                item.add_marker(pytest.mark.skip(reason=reason))


# Fixtures that several test files share, defined once.
pytest_plugins = [
    "tests.helpers.digits_int8",
    "tests.helpers.folder_builds",
    "tests.helpers.model_fixtures",
    "tests.helpers.runner_folders",
    "tests.helpers.serve_fixtures",
]
