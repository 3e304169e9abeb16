"""pipeline.runners.conv_bias: each convolution's bias as an Add of its own (what the onnxruntime-cuda runner opens;
the H100's measurement is in the module doc).  It must compute what the graph did, ONNX Runtime must keep the Adds
only with KEEP_BIAS_ADD, weights in a data file stay where they are, and graphs it must not touch stay untouched."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from trt_pipeline.pipeline.runners.conv_bias import KEEP_BIAS_ADD, split_conv_bias

RNG = np.random.default_rng(0)


def _conv_graph(path: Path, dtype: type = np.float32, *, external: bool = False, quantized: bool = False) -> Path:
    """x -> Conv(w, b) -> Relu -> Conv(w2, b2) -> out; with `quantized`, a DequantizeLinear feeding the first Conv's
    weights from int8, as an INT8 Q/DQ graph's Convs are fed."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    weights = [
        numpy_helper.from_array(RNG.standard_normal((8, 3, 3, 3)).astype(dtype), "w"),
        numpy_helper.from_array(RNG.standard_normal(8).astype(dtype), "b"),
        numpy_helper.from_array(RNG.standard_normal((4, 8, 1, 1)).astype(dtype), "w2"),
        numpy_helper.from_array(RNG.standard_normal(4).astype(dtype), "b2"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["y"], ["r"]),
        helper.make_node("Conv", ["r", "w2", "b2"], ["out"]),
    ]
    if quantized:
        weights[0] = numpy_helper.from_array(RNG.integers(-127, 127, (8, 3, 3, 3), dtype=np.int8), "w_int8")
        weights.append(numpy_helper.from_array(np.array(0.02, dtype), "w_scale"))
        nodes.insert(0, helper.make_node("DequantizeLinear", ["w_int8", "w_scale"], ["w"]))
    graph = helper.make_graph(
        nodes,
        "convs",
        [helper.make_tensor_value_info("x", elem, ["n", 3, 16, 16])],
        [helper.make_tensor_value_info("out", elem, ["n", 4, 16, 16])],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(path), save_as_external_data=external, location=f"{path.name}.data", size_threshold=0)
    return path


def _run(path: Path, x: np.ndarray, disabled: list[str] | None = None, optimized: Path | None = None) -> np.ndarray:
    options = ort.SessionOptions()
    if optimized is not None:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC  # no CPU-only layouts
        options.optimized_model_filepath = str(optimized)
    session = ort.InferenceSession(str(path), options, ["CPUExecutionProvider"], disabled_optimizers=disabled)
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_the_split_computes_the_same_and_onnx_runtime_keeps_its_adds(tmp_path: Path, dtype: type) -> None:
    graph = _conv_graph(tmp_path / "convs.onnx", dtype)
    x = RNG.standard_normal((2, 3, 16, 16)).astype(dtype)
    expected = _run(graph, x)
    assert split_conv_bias(graph) == 2
    assert [node.op_type for node in onnx.load(str(graph)).graph.node] == ["Conv", "Add", "Relu", "Conv", "Add"]
    onnx.checker.check_model(str(graph), full_check=True)

    def optimized_ops(disabled: list[str]) -> list[str]:
        optimized = tmp_path / f"optimized-{len(disabled)}.onnx"
        tolerance = 1e-5 if dtype == np.float32 else 2e-3
        np.testing.assert_allclose(_run(graph, x, disabled, optimized), expected, rtol=tolerance, atol=tolerance)
        return [node.op_type for node in onnx.load(str(optimized)).graph.node]

    assert "Add" not in optimized_ops([])  # ConvAddFusion folds them back into the Convs' biases
    assert optimized_ops(KEEP_BIAS_ADD).count("Add") == 2


def test_weights_in_a_data_file_stay_where_they_are(tmp_path: Path) -> None:
    """The runner splits its private copy of a graph whose weights may be gigabytes in a data file: only the graph
    file is rewritten (the biases, shaped, move into it), the data file is neither read whole nor changed."""
    graph = _conv_graph(tmp_path / "convs.onnx", external=True)
    data = tmp_path / "convs.onnx.data"
    before = data.read_bytes()
    x = RNG.standard_normal((1, 3, 16, 16)).astype(np.float32)
    expected = _run(graph, x)
    assert split_conv_bias(graph) == 2
    assert data.read_bytes() == before
    np.testing.assert_allclose(_run(graph, x, KEEP_BIAS_ADD), expected, rtol=1e-5, atol=1e-5)


def test_graphs_it_must_not_change_are_left_untouched(tmp_path: Path) -> None:
    """An INT8 graph (its Q/DQ around each Conv is what ONNX Runtime fuses into int8 kernels) and a graph without
    convolutions: nothing split, the file's bytes the same."""
    quantized = _conv_graph(tmp_path / "int8.onnx", quantized=True)
    no_convs = tmp_path / "mlp.onnx"
    matmul = helper.make_node("MatMul", ["x", "w"], ["out"])
    weight = numpy_helper.from_array(RNG.standard_normal((16, 4)).astype(np.float32), "w")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n", 4])
    onnx.save(helper.make_model(helper.make_graph([matmul], "mlp", [x], [out], [weight])), str(no_convs))
    for graph in (quantized, no_convs):
        before = graph.read_bytes()
        assert split_conv_bias(graph) == 0
        assert graph.read_bytes() == before
