"""The built-in models: a name maps to a builder that takes an optional weights file.

To add a model, write a builder `(weights: Path | None) -> ModelSpec` in its own module
and add one line to REGISTRY.  The builder's source file is part of the model's
fingerprint, so editing it invalidates cached artifacts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from . import digits, resnet
from .spec import ModelSpec

REGISTRY: dict[str, Callable[[Path | None], ModelSpec]] = {
    "resnet18": resnet.resnet18_spec,
    "resnet34": resnet.resnet34_spec,
    "resnet50": resnet.resnet50_spec,
    "resnet101": resnet.resnet101_spec,
    "resnet152": resnet.resnet152_spec,
    "digits": digits.digits_spec,
}

# Short names users type; each maps to a REGISTRY key.
ALIASES: dict[str, str] = {"resnet": "resnet50"}
