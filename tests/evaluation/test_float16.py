"""The faithful FP16 evaluation (pipeline/evaluation/float16.py): a copy of an FP16 graph that rounds and overflows
in float16 where ONNX Runtime's CPU provider computes in float32, and the record of an FP16 graph asking for it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from trt_pipeline.pipeline.core.precision import Precision
from trt_pipeline.pipeline.core.sessions import onnxruntime_session
from trt_pipeline.pipeline.evaluation import evaluation_session
from trt_pipeline.pipeline.evaluation.float16 import faithful_copy
from trt_pipeline.pipeline.folder.layout import graph_record


def test_the_faithful_copy_rounds_and_overflows_where_onnxruntime_does_not(tmp_path: Path):
    """x * 1000 in float16: 100 -> inf (beyond 65504), 0.1234567 -> 0.12347 (10-bit mantissa)."""
    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16), helper.make_node("Mul", ["h", "k"], ["y16"])]
        + [helper.make_node("Cast", ["y16"], ["y"], to=TensorProto.FLOAT)],
        "scale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        initializer=[numpy_helper.from_array(np.array([1000.0], np.float16), "k")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, tmp_path / "fp16.onnx")
    onnx.save(faithful_copy(model), tmp_path / "faithful.onnx")
    x = {"x": np.array([100.0, 0.1234567], np.float32)}
    (plain,) = onnxruntime_session(tmp_path / "fp16.onnx").run(None, x)
    (faithful,) = onnxruntime_session(tmp_path / "faithful.onnx").run(None, x)
    assert np.isfinite(plain).all()  # ONNX Runtime's CPU provider: float32 inside, no overflow
    assert np.isinf(faithful[0]) and faithful[1] == np.float16(np.float16(0.1234567) * np.float16(1000))
    # The evaluation the record of an FP16 graph asks for is the faithful one; as ONNX Runtime serves it, plain.
    fp16 = graph_record(Precision.FP16)
    (judged,) = evaluation_session(fp16, tmp_path / "fp16.onnx").run(None, x)
    (served,) = evaluation_session(fp16, tmp_path / "fp16.onnx", faithful_fp16=False).run(None, x)
    assert np.array_equal(judged, faithful, equal_nan=True) and np.array_equal(served, plain)
