"""The build stages in a row on small models built in code (export, check, simplify, parity, and make_engine as a
user runs it): what spans stages.  Each stage alone is tested in the file named after its module."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from tests.helpers import toy_models
from tests.helpers.exported import PROFILE, exported
from trt_pipeline.models.prepare import prepare
from trt_pipeline.models.spec import DynamicAxis
from trt_pipeline.pipeline.core.compare import compare
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.precision import Precision
from trt_pipeline.pipeline.folder.graph_io import load_reference
from trt_pipeline.pipeline.folder.layout import graph_record
from trt_pipeline.pipeline.stages.check import check_onnx
from trt_pipeline.pipeline.stages.export import export_onnx, write_reference
from trt_pipeline.pipeline.stages.fp16 import convert_fp16
from trt_pipeline.pipeline.stages.parity import check_parity
from trt_pipeline.pipeline.stages.simplify import simplify_onnx


@pytest.mark.parametrize("factory", [toy_models.tiny_cnn, toy_models.text_classifier])
def test_export_check_simplify_parity_fp16(factory, tmp_path):
    graph, reference = exported(factory(), tmp_path)
    checked = check_onnx(graph)
    assert all(io["shape"][0] == "batch" for io in checked["inputs"] + checked["outputs"])
    assert [o.version for o in onnx.load(str(graph)).opset_import if o.domain == ""] == [17]
    simplify_onnx(graph, graph)
    fp32 = check_parity(graph, reference, graph=graph_record(Precision.FP32))
    assert fp32["max_rel"] < 1e-4
    assert {1, 4, 8} <= {case["batch"] for case in fp32["cases"]}
    half = tmp_path / "model.fp16.onnx"
    convert_fp16(graph, half)
    model = onnx.load(str(half))
    float_io = onnx.TensorProto.FLOAT
    assert all(v.type.tensor_type.elem_type != onnx.TensorProto.FLOAT16 for v in model.graph.input)
    assert any(i.data_type == onnx.TensorProto.FLOAT16 for i in model.graph.initializer)
    assert model.graph.output[0].type.tensor_type.elem_type == float_io
    assert check_parity(half, reference, graph=graph_record(Precision.FP16))["max_rel"] < 1e-2


def test_multi_input_dynamic_sequence_axis(tmp_path):
    graph, reference = exported(toy_models.text_classifier(), tmp_path)
    checked = check_onnx(graph)
    shapes = {io["name"]: io["shape"] for io in checked["inputs"] + checked["outputs"]}
    assert shapes["input_ids"] == ["batch", "seq"] and shapes["attention_mask"] == ["batch", "seq"]
    assert shapes["tokens"][:2] == ["batch", "seq"]
    sequence_lengths = {case[0]["input_ids"].shape[1] for case in load_reference(reference)}
    assert sequence_lengths == {12, 64, 1}  # the example length, and the declared maximum and minimum
    check_parity(graph, reference, graph=graph_record(Precision.FP32))


def test_check_names_the_reshape_that_baked_the_batch(tmp_path):
    spec = toy_models.baked_batch_cnn()
    spec.module.eval()
    with pytest.raises(PipelineError, match=r"Reshape node .* constant shape \[2, -1\]"):
        export_onnx(spec, tmp_path / "model.onnx", exporter="torchscript")  # export runs check_onnx on its graph
    assert not (tmp_path / "model.onnx").exists()


def test_torch_transformer_encoder_exports_with_its_fast_path_off(tmp_path):
    """nn.TransformerEncoder in eval mode uses aten::_transformer_encoder_layer_fwd, which no ONNX opset has."""
    import json

    from trt_pipeline.pipeline.core.settings import Settings
    from trt_pipeline.pipeline.stages.sequence import make_engine

    before = torch.backends.mha.get_fastpath_enabled()
    settings = Settings(model="tests.helpers.toy_models:transformer_encoder", precision="fp16", out_root=tmp_path)
    manifest = json.loads((make_engine(settings) / "manifest.json").read_text())
    assert manifest["complete"] and manifest["parity_fp16"]["max_rel"] < 0.03
    assert torch.backends.mha.get_fastpath_enabled() == before  # restored after the export


def test_a_sequence_length_baked_into_the_graph_is_named_by_check(tmp_path):
    from trt_pipeline.pipeline.core.errors import PipelineError
    from trt_pipeline.pipeline.core.settings import Settings
    from trt_pipeline.pipeline.stages.sequence import make_engine

    settings = Settings(model="tests.helpers.toy_models:baked_sequence_model", precision="fp32", out_root=tmp_path)
    with pytest.raises(PipelineError, match=r"does not run with inputs x \[2, 12, 8\]: a size was baked") as caught:
        make_engine(settings)
    assert "Reshape node" in str(caught.value) and "x.shape[1]" in caught.value.fix
    # int() bakes the size for both exporters: one error names both failures, and the way round them
    assert "no exporter made a graph" in caught.value.problem
    assert "torchscript: model.onnx does not run" in caught.value.problem
    assert "dynamo: model.onnx does not run" in caught.value.problem
    assert 'Settings(model="path/to/model.onnx")' in caught.value.fix
    assert not (tmp_path / "toy_models-baked_sequence_model-fp32" / "model.onnx").exists()


def test_a_sequence_axis_torchscript_bakes_inside_multihead_attention_is_exported_by_dynamo(tmp_path):
    """nn.TransformerEncoder (batch_first) with a dynamic sequence: the TorchScript-based exporter bakes the
    sequence into MultiheadAttention's Reshape, which no forward() of the user's can change; auto keeps dynamo's
    graph, which runs at every reference size, and the manifest says which exporter made it."""
    pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript (the build extra)")
    from trt_pipeline.pipeline.core.settings import Settings
    from trt_pipeline.pipeline.folder.reader import open_folder
    from trt_pipeline.pipeline.stages.sequence import make_engine

    spec = toy_models.transformer_encoder()
    prepare(spec)
    spec.dynamic_axes = {"x": {1: DynamicAxis("x_dim1", 1, 8, 16)}}
    write_reference(spec, PROFILE, tmp_path / "reference.npz")
    with pytest.raises(PipelineError, match=r"Reshape node\. Name:'/encoder/layers\.0/self_attn/Reshape"):
        export_onnx(spec, tmp_path / "model.onnx", tmp_path / "reference.npz", exporter="torchscript")

    settings = Settings(
        model="tests.helpers.toy_models:transformer_encoder", precision="fp32", dynamic="x:1=1:8:16", out_root=tmp_path
    )
    folder = make_engine(settings)
    manifest = open_folder(folder).manifest
    assert manifest.exporter == "dynamo"
    assert "Reshape" in manifest.stages["export"]["passed_over"]["torchscript"]
    assert manifest.parity("parity_fp32").max_rel < 1e-3  # at batch 1, 4, 8 and the sequence at 16


def test_nested_outputs_are_flattened_with_their_paths_the_same_in_the_graph_manifest_and_runners(tmp_path):
    """{"logits": a, "aux": (b, c)} is three tensors named logits, aux.0, aux.1: in model.onnx, the manifest, and
    what the ONNX Runtime and torch runners return (the service names outputs from the manifest)."""
    from trt_pipeline.pipeline.core.settings import Settings
    from trt_pipeline.pipeline.folder.reader import open_folder
    from trt_pipeline.pipeline.runners import load_runner
    from trt_pipeline.pipeline.stages.sequence import make_engine

    folder = make_engine(Settings(model="tests.helpers.toy_models:nested_outputs", precision="fp32", out_root=tmp_path))
    names = ["logits", "aux.0", "aux.1"]
    assert [output.name for output in onnx.load(str(folder / "model.onnx")).graph.output] == names
    assert [output.name for output in open_folder(folder).manifest.outputs] == names
    feed = {"x": np.random.default_rng(0).standard_normal((3, 6)).astype(np.float32)}
    with load_runner(folder, "onnxruntime") as graph, load_runner(folder, "torch") as model:
        ran, expected = graph.infer(feed), model.infer(feed)
    assert list(ran) == list(expected) == names
    assert ran["aux.1"].shape == (3, 1) and compare(expected["aux.0"], ran["aux.0"], rtol=1e-4).ok


def test_exporter_setting_takes_the_three_choices_and_the_rebuild_hint_repeats_it():
    from trt_pipeline.pipeline.core.mentions import render
    from trt_pipeline.pipeline.core.settings import EXPORTERS, Settings
    from trt_pipeline.pipeline.folder.rebuild import make_engine_command

    assert EXPORTERS == ("auto", "torchscript", "dynamo") and Settings().exporter == "auto"
    with pytest.raises(PipelineError, match="unknown exporter 'onnx'"):
        Settings(exporter="onnx").check()
    record = Settings(model="m", precision="fp32", exporter="dynamo").as_record()
    assert 'exporter="dynamo"' in render(make_engine_command(record))
    assert "exporter" not in render(make_engine_command(Settings(model="m", precision="fp32").as_record()))
