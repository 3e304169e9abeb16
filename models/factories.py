"""MODEL=package.module:factory: import it, call it, and name what it returned (inputs bound to forward())."""

from __future__ import annotations

import importlib
import os
import re
import sys
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..pipeline.core.errors import PipelineError
from ..pipeline.core.settings import mention, mention_name
from .inputs import SINGLE_INPUT_NAME
from .spec import ModelSpec, first_line, forward_parameters

FACTORY_PATTERN = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def is_factory_reference(text: str) -> bool:
    return bool(FACTORY_PATTERN.match(text))


def import_factory(reference: str) -> tuple[Any, Path | None]:
    """Import `package.module:attr` with the current directory on sys.path, as uvicorn does.

    Returns the attribute and the module's source file (part of the fingerprint).
    """
    module_name, _, attr_path = reference.partition(":")
    put_cwd_on_sys_path()
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module: any error while importing it is theirs to fix
        raise PipelineError(
            f"{mention(model=reference)}: importing module {module_name!r} failed: {type(exc).__name__}: {exc}",
            "run from the directory that contains the package (it is put on sys.path) and fix the import error",
        ) from exc
    target: Any = module
    for attr in attr_path.split("."):
        if not hasattr(target, attr):
            public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
            raise PipelineError(
                f"{mention(model=reference)}: module {module_name!r} has no attribute {attr_path!r}",
                f"name one of its callables: {', '.join(public[:12]) or '(none)'}",
            )
        target = getattr(target, attr)
    if not callable(target):
        raise PipelineError(
            f"{mention(model=reference)} is a {type(target).__name__}, not a function",
            f"point {mention_name('model')} at a function that returns a ModelSpec, an nn.Module or "
            "(module, example_inputs)",
        )
    source = getattr(module, "__file__", None)
    return target, Path(source) if source else None


def call_factory(factory: Any, reference: str) -> Any:
    """Call the user's factory; an exception in it is theirs to fix, so it says where, without a traceback."""
    try:
        return factory()
    except (Exception, SystemExit) as exc:  # sys.exit() in a factory would otherwise end the run with no word
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        raise PipelineError(
            f"{mention(model=reference)}: the factory raised {type(exc).__name__}: {first_line(exc)} "
            f"(at {frame.filename}:{frame.lineno})",
            "fix the factory so that it returns a ModelSpec, an nn.Module or (module, example_inputs)",
        ) from exc


def put_cwd_on_sys_path() -> None:
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    importlib.invalidate_caches()  # a module written since the last import must still be found


def spec_from_factory_result(result: Any, reference: str) -> ModelSpec:
    """Normalise what a factory returned; example_inputs stays empty for a bare nn.Module."""
    if isinstance(result, ModelSpec):
        _check_spec_fields(result, reference)
        return result
    if isinstance(result, nn.Module):
        return ModelSpec(name=reference, module=result, example_inputs={})
    if isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], nn.Module):
        return ModelSpec(name=reference, module=result[0], example_inputs=name_example_inputs(result[1], reference))
    raise PipelineError(
        f"{mention(model=reference)} returned a {type(result).__name__}, which is not a model",
        f"return a ModelSpec, an nn.Module (with {mention_name('input_shape')}), or (module, example_inputs) where "
        "example_inputs "
        "is a tensor, a tuple of tensors or a dict name -> tensor",
    )


def name_example_inputs(examples: Any, reference: str) -> dict[str, torch.Tensor]:
    """A tensor -> {"input": t}; a tuple/list -> input_0, input_1, ...; a mapping of tensors (a dict, a
    tokenizer's BatchEncoding) as a dict."""
    if isinstance(examples, torch.Tensor):
        named = {SINGLE_INPUT_NAME: examples}
    elif isinstance(examples, (tuple, list)):
        named = dict(zip(tuple_input_names(len(examples)), examples, strict=True))
    elif isinstance(examples, Mapping):
        named = dict(examples.items())
    else:
        named = {}
    if not named or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in named.items()):
        raise PipelineError(
            f"{mention(model=reference)}: example inputs must be a tensor, a tuple/list of tensors or a dict "
            f"name -> tensor, got {_describe_examples(examples)}",
            "return (module, example_inputs) with tensors whose dim 0 is the batch (a tokenizer: return_tensors='pt')",
        )
    for name, tensor in named.items():
        if tensor.dim() == 0:
            raise PipelineError(
                f"{mention(model=reference)}: example input {name!r} is a scalar; dim 0 must be the batch",
                "give example inputs with a batch dim, e.g. torch.randn(2, 3, 224, 224)",
            )
    return named


def tuple_input_names(count: int) -> list[str]:
    """The names a tuple of example inputs takes until bind_to_forward gives it forward()'s parameter names."""
    return [f"input_{i}" for i in range(count)]


def _describe_examples(examples: Any) -> str:
    if isinstance(examples, Mapping):
        kinds = sorted({type(value).__name__ for value in examples.values()})
        return f"a {type(examples).__name__} of {', '.join(kinds) or 'nothing'}"
    return type(examples).__name__


def bind_to_forward(module: nn.Module, example_inputs: dict[str, torch.Tensor], model: str) -> dict[str, torch.Tensor]:
    """The example inputs named and ordered as forward()'s parameters, so no input can feed another's parameter.

    Named after parameters: kept, in forward()'s order (the ONNX graph's inputs follow it).  A tuple of any
    length (input_0, input_1, ...): renamed to forward()'s first parameters.  One other input (a bare tensor's
    "input"): bound by position.  Several
    inputs named otherwise: refused, since binding them by position could feed one into another's parameter.
    """
    names = forward_parameters(module)
    if names is None:
        return example_inputs
    if set(example_inputs) <= set(names):
        return {name: example_inputs[name] for name in names if name in example_inputs}
    if list(example_inputs) == tuple_input_names(len(example_inputs)) and len(example_inputs) <= len(names):
        return dict(zip(names, example_inputs.values(), strict=False))
    if len(example_inputs) == 1:
        return example_inputs
    unknown = [name for name in example_inputs if name not in names]
    raise PipelineError(
        f"{mention(model=model)}: example inputs {unknown} are not parameters of forward({', '.join(names)})",
        "name each example input after the forward() parameter it feeds (a dict name -> tensor), or give them "
        "as a tuple in forward()'s order",
    )


def _check_spec_fields(spec: ModelSpec, reference: str) -> None:
    if not isinstance(spec.module, nn.Module):
        raise PipelineError(
            f"{mention(model=reference)} returned a ModelSpec whose module is a {type(spec.module).__name__}",
            "set ModelSpec.module to the nn.Module",
        )
    if spec.example_inputs:
        spec.example_inputs = name_example_inputs(spec.example_inputs, reference)
