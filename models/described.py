"""Example inputs a model describes itself, so that a factory (or a pickled module) may hand it over bare, as a
folder does: a transformers model's config and the processor files beside it (models.huggingface), or the
`pretrained_cfg` timm keeps on each model it creates (the `input_size` it was trained at)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from . import huggingface, inputs
from .spec import ModelSpec


def described_inputs(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Example inputs from what `spec.module` records of them (a note in `spec` says where from); {} where it records
    nothing, so INPUT_SHAPE is required."""
    if huggingface.is_transformers_model(spec.module):
        return huggingface.derived_example_inputs(spec.module)
    size = _timm_input_size(spec.module)
    if size is None:
        return {}
    spec.notes.append(f"input {'x'.join(map(str, size))} from the model's pretrained_cfg (timm's input_size)")
    return inputs.example_inputs_from_shapes([inputs.InputShape(inputs.SINGLE_INPUT_NAME, size, torch.float32)])


def _timm_input_size(module: nn.Module) -> tuple[int, ...] | None:
    """(channels, height, width) from a timm model's pretrained_cfg (default_cfg in older timm), where it gives
    one."""
    config = getattr(module, "pretrained_cfg", None) or getattr(module, "default_cfg", None)
    size = config.get("input_size") if isinstance(config, Mapping) else None
    if isinstance(size, (tuple, list)) and size and all(huggingface.positive_int(dim) for dim in size):
        return tuple(size)
    return None
