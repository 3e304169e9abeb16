"""benchmarks/sweep_models.py: the sweep's random weights give activations of a trained model's size."""

from __future__ import annotations

import torch
from torch import nn

from benchmarks.sweep_models import _batchnorm_settled


def _shrinking_cnn() -> nn.Sequential:
    """Ten convolutions, each scaling its input down by about 4 (their weights drawn small), each with a BatchNorm
    at torchvision's init: unsettled, the output is about 4**-10 of the input."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(10):
        conv = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        nn.init.normal_(conv.weight, std=0.25 / (8 * 9) ** 0.5)
        layers += [conv, nn.BatchNorm2d(8)]
    return nn.Sequential(nn.Conv2d(3, 8, 1), *layers)


def test_settled_batchnorms_keep_the_activations_at_the_inputs_size() -> None:
    images = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        unsettled = _shrinking_cnn().eval()(images).std().item()
        model = _batchnorm_settled(_shrinking_cnn(), images)
        settled = model(images).std().item()
    assert unsettled < 1e-4  # the failure: a float16 graph of it computes zeros
    assert 0.5 < settled < 2  # each BatchNorm normalizes what it sees, as after training
    assert not model.training  # handed back in eval mode, each momentum as it was
    assert all(norm.momentum == 0.1 for norm in model.modules() if isinstance(norm, nn.BatchNorm2d))
