"""The export stage (pipeline/stages/export.py): a graph with a dynamic batch, in opset 17 from either exporter, the
reference's batches, and no file where export fails."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from tests.helpers import toy_models
from tests.helpers.exported import PROFILE, exported
from trt_pipeline.models.prepare import prepare
from trt_pipeline.models.spec import ModelSpec
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.precision import Precision
from trt_pipeline.pipeline.core.settings import BatchProfile
from trt_pipeline.pipeline.folder.layout import graph_record
from trt_pipeline.pipeline.stages.export import export_onnx, parity_batches, write_reference
from trt_pipeline.pipeline.stages.parity import check_parity


def test_batch_axis_really_dynamic_at_three_sizes(tmp_path):
    graph, _ = exported(toy_models.tiny_cnn(), tmp_path)
    import onnxruntime as ort

    session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    for batch in (1, 3, 17):
        (logits,) = session.run(None, {"input": np.zeros((batch, 3, 16, 16), np.float32)})
        assert logits.shape == (batch, 10)


def test_failed_export_leaves_no_file(tmp_path):
    class Untraceable(torch.nn.Module):
        def forward(self, x):
            return {"not": "a tensor"}, x

    spec = ModelSpec(name="bad", module=Untraceable(), example_inputs={"input": torch.ones(2, 3)})
    with pytest.raises(PipelineError):
        export_onnx(spec, tmp_path / "model.onnx")
    assert list(tmp_path.iterdir()) == []


def test_parity_batches_always_include_one_and_max():
    assert parity_batches(BatchProfile(1, 8, 32)) == [1, 8, 32]
    assert parity_batches(BatchProfile(4, 4, 4)) == [1, 2, 4]
    assert parity_batches(BatchProfile(1, 1, 1)) == [1, 2, 3]


def test_an_op_torchscript_cannot_convert_is_exported_by_dynamo_with_its_splits_in_opset_17_form(tmp_path):
    """SDPA with enable_gqa: the TorchScript-based exporter raises, auto keeps dynamo's graph; its chunk() is opset
    18's Split(num_outputs), which onnx's 18 -> 17 converter leaves in place and the checker refuses."""
    pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript (the build extra)")
    spec = toy_models.grouped_query_attention()
    prepare(spec)
    write_reference(spec, PROFILE, tmp_path / "reference.npz")
    with pytest.raises(PipelineError, match="torchscript.* not implemented if enable_gqa is True"):
        export_onnx(spec, tmp_path / "model.onnx", tmp_path / "reference.npz", exporter="torchscript")
    record = export_onnx(spec, tmp_path / "model.onnx", tmp_path / "reference.npz")
    assert record["exporter"] == "dynamo" and "enable_gqa" in record["passed_over"]["torchscript"]
    splits = [node for node in onnx.load(str(tmp_path / "model.onnx")).graph.node if node.op_type == "Split"]
    assert splits and not any(a.name == "num_outputs" for node in splits for a in node.attribute)
    # the sequence at 16 too
    check_parity(tmp_path / "model.onnx", tmp_path / "reference.npz", graph=graph_record(Precision.FP32))


def test_the_dynamo_graph_is_written_in_opset_17_where_onnxs_converter_has_no_adapter(tmp_path):
    """Pad, Reduce*, Resize and Split as opset 18 writes them, in their opset 17 form (onnx's converter stops at
    Pad: "No Adapter To Version $17 for Pad"), checked and run at every reference size, the sides at 32 too."""
    pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript (the build extra)")
    spec = toy_models.ops_changed_in_opset_18()
    prepare(spec)
    write_reference(spec, PROFILE, tmp_path / "reference.npz")
    record = export_onnx(spec, tmp_path / "model.onnx", tmp_path / "reference.npz", exporter="dynamo")
    assert record["exporter"] == "dynamo" and record["opset"] == 17
    graph = onnx.load(str(tmp_path / "model.onnx"))
    assert {"Pad", "ReduceMean", "Resize", "Split"} <= {node.op_type for node in graph.graph.node}
    check_parity(tmp_path / "model.onnx", tmp_path / "reference.npz", graph=graph_record(Precision.FP32))


def test_a_transformers_model_exports_its_eager_attention_and_keeps_its_own_choice(tmp_path):
    """transformers 5's default SDPA exports decomposed with a NaN guard after each Softmax, a form ONNX Runtime's
    attention fusion does not recognize; the eager form has none.  The model's own choice is back after export."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DistilBertConfig(vocab_size=30, dim=16, n_layers=2, n_heads=2, hidden_dim=32)
    module = transformers.DistilBertModel(config)
    ids = torch.randint(0, 30, (2, 6))
    spec = ModelSpec(
        name="distilbert",
        module=module,
        example_inputs={"input_ids": ids, "attention_mask": torch.ones_like(ids)},
        dynamic_axes={"input_ids": {1: toy_models.SEQ}, "attention_mask": {1: toy_models.SEQ}},
    )
    graph, _ = exported(spec, tmp_path)
    ops = [node.op_type for node in onnx.load(str(graph)).graph.node]
    assert ops.count("Softmax") == 2 and "IsNaN" not in ops
    assert module.config._attn_implementation == "sdpa"
