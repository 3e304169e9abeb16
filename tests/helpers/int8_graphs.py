"""Small FP32 graphs for the INT8 quantizers' tests (calibration/qdq_cpu.py, calibration/bias.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def weight_kinds_graph(path: Path, channels: int) -> None:
    """x [n, channels, 8, 8] -> y [n, 6], v [n]: every kind of weight the CPU quantizer rounds, written to `path`: a
    Conv per channel (one of its channels all zeros: scale 1, zero point 0), a Gemm with transB and one without, a
    MatMul on a 2-D weight (per channel) and one on a vector (per tensor, asymmetric)."""
    rng = np.random.default_rng(3)
    stem = rng.standard_normal((8, channels, 3, 3)).astype(np.float32)
    stem[5] = 0.0
    weights = {
        "stem": stem,
        "stem_b": rng.standard_normal(8).astype(np.float32),
        "fc_t": rng.standard_normal((16, 8)).astype(np.float32),
        "fc_t_b": rng.standard_normal(16).astype(np.float32),
        "fc": rng.standard_normal((16, 12)).astype(np.float32) * 3,
        "fc_b": rng.standard_normal(12).astype(np.float32),
        "proj": rng.standard_normal((12, 6)).astype(np.float32),
        "vector": rng.standard_normal(12).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "stem", "stem_b"], ["c"], pads=[1, 1, 1, 1], name="stem"),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("GlobalAveragePool", ["r"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc_t", "fc_t_b"], ["g"], transB=1, name="fc_t"),
        helper.make_node("Gemm", ["g", "fc", "fc_b"], ["h"], name="fc"),
        helper.make_node("MatMul", ["h", "proj"], ["y"], name="proj"),
        helper.make_node("MatMul", ["h", "vector"], ["v"], name="dot"),
    ]
    outputs = [
        helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 6]),
        helper.make_tensor_value_info("v", TensorProto.FLOAT, ["n"]),
    ]
    graph = helper.make_graph(
        nodes,
        "weight_kinds",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", channels, 8, 8])],
        outputs,
        [numpy_helper.from_array(value, name) for name, value in weights.items()],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
