"""The INT8 graph shaped for ONNX Runtime's CPU kernels, from the same calibrated ranges as the TensorRT graph.

model.int8.onnx is shaped for TensorRT (Q/DQ on Conv/Gemm inputs only, float biases, symmetric int8).
ONNX Runtime's CPU provider runs none of its convolutions in int8: it fuses DequantizeLinear -> Conv
-> QuantizeLinear into QLinearConv only when every Conv input, the bias included (int32), comes from
a DequantizeLinear and the output goes straight into a QuantizeLinear.  So this second graph has
uint8 asymmetric activations and per-channel weights, int32 biases, quantizes the outputs too (not
MatMul's and Gemm's: FLOAT_OUTPUTS), and lets the quantizer fold each Relu into the QuantizeLinear
before it (a uint8 zero point of 0 clips at 0 exactly as Relu does).  The graph is the one ONNX Runtime's
quantize_static writes with those options (cpu_scheme), written from memory by calibration/qdq_write.py, byte for byte.

Two forms are written, because a graph is built on one CPU and served on another and no single form is
both exact and fast on both kinds (benchmarks/int8_cpu_forms.py; docs/benchmarks/int8-cpu-forms-*.md):
  - U8S8 (int8 weights, ONNX Runtime's recommendation) for CPUs with VNNI: exact there and the fastest
    (ResNet-50 batch 8: 20 ms against 83 ms for U8U8 and 56 ms for FP32 on a 16-core Xeon with AMX);
  - U8U8 (uint8 weights) for CPUs without: there ONNX Runtime multiplies U8S8 with AVX2's VPMADDUBSW,
    which adds each pair of u8 x s8 products into a saturating int16 (2 x 255 x 127 > 32767), and on
    digits on an AVX2-only AMD EPYC U8S8 lost 0.8-1.1 top-1 points, 7-bit int8 weights (reduce_range)
    0.3, U8U8 none, while still 26% faster than FP32 there.

The ranges are the cached ones (no second calibration run), collected symmetrically for TensorRT:
each tensor's (low, high) is (-T, T) for T = max|x| (method max), or the percentile / entropy
threshold T of |x| clamped to the observed minimum and maximum (ORT's histogram calibrators).
What an asymmetric calibration would add is the true minimum of a signed tensor, and that is lost:
  - a tensor that is provably non-negative (a Relu's output, or a pooled / reshaped copy of one)
    gets [0, high]: |x| = x there, so that is the range an asymmetric calibration would find;
  - any other tensor (a conv output before a residual Add) keeps its cached (low, high): with a
    symmetric T the zero point lands near 128, which costs at most one bit where the tensor was
    lopsided, and recalibrating (a second pass over the data) to win that bit is not worth it.
Calibration covered the inputs and outputs of Conv/Gemm/MatMul only; the other tensors an int8
graph needs get the range of a tensor holding the same values (through MaxPool, Flatten, Reshape,
...), or through a Relu as ONNX Runtime's quantizer itself does (adjust_tensor_ranges: a Relu's
input takes its output's range).  A node left with an unranged tensor stays in float.

The graph's outputs stay float (the Q/DQ pair ORT puts on them is removed): a calibrated range
clips them, and clipping the largest logits of a classifier changes its top-1 answer.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ..pipeline.core.cpu import NO_VNNI, VNNI
from ..pipeline.folder.graph_files import atomic_graph, save_graph
from .qdq import qdq_structure
from .qdq_marks import IntegerForm, QdqScheme, reader_counts
from .qdq_write import QuantizedWeights, marked_initializers, qdq_model
from .quantizable import quantizable_graph

# The ops whose Q/DQ ONNX Runtime's CPU provider turns into an int8 kernel (QLinearConv, QGemm,
# QLinearMatMul, QLinearAdd/Mul, QLinearAveragePool/GlobalAveragePool, QLinearConcat), runs on
# uint8 directly (MaxPool and the reshaping ops) or folds away (Relu, Clip).
CPU_OPS = (
    "Conv",
    "Gemm",
    "MatMul",
    "Relu",
    "Clip",
    "Add",
    "Mul",
    "MaxPool",
    "AveragePool",
    "GlobalAveragePool",
    "Concat",
    "Flatten",
    "Reshape",
    "Transpose",
    "Squeeze",
    "Unsqueeze",
)
# Ops whose output stays float (ONNX Runtime then runs them as MatMulIntegerToFloat / QGemm with a float output,
# still int8 kernels), as in TensorRT's graph: a transformer's MatMul outputs are wide (attention scores, the FFN's
# hidden layer), and their uint8 rounding was most of its CPU graph's error.  all-MiniLM-L6-v2 calibrated on 64
# templated sentences (max ranges, smoothed), 128 docstring sentences no set contains, cosine min / mean, 48 of 48
# int8 kernels either way: outputs quantized 0.732 / 0.871 (percentile ranges 0.959 / 0.984), float 0.990 / 0.996,
# and no slower (batch 1: 1.37 vs 1.53 ms on a VNNI EPYC: docs/benchmarks/int8-cpu-forms-epyc-vnni.md).
FLOAT_OUTPUTS = ("MatMul", "Gemm")
# Ops whose output holds (a selection of) the input's values, so both share one range.
SAME_VALUES = ("MaxPool", "Flatten", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Identity")
# Ops whose output is non-negative when their input is (averages and copies of non-negative values).
KEEP_NON_NEGATIVE = (*SAME_VALUES, "AveragePool", "GlobalAveragePool")

INT8_KERNELS = (
    "QLinearConv",
    "ConvInteger",
    "QGemm",
    "QLinearMatMul",
    "MatMulInteger",
    "MatMulIntegerToFloat",
    "DynamicQuantizeMatMul",
)
FLOAT_KERNELS = ("Conv", "FusedConv", "MatMul", "FusedMatMul", "Gemm", "FusedGemm")


# The forms of weight a CPU graph can take: its type, symmetric or not (per tensor: per channel ORT makes every weight
# symmetric), 7-bit or 8.
WEIGHT_FORMS = {
    "u8s8": IntegerForm(onnx.TensorProto.INT8, symmetric=True),
    "u8u8": IntegerForm(onnx.TensorProto.UINT8, symmetric=False),
    "u8s8-reduce-range": IntegerForm(onnx.TensorProto.INT8, symmetric=True, reduce_range=True),
}
# The form written for each kind of CPU (pipeline.core.cpu.int8_cpu_kind).
WEIGHTS_FOR = {VNNI: "u8s8", NO_VNNI: "u8u8"}


def quantize_for_cpu(
    fp32_path: Path,
    out_path: Path,
    ranges,
    *,
    weights: str,
    float_output_ops: tuple[str, ...] = FLOAT_OUTPUTS,
    quantized_weights: QuantizedWeights | None = None,
) -> dict:
    """Write the ONNX-Runtime-CPU-shaped graph for `ranges` (ORT TensorsData) of `fp32_path`, a graph whose
    constants are all initializers (calibration.int8.calibrated_graph); return its structure.  The graph is the one
    quantize_static writes for cpu_scheme's options (calibration/qdq_write.py, byte for byte).  `float_output_ops`:
    the op types whose outputs stay float (another value only for benchmarks/int8_cpu_forms.py's comparison).
    quantized_weights: the Q/DQ of `fp32_path`'s weights made already (its smoothing alpha's: U8S8's weights are
    TensorRT's); by default quantized for this graph alone."""
    with atomic_graph(out_path) as temporary:
        cpu_ranges, unranged = _cpu_ranges(fp32_path, ranges)
        scheme = cpu_scheme(weights, float_output_ops)
        quantized = qdq_model(fp32_path, cpu_ranges, scheme, quantized_weights or QuantizedWeights(), unranged)
        float_outputs = _unquantize_graph_outputs(quantized)
        structure = qdq_structure(quantized)  # before save_graph, which moves the weights out past 2 GB
        save_graph(quantized, temporary)
        kernels = int8_kernel_counts(temporary, scratch=temporary.parent)
    return {
        **structure,
        "activations": "uint8 asymmetric: [0, high] where non-negative, else the cached (low, high)",
        "weights": weights,
        "float_nodes": unranged,
        "float_outputs": float_outputs,
        **kernels,
    }


class Uint8Rounding:
    """{weight: its rounding in the U8U8 CPU graph of `fp32_path` for `ranges`, dequantized, in float64}: the values
    DequantizedWeights reads from that graph as calibration/qdq_write.py writes it (bias.correct_biases corrects the
    graph's biases for them), computed here without writing it, each when asked for.  The graph quantizes each
    Conv/Gemm/MatMul weight it can range (the nodes nodes_without_ranges leaves unranged stay float) per channel, and a
    per-channel weight symmetric whatever WeightSymmetric says (QLinearConv needs one zero point for every channel):
    uint8 with zero point 128 and scale float32(2 max|w| / 255) computed in float64 (1 below float32's tiny), a
    per-tensor one asymmetric over [min(w, 0), max(w, 0)]; then round(w / scale) + zero point, clipped to [0, 255].
    Each weight's uint8 Q/DQ is kept in `weights`, which the U8U8 graph is then written with (quantize_for_cpu's
    quantized_weights): each weight rounded once for both."""

    def __init__(self, fp32_path: Path, ranges) -> None:
        model = quantizable_graph(fp32_path)
        unranged = nodes_without_ranges(model.graph, asymmetric_ranges(model.graph, ranges))
        self._scheme = cpu_scheme("u8u8")
        self._marks = marked_initializers(model, self._scheme, unranged)
        self._initializers = {init.name: init for init in model.graph.initializer}
        self._base = fp32_path.parent
        self.weights = QuantizedWeights()

    def __contains__(self, weight: str) -> bool:
        return weight in self._marks

    def identity(self, weight: str) -> str:
        """The graph file's weight, rounded by this rule: the file identifies it (BiasShifts keys on the file too)."""
        return f"uint8:{weight}"

    def __getitem__(self, weight: str) -> np.ndarray:
        mark = self._marks[weight]
        form = self._scheme.constant_form(mark)
        qdq = self.weights.get(self._initializers[weight], mark.axis, form, self._base)
        shape = [1] * len(qdq.quantized.dims)
        if mark.axis is not None:
            shape[mark.axis] = -1
        dequantized = numpy_helper.to_array(qdq.quantized).astype(np.float64)  # the uint8 values, exactly
        # In place: one float64 array of the weight's size (a 4096 x 4096 weight 5x faster).
        np.subtract(dequantized, qdq.zero_point.astype(np.float64).reshape(shape), out=dequantized)
        np.multiply(dequantized, qdq.scale.reshape(shape), out=dequantized)
        return dequantized


def cpu_scheme(weights: str, float_output_ops: tuple[str, ...] = FLOAT_OUTPUTS) -> QdqScheme:
    """The options of the CPU graph with weights in the form `weights` (WEIGHT_FORMS): uint8 asymmetric activations,
    int32 biases, the outputs of `float_output_ops` left float."""
    activations = IntegerForm(onnx.TensorProto.UINT8, symmetric=False)
    return QdqScheme(CPU_OPS, float_output_ops, activations, WEIGHT_FORMS[weights], quantize_bias=True)


def _cpu_ranges(fp32_path: Path, ranges) -> tuple:
    """The CPU graph's ranges (asymmetric_ranges, as ORT TensorsData) and the nodes they leave in float."""
    model = quantizable_graph(fp32_path)  # the ranges read the graph's structure and small constants only
    cpu_ranges = asymmetric_ranges(model.graph, ranges)
    return as_tensors_data(cpu_ranges, ranges.calibration_method), nodes_without_ranges(model.graph, cpu_ranges)


def asymmetric_ranges(graph: onnx.GraphProto, ranges) -> dict[str, tuple[float, float]]:
    """{tensor: (low, high)}: the cached ranges, spread to same-valued tensors, [0, high] where non-negative."""
    # Bounds are 0-d or one-element arrays, depending on the calibrator.
    known = {
        name: (float(np.min(ranges[name].range_value[0])), float(np.max(ranges[name].range_value[1])))
        for name in ranges
    }
    consumers = reader_counts(graph)
    # Same-valued tensors first; a Relu's relu(x) <= max(x) bound only where nothing exact is known.
    for exact in (True, False, True):
        _spread(graph, known, consumers, exact=exact)
    non_negative = _non_negative_tensors(graph)
    return {name: (0.0, high) if name in non_negative else (low, high) for name, (low, high) in known.items()}


def _spread(
    graph: onnx.GraphProto, known: dict[str, tuple[float, float]], consumers: dict[str, int], *, exact: bool
) -> None:
    """Fill unknown bounds along the links until nothing changes (each pass reaches one tensor further)."""
    changed = True
    while changed:
        changed = False
        for node in graph.node:
            for source, target in _range_links(node, consumers, exact=exact):
                if source in known and target not in known:
                    known[target] = known[source]
                    changed = True


def _range_links(node: onnx.NodeProto, consumers: dict[str, int], *, exact: bool) -> list[tuple[str, str]]:
    """(from, to) pairs of tensors whose range carries over: exact ones, or the Relu's upper bound."""
    if not node.input or not node.output:
        return []
    source, target = node.input[0], node.output[0]
    if exact and node.op_type in SAME_VALUES:
        return [(source, target), (target, source)]
    if exact and node.op_type == "Relu" and consumers.get(source) == 1:
        return [(target, source)]  # ORT's adjust_tensor_ranges: the Relu is folded into the input's Q
    if not exact and node.op_type == "Relu":
        return [(source, target)]  # relu(x) <= max(x); its low end becomes 0 with the other non-negative tensors
    return []


def _non_negative_tensors(graph: onnx.GraphProto) -> set[str]:
    """Relu (and ReLU6 Clip) outputs, and what KEEP_NON_NEGATIVE ops make of them; also the single-use inputs of
    those, whose values below 0 the folded Relu or Clip clips away."""
    consumers = reader_counts(graph)
    found: set[str] = set()
    for node in graph.node:  # ONNX nodes are topologically sorted: producers come first
        if node.op_type == "Relu" or _clips_below_at_zero_or_more(node, graph):
            found.add(node.output[0])
            if consumers.get(node.input[0]) == 1:
                found.add(node.input[0])
        elif node.op_type in KEEP_NON_NEGATIVE and node.input and node.input[0] in found:
            found.add(node.output[0])
    return found


def _clips_below_at_zero_or_more(node: onnx.NodeProto, graph: onnx.GraphProto) -> bool:
    """A Clip whose lower bound is a constant >= 0 (ReLU6): its output is non-negative as a Relu's is.  Without
    this, CALIB_METHOD=max's symmetric (-6, 6) for a ReLU6 output gave EfficientNet-Lite0's CPU graphs cosine 0.04
    to FP32 (ORT folds the Clip into a Q whose range no longer clips); percentile's histogram kept the low end 0."""
    if node.op_type != "Clip" or len(node.input) < 2 or not node.input[1]:
        return False
    low = next((init for init in graph.initializer if init.name == node.input[1]), None)
    return low is not None and float(numpy_helper.to_array(low)) >= 0


def nodes_without_ranges(graph: onnx.GraphProto, ranges: dict[str, tuple[float, float]]) -> list[str]:
    """Names of CPU_OPS nodes with an activation input or output that has no range: they stay in float."""
    constants = {init.name for init in graph.initializer}
    constants |= {out for node in graph.node if node.op_type == "Constant" for out in node.output}
    left = []
    for node in graph.node:
        if node.op_type not in CPU_OPS:
            continue
        tensors = [name for name in (*node.input, *node.output) if name and name not in constants]
        if any(name not in ranges for name in tensors):
            left.append(node.name)
    return left


def _unquantize_graph_outputs(model: onnx.ModelProto) -> list[str]:
    """Remove the QuantizeLinear -> DequantizeLinear pair in front of each graph output; return those outputs.

    The producer then writes the output itself, in float: ORT still fuses DequantizeLinear -> Gemm/MatMul
    into an int8 kernel with a float result (QGemm, MatMulIntegerToFloat).
    """
    nodes = model.graph.node
    producer = {out: node for node in nodes for out in node.output}
    readers = reader_counts(model.graph)
    freed = []
    for output in model.graph.output:
        dequantize = producer.get(output.name)
        if dequantize is None or dequantize.op_type != "DequantizeLinear":
            continue
        quantize = producer.get(dequantize.input[0])
        if quantize is None or quantize.op_type != "QuantizeLinear" or readers.get(quantize.output[0]) != 1:
            continue
        source = producer.get(quantize.input[0])
        if source is None or readers.get(quantize.input[0]) != 1:
            continue
        source.output[list(source.output).index(quantize.input[0])] = output.name
        nodes.remove(quantize)
        nodes.remove(dequantize)
        freed.append(output.name)
    used = {name for node in nodes for name in node.input}
    unused = [init for init in model.graph.initializer if init.name not in used]  # the pairs' scales, zero points
    for init in unused:
        model.graph.initializer.remove(init)
    return freed


def as_tensors_data(ranges: dict[str, tuple[float, float]], method):
    from onnxruntime.quantization.calibrate import TensorData, TensorsData

    data = {name: TensorData(lowest=np.float32(low), highest=np.float32(high)) for name, (low, high) in ranges.items()}
    return TensorsData(method, data)


def int8_kernel_counts(graph: Path, scratch: Path) -> dict:
    """How many Conv/MatMul/Gemm ONNX Runtime's CPU provider runs as int8 kernels after its graph optimizations.

    Read from the optimized graph ORT writes (SessionOptions.optimized_model_filepath): a Q/DQ graph
    ORT cannot fuse keeps its Conv in FP32 between Q/DQ nodes, which runs slower than the FP32 graph.
    ORT writes it in a folder made in `scratch` (the stage's is beside its graphs), its weights to /dev/null:
    only the nodes are read back, and a copy of the weights on disk cost a disk with room for them (a system
    temporary folder too small for them made both CPU graphs of a 0.6 GB MLP fail, and the build served the
    slower Q/DQ graph instead) and the time to write them.
    """
    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="optimized.", dir=scratch) as folder:
        optimized = Path(folder) / "optimized.onnx"
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.optimized_model_filepath = str(optimized)
        # Its weights in a file beside it (ORT takes a name relative to the graph), here a link to /dev/null.
        (Path(folder) / "weights.data").symlink_to(os.devnull)
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name", "weights.data")
        ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
        ops = [node.op_type for node in onnx.load(str(optimized), load_external_data=False).graph.node]
    return {
        "int8_kernels": sum(op in INT8_KERNELS for op in ops),
        "float_kernels": sum(op in FLOAT_KERNELS for op in ops),
    }
