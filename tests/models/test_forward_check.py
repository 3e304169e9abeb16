"""The load-time forward pass: an error torch raises there is named for what it is."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trt_pipeline.models import forward_check
from trt_pipeline.pipeline.core.errors import PipelineError

# An operator registered for a GPU alone, as a CUDA-only extension registers its kernels.
_LIBRARY = torch.library.Library("trt_pipeline_test", "DEF")
_LIBRARY.define("gpu_only(Tensor x) -> Tensor")
_LIBRARY.impl("gpu_only", lambda x: x.clone(), "CUDA")


class _CallsGpuOnly(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.trt_pipeline_test.gpu_only(x)


class _TorchvisionWithoutItsOps(nn.Module):
    """What a detector's NMS raises where torchvision was built for another torch (torchvision's own words)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(
            "Couldn't load custom C++ ops. This can happen if your PyTorch and torchvision versions are incompatible"
        )


@pytest.mark.parametrize("module", [_CallsGpuOnly(), _TorchvisionWithoutItsOps()], ids=["gpu-only", "torchvision"])
def test_an_operator_the_install_cannot_run_is_named_not_blamed_on_the_input_shape(module: nn.Module):
    with pytest.raises(PipelineError, match="calls an operator this install cannot run here") as caught:
        forward_check.run_example_forward(module, {"x": torch.zeros(2, 3)}, "3")
    assert "input_shape" not in caught.value.fix and torch.__version__ in caught.value.fix
    with pytest.raises(PipelineError, match="the model does not accept its inputs") as caught:  # a shape, still
        forward_check.run_example_forward(nn.Linear(4, 2), {"input": torch.zeros(2, 3)}, "3")
    assert "input_shape" in caught.value.fix
