"""The INT8 compute share (calibration/share.py) on a graph small enough to count by hand.

A Conv whose input and weight are dequantized (weight through a Transpose, as quantizers often leave it), a MatMul
of two activations (attention's kind, both dequantized) and a float MatMul; the shapes are measured by running the
graph on ONNX Runtime.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from trt_pipeline.calibration.share import compute_shapes, int8_share, macs_by_op

CONV_MACS = 4 * 8 * 8 * (3 * 3 * 3)  # output elements x (input channels x kernel)
ATTENTION_MACS = 4 * 8 * 8 * 8  # [1, 4, 8, 8] @ [1, 4, 8, 8]: output elements x inner length
DENSE_MACS = 4 * 8 * 5 * 8  # [1, 4, 8, 8] @ [8, 5]: output elements x inner length


def _toy_graph(path) -> None:
    scale = numpy_helper.from_array(np.array(0.05, np.float32), "scale")
    zero = numpy_helper.from_array(np.array(0, np.int8), "zero")
    # The conv weight is stored int8 as [kh, kw, in, out] and transposed to [out, in, kh, kw] after its DQ.
    weight = numpy_helper.from_array(np.ones((3, 3, 3, 4), np.int8), "weight_q")
    dense = numpy_helper.from_array(np.ones((8, 5), np.float32), "dense")
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "scale", "zero"], ["x_q"]),
        helper.make_node("DequantizeLinear", ["x_q", "scale", "zero"], ["x_dq"]),
        helper.make_node("DequantizeLinear", ["weight_q", "scale", "zero"], ["weight_dq"]),
        helper.make_node("Transpose", ["weight_dq"], ["weight"], perm=[3, 2, 0, 1]),
        helper.make_node("Conv", ["x_dq", "weight"], ["conv"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("QuantizeLinear", ["conv", "scale", "zero"], ["conv_q"]),
        helper.make_node("DequantizeLinear", ["conv_q", "scale", "zero"], ["conv_dq"]),
        helper.make_node("MatMul", ["conv_dq", "conv_dq"], ["attention"], name="attention"),
        helper.make_node("MatMul", ["attention", "dense"], ["y"], name="dense"),
    ]
    graph = helper.make_graph(
        nodes,
        "toy",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 5])],
        [scale, zero, weight, dense],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def test_int8_share_counts_the_dequantized_ops_macs_over_all(tmp_path):
    path = tmp_path / "toy.onnx"
    _toy_graph(path)
    macs = macs_by_op(*compute_shapes(path, {"x": np.zeros((1, 3, 8, 8), np.float32)}))
    assert macs == {"conv": CONV_MACS, "attention": ATTENTION_MACS, "dense": DENSE_MACS}
    share = int8_share(path, macs)
    assert share["ops_quantized"] == "2/3"
    assert share["int8_compute_share"] == (CONV_MACS + ATTENTION_MACS) / (CONV_MACS + ATTENTION_MACS + DENSE_MACS)
