"""The check stage (pipeline/stages/check.py) on an exported graph."""

from __future__ import annotations

import onnx
import pytest

from tests.helpers import toy_models
from tests.helpers.exported import exported
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.stages.check import check_onnx


def test_check_refuses_another_opset(tmp_path):
    graph, _ = exported(toy_models.tiny_cnn(), tmp_path)
    model = onnx.load(str(graph))
    model.opset_import[0].version = 13
    onnx.save(model, str(graph))
    with pytest.raises(PipelineError, match="not 17"):
        check_onnx(graph)


def _dividing_graph(path):
    """y = x / -1 in int64: ONNX Runtime computes it with the CPU's division, which traps (SIGFPE) on the one value
    whose quotient overflows, the smallest int64: a real crash inside ONNX Runtime, at inputs it otherwise runs."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Div", ["x", "minus_one"], ["y"])],
        "divides",
        [helper.make_tensor_value_info("x", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor("minus_one", TensorProto.INT64, [], [-1])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_a_graph_that_crashes_onnx_runtime_is_an_error_naming_the_inputs(tmp_path):
    """The cases run in a child: a crash there is the check's error, naming the case that crashes alone, and this
    process goes on (without the child, the crash killed the build with no message: a Longformer's graph)."""
    import numpy as np

    from trt_pipeline.pipeline.folder.artifacts import write_npz

    graph = _dividing_graph(tmp_path / "model.onnx")
    runs, traps = np.full((1, 4), 6, np.int64), np.full((2, 3), np.iinfo(np.int64).min, np.int64)
    write_npz(
        tmp_path / "reference.npz",
        {"case0/in/x": runs, "case0/out/y": -runs, "case1/in/x": traps, "case1/out/y": traps},
    )
    with pytest.raises(PipelineError, match=r"crashed \(SIGFPE.*model.onnx with the reference's inputs x \[2, 3\]"):
        check_onnx(graph, tmp_path / "reference.npz")
    write_npz(tmp_path / "reference.npz", {"case0/in/x": runs, "case0/out/y": -runs})
    assert check_onnx(graph, tmp_path / "reference.npz")["outputs"][0]["name"] == "y"
