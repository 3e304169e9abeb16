"""What every model source (registry, factory, checkpoint, TorchScript, ExportedProgram) yields."""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..pipeline.core.errors import PipelineError


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


# ---------------------------------------------------------------- calling forward by name


def forward_parameters(module: torch.nn.Module) -> list[str] | None:
    """The names forward() takes, in order; None where Python cannot say (TorchScript, torch.export, *args)."""
    forward = inspect.getattr_static(type(module), "forward", None)  # TorchScript's class attribute raises on get
    names = _forward_parameters_of(forward) if callable(forward) else None
    return list(names) if names is not None else None


@functools.cache
def _forward_parameters_of(forward: Any) -> tuple[str, ...] | None:
    # Once per class's forward: the torch runner calls it on every request, and inspect.signature is slow.
    try:
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError, AttributeError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    named = tuple(p.name for p in parameters if p.kind in kinds)[1:]  # the class's function: drop `self`
    return named or None


def needs_keywords(module: torch.nn.Module, inputs: Mapping[str, Any]) -> bool:
    """Whether passing the inputs by position would feed one into another parameter: they are named after
    forward()'s parameters but skip one (forward(x, mask=None, scale=None) given x and scale).

    Otherwise a call passes them by position, which every kind of module takes (torch.export's modules
    refuse keywords).
    """
    names = forward_parameters(module)
    return names is not None and set(inputs) <= set(names) and list(inputs) != names[: len(inputs)]


def call_module(module: torch.nn.Module, inputs: Mapping[str, Any]) -> Any:
    """forward() with each input bound to the parameter of its name."""
    return module(**inputs) if needs_keywords(module, inputs) else module(*inputs.values())


# ---------------------------------------------------------------- what forward() returns, by name


def named_outputs(outputs: object) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) in export order, each named by its path: a dict's keys joined with '.', a tuple's
    positions (`{"logits": a, "aux": (b, c)}` -> logits, aux.0, aux.1).  At the top a tuple's tensors are
    output_0, output_1, ... and a lone tensor (or a tuple of one) is `output`."""
    named = _named(outputs, "")
    if not named:  # an ONNX graph needs an output: ONNX Runtime refuses one without ("OrtValue indexes ...")
        raise PipelineError(
            f"the model returned {outputs!r}, which holds no tensor: there is nothing to export or to serve",
            "return at least one tensor from forward()",
        )
    if len(named) == 1 and not isinstance(outputs, dict):
        return [("output", named[0][1])]
    return named


def _named(outputs: object, path: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(outputs, torch.Tensor):
        return [(path or "output", outputs)]
    if isinstance(outputs, dict):  # transformers' ModelOutput too: it leaves out the fields that are None
        return [pair for key, value in outputs.items() for pair in _named(value, _join(path, str(key)))]
    if isinstance(outputs, (tuple, list)):
        return [
            pair
            for i, value in enumerate(outputs)
            for pair in _named(value, _join(path, str(i)) if path else f"output_{i}")
        ]
    raise PipelineError(
        f"the model returned a {type(outputs).__name__}"
        + (f" at {path!r}" if path else "")
        + ", which cannot be exported",
        "return tensors from forward(): a tensor, or tuples/lists and dicts of tensors, nested as you like",
    )


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# ---------------------------------------------------------------- an exception's words for one line of an error


_COLOURS = re.compile(r"\x1b\[[0-9;]*m")  # a terminal's colour codes: ESC [ numbers m


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, without a terminal's colour codes (torch.export's have them)."""
    return (_COLOURS.sub("", str(exc)).strip().splitlines() or [type(exc).__name__])[0]


def first_lines(exc: BaseException, count: int = 4) -> str:
    lines = [line for line in _COLOURS.sub("", str(exc)).strip().splitlines() if line.strip()]
    return " | ".join(lines[:count]) or type(exc).__name__
