"""TensorRT's Q/DQ graph as calibration/qdq_write.py writes it: the very graph ONNX Runtime's quantize_static writes
with TENSORRT_OPTIONS (serialized, byte for byte) on hand-made graphs with every case the writer mirrors and on graphs
the pipeline exports, and each weight quantized once per smoothing alpha for all the graphs of the INT8 stage."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantType
from onnxruntime.quantization.calibrate import CalibrationMethod, TensorData, TensorsData
from onnxruntime.quantization.quant_utils import compute_data_quant_params, quantize_onnx_initializer

from trt_pipeline.calibration.holdout import read_calibration
from trt_pipeline.calibration.int8 import build_candidates, calibrated_graph, fit_candidates
from trt_pipeline.calibration.int8_records import CalibrationConfig
from trt_pipeline.calibration.qdq import quantize_qdq
from trt_pipeline.calibration.qdq_marks import IntegerForm
from trt_pipeline.calibration.qdq_write import TENSORRT, QuantizedWeights, qdq_model, quantize_weight, scale_zero_point
from trt_pipeline.calibration.ranges import QUANTIZED_OPS
from trt_pipeline.pipeline.core.settings import Settings
from trt_pipeline.pipeline.folder.graph_files import graph_without_weights
from trt_pipeline.pipeline.folder.layout import CACHE_FOLDER
from trt_pipeline.pipeline.stages.sequence import make_engine

from ..helpers.quantize_static import quantize_static_graph


def _ranges(model: onnx.ModelProto, seed: int = 0) -> TensorsData:
    """A lopsided range for every tensor the graph's nodes read or write."""
    rng = np.random.default_rng(seed)
    names = sorted({name for node in model.graph.node for name in (*node.input, *node.output) if name})
    data = {
        name: TensorData(lowest=np.float32(-rng.uniform(0.1, 4)), highest=np.float32(rng.uniform(0.1, 4)))
        for name in names
    }
    return TensorsData(CalibrationMethod.MinMax, data)


# quantize_static's options for TensorRT's graph (with int8 activations and weights, per channel): what qdq_write.py
# reproduces as its TENSORRT scheme.
TENSORRT_OPTIONS = {
    "op_types_to_quantize": list(QUANTIZED_OPS),
    "activation_type": QuantType.QInt8,
    "extra_options": {
        "ActivationSymmetric": True,
        "WeightSymmetric": True,
        "QuantizeBias": False,
        "OpTypesToExcludeOutputQuantization": list(QUANTIZED_OPS),
    },
}


def _quantize_static(graph: Path, ranges, exclude: list[str], scratch: Path) -> onnx.ModelProto:
    return quantize_static_graph(graph, scratch, ranges, nodes_to_exclude=exclude, **TENSORRT_OPTIONS)


def _every_case(folder: Path) -> Path:
    """A graph with each case qdq_write mirrors: Conv with and without bias, a bias two Convs read (ORT copies it for
    the second), a weight a quantized and an excluded Conv share, a bias so large beside its weight's and input's
    scales that ORT raises the weight's scale (the int32 bias rule), a weight channel of zeros (scale 1), Gemm with
    transB and without (a beta ORT resets), MatMul on a 2-D weight (axis 1), on a 1-D weight (per tensor), on two
    activations, and an activation that is also a graph output; weights past 1 KB, as real ones are."""
    rng = np.random.default_rng(1)

    def init(name: str, *shape: int, scale: float = 1.0) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    w1 = init("w1", 8, 4, 3, 3)
    w1_values = numpy_helper.to_array(w1).copy()
    w1_values[3] = 0  # a channel of zeros
    huge = numpy_helper.from_array(np.full(8, 3e9, np.float32), "huge_bias")
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b1"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),  # b1 shared
        helper.make_node("Conv", ["r1", "w2"], ["c3"], name="conv3", pads=[1, 1, 1, 1]),  # w2 shared, excluded
        helper.make_node("Conv", ["c2", "w4", "huge_bias"], ["c4"], name="conv4", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c4", "c3"], ["a"], name="add"),
        helper.make_node("GlobalAveragePool", ["a"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "wg", "bg"], ["g"], name="gemm", transB=1),
        helper.make_node("Gemm", ["g", "wh", "bh"], ["h"], name="gemm_beta", beta=0.5),
        helper.make_node("MatMul", ["h", "wm"], ["m"], name="matmul"),
        helper.make_node("MatMul", ["m", "wv"], ["v"], name="matmul_vector"),
        helper.make_node("Unsqueeze", ["m", "axis"], ["mu"], name="unsqueeze"),
        helper.make_node("MatMul", ["mu", "mu_t"], ["outer"], name="matmul_activations"),
        helper.make_node("Transpose", ["mu"], ["mu_t"], name="transpose", perm=[0, 2, 1]),
    ]
    nodes.insert(-1, nodes.pop())  # the Transpose before the MatMul that reads it
    graph = helper.make_graph(
        nodes,
        "every_case",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 6, 6])],
        [
            helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
            for name in ("m", "v", "outer")  # m: an output that MatMuls also read
        ],
        [
            numpy_helper.from_array(w1_values, "w1"),
            init("b1", 8),
            init("w2", 8, 8, 3, 3),
            init("w4", 8, 8, 3, 3, scale=1e-6),
            huge,
            init("wg", 16, 8),
            init("bg", 16),
            init("wh", 16, 12),
            init("bh", 12),
            init("wm", 12, 100),  # 1.2 KB in int8: onnx writes it to external data in quantize_static
            init("wv", 100),
            numpy_helper.from_array(np.array([2], np.int64), "axis"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = folder / "every_case.onnx"
    onnx.save(model, str(path))
    return calibrated_graph(path, {}, folder / "model.calibrated.onnx")


@pytest.mark.parametrize("exclude", [[], ["conv3"], ["conv3", "gemm", "matmul_activations"]])
def test_the_written_graph_is_quantize_statics_byte_for_byte(tmp_path, exclude):
    graph = _every_case(tmp_path)
    ranges = _ranges(graph_without_weights(graph))
    reference = _quantize_static(graph, ranges, exclude, tmp_path / "ort")
    written = qdq_model(graph, ranges, TENSORRT, QuantizedWeights(), exclude)
    assert written.SerializeToString() == reference.SerializeToString()
    # The cases are there: the shared bias copied, the int32 rule's raised scale, the zero channel's scale of 1.
    initializers = {init.name: numpy_helper.to_array(init) for init in written.graph.initializer}
    assert "b10" in initializers and initializers["w1_scale"][3] == 1
    raised = initializers["w4_scale"]
    own, _ = scale_zero_point(numpy_helper.to_array(_initializer(graph, "w4")), 0, TENSORRT.weights)
    assert np.all(raised > own)


def _initializer(graph: Path, name: str) -> onnx.TensorProto:
    return next(init for init in onnx.load(str(graph)).graph.initializer if init.name == name)


@pytest.mark.parametrize("model", ["tests.helpers.toy_models:tiny_cnn", "tests.helpers.toy_models:transformer_encoder"])
def test_exported_graphs_are_quantize_statics_byte_for_byte(tmp_path, model):
    folder = make_engine(Settings(model=model, precision="fp32", out_root=tmp_path / "engines"))
    graph = calibrated_graph(folder / "model.onnx", {}, tmp_path / "model.calibrated.onnx")
    ranges = _ranges(graph_without_weights(graph), seed=2)
    reference = _quantize_static(graph, ranges, [], tmp_path / "ort")
    written = tmp_path / "model.qdq.onnx"
    quantize_qdq(graph, written, ranges)
    assert onnx.load(str(written)).SerializeToString() == reference.SerializeToString()


# Each form a Q/DQ graph gives an initializer: TensorRT's and the CPU graphs' weights (int8 symmetric, 7-bit with
# reduce_range, uint8: symmetric per channel, asymmetric per tensor) and an activation's uint8 (an Add's constant).
FORMS = {
    "int8": IntegerForm(TensorProto.INT8, symmetric=True),
    "int8-7bit": IntegerForm(TensorProto.INT8, symmetric=True, reduce_range=True),
    "uint8-symmetric": IntegerForm(TensorProto.UINT8, symmetric=True),
    "uint8": IntegerForm(TensorProto.UINT8, symmetric=False),
    "uint8-7bit": IntegerForm(TensorProto.UINT8, symmetric=False, reduce_range=True),
}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("axis", [0, 1, None])
def test_weights_round_as_onnx_runtime_rounds_them_channel_by_channel(axis, form):
    form = FORMS[form]
    if axis is not None and not form.symmetric:
        pytest.skip("ORT quantizes a weight per channel symmetric only")
    rng = np.random.default_rng(3)
    values = (rng.standard_normal((6, 5, 3)) * rng.uniform(1e-3, 50, (6, 1, 1))).astype(np.float32)
    values[2] = 0
    values[4, 1, 1] = 1e-39  # below float32's tiny scale on its own channel along axis 0
    values[5] = np.abs(values[5])  # a channel without negative values: its asymmetric zero point 0
    ours = quantize_weight(values, "w", axis, *scale_zero_point(values, axis, form))
    if axis is None:
        zero_point, scale = compute_data_quant_params(values.flatten(), form.type, form.symmetric, form.reduce_range)
    else:
        channels = [
            compute_data_quant_params(values.take(i, axis).ravel(), form.type, True, form.reduce_range)
            for i in range(values.shape[axis])
        ]
        zero_point, scale = np.asarray([c[0] for c in channels]), np.asarray([c[1] for c in channels])
    theirs = quantize_onnx_initializer(numpy_helper.from_array(values, "w"), form.type, zero_point, scale, axis)
    assert ours.scale.tobytes() == scale.tobytes() and ours.scale.shape == scale.shape
    assert ours.zero_point.tobytes() == zero_point.tobytes() and ours.zero_point.dtype == zero_point.dtype
    assert ours.quantized.SerializeToString() == theirs.SerializeToString()


def test_the_candidates_of_one_smoothing_alpha_share_their_weights(tmp_path):
    """Two methods on the unsmoothed graph and on a smoothed one: four candidates, one set of quantized weights per
    alpha, and each candidate's graph, made from its alpha's weights, quantize_static's of its graph and ranges."""
    folder = make_engine(
        Settings(model="tests.helpers.toy_models:transformer_encoder", precision="fp32", out_root=tmp_path / "e")
    )
    rows = tmp_path / "rows.npz"
    np.savez(rows, x=np.random.default_rng(4).standard_normal((48, 8, 16)).astype(np.float32))
    fp32 = folder / "model.onnx"
    parts = read_calibration(rows, fp32, None, samples=48, batch=16)
    config = CalibrationConfig(methods=("max", "percentile"), smooth_alphas=(0.9, None))
    scratch = tmp_path / "scratch"
    fits = fit_candidates(fp32, parts, config, tmp_path / CACHE_FOLDER, scratch, judged=True)
    candidates = list(build_candidates(fits, parts.fit, config, scratch))
    assert [(c.method, c.alpha) for c in candidates] == [(m, a) for m in config.methods for a in config.smooth_alphas]
    smoothed, unsmoothed = candidates[0], candidates[1]
    assert candidates[2].weights is smoothed.weights and candidates[3].weights is unsmoothed.weights
    assert smoothed.weights is not unsmoothed.weights
    for index, candidate in enumerate(candidates):
        reference = _quantize_static(candidate.calibrated, candidate.ranges, [], tmp_path / f"ort-{index}")
        assert onnx.load(str(candidate.qdq)).SerializeToString() == reference.SerializeToString()
