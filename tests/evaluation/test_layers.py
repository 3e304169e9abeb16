"""Where a lower-precision graph departs from the FP32 graph, node by node (pipeline/evaluation/layers.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from trt_pipeline.pipeline.core.precision import Precision
from trt_pipeline.pipeline.evaluation.layers import compare_layers
from trt_pipeline.pipeline.folder.layout import graph_record


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
