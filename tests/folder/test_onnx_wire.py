"""An ONNX file written from the wire: a model in memory written with its weights out of the serializer."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from trt_pipeline.pipeline.folder.onnx_wire import write_held


def _model_of_every_tensor_form() -> onnx.ModelProto:
    """Initializers held as large raw_data (float32, int8), small raw_data, typed fields (float_data), and raw_data
    followed by later fields (doc_string, data_location, metadata_props); a tensor attribute; model metadata."""
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((64, 32)).astype(np.float32), "weight")
    quantized = numpy_helper.from_array(rng.integers(-128, 128, (64, 32), dtype=np.int8), "quantized")
    quantized.doc_string = "after raw_data"
    quantized.data_location = TensorProto.DEFAULT
    entry = quantized.metadata_props.add()
    entry.key, entry.value = "origin", "test"
    small = numpy_helper.from_array(np.arange(4, dtype=np.int64), "small")
    typed = helper.make_tensor("typed", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])
    constant = helper.make_node(
        "Constant", [], ["c"], value=numpy_helper.from_array(rng.standard_normal(300).astype(np.float32))
    )
    nodes = [constant, helper.make_node("MatMul", ["x", "weight"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32])],
        [weight, small, quantized, typed],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.helper.set_model_props(model, {"purpose": "test"})
    return model


def test_a_held_model_is_written_as_onnx_save_writes_it(tmp_path):
    """Byte for byte onnx.save's file, the large weights written from where they are held and dropped from the model
    (as the graph's data files drop them); the small ones and every other field stay."""
    model = _model_of_every_tensor_form()
    onnx.save(model, str(tmp_path / "saved.onnx"))
    write_held(model, tmp_path / "held.onnx", large=1024)
    assert (tmp_path / "held.onnx").read_bytes() == (tmp_path / "saved.onnx").read_bytes()
    kept = {tensor.name: tensor.HasField("raw_data") for tensor in model.graph.initializer}
    assert kept == {"weight": False, "quantized": False, "small": True, "typed": False}
    assert model.graph.initializer[3].float_data == [1.0, 2.0, 3.0]
