"""The INT8 graphs for ONNX Runtime's CPU kernels (calibration/qdq_cpu.py): their ranges, from the symmetric ones
calibration found, and the graphs themselves, written by calibration/qdq_write.py as quantize_static writes them (byte
for byte) in every form, on a hand-made graph with every op and case the writer mirrors and on exported graphs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantType
from onnxruntime.quantization.calibrate import CalibrationMethod, TensorData, TensorsData

from trt_pipeline.calibration.holdout import read_calibration
from trt_pipeline.calibration.int8 import calibrated_graph
from trt_pipeline.calibration.qdq import quantize_qdq
from trt_pipeline.calibration.qdq_cpu import (
    CPU_OPS,
    FLOAT_OUTPUTS,
    WEIGHT_FORMS,
    _unquantize_graph_outputs,
    as_tensors_data,
    asymmetric_ranges,
    cpu_scheme,
    nodes_without_ranges,
    quantize_for_cpu,
)
from trt_pipeline.calibration.qdq_marks import Mark
from trt_pipeline.calibration.qdq_write import QuantizedWeights, qdq_model, scale_zero_point
from trt_pipeline.calibration.ranges import collect_statistics
from trt_pipeline.pipeline.core.settings import Settings
from trt_pipeline.pipeline.folder.graph_files import graph_without_weights
from trt_pipeline.pipeline.stages.sequence import make_engine

from ..helpers.quantize_static import quantize_static_graph


def test_cpu_ranges_from_symmetric_ones():
    """ResNet's shape in miniature: conv-relu-maxpool-conv, a residual Add-Relu, pooling and a classifier.
    Calibration ranged the Conv/Gemm inputs and outputs (symmetric, as TensorRT wants them)."""
    from onnx import helper
    from onnxruntime.quantization import CalibrationMethod
    from onnxruntime.quantization.calibrate import TensorData, TensorsData

    weights = [
        numpy_helper.from_array(np.ones(shape, np.float32), name)
        for name, shape in (("w", (4, 4, 1, 1)), ("w2", (3, 4)))
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c1"], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["m1"], name="pool", kernel_shape=[1, 1]),
        helper.make_node("Conv", ["m1", "w"], ["c2"], name="conv2"),
        helper.make_node("Add", ["c2", "m1"], ["a"], name="add"),
        helper.make_node("Relu", ["a"], ["r2"], name="relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "w2"], ["y"], name="fc"),
    ]
    graph = helper.make_graph(nodes, "g", [], [], weights)
    # Symmetric (-T, T), except f: percentile's T is clamped to the observed minimum (all f > 0.2).
    bounds = {"x": (-2, 2), "c1": (-5, 5), "m1": (-3, 3), "c2": (-4, 4), "f": (0.2, 1.5), "y": (-9, 9)}
    symmetric = TensorsData(
        CalibrationMethod.Percentile,
        {n: TensorData(lowest=np.float32(lo), highest=np.float32(hi)) for n, (lo, hi) in bounds.items()},
    )
    ranges = asymmetric_ranges(graph, symmetric)
    assert ranges == {
        "x": (-2.0, 2.0),  # the input: signed
        "c1": (0.0, 5.0),  # only a Relu reads it: the Relu folded into its QuantizeLinear clips at 0
        "r1": (0.0, 3.0),  # MaxPool keeps values: its output's range is its input's
        "m1": (0.0, 3.0),
        "c2": (-4.0, 4.0),  # a conv output before the residual Add: its true min and max are unknown
        "g": (0.0, 1.5),  # Flatten keeps values; average of a Relu output: non-negative
        "f": (0.0, 1.5),
        "y": (-9.0, 9.0),
    }
    # Nothing ranged the residual sum or the last Relu: those nodes stay in float.
    assert nodes_without_ranges(graph, ranges) == ["add", "relu2", "gap"]
    assert as_tensors_data(ranges, symmetric.calibration_method)["c1"].range_value == (0.0, 5.0)


def test_cpu_ranges_of_a_relu6_are_non_negative():
    """EfficientNet-Lite's ReLU6 (Clip 0..6): its output, and its input where only it reads that, get [0, high] as
    a Relu's do; max calibration's symmetric (-6, 6) there gave that model's CPU graphs cosine 0.04 to FP32."""
    from onnx import helper
    from onnxruntime.quantization import CalibrationMethod
    from onnxruntime.quantization.calibrate import TensorData, TensorsData

    weights = [
        numpy_helper.from_array(np.ones((4, 4, 1, 1), np.float32), "w"),
        numpy_helper.from_array(np.array(0, np.float32), "low"),
        numpy_helper.from_array(np.array(6, np.float32), "high"),
        numpy_helper.from_array(np.array(-1, np.float32), "minus_one"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c1"], name="conv1"),
        helper.make_node("Clip", ["c1", "low", "high"], ["r1"], name="relu6"),
        helper.make_node("Conv", ["r1", "w"], ["c2"], name="conv2"),
        helper.make_node("Clip", ["c2", "minus_one", "high"], ["r2"], name="not_a_relu"),
        helper.make_node("Conv", ["r2", "w"], ["y"], name="conv3"),
    ]
    graph = helper.make_graph(nodes, "g", [], [], weights)
    bounds = {"x": (-2, 2), "c1": (-80, 80), "r1": (-6, 6), "c2": (-7, 7), "r2": (-6, 6), "y": (-9, 9)}
    symmetric = TensorsData(
        CalibrationMethod.MinMax,
        {n: TensorData(lowest=np.float32(lo), highest=np.float32(hi)) for n, (lo, hi) in bounds.items()},
    )
    ranges = asymmetric_ranges(graph, symmetric)
    assert ranges["r1"] == (0.0, 6.0) and ranges["c1"] == (0.0, 80.0)
    assert ranges["r2"] == (-6.0, 6.0) and ranges["c2"] == (-7.0, 7.0)  # a Clip from -1 is no Relu


# quantize_static's weight options for each CPU form, as quantize_for_cpu asked for them when ONNX Runtime wrote the
# graphs: (weight_type, WeightSymmetric, reduce_range).
ORT_WEIGHTS = {
    "u8s8": (QuantType.QInt8, True, False),
    "u8u8": (QuantType.QUInt8, False, False),
    "u8s8-reduce-range": (QuantType.QInt8, True, True),
}


def _quantize_static(
    graph: Path, ranges, weights: str, exclude: list[str], scratch: Path, float_outputs=FLOAT_OUTPUTS
) -> onnx.ModelProto:
    """quantize_static's CPU graph of the form `weights`: uint8 asymmetric activations, int32 biases (its default),
    the outputs of `float_outputs` (MatMul and Gemm) float."""
    weight_type, symmetric, reduce_range = ORT_WEIGHTS[weights]
    extra = {
        "ActivationSymmetric": False,
        "WeightSymmetric": symmetric,
        "OpTypesToExcludeOutputQuantization": list(float_outputs),
    }
    return quantize_static_graph(
        graph,
        scratch,
        ranges,
        op_types_to_quantize=list(CPU_OPS),
        activation_type=QuantType.QUInt8,
        weight_type=weight_type,
        reduce_range=reduce_range,
        nodes_to_exclude=exclude,
        extra_options=extra,
    )


def _every_cpu_case(folder: Path) -> Path:
    """A graph with every op of CPU_OPS and each case the writer mirrors: a Relu folded into its Conv's Q (only it
    reads the Conv's output), a Relu whose input a second op reads (kept), one whose input is a graph output (kept,
    the input's Q with the Relu's range: ORT's adjust_tensor_ranges), a ReLU6 Clip folded into an Add's Q,
    MaxPool / Transpose / Unsqueeze / Squeeze / AveragePool / Flatten / Reshape sharing their input's scale (a chain
    of them), Concat, Add and Mul of two activations and of an activation and a constant (a 0-d one), a bias two Convs
    read (ORT copies it for the second), a Conv of one channel (its bias's one scale a scalar), a bias so large beside
    its weight's and input's scales that ORT raises an int8 weight's scale, a weight channel of zeros, Gemm with
    transB and without (a beta ORT resets), MatMul on a 2-D weight (per channel, past 1 KB in int8: external data in
    quantize_static), on a 1-D one (per tensor: asymmetric in uint8) and on two activations, and graph outputs a
    quantized op writes (u2, c4), that ops also read (u2, h, c4), and that stay float (MatMul outputs)."""
    rng = np.random.default_rng(5)

    def init(name: str, *shape: int, scale: float = 1.0) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    w1 = numpy_helper.to_array(init("w1", 8, 4, 3, 3)).copy()
    w1[3] = 0  # a channel of zeros
    constants = [
        numpy_helper.from_array(w1, "w1"),
        init("b1", 8),
        init("w2", 8, 8, 3, 3),
        init("w3", 8, 8, 1, 1, scale=1e-6),
        numpy_helper.from_array(np.full(8, 3e9, np.float32), "huge_bias"),
        numpy_helper.from_array(np.array(0, np.float32), "zero"),
        numpy_helper.from_array(np.array(6, np.float32), "six"),
        numpy_helper.from_array(np.array(0.5, np.float32), "half"),
        init("shift", 1, 8, 1, 1),
        numpy_helper.from_array(np.array([1], np.int64), "axis1"),
        init("w4", 1, 8, 1, 1),
        init("b4", 1),
        init("wg", 12, 17),
        init("bg", 12),
        init("wh", 12, 12),
        init("bh", 12),
        numpy_helper.from_array(np.array([-1, 4, 4], np.int64), "shape"),
        init("wm", 4, 300),
        init("wv", 12),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),  # folded: only it reads c1
        helper.make_node("MaxPool", ["r1"], ["m1"], name="pool1", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Transpose", ["m1"], ["t1"], name="transpose1", perm=[0, 1, 3, 2]),
        helper.make_node("Unsqueeze", ["t1", "axis1"], ["us"], name="unsqueeze"),
        helper.make_node("Squeeze", ["us", "axis1"], ["sq"], name="squeeze"),
        helper.make_node("Conv", ["sq", "w2", "b1"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),  # b1 again
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),  # kept: add1 reads c2 too
        helper.make_node("Add", ["r2", "c2"], ["a1"], name="add1"),
        helper.make_node("Clip", ["a1", "zero", "six"], ["k1"], name="relu6"),  # folded into add1's Q
        helper.make_node("Conv", ["k1", "w3", "huge_bias"], ["c3"], name="conv3"),
        helper.make_node("Mul", ["c3", "half"], ["u1"], name="mul1"),
        helper.make_node("Add", ["u1", "shift"], ["a2"], name="add2"),
        helper.make_node("Mul", ["a2", "k1"], ["u2"], name="mul2"),
        helper.make_node("AveragePool", ["u2"], ["p1"], name="average", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("MaxPool", ["m1"], ["m2"], name="pool2", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["m2", "w4", "b4"], ["c4"], name="conv4"),  # one channel: a scalar bias scale
        helper.make_node("Relu", ["c4"], ["r4"], name="relu4"),  # kept: c4 is a graph output
        helper.make_node("Concat", ["p1", "m2", "r4"], ["cat"], name="concat", axis=1),
        helper.make_node("GlobalAveragePool", ["cat"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "wg", "bg"], ["h"], name="gemm", transB=1),
        helper.make_node("Gemm", ["h", "wh", "bh"], ["hb"], name="gemm_beta", beta=0.5),
        helper.make_node("MatMul", ["hb", "wv"], ["v"], name="matmul_vector"),
        helper.make_node("Reshape", ["f", "shape"], ["rf"], name="reshape"),
        helper.make_node("MatMul", ["rf", "wm"], ["mm"], name="matmul"),
        helper.make_node("Transpose", ["rf"], ["rt"], name="transpose2", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["rf", "rt"], ["outer"], name="matmul_activations"),
    ]
    assert {node.op_type for node in nodes} == set(CPU_OPS)
    outputs = [
        helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("u2", "h", "mm", "v", "outer", "c4")
    ]
    graph = helper.make_graph(
        nodes,
        "every_cpu_case",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 6, 6])],
        outputs,
        constants,
    )
    path = folder / "every_cpu_case.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return calibrated_graph(path, {}, folder / "model.calibrated.onnx")


def _activation_ranges(model: onnx.ModelProto, unranged: set[str]) -> TensorsData:
    """A lopsided range for every tensor the graph's nodes read or write but its initializers and `unranged`."""
    rng = np.random.default_rng(6)
    constants = {init.name for init in model.graph.initializer}
    names = sorted({name for node in model.graph.node for name in (*node.input, *node.output)} - constants - unranged)
    data = {
        name: TensorData(lowest=np.float32(-rng.uniform(0.1, 4)), highest=np.float32(rng.uniform(0.1, 4)))
        for name in names
    }
    return TensorsData(CalibrationMethod.MinMax, data)


def _weight(graph: Path, name: str) -> np.ndarray:
    return next(numpy_helper.to_array(i) for i in onnx.load(str(graph)).graph.initializer if i.name == name)


@pytest.mark.parametrize("unranged", [set(), {"outer", "u1"}], ids=["all-ranged", "unranged-left-float"])
@pytest.mark.parametrize("weights", list(WEIGHT_FORMS))
def test_the_written_cpu_graph_is_quantize_statics_byte_for_byte(tmp_path, weights, unranged):
    assert set(ORT_WEIGHTS) == set(WEIGHT_FORMS)
    graph = _every_cpu_case(tmp_path)
    ranges = _activation_ranges(graph_without_weights(graph), unranged)
    exclude = nodes_without_ranges(graph_without_weights(graph).graph, dict(ranges.items()))
    assert exclude == (["mul1", "add2", "matmul_activations"] if unranged else [])
    reference = _quantize_static(graph, ranges, weights, exclude, tmp_path / "ort")
    written = qdq_model(graph, ranges, cpu_scheme(weights), QuantizedWeights(), exclude)
    assert written.SerializeToString() == reference.SerializeToString()
    # quantize_for_cpu's last step: the graph outputs' Q/DQ pairs removed alike.
    assert _unquantize_graph_outputs(written) == _unquantize_graph_outputs(reference) == ["u2", "h", "c4"]
    assert written.SerializeToString() == reference.SerializeToString()
    # The cases are there: Relu and Clip folded where only they read their input, shared scales, the copied bias, all
    # biases int32, the zero channel's scale of 1, the int32 rule's raised scale (int8 weights only).
    nodes = {node.name: node for node in written.graph.node}
    initializers = {init.name: numpy_helper.to_array(init) for init in written.graph.initializer}
    assert "relu1" not in nodes and "relu6" not in nodes and "relu2" in nodes and "relu4" in nodes
    assert nodes["m2_QuantizeLinear"].input[1] == "r1_scale" and nodes["rt_QuantizeLinear"].input[1] == "g_scale"
    assert {initializers[f"{bias}_quantized"].dtype for bias in ("b1", "b10", "huge_bias", "bg", "bh")} == {
        np.dtype(np.int32)
    }
    assert initializers["w1_scale"][3] == 1 and ("u1_QuantizeLinear" in nodes) == (not unranged)
    form = cpu_scheme(weights).constant_form(Mark(weight=True, axis=0))  # a Conv weight's
    own, _ = scale_zero_point(_weight(graph, "w3"), 0, form)
    raised = initializers["w3_scale"] > own
    assert raised.all() if WEIGHT_FORMS[weights].type == TensorProto.INT8 else not raised.any()


@pytest.mark.parametrize("weights", list(WEIGHT_FORMS))
def test_the_cpu_graph_with_every_output_quantized_is_quantize_statics(tmp_path, weights):
    """benchmarks/int8_cpu_forms.py's other graph (float_output_ops=()): MatMul's and Gemm's outputs quantized too."""
    graph = _every_cpu_case(tmp_path)
    ranges = _activation_ranges(graph_without_weights(graph), set())
    reference = _quantize_static(graph, ranges, weights, [], tmp_path / "ort", float_outputs=())
    written = qdq_model(graph, ranges, cpu_scheme(weights, ()), QuantizedWeights())
    assert written.SerializeToString() == reference.SerializeToString()
    assert (
        _unquantize_graph_outputs(written)
        == _unquantize_graph_outputs(reference)
        == ["u2", "h", "mm", "v", "outer", "c4"]
    )
    assert written.SerializeToString() == reference.SerializeToString()


@pytest.mark.parametrize("model", ["tests.helpers.toy_models:tiny_cnn", "tests.helpers.toy_models:transformer_encoder"])
def test_exported_cpu_graphs_are_quantize_statics_byte_for_byte(tmp_path, model):
    """The graphs quantize_for_cpu writes, from calibrated ranges turned into CPU ranges, are quantize_static's for the
    same ranges and the nodes those leave unranged, its graph outputs' Q/DQ pairs removed alike, in every form; U8S8's
    too where it takes its weights from those TensorRT's graph quantized (the INT8 stage's: int8._cpu_graph)."""
    folder = make_engine(Settings(model=model, precision="fp32", out_root=tmp_path / "engines"))
    graph = calibrated_graph(folder / "model.onnx", {}, tmp_path / "model.calibrated.onnx")
    structure = graph_without_weights(graph).graph
    rng = np.random.default_rng(7)
    rows = {
        i.name: rng.standard_normal([32, *[d.dim_value for d in i.type.tensor_type.shape.dim[1:]]]).astype(np.float32)
        for i in structure.input
    }
    np.savez(tmp_path / "rows.npz", **rows)
    data = read_calibration(tmp_path / "rows.npz", graph, None, samples=32, batch=16).data
    ranges = collect_statistics(graph, data, ["max"]).ranges["max"]
    cpu = asymmetric_ranges(structure, ranges)
    exclude = nodes_without_ranges(structure, cpu)
    for weights in WEIGHT_FORMS:
        reference = _quantize_static(
            graph, as_tensors_data(cpu, ranges.calibration_method), weights, exclude, tmp_path / weights
        )
        _unquantize_graph_outputs(reference)
        written = tmp_path / f"model.int8.{weights}.onnx"
        record = quantize_for_cpu(graph, written, ranges, weights=weights)
        assert record["float_nodes"] == exclude and record["int8_kernels"] > 0
        assert onnx.load(str(written)).SerializeToString() == reference.SerializeToString(), weights
    tensorrts = QuantizedWeights()
    quantize_qdq(graph, tmp_path / "model.int8.onnx", ranges, weights=tensorrts)
    quantize_for_cpu(graph, tmp_path / "reused.onnx", ranges, weights="u8s8", quantized_weights=tensorrts)
    assert (tmp_path / "reused.onnx").read_bytes() == (tmp_path / "model.int8.u8s8.onnx").read_bytes()
