"""The device-memory layers (pipeline/runners/device_memory.py): an unknown or unusable one is refused with the fix."""

from __future__ import annotations

import pytest

from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.runners.device_memory import available_layers, open_device_memory


def test_device_memory_layer_refusals():
    with pytest.raises(PipelineError, match="unknown device-memory layer 'numba'"):
        open_device_memory("numba")
    missing = [layer for layer in ("pycuda", "cuda-python") if layer not in available_layers()]
    for layer in missing:
        with pytest.raises(PipelineError, match=f"device-memory layer '{layer}' is not usable here") as caught:
            open_device_memory(layer)
        assert "pip install pycuda" in str(caught.value)
