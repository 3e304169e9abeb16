"""Where a lower-precision graph departs from the FP32 graph, node by node (pipeline/evaluation/layers.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from trt_pipeline.pipeline.core.precision import Precision
from trt_pipeline.pipeline.evaluation.layers import compare_layers, first_bad_node_text, first_node_past
from trt_pipeline.pipeline.folder.layout import graph_record
from trt_pipeline.pipeline.stages.fp16 import convert_fp16


def _scaled_by_its_peak(path: Path, factor: float) -> Path:
    """y = x * factor * max(x): its peak a 0-d tensor (ReduceMax over every axis, keepdims=0), as shape and
    normalisation arithmetic makes them (a DPT's graph had some)."""
    nodes = [
        helper.make_node("ReduceMax", ["x"], ["peak"], keepdims=0),
        helper.make_node("Mul", ["peak", "factor"], ["scaled_peak"]),
        helper.make_node("Mul", ["x", "scaled_peak"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "peak",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor("factor", TensorProto.FLOAT, [], [factor])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_a_zero_dimensional_tensor_is_compared_like_any_other(tmp_path: Path):
    fp32 = _scaled_by_its_peak(tmp_path / "model.onnx", 1.0)
    lower = _scaled_by_its_peak(tmp_path / "lower.onnx", 1.01)
    x = np.array([[1.0, -2.0, 3.0, 0.5], [0.0, 4.0, -1.0, 2.0]], dtype=np.float32)
    errors = {error.tensor: error for error in compare_layers(fp32, lower, {"x": x}, graph_record(Precision.FP32))}
    assert errors["peak"].max_abs == 0.0  # 0-d in both graphs, and the same
    assert np.isclose(errors["scaled_peak"].max_abs, 0.04) and np.isclose(errors["scaled_peak"].rel, 0.01)
    assert np.isclose(errors["y"].max_abs, 0.16, rtol=1e-5)


def _masked_scores(path: Path) -> Path:
    """Scores masked where sigmoid(x) < 0.5, then a Softmax: a mask from a threshold, as a Mask2Former's decoder
    masks its attention by its predicted masks.  Near x = 0 float16 rounds sigmoid(x) to 0.5 and the mask flips."""
    nodes = [  # named, as exporters name them
        helper.make_node("Sigmoid", ["x"], ["probability"], name="sigmoid"),
        helper.make_node("Less", ["probability", "half"], ["masked"], name="less"),
        helper.make_node("Where", ["masked", "fill", "zero"], ["bias"], name="fill"),
        helper.make_node("Add", ["x", "bias"], ["scores"], name="add"),
        helper.make_node("Softmax", ["scores"], ["y"], axis=-1, name="softmax"),
    ]
    constants = {"half": 0.5, "fill": -1e4, "zero": 0.0}
    graph = helper.make_graph(
        nodes,
        "masked",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor(name, TensorProto.FLOAT, [], [value]) for name, value in constants.items()],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_a_node_kept_in_fp32_that_departs_is_named_as_kept_and_what_it_reads_as_the_cause(tmp_path: Path):
    fp32 = _masked_scores(tmp_path / "model.onnx")
    x = {"x": np.array([[-1e-4, 2.0, -3e-5, 1.0]], dtype=np.float32)}  # sigmoid < 0.5 in FP32, 0.5 in float16
    graph = graph_record(Precision.FP16)
    convert_fp16(fp32, tmp_path / "kept.onnx", keep_fp32=["Where", "Softmax"])  # as the FP32 fallback keeps a fill
    first = first_node_past(fp32, tmp_path / "kept.onnx", x, graph)
    assert first is not None and (first.op, first.kept_fp32) == ("Where", True)
    assert "'fill' (Where), kept in FP32 already, so what it reads departs: " in first_bad_node_text(first)
    convert_fp16(fp32, tmp_path / "lowered.onnx")
    first = first_node_past(fp32, tmp_path / "lowered.onnx", x, graph)
    assert first is not None and (first.op, first.kept_fp32) == ("Where", False)
    assert "kept in FP32" not in first_bad_node_text(first)
