"""What users type about a model's inputs, INPUT_SHAPE and DYNAMIC, and the example tensors made from it.

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
    DYNAMIC=none: no axis besides the batch (a transformers model's token inputs get a dynamic
    sequence axis by default; see models.huggingface).
    Naming: inputs that declare the same axis index with the same MIN:OPT:MAX share one
    DynamicAxis, named `<first input>_dim<axis>` (above: `input_ids_dim1` on both), so the
    ONNX graph gets one symbolic dim and the engine profile one range.  A single input's
    axis is named the same way.  To keep two axes independent, give them different ranges.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..pipeline.core.errors import PipelineError
from ..pipeline.core.settings import mention, mention_name
from .spec import DynamicAxis, ModelSpec

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
INPUT_SHAPE_HELP = f"give {mention_name('input_shape')} as {INPUT_SHAPE_FORMS}"
DYNAMIC_HELP = (
    f"give {mention_name('dynamic')} as NAME:AXIS[=MIN:OPT:MAX],... "
    "(e.g. input_ids:1=1:64:128,attention_mask:1=1:64:128)"
)
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
            raise PipelineError(f"{mention(input_shape=text)}: {part!r} is not name=DIMS[:dtype]", INPUT_SHAPE_HELP)
        shapes.append(_parse_one_input(name.strip(), rest.strip(), text))
    names = [shape.name for shape in shapes]
    if len(set(names)) != len(names):
        raise PipelineError(f"{mention(input_shape=text)} names an input twice", "name each input once")
    return shapes


def _parse_one_input(name: str, dims_and_dtype: str, text: str) -> InputShape:
    dims, _, dtype_name = dims_and_dtype.partition(":")
    dims = dims.strip().lower()
    if not _DIMS_PATTERN.match(dims):
        raise PipelineError(
            f"{mention(input_shape=text)}: {dims!r} is not dims like 3x224x224 (whole numbers joined by x)",
            INPUT_SHAPE_HELP,
        )
    dtype_name = dtype_name.strip().lower() or "float32"
    if dtype_name not in DTYPES:
        raise PipelineError(
            f"{mention(input_shape=text)}: unknown dtype {dtype_name!r}", f"use one of {', '.join(sorted(DTYPES))}"
        )
    sizes = tuple(int(d) for d in dims.split("x"))
    if 0 in sizes:
        raise PipelineError(f"{mention(input_shape=text)} has a zero-sized dim", "give every dim as 1 or more")
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
            f"check {mention_name('input_shape')}: one example batch may take at most "
            f"{EXAMPLE_MAX_BYTES >> 30} GiB per input",
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
    """Parse the DYNAMIC grammar (see the module docstring); `none` declares no axis besides the batch."""
    if text.strip().lower() == "none":
        return []
    requests = [_parse_one_dynamic(item.strip(), text) for item in text.split(",")]
    seen = [(r.input_name, r.axis) for r in requests]
    if len(set(seen)) != len(seen):
        raise PipelineError(f"{mention(dynamic=text)} declares the same axis twice", "declare each NAME:AXIS once")
    return requests


def _parse_one_dynamic(item: str, text: str) -> DynamicRequest:
    target, equals, bounds_text = item.partition("=")
    name, colon, axis_text = target.strip().rpartition(":")
    if not colon or not _NAME_PATTERN.match(name) or not axis_text.strip().isdigit():
        raise PipelineError(f"{mention(dynamic=text)}: {item!r} is not NAME:AXIS[=MIN:OPT:MAX]", DYNAMIC_HELP)
    axis = int(axis_text)
    if axis == 0:
        raise PipelineError(
            f"{mention(dynamic=text)}: axis 0 is the batch, which is always dynamic",
            f"set the batch range with {mention(batch='min:opt:max')} and list only other axes in "
            f"{mention_name('dynamic')}",
        )
    if not equals:
        return DynamicRequest(name, axis, None)
    numbers = bounds_text.split(":")
    if len(numbers) != 3 or not all(n.strip().isdigit() for n in numbers):
        raise PipelineError(f"{mention(dynamic=text)}: range {bounds_text!r} is not MIN:OPT:MAX", DYNAMIC_HELP)
    low, opt, high = (int(n) for n in numbers)
    if not 1 <= low <= opt <= high:
        raise PipelineError(
            f"{mention(dynamic=text)}: range {bounds_text!r} is not ordered 1 <= MIN <= OPT <= MAX", DYNAMIC_HELP
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
                f"{mention(dynamic=text)}: the example size of {request.input_name} on axis {request.axis} is {size}, "
                f"outside its range {low}:{opt}:{high}",
                f"widen the range to include the example size, or change {mention_name('input_shape')}",
            )
        key = (request.axis, low, opt, high)
        axis = shared.setdefault(key, DynamicAxis(f"{request.input_name}_dim{request.axis}", low, opt, high))
        other_name, other_size = first_size.setdefault(axis.name, (request.input_name, size))
        if other_size != size:
            # One symbolic dim must have one example size, or export proves the dims unequal.
            raise PipelineError(
                f"{mention(dynamic=text)}: {other_name} and {request.input_name} share axis {request.axis} range "
                f"{low}:{opt}:{high} but their example sizes differ ({other_size} vs {size})",
                f"give them the same example size in {mention_name('input_shape')}, or different ranges if they "
                "really vary independently",
            )
        axes.setdefault(request.input_name, {})[request.axis] = axis
    return axes


def _example_size_on_axis(request: DynamicRequest, example_inputs: dict[str, torch.Tensor], text: str) -> int:
    tensor = example_inputs.get(request.input_name)
    if tensor is None:
        raise PipelineError(
            f"{mention(dynamic=text)} names input {request.input_name!r}, which the model does not have",
            f"use the model's input names: {', '.join(example_inputs)}",
        )
    if request.axis >= tensor.dim():
        raise PipelineError(
            f"{mention(dynamic=text)}: {request.input_name} has {tensor.dim()} dims (batch included), "
            f"no axis {request.axis}",
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
                    f"give {mention_name('dynamic')} or {mention_name('input_shape')} so that the example size "
                    "lies inside the range",
                )
