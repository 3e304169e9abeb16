"""Opset 18 nodes written in their opset 17 form (pipeline/stages/opset17.py), or named where they have none."""

from __future__ import annotations

import onnx
import pytest

from trt_pipeline.pipeline.core.errors import PipelineError


def test_an_opset_18_node_with_no_opset_17_form_is_named():
    """Pad over chosen axes (opset 18's axes input) has no opset 17 form: refused naming the node, not written
    as a Pad that would pad every axis."""
    from trt_pipeline.pipeline.stages.opset17 import convert_to_opset_17

    helper = onnx.helper
    pads = helper.make_tensor("pads", onnx.TensorProto.INT64, [2], [1, 1])
    axes = helper.make_tensor("axes", onnx.TensorProto.INT64, [1], [1])
    node = helper.make_node("Pad", ["x", "pads", "", "axes"], ["y"], name="pad_columns")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 6])],
        [pads, axes],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(PipelineError, match="node 'pad_columns': Pad with an axes input") as caught:
        convert_to_opset_17(model)
    assert 'Settings(exporter="torchscript")' in caught.value.fix
