"""TensorRT's Q/DQ graph (calibration/qdq.py) written from what is in memory: the graph ONNX Runtime's quantize_static
writes with qdq.QDQ_OPTIONS, byte for byte, without its cost per graph.

Given a graph, quantize_static infers its shapes by path (a copy of the graph, weights and all, written and read
back), loads it whole, quantizes every weight it marks and writes the result, which qdq.quantize_with_ranges reads
back again: for every candidate, every float-search try.  Yet a weight's Q/DQ (its int8 values and per-channel scales)
depends on the weight alone, and every Q/DQ graph of one smoothing alpha has the same weights (bias correction moves
biases only).  QuantizedWeights holds each weight's Q/DQ once per alpha; qdq_model puts a graph together from them,
its ranges' activation scales and the graph's other initializers, read one at a time from where they lie.

What it does of ORT's QDQQuantizer (onnxruntime/quantization/qdq_quantizer.py and operators/, for the op types
QUANTIZED_OPS with their outputs left float, symmetric int8, per-channel weights, QuantizeBias off), with ORT's own
functions where they cost nothing (compute_scale_zp for activations, ONNXModel's clean-up and sort) and its weight
arithmetic done for every channel at once (quantize_weight); tests/calibration/test_qdq.py holds the graphs equal to
quantize_static's, serialized:
  - tensors marked in node order: a Conv's and a Gemm's input 0 and weight (per channel on axis 0; a Gemm's on axis 1
    unless transB), each input of a MatMul (an initializer a weight on axis 1, per tensor where it has no axis 1);
  - the biases ORT marks for int32 even with QuantizeBias off: one that a second op reads is copied for it (ORT names
    the copy <bias><n>), and a weight whose scale times its input's is too small for its bias in int32 gets a larger
    scale (ORT's _adjust_weight_scale_for_int32_bias): that weight's Q/DQ then depends on the range, and is made anew;
  - per marked tensor, in that order, its zero point and scale (then the int8 weight) appended to the initializers,
    every reader switched to its DequantizeLinear's output, the nodes appended; then ORT's clean-up and sort;
  - the producer, the metadata and the value_info as quantize_static leaves them, and data_location set on each
    tensor that went through an external-data file on its way (every one of 991 bytes or more: onnx's threshold).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.external_data_helper import uses_external_data

from ..pipeline.folder.graph_files import graph_without_weights, initializer_array
from ..pipeline.folder.onnx_wire import external_span, read_span
from .ranges import QUANTIZED_OPS

INT8 = onnx.TensorProto.INT8
FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
ACTIVATION = "activation"  # a mark's kind where a weight's is its channel axis (None: per tensor)
EXTERNAL_THRESHOLD = 1024  # onnx's convert_model_to_external_data size_threshold, on sys.getsizeof(raw_data)
INT32_QRANGE = np.array(np.iinfo(np.int32).max, dtype=np.float64) - np.array(np.iinfo(np.int32).min + 1, np.float64)


@dataclass(frozen=True)
class WeightQdq:
    """One weight's Q/DQ: its int8 initializer (<weight>_quantized), scale and zero point, channel axis (None: one
    scale)."""

    quantized: onnx.TensorProto
    scale: np.ndarray
    zero_point: np.ndarray
    axis: int | None


class QuantizedWeights:
    """Each weight of one calibrated graph (one smoothing alpha) quantized when first asked for and kept: every Q/DQ
    graph made from that graph or its bias-corrected copies (the candidates of its alpha, their corrected graphs, the
    float search's tries) reads the same weights.  Holds a quarter of the quantized weights' float bytes."""

    def __init__(self) -> None:
        self._weights: dict[tuple[str, int | None], WeightQdq] = {}

    def get(self, tensor: onnx.TensorProto, axis: int | None, base: Path) -> WeightQdq:
        """`tensor`'s Q/DQ on `axis`, its values read from under `base` (graph_without_weights) the first time."""
        key = (tensor.name, axis)
        if key not in self._weights:
            self._weights[key] = quantize_weight(_values(tensor, base), tensor.name, axis)
        return self._weights[key]

    def clear(self) -> None:
        """Forget every weight's Q/DQ (a graph asked for later quantizes them again)."""
        self._weights.clear()


def quantize_weight(values: np.ndarray, name: str, axis: int | None, scale: np.ndarray | None = None) -> WeightQdq:
    """ORT's symmetric int8 Q/DQ of a float32 weight, per channel along `axis` (per tensor where None), with the scale
    computed from its values unless `scale` is given (raised for an int32 bias: _int32_bias_scale).  Every channel at
    once, where ORT loops over them in Python (most of quantize_static's time on a CNN: ResNet-50's 26k channels per
    graph), by the same float32 and float64 operations element by element: compute_data_quant_params ->
    compute_scale_zp (symmetric: scale = float32(2 max|w| / 254) in float64, 1 below float32's tiny), then
    quantize_nparray (round(w / scale) clipped to int8)."""
    if values.dtype != np.float32:  # int8.calibrated_graph's weights are the FP32 graph's
        raise RuntimeError(f"weight {name!r} is {values.dtype}, not float32")
    shape = [1] * values.ndim
    if axis is not None:
        shape[axis] = -1
    if scale is None:
        scale = symmetric_scale_zp(values, axis, -127, 127)[0].reshape(() if axis is None else (-1,))
    quantized = np.divide(values, scale.reshape(shape))  # then in place: one float32 array of the weight's size
    np.round(quantized, out=quantized)  # ORT adds the zero point, 0 here: nothing to add (-0.0 is int8 0 too)
    np.clip(quantized, -128, 127, out=quantized)
    zero_point = np.zeros(scale.shape, np.int8)
    return WeightQdq(numpy_helper.from_array(quantized.astype(np.int8), f"{name}_quantized"), scale, zero_point, axis)


def weight_axes(model: onnx.ModelProto, exclude: Sequence[str] = ()) -> dict[str, int | None]:
    """{weight: its channel axis (None: per tensor)}: the initializers ORT's quantizer quantizes as the weights of
    the Conv/Gemm/MatMul ops of `model` not named in `exclude` (marked in memory: `model` is changed as _marks
    changes it)."""
    marks, _ = _marks(model, exclude)
    initializers = {init.name for init in model.graph.initializer}
    return {name: axis for name, axis in marks.items() if name in initializers and not isinstance(axis, str)}


def symmetric_scale_zp(values: np.ndarray, axis: int | None, low: int, high: int) -> tuple[np.ndarray, np.ndarray]:
    """ORT's symmetric (scale, zero point) of a float32 weight per channel along `axis` (one, where None) for the
    integer range [low, high] ([-127, 127] for int8, [0, 255] for uint8), every channel at once (compute_scale_zp):
    the scale float32(2 max|w| / (high - low)) computed in float64 and the zero point round((low + high) / 2), or 1
    and 0 where that scale is below float32's tiny."""
    rows = values.reshape(1, -1) if axis is None else np.moveaxis(values, axis, 0).reshape(values.shape[axis], -1)
    smallest, largest = np.minimum(rows.min(axis=1), np.float32(0)), np.maximum(rows.max(axis=1), np.float32(0))
    largest = np.maximum(np.abs(smallest), np.abs(largest))
    exact = (largest.astype(np.float64) - (-largest).astype(np.float64)) / (np.float64(high) - np.float64(low))
    tiny = exact < np.finfo(np.float32).tiny
    scale = np.where(tiny, np.float32(1), exact.astype(np.float32)).astype(np.float32)
    return scale, np.where(tiny, 0, round((low + high) / 2))


def qdq_model(graph: Path, ranges, weights: QuantizedWeights, exclude: Sequence[str] = ()) -> onnx.ModelProto:
    """The Q/DQ graph quantize_static makes of `graph` (a graph whose constants are all initializers:
    int8.calibrated_graph) with qdq.QDQ_OPTIONS, `ranges` (ORT TensorsData) and the nodes named in `exclude` left in
    float, its weights from `weights` (those of `graph`'s smoothing alpha), every tensor in memory."""
    from onnxruntime.quantization.onnx_model import ONNXModel
    from onnxruntime.quantization.quant_utils import __producer__, __version__, add_infer_metadata

    graph = Path(graph)
    model = onnx.shape_inference.infer_shapes(graph_without_weights(graph))  # ORT's value_info: it infers by path
    add_infer_metadata(model)
    marks, biases = _marks(model, exclude)
    scales = {name: _activation_qdq(ranges[name]) for name in marks if name in ranges}
    weight_qdq = _weight_qdq(model, marks, biases, scales, weights, graph.parent)
    _insert_qdq(model, marks, scales, weight_qdq)
    ONNXModel(model).clean_initializers()
    model.producer_name, model.producer_version = __producer__, __version__
    ONNXModel(model).topological_sort()
    _load_remaining(model, graph.parent)
    return model


@dataclass(frozen=True)
class _Bias:
    """A bias ORT marks for int32 quantization: its op, and the op's input and weight."""

    name: str
    node: str
    input: str
    weight: str


def _marks(model: onnx.ModelProto, exclude: Sequence[str]) -> tuple[dict[str, int | str | None], list[_Bias]]:
    """{tensor: ACTIVATION or a weight's channel axis}, in the order ORT's op quantizers mark them, and the biases
    they mark (a bias a second op reads copied for it first, as ORT's quantize_bias_tensor does)."""
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    types = {info.name: info.type for info in (*graph.value_info, *graph.output, *graph.input)}
    marks: dict[str, int | str | None] = {}
    biases: list[_Bias] = []

    def quantizable(name: str) -> bool:
        if name in initializers:
            return initializers[name].data_type in FLOATS
        kind = types.get(name)
        return kind is not None and kind.HasField("tensor_type") and kind.tensor_type.elem_type in FLOATS

    def activation(name: str) -> None:
        if quantizable(name) and name not in marks:
            marks[name] = None if name in initializers else ACTIVATION  # an initializer: per tensor, as a weight

    def weight(name: str, axis: int) -> None:
        init = initializers.get(name)
        rank = len(init.dims) if init is not None else 0
        normalized = axis + rank if axis < 0 else axis
        if init is None or not 0 <= normalized < rank:
            activation(name)  # ORT's quantize_weight_tensor: per tensor, or a range for a weight computed in the graph
        elif init.data_type in FLOATS:
            marks[name] = normalized  # ORT's per-channel mark replaces an earlier one, in its place

    for node in graph.node:
        if node.op_type not in QUANTIZED_OPS or node.name in exclude:
            continue
        if node.op_type == "MatMul":
            for name in node.input:
                weight(name, 1) if name in initializers else activation(name)
            continue
        activation(node.input[0])
        transposed = any(a.name == "transB" and a.i for a in node.attribute)
        weight(node.input[1], 0 if node.op_type == "Conv" or transposed else 1)
        if len(node.input) == 3 and (node.op_type == "Conv" or node.input[2] in initializers):
            _mark_bias(model, node, initializers, biases)
            for attribute in node.attribute if node.op_type == "Gemm" else ():
                if attribute.name == "beta":  # ORT's set_default_beta, though it leaves the bias float
                    attribute.f = 1.0
    return marks, biases


def _mark_bias(model: onnx.ModelProto, node: onnx.NodeProto, initializers: dict, biases: list[_Bias]) -> None:
    """ORT's quantize_bias_tensor: a float initializer bias marked, copied first where another op marked it already."""
    name = node.input[2]
    bias = initializers.get(name)
    if bias is None or bias.data_type not in FLOATS:
        return
    if any(marked.name == name for marked in biases):
        suffix = max((_int_suffix(init.name, name) for init in model.graph.initializer), default=-1) + 1
        copy = onnx.TensorProto()
        copy.CopyFrom(bias)
        copy.name = f"{name}{suffix}"
        model.graph.initializer.append(copy)
        initializers[copy.name] = model.graph.initializer[-1]
        for reader in model.graph.node:  # ORT replaces it by node name
            if reader.name == node.name:
                reader.input[:] = [copy.name if i == name else i for i in reader.input]
        name = copy.name
    biases.append(_Bias(name, node.name, node.input[0], node.input[1]))


def _int_suffix(name: str, prefix: str) -> int:
    if not name.startswith(prefix):
        return -1
    try:
        return int(name[len(prefix) :])
    except ValueError:
        return -1


def _activation_qdq(data) -> tuple[np.ndarray, np.ndarray]:
    """(zero point, scale) of an activation's range, as ORT's calc_quant_params computes them (symmetric int8)."""
    from onnxruntime.quantization.quant_utils import compute_scale_zp, get_qmin_qmax_for_qType

    qmin, qmax = get_qmin_qmax_for_qType(INT8, reduce_range=False, symmetric=True)
    zero_point, scale = compute_scale_zp(data.range_value[0], data.range_value[1], qmin, qmax, True, None)
    return zero_point.squeeze(), scale.squeeze()


def _weight_qdq(
    model: onnx.ModelProto,
    marks: dict[str, int | str | None],
    biases: list[_Bias],
    scales: dict[str, tuple[np.ndarray, np.ndarray]],
    weights: QuantizedWeights,
    base: Path,
) -> dict[str, WeightQdq]:
    """Each marked initializer's Q/DQ: the alpha's, or made anew where an int32 bias raises its scale."""
    initializers = {init.name: init for init in model.graph.initializer}
    qdq = {  # an initializer's mark is its axis (an activation's is ACTIVATION)
        name: weights.get(initializers[name], axis, base)
        for name, axis in marks.items()
        if name in initializers and not isinstance(axis, str)
    }
    for bias in biases:  # ORT's _adjust_weight_quant_params_for_bias_tensors
        if bias.input not in scales or marks.get(bias.input) != ACTIVATION or bias.weight not in qdq:
            continue
        current = qdq[bias.weight]
        raised = _int32_bias_scale(scales[bias.input][1], current, _values(initializers[bias.name], base))
        if raised is not None:
            values = _values(initializers[bias.weight], base)
            qdq[bias.weight] = quantize_weight(values, bias.weight, current.axis, raised)
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


def _insert_qdq(
    model: onnx.ModelProto,
    marks: dict[str, int | str | None],
    scales: dict[str, tuple[np.ndarray, np.ndarray]],
    weight_qdq: dict[str, WeightQdq],
) -> None:
    """ORT's _quantize_normal_tensors: per marked tensor its initializers and nodes, its readers switched to them."""
    graph = model.graph
    present = {init.name for init in graph.initializer}

    def add(tensor: onnx.TensorProto) -> None:
        if tensor.name not in present:
            # Copied in place: append copies its argument again, slower (a 16 MB int8 weight: 12 ms, against 53 ms
            # for a copy appended).
            graph.initializer.add().CopyFrom(tensor)
            present.add(tensor.name)

    def scale_and_zero_point(name: str, zero_point: np.ndarray, scale: np.ndarray) -> tuple[str, str]:
        add(onnx.helper.make_tensor(f"{name}_zero_point", INT8, zero_point.shape, zero_point.ravel().tolist()))
        add(onnx.helper.make_tensor(f"{name}_scale", onnx.TensorProto.FLOAT, scale.shape, scale.ravel().tolist()))
        return f"{name}_scale", f"{name}_zero_point"

    for name in marks:
        if name in weight_qdq:
            qdq = weight_qdq[name]
            scale, zero_point = scale_and_zero_point(name, qdq.zero_point, qdq.scale)
            _switch_readers(graph, name, f"{name}_DequantizeLinear_Output")
            add(qdq.quantized)
            graph.node.append(_qdq_node("DequantizeLinear", qdq.quantized.name, scale, zero_point, name, axis=qdq.axis))
            continue
        if name not in scales:
            raise ValueError(
                f"Quantization parameters are not specified for param {name}. In static mode quantization params "
                "for inputs and outputs of nodes to be quantized are required."
            )
        scale, zero_point = scale_and_zero_point(name, *scales[name])
        source, output = name, f"{name}_DequantizeLinear_Output"
        if any(out.name == name for out in graph.output):  # the DequantizeLinear writes the graph's output
            source, output = f"{name}_QuantizeLinear_Input", name
            for node in graph.node:
                node.output[:] = [source if o == name else o for o in node.output]
        else:
            _switch_readers(graph, name, output)
        quantized = f"{name}_QuantizeLinear_Output"
        graph.node.append(_qdq_node("QuantizeLinear", source, scale, zero_point, name, output=quantized))
        graph.node.append(_qdq_node("DequantizeLinear", quantized, scale, zero_point, name, output=output))


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
    """Every initializer's bytes into the model, each marked as ORT's file round trip leaves it: a tensor read from
    external data, or large enough for onnx to have written it there, has data_location set (to DEFAULT)."""
    for tensor in model.graph.initializer:
        if uses_external_data(tensor):
            raw = read_span(external_span(tensor, base))
            del tensor.external_data[:]
            tensor.raw_data = raw
            tensor.data_location = onnx.TensorProto.DEFAULT
        elif tensor.HasField("raw_data") and sys.getsizeof(tensor.raw_data) >= EXTERNAL_THRESHOLD:
            tensor.data_location = onnx.TensorProto.DEFAULT


def _values(tensor: onnx.TensorProto, base: Path) -> np.ndarray:
    return initializer_array(tensor, base)
