"""The models benchmarks/scale.py builds, each a factory the pipeline loads as MODEL=scale_models:<name>.

A family grows one model's weights through sizes; benchmarks/scale.py's FAMILIES names the members.  The
weights are random (seeded): the stages' cost depends on the bytes and the graph, not on what the weights say.
"""

from __future__ import annotations

import torch
from torch import nn


def mlp(layers: int, width: int) -> tuple[nn.Module, torch.Tensor]:
    """`layers` x (Linear(width, width) + GELU): layers * (width + 1) * width FP32 parameters."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]
    return nn.Sequential(*blocks), torch.randn(1, width)


# The MLP family's sizes, by their FP32 weights; 1.2 GB and 2.4 GB are issue 38's models.
def mlp_100mb() -> tuple[nn.Module, torch.Tensor]:
    return mlp(6, 2048)  # 25.2M parameters, 0.10 GB


def mlp_600mb() -> tuple[nn.Module, torch.Tensor]:
    return mlp(9, 4096)  # 151M parameters, 0.60 GB


def mlp_1200mb() -> tuple[nn.Module, torch.Tensor]:
    return mlp(18, 4096)  # 302M parameters, 1.21 GB


def mlp_2400mb() -> tuple[nn.Module, torch.Tensor]:
    return mlp(9, 8192)  # 604M parameters, 2.42 GB: past protobuf's 2 GB


def mlp_5gb() -> tuple[nn.Module, torch.Tensor]:
    return mlp(19, 8192)  # 1.28G parameters, 5.10 GB
