"""What a runner says when ONNX Runtime fails on inputs whose names, dtypes and shapes were checked
(pipeline/runners/onnxruntime.py run_error): a fix names a cause only where the error shows it."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnxruntime.capi.onnxruntime_pybind11_state import Fail

from trt_pipeline.pipeline.runners.base import TensorSpec
from trt_pipeline.pipeline.runners.onnxruntime import CUDA_FIX, run_error

TOKEN_IDS = "token ids must lie within"
UNKNOWN = "ONNX Runtime's message is all that is known"
# ONNX Runtime's words when a ConvNeXt's captured CUDA graph failed on an H200 (issue 54).
MISALIGNED = (
    "[ONNXRuntimeError] : 1 : FAIL : CUDA failure 716: misaligned address ; GPU=0 ; file=cuda_graph.cc ; line=118 ; "
    "expr=cudaStreamSynchronize(stream);"
)


def _gather_error(dtype: int) -> Exception:
    """ONNX Runtime's own error for a Gather whose index, read from input 'x' of `dtype`, is past its table."""
    index = "x" if dtype == TensorProto.INT64 else "index"
    nodes = [helper.make_node("Gather", ["table", index], ["y"])]
    if dtype != TensorProto.INT64:  # a float input made an index: its values decide, but it holds no token ids
        nodes.insert(0, helper.make_node("Cast", ["x"], ["index"], to=TensorProto.INT64))
    graph = helper.make_graph(
        nodes,
        "gather",
        [helper.make_tensor_value_info("x", dtype, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        initializer=[helper.make_tensor("table", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match="out of data bounds") as caught:
        session.run(None, {"x": np.full((1, 4), 7, onnx.helper.tensor_dtype_to_np_dtype(dtype))})
    return caught.value


def _spec(dtype: type) -> list[TensorSpec]:
    return [TensorSpec("x", np.dtype(dtype), (-1, 4))]


def test_an_index_past_its_table_from_an_integer_input_names_that_input_and_its_range():
    error = run_error("model.onnx", _gather_error(TensorProto.INT64), _spec(np.int64))
    assert "ONNX Runtime could not run model.onnx on these inputs: InvalidArgument" in error.problem
    assert "integer input(s) ['x']" in str(error.fix) and TOKEN_IDS in str(error.fix)


def test_an_index_error_with_float_inputs_only_names_no_token_ids():
    error = run_error("model.onnx", _gather_error(TensorProto.FLOAT), _spec(np.float32))
    assert "out of data bounds" in error.problem
    assert TOKEN_IDS not in str(error.fix) and UNKNOWN in str(error.fix)


@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_a_cuda_failure_is_named_as_one_whatever_the_inputs(dtype):
    error = run_error("model.fp16.onnx", Fail(MISALIGNED), _spec(dtype))
    assert "a CUDA error inside ONNX Runtime's kernels, which is sticky" in error.problem
    assert "CUDA failure 716: misaligned address" in error.problem
    assert error.fix == CUDA_FIX and TOKEN_IDS not in CUDA_FIX
    assert "backend='onnxruntime'" in CUDA_FIX and "report it" in CUDA_FIX
