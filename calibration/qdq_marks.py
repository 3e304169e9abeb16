"""Which tensors ONNX Runtime's QDQ quantizer marks for Q/DQ, and how, for the options calibration/qdq_write.py
reproduces (a QdqScheme): its op quantizers' pass over a graph (QDQQuantizer.quantize_model's loop over the nodes,
registry.py's QDQRegistry, operators/), the graph changed as that pass changes it.

Per op type (OP_RULES; ORT's class in each rule's docstring), in node order, nodes of other types or excluded skipped:
  - Conv, Gemm: input 0 and the output (unless its op's outputs stay float), the weight per channel (a Conv's on axis
    0, a Gemm's on 1 unless transB; per tensor where that axis is out of range), the bias for int32 (a Gemm's only an
    initializer, its beta reset to 1): a bias a second op reads is copied for it (ORT names the copy <bias><n>);
  - MatMul: each input (an initializer a weight, on axis 1) and the output (unless float);
  - Add, Mul, GlobalAveragePool, Concat (QDQRegistry has none: ORT's base class): every input and the output;
  - Relu, Clip, once their input is marked: with asymmetric activations, folded into the QuantizeLinear before them
    (the producer writes their output, they go) where a range is given for their output and only they read their
    input; otherwise the input; then the output;
  - MaxPool (opset 12 on), AveragePool, Reshape, Transpose, Squeeze, Unsqueeze, Flatten, once their input is marked:
    the output, with the input's scale and zero point.
A mark is only made on a float tensor (an initializer's type, or one shape inference gave it); an earlier mark stands,
but a weight's per-channel mark and a shared one replace it in its place.  Before the pass ORT gives a Relu's or a
Clip's input its output's range where only it reads that input (adjusted_ranges).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace

import numpy as np
import onnx

FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
INTEGERS: dict[int, str] = {onnx.TensorProto.INT8: "int8", onnx.TensorProto.UINT8: "uint8"}


@dataclass(frozen=True)
class IntegerForm:
    """How float values become 8-bit integers, as quantize_static's options say: the type (onnx.TensorProto.INT8 or
    UINT8), symmetric or not, and 7 bits instead of 8 (reduce_range)."""

    type: int
    symmetric: bool
    reduce_range: bool = False

    def __post_init__(self) -> None:
        if self.type not in INTEGERS:
            raise ValueError(f"the Q/DQ writer reproduces int8 and uint8 only, not onnx type {self.type}")

    def bounds(self) -> tuple[int, int]:
        """The integer range scales are computed for (ORT's get_qmin_qmax_for_qType): [-127, 127] for symmetric int8,
        [-64, 64] and [0, 127] with reduce_range, the type's whole range otherwise."""
        from onnxruntime.quantization.quant_utils import get_qmin_qmax_for_qType

        low, high = get_qmin_qmax_for_qType(self.type, reduce_range=self.reduce_range, symmetric=self.symmetric)
        return int(low), int(high)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(INTEGERS[self.type])


@dataclass(frozen=True)
class Mark:
    """A tensor marked for Q/DQ (ORT's QDQTensorQuantInfo): as a weight (an initializer then takes the weights' form,
    else the activations'), per channel on `axis`, or quantized with the scale and zero point of `shares`."""

    weight: bool = False
    axis: int | None = None
    shares: str | None = None


@dataclass(frozen=True)
class QdqScheme:
    """quantize_static's options (QuantFormat.QDQ, per_channel=True, ranges given, the others at their defaults) of
    those the writer reproduces: op_types_to_quantize, OpTypesToExcludeOutputQuantization, the activations' form
    (activation_type, ActivationSymmetric), the weights' (weight_type, WeightSymmetric, reduce_range) and
    QuantizeBias."""

    ops: tuple[str, ...]
    float_outputs: tuple[str, ...]
    activations: IntegerForm
    weights: IntegerForm
    quantize_bias: bool

    def __post_init__(self) -> None:
        unknown = [op for op in self.ops if op not in OP_RULES]
        if unknown:  # ORT's quantizers for them are not reproduced: refused rather than written otherwise
            raise ValueError(f"the Q/DQ writer does not reproduce ONNX Runtime's quantizer for {unknown}")
        if self.activations.reduce_range:
            raise ValueError("reduce_range is the weights' option (ORT never reduces a ranged activation's)")

    def constant_form(self, mark: Mark) -> IntegerForm:
        """A marked initializer's form: the weights', or the activations' for one an op reads as an activation (an
        Add's constant), with the weights' reduce_range either way (ORT applies it to every initializer); one per
        channel symmetric whatever the option (QLinearConv needs one zero point for every channel)."""
        form = self.weights if mark.weight else replace(self.activations, reduce_range=self.weights.reduce_range)
        return replace(form, symmetric=True) if mark.axis is not None else form


@dataclass(frozen=True)
class Bias:
    """A bias an op marks for int32 quantization (ORT's QDQBiasQuantInfo): the op, and its input, weight and beta."""

    node: str
    input: str
    weight: str
    beta: float


@dataclass
class Marks:
    """What the pass leaves: the marked tensors in ORT's order (its tensors_to_quantize), the biases (bias_to_quantize)
    and the Relu/Clip nodes folded into the QuantizeLinear before them (removed once the Q/DQ nodes are in)."""

    tensors: dict[str, Mark] = field(default_factory=dict)
    biases: dict[str, Bias] = field(default_factory=dict)
    folded: list[onnx.NodeProto] = field(default_factory=list)


def mark_tensors(
    model: onnx.ModelProto, scheme: QdqScheme, ranged: Collection[str], exclude: Collection[str] = ()
) -> Marks:
    """The marks ORT's pass makes on `model` (shape-inferred; changed as the pass changes it) for `scheme`, the nodes
    named in `exclude` skipped, `ranged` the tensors with a range (adjusted_ranges')."""
    marker = _Marker(model, scheme, ranged)
    for node in model.graph.node:
        if node.op_type in scheme.ops and node.name not in exclude:
            OP_RULES[node.op_type](marker, node)
    return marker.marks


def adjusted_ranges(model: onnx.ModelProto, ranges, scheme: QdqScheme, exclude: Collection[str] = ()) -> dict:
    """{tensor: its TensorData} from `ranges` (ORT TensorsData), with ORT's adjust_tensor_ranges: the input of a Relu
    or Clip it quantizes takes the output's range where only that node reads the input and both have one."""
    adjusted = dict(ranges.items())
    readers = reader_counts(model.graph)
    for node in model.graph.node:
        if node.op_type not in ("Relu", "Clip") or node.op_type not in scheme.ops or node.name in exclude:
            continue
        source, target = node.input[0], node.output[0]
        if readers[source] == 1 and source in adjusted and target in adjusted:
            adjusted[source] = adjusted[target]
    return adjusted


def reader_counts(graph: onnx.GraphProto) -> dict[str, int]:
    """{tensor: how many node inputs read it} (ORT's input_name_to_nodes counts a node once per input it reads)."""
    counts: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            if name:
                counts[name] = counts.get(name, 0) + 1
    return counts


class _Marker:
    """The quantizer's state during the pass: what its op quantizers read (initializers, inferred types, the opset,
    the ranged tensors) and the marks they make."""

    def __init__(self, model: onnx.ModelProto, scheme: QdqScheme, ranged: Collection[str]) -> None:
        graph = model.graph
        self.graph, self.scheme, self.ranged, self.marks = graph, scheme, ranged, Marks()
        self.initializers: dict[str, onnx.TensorProto] = {}
        for init in graph.initializer:  # ORT finds the first of a name
            self.initializers.setdefault(init.name, init)
        self.ranks = {name: len(init.dims) for name, init in self.initializers.items()}  # the graph's own: no copies
        self.types = {info.name: info.type for info in (*graph.value_info, *graph.output, *graph.input)}
        self.opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))

    def quantizable(self, name: str) -> bool:
        """ORT's _is_tensor_quantizable: a float initializer, or a tensor shape inference typed float."""
        if name in self.initializers:
            return self.initializers[name].data_type in FLOATS
        kind = self.types.get(name)
        return kind is not None and kind.HasField("tensor_type") and kind.tensor_type.elem_type in FLOATS

    def marked(self, name: str) -> bool:
        """ORT's is_tensor_quantized: marked, or a bias marked for int32."""
        return name in self.marks.tensors or name in self.marks.biases

    def output_quantized(self, node: onnx.NodeProto) -> bool:
        return node.op_type not in self.scheme.float_outputs

    def activation(self, name: str, *, weight: bool = False) -> None:
        """quantize_activation_tensor (quantize_weight_tensor where `weight`): marked unless marked already."""
        if self.quantizable(name) and name not in self.marks.tensors:
            self.marks.tensors[name] = Mark(weight=weight)

    def weight(self, name: str, axis: int) -> None:
        """is_tensor_per_channel, then quantize_weight_tensor_per_channel (replacing an earlier mark in its place)
        where `axis` is in range of an initializer of the graph's own, else quantize_weight_tensor."""
        rank = self.ranks.get(name)
        normalized = axis + rank if rank is not None and axis < 0 else axis
        if rank is None or not 0 <= normalized < rank:
            self.activation(name, weight=True)
        elif self.initializers[name].data_type in FLOATS:
            self.marks.tensors[name] = Mark(weight=True, axis=normalized)

    def share(self, output: str, source: str) -> None:
        """quantize_output_same_as_input: `output` takes `source`'s scale and zero point (replacing an earlier mark)."""
        if self.quantizable(output):
            self.marks.tensors[output] = Mark(shares=source)

    def bias(self, node: onnx.NodeProto, beta: float) -> None:
        """quantize_bias_tensor: a float initializer bias marked for int32, copied first where another op marked it."""
        name, source, weight = node.input[2], node.input[0], node.input[1]
        bias = self.initializers.get(name)
        if bias is None or bias.data_type not in FLOATS:
            return
        if name in self.marks.biases:  # the bias's scale follows its op's input and weight: one copy per op
            name = self._copy(bias, node.name)
        self.marks.biases[name] = Bias(node.name, source, weight, beta)

    def _copy(self, bias: onnx.TensorProto, reader: str) -> str:
        """_dup_initializer and replace_input_of_nodes: `bias` copied as <bias><n> (n past every <bias><int> name),
        read by the nodes named `reader` instead."""
        suffix = max((_int_suffix(init.name, bias.name) for init in self.graph.initializer), default=-1) + 1
        copy = onnx.TensorProto()
        copy.CopyFrom(bias)
        copy.name = f"{bias.name}{suffix}"
        self.graph.initializer.append(copy)
        self.initializers[copy.name] = self.graph.initializer[-1]
        for node in self.graph.node:
            if node.name == reader:
                node.input[:] = [copy.name if name == bias.name else name for name in node.input]
        return copy.name

    def fold(self, node: onnx.NodeProto) -> bool:
        """try_replacing_upstream_output for a Relu/Clip (asymmetric activations, QDQKeepRemovableActivations off):
        its producer writes its output instead where the output has a range and only it reads its input, which is
        neither a graph input nor a graph output; the input's mark goes."""
        source, target = node.input[0], node.output[0]
        if self.scheme.activations.symmetric or target not in self.ranged:
            return False
        if source not in self.ranged:  # ORT fails here too (a KeyError)
            raise ValueError(f"Quantization parameters are not specified for param {source}.")
        graph_ends = {info.name for info in (*self.graph.input, *self.graph.output)}
        if reader_counts(self.graph).get(source) != 1 or source in graph_ends:
            return False
        for producer in self.graph.node:
            producer.output[:] = [target if name == source else name for name in producer.output]
        self.marks.tensors.pop(source, None)
        return True


def _int_suffix(name: str, prefix: str) -> int:
    """get_largest_initializer_name_suffix's reading of one name: the integer after `prefix`, or -1."""
    if not name.startswith(prefix):
        return -1
    try:
        return int(name[len(prefix) :])
    except ValueError:
        return -1


def _attribute(node: onnx.NodeProto, name: str, default):
    found = next((a for a in node.attribute if a.name == name), None)
    return default if found is None else onnx.helper.get_attribute_value(found)


def _weighted(marker: _Marker, node: onnx.NodeProto) -> None:
    """QDQConv, QDQGemm."""
    marker.activation(node.input[0])
    if marker.output_quantized(node):
        marker.activation(node.output[0])
    gemm = node.op_type == "Gemm"
    marker.weight(node.input[1], 1 if gemm and not _attribute(node, "transB", 0) > 0 else 0)
    if len(node.input) != 3:
        return
    if not gemm:
        marker.bias(node, 1.0)
    elif node.input[2] in marker.initializers:
        marker.bias(node, _attribute(node, "beta", 1.0))
        for attribute in node.attribute:  # set_default_beta: the int32 bias's scale holds beta
            if attribute.name == "beta":
                attribute.f = 1.0


def _matmul(marker: _Marker, node: onnx.NodeProto) -> None:
    """QDQMatMul."""
    for name in (*node.input, *(node.output if marker.output_quantized(node) else ())):
        if name in marker.initializers:
            marker.weight(name, 1)
        else:
            marker.activation(name)


def _every_tensor(marker: _Marker, node: onnx.NodeProto) -> None:
    """QDQOperatorBase (what ORT gives an op QDQRegistry lacks)."""
    for name in (*node.input, *(node.output if marker.output_quantized(node) else ())):
        marker.activation(name)


def _removable(marker: _Marker, node: onnx.NodeProto) -> None:
    """QDQRemovableActivation."""
    if not marker.marked(node.input[0]):
        return
    if marker.fold(node):
        marker.marks.folded.append(node)
    else:
        marker.activation(node.input[0])
    if marker.output_quantized(node):
        marker.activation(node.output[0])


def _same_as_input(marker: _Marker, node: onnx.NodeProto) -> None:
    """QDQDirect8BitOp."""
    if marker.marked(node.input[0]) and marker.output_quantized(node):
        marker.share(node.output[0], node.input[0])


def _max_pool(marker: _Marker, node: onnx.NodeProto) -> None:
    """QDQMaxPool: QDQDirect8BitOp from opset 12 (ONNX's first int8 MaxPool)."""
    if marker.opset >= 12:
        _same_as_input(marker, node)


OP_RULES: Mapping[str, Callable[[_Marker, onnx.NodeProto], None]] = {
    "Conv": _weighted,
    "Gemm": _weighted,
    "MatMul": _matmul,
    "Add": _every_tensor,
    "Mul": _every_tensor,
    "GlobalAveragePool": _every_tensor,
    "Concat": _every_tensor,
    "Relu": _removable,
    "Clip": _removable,
    "MaxPool": _max_pool,
    "AveragePool": _same_as_input,
    "Reshape": _same_as_input,
    "Transpose": _same_as_input,
    "Squeeze": _same_as_input,
    "Unsqueeze": _same_as_input,
    "Flatten": _same_as_input,
}
