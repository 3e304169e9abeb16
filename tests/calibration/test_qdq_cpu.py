"""The ranges of the INT8 graphs for ONNX Runtime's CPU kernels (calibration/qdq_cpu.py), from the symmetric ones
calibration found."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from trt_pipeline.calibration import qdq_cpu
from trt_pipeline.calibration.holdout import read_calibration
from trt_pipeline.calibration.qdq import write_with_ranges
from trt_pipeline.calibration.qdq_cpu import (
    WEIGHT_FORMS,
    as_tensors_data,
    asymmetric_ranges,
    nodes_without_ranges,
)
from trt_pipeline.calibration.ranges import collect_statistics

from ..helpers.int8_graphs import weight_kinds_graph


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


@pytest.mark.parametrize("weights", list(WEIGHT_FORMS))
def test_the_weights_scales_given_to_the_quantizer_write_the_graph_it_writes_alone(tmp_path, weights):
    """Each per-channel weight's scales and zero points are computed for every channel at once and given to ONNX
    Runtime's quantizer (TensorQuantOverrides), which otherwise computes them one channel at a time: the graph is
    the one it writes without them, byte for byte, in every CPU form (a channel of zeros among them: scale 1, zero
    point 0 in uint8 too)."""
    fp32 = tmp_path / "model.onnx"
    weight_kinds_graph(fp32, 4)
    np.save(tmp_path / "rows.npy", np.random.default_rng(0).uniform(-2, 4, (32, 4, 8, 8)).astype(np.float32))
    data = read_calibration(tmp_path / "rows.npy", fp32, None, samples=32, batch=16).data
    ranges = collect_statistics(fp32, data, ["max"]).ranges["max"]
    options, _ = qdq_cpu._cpu_options(fp32, ranges, weights, qdq_cpu.FLOAT_OUTPUTS)
    assert options["extra_options"]["TensorQuantOverrides"]  # the Conv's, the Gemms' and the 2-D MatMul's
    alone = {**options, "extra_options": {**options["extra_options"], "TensorQuantOverrides": {}}}
    written = {}
    for label, given in (("given", options), ("alone", alone)):
        (tmp_path / label).mkdir()
        write_with_ranges(fp32, tmp_path / label / "q.onnx", **given)
        written[label] = onnx.load(str(tmp_path / label / "q.onnx")).SerializeToString()
    assert written["given"] == written["alone"]
