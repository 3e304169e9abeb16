"""The Q/DQ graphs ONNX Runtime's quantize_static writes, written from what is in memory, byte for byte: TensorRT's
(calibration/qdq.py: TENSORRT) and the two shaped for ONNX Runtime's CPU kernels (calibration/qdq_cpu.py).

Given a graph, quantize_static infers its shapes by path (a copy of the graph, weights and all, written and read
back), loads it whole, quantizes every weight it marks one channel at a time in Python and writes the result, which
had to be read back again: for every candidate, every float-search try and each CPU graph.  Yet a weight's Q/DQ
depends on the weight and its form alone, and every Q/DQ graph of one smoothing alpha has the same weights (bias
correction moves biases only).  QuantizedWeights holds each weight's Q/DQ once per alpha and form; qdq_model puts a
graph together from them, its ranges' activation scales and the graph's other initializers, read one at a time from
where they lie.

What it does of ORT's QDQQuantizer (onnxruntime/quantization/qdq_quantizer.py), for the options a QdqScheme holds
(QuantFormat.QDQ, per-channel weights, int8 or uint8, the op types of calibration/qdq_marks.py, which marks the tensors
as ORT's op quantizers do), with ORT's own functions where they cost nothing (compute_scale_zp for activations,
ONNXModel's clean-up and sort) and its weight arithmetic done for every channel at once (scale_zero_point, rounded);
tests/calibration/test_qdq.py and test_qdq_cpu.py hold the graphs equal to quantize_static's, serialized:
  - the ranges adjusted (a Relu's or Clip's input takes its output's range), the tensors marked, then the initializers'
    scales: a weight's per channel symmetric, per tensor as the form says, an initializer an op reads as an activation
    (an Add's constant) in the activations' type, and an int8 weight whose scale times its op's input scale is too
    small for the op's bias in int32 with a larger one (_adjust_weight_scale_for_int32_bias, QuantizeBias on or off);
  - per marked tensor, in that order, its zero point and scale (then the weight's integers) appended to the
    initializers, every reader switched to its DequantizeLinear's output, the nodes appended (a graph output keeps its
    name: the DequantizeLinear writes it); then the tensors that share another's scale and zero point; then, with
    QuantizeBias, each bias as int32 (scale input scale x weight scale x beta) behind a DequantizeLinear that writes
    the bias's name; the folded Relu/Clip nodes removed; then ORT's clean-up and sort;
  - the producer, the metadata and the value_info as quantize_static leaves them, and data_location set on each
    tensor that went through an external-data file on its way (every one of 991 bytes or more: onnx's threshold).
Refused, where ORT would write something else: opsets below 10 (ORT converts the graph first), graphs with
DequantizeLinear nodes already (pre-quantized weights), float16 weights and biases, an op type the marks do not
reproduce (QdqScheme), a shared scale whose source is never quantized (ORT loops forever there).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.external_data_helper import _get_all_tensors, uses_external_data

from ..pipeline.folder.graph_files import initializer_array
from ..pipeline.folder.onnx_wire import external_span, read_span
from .qdq_marks import Bias, IntegerForm, Mark, Marks, QdqScheme, adjusted_ranges, mark_tensors
from .quantizable import quantizable_graph
from .ranges import QUANTIZED_OPS

INT8 = onnx.TensorProto.INT8
EXTERNAL_THRESHOLD = 1024  # onnx's convert_model_to_external_data size_threshold, on sys.getsizeof(raw_data)
INT32_QRANGE = np.array(np.iinfo(np.int32).max, dtype=np.float64) - np.array(np.iinfo(np.int32).min + 1, np.float64)

# TensorRT's graph (calibration/qdq.py): symmetric int8 everywhere, Q/DQ on the inputs of Conv/Gemm/MatMul only,
# float biases (TensorRT rejects a DequantizeLinear on int32).
TENSORRT = QdqScheme(
    ops=QUANTIZED_OPS,
    float_outputs=QUANTIZED_OPS,
    activations=IntegerForm(INT8, symmetric=True),
    weights=IntegerForm(INT8, symmetric=True),
    quantize_bias=False,
)


@dataclass(frozen=True)
class WeightQdq:
    """One initializer's Q/DQ: its integers (<name>_quantized), scale and zero point (their type the integers'),
    channel axis (None: one scale)."""

    quantized: onnx.TensorProto
    scale: np.ndarray
    zero_point: np.ndarray
    axis: int | None


class QuantizedWeights:
    """Each weight of one calibrated graph (one smoothing alpha) quantized when first asked for, per form, and kept:
    every Q/DQ graph made from that graph or its bias-corrected copies (the candidates of its alpha, their corrected
    graphs, the float search's tries) reads the same weights.  Holds a quarter of the quantized weights' float bytes
    per form."""

    def __init__(self) -> None:
        self._weights: dict[tuple[str, int | None, IntegerForm], WeightQdq] = {}

    def get(self, tensor: onnx.TensorProto, axis: int | None, form: IntegerForm, base: Path) -> WeightQdq:
        """`tensor`'s Q/DQ in `form` on `axis`, its values read from under `base` (graph_without_weights) the first
        time."""
        key = (tensor.name, axis, form)
        if key not in self._weights:
            values = initializer_array(tensor, base)
            self._weights[key] = quantize_weight(values, tensor.name, axis, *scale_zero_point(values, axis, form))
        return self._weights[key]

    def clear(self) -> None:
        """Forget every weight's Q/DQ (a graph asked for later quantizes them again)."""
        self._weights.clear()


def quantize_weight(
    values: np.ndarray, name: str, axis: int | None, scale: np.ndarray, zero_point: np.ndarray
) -> WeightQdq:
    """A float32 initializer's Q/DQ with `scale` and `zero_point` (scale_zero_point's, or a scale raised for an int32
    bias: _int32_bias_scale), per channel along `axis` (per tensor where None)."""
    if values.dtype != np.float32:  # int8.calibrated_graph's weights are the FP32 graph's
        raise RuntimeError(f"weight {name!r} is {values.dtype}, not float32")
    quantized = _rounded(values, scale, zero_point, axis).astype(zero_point.dtype)
    return WeightQdq(numpy_helper.from_array(quantized, f"{name}_quantized"), scale, zero_point, axis)


def scale_zero_point(values: np.ndarray, axis: int | None, form: IntegerForm) -> tuple[np.ndarray, np.ndarray]:
    """ORT's (scale, zero point) of a float32 initializer in `form`, per channel along `axis` ([channels] each; one,
    of shape (), where None), every channel at once where ORT loops over them in Python (most of quantize_static's
    time on a CNN: ResNet-50's 26k channels per graph), by the same float32 and float64 operations element by element
    (compute_data_quant_params -> compute_scale_zp)."""
    low, high = form.bounds()
    if form.symmetric:
        scale, zero_point = _symmetric_scale_zp(values, axis, low, high)
    elif axis is None:
        scale, zero_point = _asymmetric_scale_zp(values, low, high)
    else:
        raise ValueError("ORT quantizes a weight per channel symmetric only (QdqScheme.constant_form)")
    shape = () if axis is None else (-1,)
    return scale.reshape(shape), zero_point.astype(form.dtype).reshape(shape)


def _rounded(values: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, axis: int | None) -> np.ndarray:
    """ORT's quantize_nparray for every channel at once: round(w / scale) + zero point, clipped to the zero point's
    integer type, as whole numbers in float32 (in place: one float32 array of the weight's size)."""
    shape = [1] * values.ndim
    if axis is not None:
        shape[axis] = -1
    quantized = np.asarray(np.divide(values, scale.reshape(shape)))  # asarray: a 0-d weight divides to a scalar
    np.round(quantized, out=quantized)
    if zero_point.any():  # int8's is 0: nothing to add (-0.0 is integer 0 too)
        np.add(quantized, zero_point.astype(np.float32).reshape(shape), out=quantized)
    limits = np.iinfo(zero_point.dtype)
    np.clip(quantized, limits.min, limits.max, out=quantized)
    return quantized


def _symmetric_scale_zp(values: np.ndarray, axis: int | None, low: int, high: int) -> tuple[np.ndarray, np.ndarray]:
    """compute_scale_zp, symmetric, per channel along `axis` (one, where None) for the integer range [low, high]: the
    scale float32(2 max|w| / (high - low)) computed in float64 and the zero point round((low + high) / 2), or 1 and 0
    where that scale is below float32's tiny."""
    rows = values.reshape(1, -1) if axis is None else np.moveaxis(values, axis, 0).reshape(values.shape[axis], -1)
    smallest, largest = np.minimum(rows.min(axis=1), np.float32(0)), np.maximum(rows.max(axis=1), np.float32(0))
    largest = np.maximum(np.abs(smallest), np.abs(largest))
    exact = (largest.astype(np.float64) - (-largest).astype(np.float64)) / (np.float64(high) - np.float64(low))
    tiny = exact < np.finfo(np.float32).tiny
    scale = np.where(tiny, np.float32(1), exact.astype(np.float32)).astype(np.float32)
    return scale, np.where(tiny, 0, round((low + high) / 2))


def _asymmetric_scale_zp(values: np.ndarray, low: int, high: int) -> tuple[np.ndarray, np.ndarray]:
    """compute_scale_zp, asymmetric, of a whole tensor over [min(w, 0), max(w, 0)]: the scale float32((max - min) /
    (high - low)) computed in float64, the zero point round(low - min / that); 1 and 0 where it is below float32's
    tiny."""
    smallest, largest = np.minimum(values.min(), np.float32(0)), np.maximum(values.max(), np.float32(0))
    exact = (np.float64(largest) - np.float64(smallest)) / (np.float64(high) - np.float64(low))
    if exact < np.finfo(np.float32).tiny:
        return np.array(1, np.float32), np.array(0)
    return np.array(exact, np.float32), np.array(np.round(np.float64(low) - np.float64(smallest) / exact))


def marked_initializers(model: onnx.ModelProto, scheme: QdqScheme, exclude: Sequence[str] = ()) -> dict[str, Mark]:
    """{initializer: its mark}: the initializers qdq_model quantizes in `model` for `scheme` (marked in memory: `model`
    is changed as marking changes it).  No ranges are needed: a Relu folded into the QuantizeLinear before it moves
    the marks of activations alone."""
    marks = mark_tensors(model, scheme, ranged=(), exclude=exclude)
    initializers = {init.name for init in model.graph.initializer}
    return {name: mark for name, mark in marks.tensors.items() if name in initializers}


def qdq_model(
    graph: Path, ranges, scheme: QdqScheme, weights: QuantizedWeights, exclude: Sequence[str] = ()
) -> onnx.ModelProto:
    """The Q/DQ graph quantize_static makes of `graph` (its Constant nodes as initializers: quantizable_graph) with
    `scheme`'s options, `ranges` (ORT TensorsData) and the nodes named in `exclude` left in float, its weights from
    `weights` (those of `graph`'s smoothing alpha), every tensor in memory."""
    from onnxruntime.quantization.onnx_model import ONNXModel
    from onnxruntime.quantization.quant_utils import __producer__, __version__, add_infer_metadata

    graph = Path(graph)
    model = onnx.shape_inference.infer_shapes(quantizable_graph(graph))  # ORT's value_info: it infers by path
    add_infer_metadata(model)
    _refuse_what_is_not_reproduced(model)
    adjusted = adjusted_ranges(model, ranges, scheme, exclude)
    marks = mark_tensors(model, scheme, adjusted, exclude)
    activations = {
        name: _activation_qdq(adjusted[name], scheme.activations) for name in marks.tensors if name in adjusted
    }
    constants = _constant_qdq(model, marks, scheme, activations, weights, graph.parent)
    initializers = _Initializers(model.graph)
    quantized = _insert_qdq(model.graph, initializers, marks, activations, constants)
    if scheme.quantize_bias:
        _insert_int32_biases(model.graph, initializers, marks.biases, quantized, graph.parent)
    for node in marks.folded:
        model.graph.node.remove(node)
    ONNXModel(model).clean_initializers()
    model.producer_name, model.producer_version = __producer__, __version__
    ONNXModel(model).topological_sort()
    _load_remaining(model, graph.parent)
    return model


def _refuse_what_is_not_reproduced(model: onnx.ModelProto) -> None:
    """Raise where quantize_static would write a graph qdq_model does not: it converts a graph of an opset below 10
    first, and leaves a tensor a DequantizeLinear already writes (pre-quantized weights) as it is."""
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    if opset < 10:
        raise ValueError(f"opset {opset}: quantize_static converts such a graph to opset 11, which the writer does not")
    if any(node.op_type == "DequantizeLinear" for node in model.graph.node):
        raise ValueError("the graph has DequantizeLinear nodes already: the writer does not reproduce ORT there")


def _activation_qdq(data, form: IntegerForm) -> tuple[np.ndarray, np.ndarray]:
    """(scale, zero point) of an activation's range, as ORT's calc_quant_params computes them."""
    from onnxruntime.quantization.quant_utils import compute_scale_zp, get_qmin_qmax_for_qType

    qmin, qmax = get_qmin_qmax_for_qType(form.type, reduce_range=False, symmetric=form.symmetric)
    zero_point, scale = compute_scale_zp(data.range_value[0], data.range_value[1], qmin, qmax, form.symmetric, None)
    return scale.squeeze(), zero_point.squeeze()


def _constant_qdq(
    model: onnx.ModelProto,
    marks: Marks,
    scheme: QdqScheme,
    activations: dict[str, tuple[np.ndarray, np.ndarray]],
    weights: QuantizedWeights,
    base: Path,
) -> dict[str, WeightQdq]:
    """Each marked initializer's Q/DQ: from `weights`, or made anew where an int32 bias raises an int8 weight's scale
    (ORT's _adjust_weight_quant_params_for_bias_tensors)."""
    initializers = _Initializers(model.graph)
    qdq = {}
    for name, mark in marks.tensors.items():
        if name not in initializers:
            continue
        if mark.shares is not None:  # ORT raises this too, once it gets there
            raise ValueError("Quantization parameter shared mode is not supported for weight yet")
        qdq[name] = weights.get(initializers[name], mark.axis, scheme.constant_form(mark), base)
    for name, bias in marks.biases.items():
        current = qdq.get(bias.weight)
        if bias.input not in activations or current is None or current.zero_point.dtype != np.int8:
            continue
        raised = _int32_bias_scale(activations[bias.input][0], current, initializer_array(initializers[name], base))
        if raised is not None:
            values = initializer_array(initializers[bias.weight], base)
            qdq[bias.weight] = quantize_weight(values, bias.weight, current.axis, raised, current.zero_point)
    return qdq


def _int32_bias_scale(input_scale: np.ndarray, weight: WeightQdq, bias: np.ndarray) -> np.ndarray | None:
    """The weight's scale raised where input scale x weight scale is too small for the bias in int32 (ORT's
    _adjust_weight_scale_for_int32_bias, element by element the same float64 arithmetic); None where none is."""
    scale = weight.scale
    if not scale.size or weight.zero_point.any():
        return None
    if weight.axis is None:
        low, high = np.minimum(bias.min(), np.float64(0)), np.maximum(bias.max(), np.float64(0))
        largest = np.maximum(np.abs(low), np.abs(high))
    else:
        largest = np.abs(bias)
    smallest_valid = 1.0001 * (2.0 * largest) / INT32_QRANGE
    candidate = np.float64(input_scale.item()) * scale.astype(np.float64)
    too_small = (candidate < smallest_valid) & (candidate > 0.0)
    if not too_small.any():
        return None
    raised = np.where(too_small, scale.astype(np.float64) * (smallest_valid / candidate), scale).astype(scale.dtype)
    return raised.reshape(scale.shape)


class _Initializers:
    """A graph's initializers by name, the first of each name as ORT's find_by_name finds it, added to as ORT's
    add_initializer adds (a name already there is not added again)."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self._graph = graph
        self._by_name: dict[str, onnx.TensorProto] = {}
        for init in graph.initializer:
            self._by_name.setdefault(init.name, init)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> onnx.TensorProto:
        return self._by_name[name]

    def add(self, tensor: onnx.TensorProto) -> None:
        if tensor.name not in self._by_name:
            # Copied in place: append copies its argument again, slower (a 16 MB int8 weight: 12 ms, against 53 ms
            # for a copy appended).
            added = self._graph.initializer.add()
            added.CopyFrom(tensor)
            self._by_name[tensor.name] = added


def _insert_qdq(
    graph: onnx.GraphProto,
    initializers: _Initializers,
    marks: Marks,
    activations: dict[str, tuple[np.ndarray, np.ndarray]],
    constants: dict[str, WeightQdq],
) -> dict[str, tuple[str, str]]:
    """ORT's _quantize_normal_tensors, then _quantize_sharing_param_tensors: per marked tensor its initializers and
    nodes, its readers switched to them; {tensor: the names of its scale and zero point} (ORT's quantized_value_map)."""
    quantized: dict[str, tuple[str, str]] = {}
    for name, mark in marks.tensors.items():
        if mark.shares is not None:
            continue
        if name in constants:
            quantized[name] = _insert_constant(graph, initializers, name, constants[name])
            continue
        if name not in activations:
            raise ValueError(
                f"Quantization parameters are not specified for param {name}. In static mode quantization params "
                "for inputs and outputs of nodes to be quantized are required."
            )
        quantized[name] = _scale_and_zero_point(initializers, name, *activations[name])
        _insert_activation_pair(graph, name, *quantized[name])
    _insert_shared(graph, marks, quantized)
    return quantized


def _insert_constant(graph: onnx.GraphProto, initializers: _Initializers, name: str, qdq: WeightQdq) -> tuple[str, str]:
    """_add_qdq_nodes_for_initializer: its scale and zero point, its readers switched, its integers, a
    DequantizeLinear."""
    scale, zero_point = _scale_and_zero_point(initializers, name, qdq.scale, qdq.zero_point)
    _switch_readers(graph, name, f"{name}_DequantizeLinear_Output")
    initializers.add(qdq.quantized)
    graph.node.append(_qdq_node("DequantizeLinear", qdq.quantized.name, scale, zero_point, name, axis=qdq.axis))
    return scale, zero_point


def _insert_shared(graph: onnx.GraphProto, marks: Marks, quantized: dict[str, tuple[str, str]]) -> None:
    """_quantize_sharing_param_tensors: in passes over the marks, each tensor whose source is quantized gets its Q/DQ
    with the source's scale and zero point (ORT loops forever where a source never is: refused here)."""
    waiting = {name: mark.shares for name, mark in marks.tensors.items() if mark.shares is not None}
    while waiting:
        ready = [name for name, source in waiting.items() if source in quantized]
        if not ready:
            raise ValueError(f"{sorted(waiting)} share the scales of tensors nothing quantizes")
        for name, source in list(waiting.items()):
            if source in quantized:  # one quantized earlier in this pass counts: ORT reads the map as it grows
                del waiting[name]
                quantized[name] = quantized[source]
                _insert_activation_pair(graph, name, *quantized[source])


def _scale_and_zero_point(
    initializers: _Initializers, name: str, scale: np.ndarray, zero_point: np.ndarray
) -> tuple[str, str]:
    """_make_scale_zp_initializers: <name>_zero_point, then <name>_scale, each added unless there already."""
    zero_type = onnx.helper.np_dtype_to_tensor_dtype(zero_point.dtype)
    initializers.add(
        onnx.helper.make_tensor(f"{name}_zero_point", zero_type, zero_point.shape, zero_point.ravel().tolist())
    )
    initializers.add(
        onnx.helper.make_tensor(f"{name}_scale", onnx.TensorProto.FLOAT, scale.shape, scale.ravel().tolist())
    )
    return f"{name}_scale", f"{name}_zero_point"


def _insert_activation_pair(graph: onnx.GraphProto, name: str, scale: str, zero_point: str) -> None:
    """_add_qdq_pair_for_activation: QuantizeLinear -> DequantizeLinear after `name`, its readers switched to it (a
    graph output keeps its name: its producer writes <name>_QuantizeLinear_Input, the DequantizeLinear the output)."""
    source, output = name, f"{name}_DequantizeLinear_Output"
    if any(out.name == name for out in graph.output):
        source, output = f"{name}_QuantizeLinear_Input", name
        for node in graph.node:
            node.output[:] = [source if o == name else o for o in node.output]
    else:
        _switch_readers(graph, name, output)
    quantized = f"{name}_QuantizeLinear_Output"
    graph.node.append(_qdq_node("QuantizeLinear", source, scale, zero_point, name, output=quantized))
    graph.node.append(_qdq_node("DequantizeLinear", quantized, scale, zero_point, name, output=output))


def _insert_int32_biases(
    graph: onnx.GraphProto,
    initializers: _Initializers,
    biases: dict[str, Bias],
    quantized: dict[str, tuple[str, str]],
    base: Path,
) -> None:
    """_quantize_bias_tensors (QuantizeBias on): each marked bias in int32 behind a DequantizeLinear that writes the
    bias's name, in place of the float bias (ORT removes it there; its clean-up would, as it does here)."""
    for name, bias in biases.items():
        if name in quantized:  # marked as a tensor too: quantized as one
            continue
        scales = {}
        for role, tensor in (("weight input", bias.weight), ("input", bias.input)):
            if tensor not in quantized:
                raise ValueError(
                    f"Unable to get valid quantization scale for {role} '{tensor}' when quantizing bias '{name}' to "
                    "int32."
                )
            scales[role] = numpy_helper.to_array(initializers[quantized[tensor][0]])
        values = initializer_array(initializers[name], base)
        if values.dtype != np.float32:  # ORT handles float16 biases otherwise (a float32 scale, a Cast)
            raise RuntimeError(f"bias {name!r} is {values.dtype}, not float32")
        integers, scale, zero_point = _int32_bias(name, values, scales["input"], scales["weight input"], bias.beta)
        graph.initializer.extend([integers, scale, zero_point])  # the float bias: unread now, the clean-up drops it
        axis = 0 if scale.dims[0] > 1 else None
        dequantize = _qdq_node(
            "DequantizeLinear", integers.name, scale.name, zero_point.name, name, output=name, axis=axis
        )
        graph.node.append(dequantize)


def _int32_bias(
    name: str, values: np.ndarray, input_scale: np.ndarray, weight_scale: np.ndarray, beta: float
) -> tuple[onnx.TensorProto, onnx.TensorProto, onnx.TensorProto]:
    """quantize_bias_static_impl: the bias's int32 values, scale (input scale x weight scale x beta, float32) and zero
    point (0: one per channel where the scale is, else a scalar)."""
    if beta == 0:  # ORT's: a bias a zero beta scales away is zeros
        values, beta = np.zeros_like(values), 1.0
    scale = input_scale * weight_scale * beta
    integers = (np.asarray(values, dtype=np.float64) / np.asarray(scale, dtype=np.float64)).round()
    limits = np.iinfo(np.int32)
    integers = np.clip(integers, np.float64(limits.min), np.float64(limits.max)).astype(np.int32)
    if np.size(scale) > 1:
        zero_point = numpy_helper.from_array(
            np.zeros(np.shape(scale), np.int32).reshape(-1), f"{name}_quantized_zero_point"
        )
    else:
        zero_point = onnx.helper.make_tensor(f"{name}_quantized_zero_point", onnx.TensorProto.INT32, [], [0])
    return (
        numpy_helper.from_array(integers.reshape(values.shape), f"{name}_quantized"),
        numpy_helper.from_array(np.asarray(scale, dtype=values.dtype).reshape(-1), f"{name}_quantized_scale"),
        zero_point,
    )


def _qdq_node(
    op: str, source: str, scale: str, zero_point: str, tensor: str, *, output: str | None = None, axis=None
) -> onnx.NodeProto:
    output = output or f"{tensor}_{op}_Output"
    return onnx.helper.make_node(op, [source, scale, zero_point], [output], f"{tensor}_{op}", axis=axis)


def _switch_readers(graph: onnx.GraphProto, old: str, new: str) -> None:
    for node in graph.node:
        for index, name in enumerate(node.input):
            if name == old:
                node.input[index] = new


def _load_remaining(model: onnx.ModelProto, base: Path) -> None:
    """Every tensor's bytes into the model (node attributes' too: ORT writes them out as well), each marked as ORT's
    file round trip leaves it: a tensor read from external data, or large enough for onnx to have written it there,
    has data_location set (to DEFAULT)."""
    for tensor in _get_all_tensors(model):
        if uses_external_data(tensor):
            raw = read_span(external_span(tensor, base))
            del tensor.external_data[:]
            tensor.raw_data = raw
            tensor.data_location = onnx.TensorProto.DEFAULT
        elif tensor.HasField("raw_data") and sys.getsizeof(tensor.raw_data) >= EXTERNAL_THRESHOLD:
            tensor.data_location = onnx.TensorProto.DEFAULT
