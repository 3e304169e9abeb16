"""The PyTorch runner (pipeline/runners/torch.py), beyond the contract every runner shares."""

from __future__ import annotations

import pytest

from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.trt_module import gpu_present
from trt_pipeline.pipeline.runners import load_runner


@pytest.mark.skipif(gpu_present(), reason="on a GPU host torch may have CUDA")
def test_the_torch_runner_refuses_a_cuda_device_it_has_not_before_loading_the_model(folders):
    with pytest.raises(PipelineError, match="device='cuda': torch .* has no such CUDA device here"):
        load_runner(folders["tiny_cnn"], "torch", device="cuda")
