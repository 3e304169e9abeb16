"""Users' own models: a factory, a checkpoint, a TorchScript or an ExportedProgram file.

`models.load_model` decides which form a MODEL string is and calls the loaders here;
this module also holds the two small grammars users type and the state_dict helpers the
registry builders share.

INPUT_SHAPE grammar (the example batch, 2, is added in front of every shape):
    3x224x224                              one input named "input", dims without the batch
    3x224x224:float16                      the same with a dtype
    input_ids=128:int64,attention_mask=128:int64
                                           named inputs, in the order forward() takes them
    DIMS is positive whole numbers joined by "x"; dtype is one of DTYPES (default float32).
    Float inputs get standard-normal example values; integer inputs get values in 0..9
    (valid token ids / indices for almost any model); bool inputs get random booleans.

DYNAMIC grammar (axes besides the batch, which is always dynamic and set by BATCH):
    NAME:AXIS[=MIN:OPT:MAX][,NAME:AXIS[=MIN:OPT:MAX]...]
    e.g. input_ids:1=1:64:128,attention_mask:1=1:64:128
    Without a range: min 1, opt = max = the example size on that axis.
    Naming: inputs that declare the same axis index with the same MIN:OPT:MAX share one
    DynamicAxis, named `<first input>_dim<axis>` (above: `input_ids_dim1` on both), so the
    ONNX graph gets one symbolic dim and the engine profile one range.  A single input's
    axis is named the same way.  To keep two axes independent, give them different ranges.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import os
import pickle
import re
import sys
import traceback
import types
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models.spec import DynamicAxis, ModelSpec, call_module, forward_parameters
from pipeline.errors import PipelineError

EXAMPLE_BATCH = 2  # not 1: exporters can specialise a batch of 1 into a constant
SINGLE_INPUT_NAME = "input"
INTEGER_EXAMPLE_HIGH = 10  # integer example values are drawn from 0..9
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
    "double": torch.float64,
    "int64": torch.int64,
    "long": torch.int64,
    "int32": torch.int32,
    "int": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
INPUT_SHAPE_FORMS = (
    "DIMS without the batch (e.g. 3x224x224) or name=DIMS[:dtype],... "
    "(e.g. input_ids=128:int64,attention_mask=128:int64)"
)
INPUT_SHAPE_HELP = f"give INPUT_SHAPE as {INPUT_SHAPE_FORMS}"
DYNAMIC_HELP = "give DYNAMIC as NAME:AXIS[=MIN:OPT:MAX],... (e.g. input_ids:1=1:64:128,attention_mask:1=1:64:128)"
FACTORY_PATTERN = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_NAME_PATTERN = re.compile(r"^[A-Za-z_][\w.\-]*$")
_DIMS_PATTERN = re.compile(r"^\d+(x\d+)*$")


# ---------------------------------------------------------------- INPUT_SHAPE


@dataclass(frozen=True)
class InputShape:
    """One input as the user described it: dims exclude the batch."""

    name: str
    dims: tuple[int, ...]
    dtype: torch.dtype


def parse_input_shape(text: str) -> list[InputShape]:
    """Parse the INPUT_SHAPE grammar (see the module docstring)."""
    parts = [part.strip() for part in text.split(",")]
    if len(parts) == 1 and "=" not in parts[0]:
        return [_parse_one_input(SINGLE_INPUT_NAME, parts[0], text)]
    shapes = []
    for part in parts:
        name, equals, rest = part.partition("=")
        if not equals or not _NAME_PATTERN.match(name.strip()):
            raise PipelineError(f"INPUT_SHAPE={text!r}: {part!r} is not name=DIMS[:dtype]", INPUT_SHAPE_HELP)
        shapes.append(_parse_one_input(name.strip(), rest.strip(), text))
    names = [shape.name for shape in shapes]
    if len(set(names)) != len(names):
        raise PipelineError(f"INPUT_SHAPE={text!r} names an input twice", "name each input once")
    return shapes


def _parse_one_input(name: str, dims_and_dtype: str, text: str) -> InputShape:
    dims, _, dtype_name = dims_and_dtype.partition(":")
    dims = dims.strip().lower()
    if not _DIMS_PATTERN.match(dims):
        raise PipelineError(
            f"INPUT_SHAPE={text!r}: {dims!r} is not dims like 3x224x224 (whole numbers joined by x)", INPUT_SHAPE_HELP
        )
    dtype_name = dtype_name.strip().lower() or "float32"
    if dtype_name not in DTYPES:
        raise PipelineError(
            f"INPUT_SHAPE={text!r}: unknown dtype {dtype_name!r}", f"use one of {', '.join(sorted(DTYPES))}"
        )
    sizes = tuple(int(d) for d in dims.split("x"))
    if 0 in sizes:
        raise PipelineError(f"INPUT_SHAPE={text!r} has a zero-sized dim", "give every dim as 1 or more")
    return InputShape(name, sizes, DTYPES[dtype_name])


@contextlib.contextmanager
def seeded(seed: int = 0) -> Iterator[None]:
    """Same random weights and example inputs on every run, global RNG untouched: the runner
    reloads the model from its settings and must get the model the engine was built from."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


# The largest example tensor made from INPUT_SHAPE: the export holds several batches of them.
EXAMPLE_MAX_BYTES = 1 << 30


def example_tensor(dims: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An example tensor of the full shape (batch included) with values valid for its dtype."""
    nbytes = math.prod(dims) * torch.empty((), dtype=dtype).element_size()
    if nbytes > EXAMPLE_MAX_BYTES:
        raise PipelineError(
            f"an example input of shape {list(dims)} ({dtype}) would take {nbytes / 2**30:.3g} GiB",
            f"check INPUT_SHAPE: one example batch may take at most {EXAMPLE_MAX_BYTES >> 30} GiB per input",
        )
    if dtype == torch.bool:
        return torch.randint(0, 2, dims).bool()
    if dtype.is_floating_point:
        return torch.randn(dims).to(dtype)
    return torch.randint(0, INTEGER_EXAMPLE_HIGH, dims, dtype=dtype)


def example_inputs_from_shapes(shapes: list[InputShape]) -> dict[str, torch.Tensor]:
    with seeded():
        return {shape.name: example_tensor((EXAMPLE_BATCH, *shape.dims), shape.dtype) for shape in shapes}


# ---------------------------------------------------------------- DYNAMIC


@dataclass(frozen=True)
class DynamicRequest:
    """One NAME:AXIS[=MIN:OPT:MAX] item; `bounds` is None when the range was left out."""

    input_name: str
    axis: int
    bounds: tuple[int, int, int] | None


def parse_dynamic(text: str) -> list[DynamicRequest]:
    """Parse the DYNAMIC grammar (see the module docstring)."""
    requests = [_parse_one_dynamic(item.strip(), text) for item in text.split(",")]
    seen = [(r.input_name, r.axis) for r in requests]
    if len(set(seen)) != len(seen):
        raise PipelineError(f"DYNAMIC={text!r} declares the same axis twice", "declare each NAME:AXIS once")
    return requests


def _parse_one_dynamic(item: str, text: str) -> DynamicRequest:
    target, equals, bounds_text = item.partition("=")
    name, colon, axis_text = target.strip().rpartition(":")
    if not colon or not _NAME_PATTERN.match(name) or not axis_text.strip().isdigit():
        raise PipelineError(f"DYNAMIC={text!r}: {item!r} is not NAME:AXIS[=MIN:OPT:MAX]", DYNAMIC_HELP)
    axis = int(axis_text)
    if axis == 0:
        raise PipelineError(
            f"DYNAMIC={text!r}: axis 0 is the batch, which is always dynamic",
            "set the batch range with BATCH=min:opt:max and list only other axes in DYNAMIC",
        )
    if not equals:
        return DynamicRequest(name, axis, None)
    numbers = bounds_text.split(":")
    if len(numbers) != 3 or not all(n.strip().isdigit() for n in numbers):
        raise PipelineError(f"DYNAMIC={text!r}: range {bounds_text!r} is not MIN:OPT:MAX", DYNAMIC_HELP)
    low, opt, high = (int(n) for n in numbers)
    if not 1 <= low <= opt <= high:
        raise PipelineError(
            f"DYNAMIC={text!r}: range {bounds_text!r} is not ordered 1 <= MIN <= OPT <= MAX", DYNAMIC_HELP
        )
    return DynamicRequest(name, axis, (low, opt, high))


def dynamic_axes_from_requests(
    requests: list[DynamicRequest], example_inputs: dict[str, torch.Tensor], text: str
) -> dict[str, dict[int, DynamicAxis]]:
    """Turn parsed DYNAMIC items into ModelSpec.dynamic_axes, sharing one DynamicAxis per (axis, range)."""
    shared: dict[tuple[int, int, int, int], DynamicAxis] = {}
    first_size: dict[str, tuple[str, int]] = {}
    axes: dict[str, dict[int, DynamicAxis]] = {}
    for request in requests:
        size = _example_size_on_axis(request, example_inputs, text)
        low, opt, high = request.bounds or (1, size, size)
        if not low <= size <= high:
            raise PipelineError(
                f"DYNAMIC={text!r}: the example size of {request.input_name} on axis {request.axis} is {size}, "
                f"outside its range {low}:{opt}:{high}",
                "widen the range to include the example size, or change INPUT_SHAPE",
            )
        key = (request.axis, low, opt, high)
        axis = shared.setdefault(key, DynamicAxis(f"{request.input_name}_dim{request.axis}", low, opt, high))
        other_name, other_size = first_size.setdefault(axis.name, (request.input_name, size))
        if other_size != size:
            # One symbolic dim must have one example size, or export proves the dims unequal.
            raise PipelineError(
                f"DYNAMIC={text!r}: {other_name} and {request.input_name} share axis {request.axis} range "
                f"{low}:{opt}:{high} but their example sizes differ ({other_size} vs {size})",
                "give them the same example size in INPUT_SHAPE, or different ranges if they really vary independently",
            )
        axes.setdefault(request.input_name, {})[request.axis] = axis
    return axes


def _example_size_on_axis(request: DynamicRequest, example_inputs: dict[str, torch.Tensor], text: str) -> int:
    tensor = example_inputs.get(request.input_name)
    if tensor is None:
        raise PipelineError(
            f"DYNAMIC={text!r} names input {request.input_name!r}, which the model does not have",
            f"use the model's input names: {', '.join(example_inputs)}",
        )
    if request.axis >= tensor.dim():
        raise PipelineError(
            f"DYNAMIC={text!r}: {request.input_name} has {tensor.dim()} dims (batch included), no axis {request.axis}",
            f"give an axis from 1 to {tensor.dim() - 1}",
        )
    return tensor.shape[request.axis]


def check_dynamic_axes(spec: ModelSpec) -> None:
    """Every declared input axis exists and its range covers the example size (export fails otherwise)."""
    for name, axes in spec.dynamic_axes.items():
        tensor = spec.example_inputs.get(name)
        if tensor is None:
            continue  # an output's axis; outputs are only known after export
        for axis, dynamic in axes.items():
            if not 0 < axis < tensor.dim() or not dynamic.min <= tensor.shape[axis] <= dynamic.max:
                raise PipelineError(
                    f"dynamic axis {dynamic.name} ({name} axis {axis}, "
                    f"range {dynamic.min}:{dynamic.opt}:{dynamic.max}) "
                    f"does not fit the example input of shape {list(tensor.shape)}",
                    "give DYNAMIC or INPUT_SHAPE so that the example size lies inside the range",
                )


# ---------------------------------------------------------------- state_dicts


# Keys that wrap a state_dict in common training checkpoints ({"state_dict": ..., "epoch": ...}).
STATE_DICT_WRAPPERS = ("state_dict", "model_state_dict", "model")


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Read a state_dict (optionally wrapped under STATE_DICT_WRAPPERS) with weights_only=True."""
    path = Path(path)
    if not path.is_file():
        raise PipelineError(
            f"WEIGHTS file {path} does not exist", "give the path of a state_dict saved with torch.save"
        )
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if not _refused_by_weights_only(exc):
            raise _unreadable(f"WEIGHTS file {path}", exc, "give a file written by torch.save") from exc
        raise PipelineError(
            f"WEIGHTS file {path} holds pickled Python objects ({_refused_global(exc)}), not just tensors",
            "save model.state_dict() with torch.save; a whole pickled model goes in MODEL=<file> instead",
        ) from exc
    except Exception as exc:  # the unpickler fails on a non-torch file in many ways (KeyError, ValueError, ...)
        raise _unreadable(f"WEIGHTS file {path}", exc, "give a file written by torch.save") from exc
    state_dict = unwrap_state_dict(loaded)
    if state_dict is None:
        raise PipelineError(
            f"WEIGHTS file {path} is not a state_dict (it holds a {type(loaded).__name__})",
            "save model.state_dict() with torch.save",
        )
    return state_dict


def unwrap_state_dict(loaded: Any) -> dict[str, torch.Tensor] | None:
    """The name -> tensor mapping inside `loaded`, or None if there is none."""
    if _is_tensor_mapping(loaded):
        state_dict = dict(loaded)  # plain dict: see apply_state_dict for why _metadata is dropped
    elif isinstance(loaded, dict):
        inner = next((loaded[key] for key in STATE_DICT_WRAPPERS if _is_tensor_mapping(loaded.get(key))), None)
        if inner is None:
            return None
        state_dict = dict(inner)
    else:
        return None
    # nn.DataParallel / DistributedDataParallel save every key under "module."
    if all(key.startswith("module.") for key in state_dict):
        state_dict = {key.removeprefix("module."): value for key, value in state_dict.items()}
    return state_dict


def _is_tensor_mapping(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and bool(value)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())
    )


def apply_state_dict(module: nn.Module, state_dict: dict[str, torch.Tensor], source: Path | str) -> None:
    """Load `state_dict` strictly, or raise a PipelineError naming the keys that do not match."""
    expected = module.state_dict()
    # Old torchvision checkpoints predate BatchNorm's num_batches_tracked; without _metadata,
    # BatchNorm's loader fills it in, so its absence is not a mismatch.
    missing = [k for k in expected if k not in state_dict and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in state_dict if k not in expected]
    wrong_shape = [
        f"{k} (file {list(state_dict[k].shape)}, model {list(v.shape)})"
        for k, v in expected.items()
        if k in state_dict and state_dict[k].shape != v.shape
    ]
    if missing or unexpected or wrong_shape:
        raise PipelineError(
            f"checkpoint {source} does not fit the model: "
            + "; ".join(
                f"{len(keys)} {label}: {', '.join(keys[:5])}{', ...' if len(keys) > 5 else ''}"
                for label, keys in (
                    ("missing keys", missing),
                    ("unexpected keys", unexpected),
                    ("shapes differ", wrong_shape),
                )
                if keys
            ),
            "give WEIGHTS saved from the same architecture as MODEL (e.g. a resnet18 checkpoint with MODEL=resnet18)",
        )
    module.load_state_dict(state_dict, strict=True)


# ---------------------------------------------------------------- factories


def is_factory_reference(text: str) -> bool:
    return bool(FACTORY_PATTERN.match(text))


def import_factory(reference: str) -> tuple[Any, Path | None]:
    """Import `package.module:attr` with the current directory on sys.path, as uvicorn does.

    Returns the attribute and the module's source file (part of the fingerprint).
    """
    module_name, _, attr_path = reference.partition(":")
    _put_cwd_on_sys_path()
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module: any error while importing it is theirs to fix
        raise PipelineError(
            f"MODEL={reference!r}: importing module {module_name!r} failed: {type(exc).__name__}: {exc}",
            "run from the directory that contains the package (it is put on sys.path) and fix the import error",
        ) from exc
    target: Any = module
    for attr in attr_path.split("."):
        if not hasattr(target, attr):
            public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
            raise PipelineError(
                f"MODEL={reference!r}: module {module_name!r} has no attribute {attr_path!r}",
                f"name one of its callables: {', '.join(public[:12]) or '(none)'}",
            )
        target = getattr(target, attr)
    if not callable(target):
        raise PipelineError(
            f"MODEL={reference!r} is a {type(target).__name__}, not a function",
            "point MODEL at a function that returns a ModelSpec, an nn.Module or (module, example_inputs)",
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
            f"MODEL={reference!r}: the factory raised {type(exc).__name__}: {_first_line(exc)} "
            f"(at {frame.filename}:{frame.lineno})",
            "fix the factory so that it returns a ModelSpec, an nn.Module or (module, example_inputs)",
        ) from exc


def _put_cwd_on_sys_path() -> None:
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
        f"MODEL={reference!r} returned a {type(result).__name__}, which is not a model",
        "return a ModelSpec, an nn.Module (with INPUT_SHAPE), or (module, example_inputs) where example_inputs "
        "is a tensor, a tuple of tensors or a dict name -> tensor",
    )


def name_example_inputs(examples: Any, reference: str) -> dict[str, torch.Tensor]:
    """A tensor -> {"input": t}; a tuple/list -> input_0, input_1, ...; a dict of tensors as it is."""
    if isinstance(examples, torch.Tensor):
        named = {SINGLE_INPUT_NAME: examples}
    elif isinstance(examples, (tuple, list)):
        named = {f"input_{i}": tensor for i, tensor in enumerate(examples)}
    elif isinstance(examples, dict):
        named = dict(examples)
    else:
        named = {}
    if not named or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in named.items()):
        raise PipelineError(
            f"MODEL={reference!r}: example inputs must be a tensor, a tuple/list of tensors or a dict name -> tensor, "
            f"got {type(examples).__name__}",
            "return (module, example_inputs) with tensors whose dim 0 is the batch",
        )
    for name, tensor in named.items():
        if tensor.dim() == 0:
            raise PipelineError(
                f"MODEL={reference!r}: example input {name!r} is a scalar; dim 0 must be the batch",
                "give example inputs with a batch dim, e.g. torch.randn(2, 3, 224, 224)",
            )
    return named


def bind_to_forward(module: nn.Module, example_inputs: dict[str, torch.Tensor], model: str) -> dict[str, torch.Tensor]:
    """The example inputs named and ordered as forward()'s parameters, so no input can feed another's parameter.

    Named after parameters: kept, in forward()'s order (the ONNX graph's inputs follow it).  input_0, input_1,
    ... (from a tuple): renamed to forward()'s first parameters.  One input: bound by position.  Several
    inputs named otherwise: refused, since binding them by position could feed one into another's parameter.
    """
    names = forward_parameters(module)
    if names is None or len(example_inputs) == 1 and not set(example_inputs) <= set(names):
        return example_inputs
    if set(example_inputs) <= set(names):
        return {name: example_inputs[name] for name in names if name in example_inputs}
    generated = [f"input_{i}" for i in range(len(example_inputs))]
    if list(example_inputs) == generated and len(generated) <= len(names):
        return dict(zip(names, example_inputs.values(), strict=False))
    unknown = [name for name in example_inputs if name not in names]
    raise PipelineError(
        f"MODEL={model!r}: example inputs {unknown} are not parameters of forward({', '.join(names)})",
        "name each example input after the forward() parameter it feeds (a dict name -> tensor), or give them "
        "as a tuple in forward()'s order",
    )


def _check_spec_fields(spec: ModelSpec, reference: str) -> None:
    if not isinstance(spec.module, nn.Module):
        raise PipelineError(
            f"MODEL={reference!r} returned a ModelSpec whose module is a {type(spec.module).__name__}",
            "set ModelSpec.module to the nn.Module",
        )
    if spec.example_inputs:
        spec.example_inputs = name_example_inputs(spec.example_inputs, reference)


# ---------------------------------------------------------------- model files


MODEL_FILE_FIX = "give a TorchScript file, a torch.export .pt2 file, or a whole nn.Module saved with torch.save"
MODEL_FILE_SUFFIXES = (".pt", ".pth", ".pt2", ".ts", ".torchscript", ".jit", ".ckpt", ".bin")


@dataclass
class LoadedFile:
    """A model read from a file; example_inputs is empty when they must come from INPUT_SHAPE."""

    spec: ModelSpec
    kind: str  # "torchscript", "exported_program" or "pickled_module"
    class_source: Path | None = None  # for a pickled module: the file defining its class


def load_model_file(path: Path, *, trust: bool = False) -> LoadedFile:
    """Read a TorchScript, ExportedProgram or whole pickled nn.Module file.

    A whole pickled module loads only with `trust` (TRUST_MODEL_FILE=1): unpickling it runs whatever
    code the file names, so, as PyTorch's weights_only=True default and Hugging Face's
    trust_remote_code, that is the user's explicit choice, never a fallback.
    """
    if not path.is_file():
        raise PipelineError(
            f"model file {path} does not exist", "give an existing .pt/.pth/.pt2/TorchScript file, or a registry name"
        )
    kind = model_file_kind(path)
    if kind == "exported_program":
        return _load_exported_program(path)
    if kind == "torchscript":
        return _load_torchscript(path)
    return _load_pickled_module(path, trust)


def model_file_kind(path: Path) -> str:
    """Tell the three formats apart by their zip layout, not by the suffix users pick."""
    if not zipfile.is_zipfile(path):
        return "pickled_module"  # torch.save's legacy (non-zip) format
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
    if any(n.endswith("/archive_format") or n == "archive_format" for n in names):
        return "exported_program"
    if any(n.endswith("/constants.pkl") for n in names) and any("/code/" in n for n in names):
        return "torchscript"
    return "pickled_module"


def _load_torchscript(path: Path) -> LoadedFile:
    try:
        module = torch.jit.load(str(path), map_location="cpu")
    except RuntimeError as exc:
        raise PipelineError(f"TorchScript file {path} could not be loaded: {_first_line(exc)}", None) from exc
    return LoadedFile(ModelSpec(name=path.stem, module=module, example_inputs={}), "torchscript")


def _load_exported_program(path: Path) -> LoadedFile:
    try:
        program = torch.export.load(str(path))
    except Exception as exc:  # a .pt2 can also be an AOTInductor package or from another torch version
        raise PipelineError(
            f"{path} could not be read by torch.export.load: {type(exc).__name__}: {_first_line(exc)}",
            "give a file written by torch.export.save with this torch version",
        ) from exc
    examples, notes = example_inputs_from_program(program, path)
    spec = ModelSpec(name=path.stem, module=module_from_program(program), example_inputs=examples, notes=notes)
    return LoadedFile(spec, "exported_program")


def module_from_program(program: Any) -> nn.Module:
    """`program.module()`, with train()/eval() that only set the flags instead of raising.

    torch.export's unlifted module raises NotImplementedError on train()/eval() because its
    graph's mode was fixed at export.  The prepare stage calls eval() on every model; as a
    flag-only call it is truthful for a program exported in eval mode, and a program exported
    in train mode still shows itself to prepare's checks (dropout makes two calls differ).
    """
    module = program.module()
    module.train = types.MethodType(nn.Module.train, module)
    module.eval = types.MethodType(nn.Module.eval, module)
    return module


def example_inputs_from_program(program: Any, path: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Example inputs from an ExportedProgram's input placeholders (their fake tensors give shape and dtype).

    A symbolic dim gets size 2 (clamped into its range), so a dynamic batch gets the usual example batch.
    Returns ({}, []) when some input cannot be derived; INPUT_SHAPE is then required.
    """
    placeholders = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}
    examples, notes = {}, []
    with seeded():
        for name in program.graph_signature.user_inputs:
            fake = placeholders[name].meta.get("val") if name in placeholders else None
            if not isinstance(fake, torch.Tensor) or fake.dim() == 0:
                return {}, []
            sizes = [_example_size(dim, program.range_constraints) for dim in fake.shape]
            if None in sizes:
                return {}, []
            if isinstance(fake.shape[0], int):
                notes.append(
                    f"{path.name} was exported with a static batch of {fake.shape[0]} on {name}: "
                    "only that batch size will run"
                )
            examples[name] = example_tensor(tuple(int(size) for size in sizes if size is not None), fake.dtype)
    return examples, notes


def _example_size(dim: Any, range_constraints: dict) -> int | None:
    if isinstance(dim, int):
        return dim
    value_range = range_constraints.get(getattr(getattr(dim, "node", None), "expr", None))
    if value_range is None:
        return None  # a derived dim such as 2*s0: no range of its own to pick from
    low = int(value_range.lower) if value_range.lower.is_finite else 1
    high = int(value_range.upper) if value_range.upper.is_finite else EXAMPLE_BATCH
    return min(max(EXAMPLE_BATCH, low), high)


def _load_pickled_module(path: Path, trust: bool) -> LoadedFile:
    # A plain state_dict loads with weights_only=True; try that first so a file that is
    # only tensors never runs pickle code, and so we can say what to do with it.
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if not _refused_by_weights_only(exc):
            raise _unreadable(f"model file {path}", exc, MODEL_FILE_FIX) from exc
        if not trust:
            raise PipelineError(
                f"model file {path} is a pickled Python object ({_refused_global(exc)}): loading it runs code "
                "the file contains, so it is not loaded unless you say you trust it",
                "if you wrote the file or trust where it came from, add TRUST_MODEL_FILE=1 (--trust-model-file); "
                "safer: save it with torch.jit.save or torch.export.save, or give MODEL=package.module:factory "
                "with WEIGHTS=<state_dict>",
            ) from exc
        loaded = _load_pickle_trusting_user(path)
    except Exception as exc:  # the unpickler fails on a non-torch file in many ways (KeyError, ValueError, ...)
        raise _unreadable(f"model file {path}", exc, MODEL_FILE_FIX) from exc
    if unwrap_state_dict(loaded) is not None:
        raise PipelineError(
            f"model file {path} is a state_dict (weights only), which has no architecture",
            f"give the architecture and the weights separately: MODEL=<registry name or package.module:factory> "
            f"WEIGHTS={path}",
        )
    if not isinstance(loaded, nn.Module):
        raise PipelineError(
            f"model file {path} holds a {type(loaded).__name__}, not an nn.Module",
            "save the model with torch.save(model, path), torch.jit.save or torch.export.save",
        )
    class_source = inspect.getsourcefile(type(loaded)) if not isinstance(loaded, torch.jit.ScriptModule) else None
    spec = ModelSpec(name=path.stem, module=loaded, example_inputs={})
    return LoadedFile(spec, "pickled_module", Path(class_source) if class_source else None)


def _refused_by_weights_only(exc: pickle.UnpicklingError) -> bool:
    """True when weights_only=True declined a class the pickle names (the file holds Python objects),
    False when the bytes are not a torch file at all (torch words both as "Weights only load failed")."""
    # torch words it "Unsupported global: GLOBAL x" or "unsupported GLOBAL posix.system whose module ..."
    return "unsupported global" in str(exc).lower()


def _refused_global(exc: pickle.UnpicklingError) -> str:
    found = re.search(r"GLOBAL (\S+)", str(exc))
    return found.group(1) if found else "a class"


def _unreadable(what: str, exc: BaseException, fix: str) -> PipelineError:
    return PipelineError(f"{what} is not a file torch.load can read ({type(exc).__name__}: {_first_line(exc)})", fix)


def _load_pickle_trusting_user(path: Path) -> Any:
    # weights_only=False runs arbitrary pickle code: only for a file the user said they trust.
    _put_cwd_on_sys_path()  # the pickle names the model's class by module; import it like a factory
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except (pickle.UnpicklingError, EOFError, RuntimeError) as exc:
        raise _unreadable(f"model file {path}", exc, MODEL_FILE_FIX) from exc
    except (AttributeError, ImportError) as exc:
        raise PipelineError(
            f"model file {path} is a pickled model whose class cannot be imported: {exc}",
            "run from the directory where the model's module is importable, or use MODEL=package.module:factory",
        ) from exc


# ---------------------------------------------------------------- the forward check


def run_example_forward(module: nn.Module, example_inputs: dict[str, torch.Tensor], input_shape: str | None) -> Any:
    """One eval-mode forward pass on the example inputs; a PipelineError says which shape did not fit."""
    with torch.no_grad(), _temporarily_eval(module):
        try:
            return call_module(module, example_inputs)
        # RuntimeError: shape mismatches; IndexError: ids out of an embedding; TypeError: wrong
        # number of inputs; AssertionError: a torch.export program's input guards.
        except (RuntimeError, ValueError, IndexError, TypeError, AssertionError) as exc:
            given = f"INPUT_SHAPE={input_shape!r} gave" if input_shape else "the example inputs are"
            raise PipelineError(
                f"the model does not accept its inputs: {given} {describe_inputs(example_inputs)}; "
                f"torch says: {_first_lines(exc)}",
                f"give an INPUT_SHAPE that fits the model's forward: {INPUT_SHAPE_FORMS}",
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


def output_names_from(outputs: Any) -> list[str] | None:
    """Output names export can use: "output" for a tensor, output_0.. for a tuple, the keys of a dict."""
    if isinstance(outputs, torch.Tensor):
        return ["output"]
    if isinstance(outputs, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in outputs):
        return [f"output_{i}" for i in range(len(outputs))]
    if isinstance(outputs, dict) and all(isinstance(k, str) for k in outputs):
        return list(outputs)
    return None


def describe_inputs(example_inputs: dict[str, torch.Tensor]) -> str:
    return ", ".join(
        f"{name}={list(t.shape)} {str(t.dtype).removeprefix('torch.')}" for name, t in example_inputs.items()
    )


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _first_lines(exc: BaseException, count: int = 4) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return " | ".join(lines[:count]) or type(exc).__name__
