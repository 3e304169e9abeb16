"""A graph's inputs and outputs as its ONNX file declares them: the one reader of them in the project.

The check stage records them in the manifest, the build names the profile's dynamic axes from them, the Triton
writer turns them into a model config and calibration checks its data against them.  Weights are never read,
and onnx is imported on first use only: the manifest (read by runners and the service) holds GraphTensors too.
"""

from __future__ import annotations

import ast
import io
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.errors import PipelineError
from ..core.settings import engine_command
from .graph_files import graph_without_weights

if TYPE_CHECKING:
    import onnx

# A dim as the file declares it: a fixed size, the name of a symbolic dim ("batch", "seq"), or None for a
# dynamic dim with no name.  An output's name may be an expression over the inputs' dims ("2*seq": the check stage
# names it so, stages/output_dims.py), whose size dim_size computes.
Dim = int | str | None
DYNAMIC = -1  # how a dim that is not a fixed size is written where only numbers are allowed


@dataclass(frozen=True)
class GraphTensor:
    """One graph input or output: its name, numpy dtype name and declared dims."""

    name: str
    dtype: str
    shape: tuple[Dim, ...]

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    def sizes(self) -> list[int]:
        """The shape with every dim that is not a fixed size as DYNAMIC (-1)."""
        return [d if isinstance(d, int) else DYNAMIC for d in self.shape]

    @classmethod
    def from_record(cls, record: dict) -> GraphTensor:
        return cls(record["name"], record["dtype"], tuple(record["shape"]))

    def as_record(self) -> dict:
        """The manifest's form: {"name", "dtype", "shape": [3, "batch", null, ...]}."""
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class GraphIO:
    inputs: tuple[GraphTensor, ...]
    outputs: tuple[GraphTensor, ...]


def graph_io(graph: Path | bytes | onnx.ModelProto) -> GraphIO:
    """The inputs (weights listed as inputs by old exporters left out) and outputs of a graph: a file, its bytes,
    or a loaded model (the check stage passes its shape-inferred one)."""
    import onnx

    if isinstance(graph, onnx.ModelProto):
        model = graph
    elif isinstance(graph, bytes):
        model = onnx.load_model_from_string(graph)
    else:
        model = graph_without_weights(graph)
    weights = {tensor.name for tensor in model.graph.initializer}
    inputs = tuple(_tensor(value) for value in model.graph.input if value.name not in weights)
    return GraphIO(inputs, tuple(_tensor(value) for value in model.graph.output))


def _tensor(value: onnx.ValueInfoProto) -> GraphTensor:
    from onnx.helper import tensor_dtype_to_np_dtype

    tensor = value.type.tensor_type
    dims = tuple(_dim(d) for d in tensor.shape.dim)
    return GraphTensor(value.name, np.dtype(tensor_dtype_to_np_dtype(tensor.elem_type)).name, dims)


def _dim(dim: onnx.TensorShapeProto.Dimension) -> Dim:
    if dim.HasField("dim_value"):
        return int(dim.dim_value)
    return dim.dim_param or None


def load_reference(source: Path | str | bytes) -> list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]:
    """The (inputs, outputs) cases the export wrote to reference.npz (stages/export.write_reference), in order; from
    its path, or from its bytes as ArtifactFolder.read checked them (the runner reads it without the build stages)."""
    if not isinstance(source, bytes) and not Path(source).is_file():
        raise PipelineError(
            f"no PyTorch reference at {source}", f"run the export stage first ({engine_command(more=True)})"
        )
    cases: dict[int, tuple[dict, dict]] = {}
    with np.load(io.BytesIO(source) if isinstance(source, bytes) else source) as data:
        for key in data.files:
            case, kind, name = key.split("/", 2)
            inputs, outputs = cases.setdefault(int(case.removeprefix("case")), ({}, {}))
            (inputs if kind == "in" else outputs)[name] = data[key]
    return [cases[i] for i in sorted(cases)]


# What sympy writes in a dim expression: the operators and the functions symbolic shape inference uses.
_OPERATORS: dict[type, Callable[[Fraction, Fraction], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "floor": math.floor,
    "ceiling": math.ceil,
    "Min": min,
    "Max": max,
    "Mod": operator.mod,
}
_MAX_EXPONENT = 8  # sympy writes sequence*sequence as sequence**2; no real dim is a larger power


def dim_size(expression: str, sizes: dict[str, int]) -> int | None:
    """The size a dim name or expression over named dims ("sequence", "2*sequence", "floor(height/2) + 1") takes at
    `sizes`; None where it names another dim or is not such an expression.  Parsed, never evaluated as Python."""
    try:
        value = _evaluate(ast.parse(expression, mode="eval").body, sizes)
    except (SyntaxError, KeyError, ValueError, TypeError, ZeroDivisionError):
        return None
    return int(value) if value.denominator == 1 else None


def _evaluate(node: ast.expr, sizes: dict[str, int]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.Name):
        return Fraction(sizes[node.id])
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand, sizes)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left, sizes), _evaluate(node.right, sizes)
        if isinstance(node.op, ast.Pow) and (right.denominator != 1 or not 0 <= right <= _MAX_EXPONENT):
            raise ValueError(f"the power {right} in a dim expression")
        return Fraction(_OPERATORS[type(node.op)](left, right))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS:
        if node.keywords:
            raise ValueError("keywords in a dim expression")
        return Fraction(_FUNCTIONS[node.func.id](*(_evaluate(arg, sizes) for arg in node.args)))
    raise ValueError(f"not a dim expression: {ast.dump(node)}")
