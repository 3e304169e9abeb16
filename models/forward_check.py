"""The load-time check: one eval-mode forward pass on the example inputs, and the output names it gives."""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..pipeline.core.errors import PipelineError
from ..pipeline.core.settings import mention, mention_name
from .inputs import INPUT_SHAPE_FORMS
from .spec import call_module, first_line, first_lines, named_outputs

# What torch says where the model calls an operator this install cannot run: torchvision's C++ operators did not load
# (a torchvision built for another torch), or an operator is registered for another device only (a GPU-only
# extension's).  No input shape fixes either.
MISSING_OPERATOR = re.compile(
    r"Couldn't load custom C\+\+ ops|Could not run '[^']+' with arguments from the '\w+' backend"
)


def run_example_forward(module: nn.Module, example_inputs: dict[str, torch.Tensor], input_shape: str | None) -> Any:
    """One eval-mode forward pass on the example inputs; a PipelineError says which shape did not fit."""
    with torch.no_grad(), _temporarily_eval(module):
        try:
            return call_module(module, example_inputs)
        except RecursionError as exc:  # a RuntimeError too: not a shape that did not fit
            raise PipelineError(
                f"the model's forward() went deeper than Python's recursion limit ({sys.getrecursionlimit()} "
                f"frames) on {describe_inputs(example_inputs)}: {first_lines(exc)}",
                "make forward() loop over its layers instead of recursing (or nesting modules) that deep",
            ) from None
        # RuntimeError: shape mismatches; IndexError: ids out of an embedding; TypeError: wrong
        # number of inputs; AssertionError: a torch.export program's input guards.
        except (RuntimeError, ValueError, IndexError, TypeError, AssertionError) as exc:
            if MISSING_OPERATOR.search(str(exc)):
                raise _missing_operator(exc) from None
            given = f"{mention(input_shape=input_shape)} gave" if input_shape else "the example inputs are"
            raise PipelineError(
                f"the model does not accept its inputs: {given} {describe_inputs(example_inputs)}; "
                f"torch says: {first_lines(exc)}",
                f"give {mention_name('input_shape')} that fits the model's forward: {INPUT_SHAPE_FORMS}",
            ) from exc


def _missing_operator(error: BaseException) -> PipelineError:
    return PipelineError(
        f"the model calls an operator this install cannot run here: {first_line(error)}",
        f"install the library that provides it as built for this torch ({torch.__version__}); for torchvision, the "
        "release paired with it (pip install torchvision, unpinned, picks it); an operator written for a GPU alone "
        "needs a machine and a build with one",
    )


# The deepest nesting of modules the pipeline walks.  torch recurses once per level in eval() and named_modules(), and
# three or more frames per level in forward() and the exporters (TorchScript's tracer failed at 190 levels of a module
# that calls the next); past Python's recursion limit that is a RecursionError wherever it happens first.  Half the
# measured depth leaves room for the frames of a service or a test runner around the call.
MAX_MODULE_DEPTH = 96


def refuse_deep_nesting(module: nn.Module, model: str) -> None:
    """Refuse a module tree nested deeper than MAX_MODULE_DEPTH, measured without recursing."""
    deepest, seen = ("", 0), {id(module)}
    stack = [(module, "", 0)]
    while stack:
        parent, path, depth = stack.pop()
        deepest = max(deepest, (path, depth), key=lambda pair: pair[1])
        for name, child in parent.named_children():
            if id(child) not in seen:  # a module shared by two parents is walked once
                seen.add(id(child))
                stack.append((child, f"{path}.{name}" if path else name, depth + 1))
    path, depth = deepest
    if depth > MAX_MODULE_DEPTH:
        shown = path if len(path) <= 80 else f"{path[:40]}...{path[-36:]}"
        raise PipelineError(
            f"MODEL={model!r} nests modules {depth} deep ({shown}), deeper than the {MAX_MODULE_DEPTH} levels the "
            "pipeline can walk: torch's eval(), forward() and the exporters recurse at every level, past Python's "
            "recursion limit",
            "keep the layers side by side, in one nn.Sequential or nn.ModuleList that forward() loops over, instead "
            "of each wrapping the next",
        )


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
