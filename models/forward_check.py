"""The load-time check: one eval-mode forward pass on the example inputs, and the output names it gives."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..pipeline.core.errors import PipelineError
from ..pipeline.core.settings import mention, mention_name
from .inputs import INPUT_SHAPE_FORMS
from .spec import call_module, first_lines, named_outputs


def run_example_forward(module: nn.Module, example_inputs: dict[str, torch.Tensor], input_shape: str | None) -> Any:
    """One eval-mode forward pass on the example inputs; a PipelineError says which shape did not fit."""
    with torch.no_grad(), _temporarily_eval(module):
        try:
            return call_module(module, example_inputs)
        # RuntimeError: shape mismatches; IndexError: ids out of an embedding; TypeError: wrong
        # number of inputs; AssertionError: a torch.export program's input guards.
        except (RuntimeError, ValueError, IndexError, TypeError, AssertionError) as exc:
            given = f"{mention(input_shape=input_shape)} gave" if input_shape else "the example inputs are"
            raise PipelineError(
                f"the model does not accept its inputs: {given} {describe_inputs(example_inputs)}; "
                f"torch says: {first_lines(exc)}",
                f"give {mention_name('input_shape')} that fits the model's forward: {INPUT_SHAPE_FORMS}",
            ) from exc


@contextlib.contextmanager
def _temporarily_eval(module: nn.Module) -> Iterator[None]:
    """Eval mode for the check (train mode would update BatchNorm statistics); the mode is restored,
    because putting the model in eval mode for export is the prepare stage's job."""
    was_training = module.training
    switched = _switch_to_eval(module)
    try:
        yield
    finally:
        if switched:
            module.train(was_training)


def _switch_to_eval(module: nn.Module) -> bool:
    try:
        module.eval()
    except NotImplementedError:
        # torch.export's unlifted module refuses eval(): its mode was fixed when it was exported.
        return False
    return True


def output_names_from(outputs: Any) -> list[str]:
    """Each returned tensor's name, by its place in what forward() returns (spec.named_outputs)."""
    return [name for name, _ in named_outputs(outputs)]


def describe_inputs(example_inputs: dict[str, torch.Tensor]) -> str:
    return ", ".join(
        f"{name}={list(t.shape)} {str(t.dtype).removeprefix('torch.')}" for name, t in example_inputs.items()
    )
