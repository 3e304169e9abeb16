"""What every model source (registry, factory, checkpoint, TorchScript, ExportedProgram) yields."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DynamicAxis:
    """A dynamic axis besides the batch, with the range the engine profile covers."""

    name: str
    min: int
    opt: int
    max: int


@dataclass(frozen=True)
class ImagePreprocess:
    """How raw images become model input; shared by calibration, the runner and the benchmark."""

    resize: int = 256
    crop: int = 224
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    grayscale: bool = False


@dataclass
class ModelSpec:
    """A loaded model with everything export needs.

    `example_inputs` maps input names to example tensors whose dim 0 is the batch.
    `dynamic_axes` declares axes besides the batch (e.g. a sequence length).
    `fingerprint` identifies code and weights, so a rerun can reuse artifacts.
    """

    name: str
    module: torch.nn.Module
    example_inputs: dict[str, torch.Tensor]
    output_names: list[str] | None = None
    dynamic_axes: dict[str, dict[int, DynamicAxis]] = field(default_factory=dict)
    preprocess: ImagePreprocess | None = None
    fingerprint: str = ""
    notes: list[str] = field(default_factory=list)
