"""The spine's stages on small models built in code: real export, checker, onnxsim and ONNX Runtime."""

from __future__ import annotations

import errno
import resource

import numpy as np
import onnx
import pytest
import torch

from tests.helpers import toy_models
from trt_pipeline.models.prepare import prepare
from trt_pipeline.models.spec import DynamicAxis, ModelSpec
from trt_pipeline.pipeline.core.compare import compare
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.precision import Precision
from trt_pipeline.pipeline.core.settings import BatchProfile
from trt_pipeline.pipeline.folder.graph_io import load_reference
from trt_pipeline.pipeline.folder.layout import graph_record
from trt_pipeline.pipeline.stages.check import check_onnx
from trt_pipeline.pipeline.stages.export import export_onnx, parity_batches, write_reference
from trt_pipeline.pipeline.stages.fp16 import convert_fp16
from trt_pipeline.pipeline.stages.parity import check_parity
from trt_pipeline.pipeline.stages.simplify import simplify_onnx

PROFILE = BatchProfile(1, 4, 8)


def exported(spec: ModelSpec, folder) -> tuple:
    prepare(spec)
    graph, reference = folder / "model.onnx", folder / "reference.npz"
    export_onnx(spec, graph)
    write_reference(spec, PROFILE, reference)
    return graph, reference


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


def test_batch_axis_really_dynamic_at_three_sizes(tmp_path):
    graph, _ = exported(toy_models.tiny_cnn(), tmp_path)
    import onnxruntime as ort

    session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    for batch in (1, 3, 17):
        (logits,) = session.run(None, {"input": np.zeros((batch, 3, 16, 16), np.float32)})
        assert logits.shape == (batch, 10)


def test_multi_input_dynamic_sequence_axis(tmp_path):
    graph, reference = exported(toy_models.text_classifier(), tmp_path)
    checked = check_onnx(graph)
    shapes = {io["name"]: io["shape"] for io in checked["inputs"] + checked["outputs"]}
    assert shapes["input_ids"] == ["batch", "seq"] and shapes["attention_mask"] == ["batch", "seq"]
    assert shapes["tokens"][:2] == ["batch", "seq"]
    sequence_lengths = {case[0]["input_ids"].shape[1] for case in load_reference(reference)}
    assert sequence_lengths == {12, 64}  # the example length, and the declared maximum
    check_parity(graph, reference, graph=graph_record(Precision.FP32))


def test_prepare_proves_eval_mode_and_counts_layers():
    module, example = toy_models.dropout_mlp()
    module.train()
    spec = ModelSpec(name="mlp", module=module, example_inputs={"input": example})
    record = prepare(spec)
    assert record["dropout_layers"] == 1 and record["batchnorm_layers"] == 1
    assert not any(m.training for m in module.modules())
    assert not any(p.requires_grad for p in module.parameters())


class _AlwaysDropout(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.dropout(x, 0.5, training=True)


def test_prepare_refuses_randomness_in_eval():
    spec = ModelSpec(name="noisy", module=_AlwaysDropout(), example_inputs={"input": torch.ones(2, 64)})
    with pytest.raises(PipelineError, match="changed between two identical calls"):
        prepare(spec)


def test_prepare_refuses_batch_statistics():
    with pytest.raises(PipelineError, match="no running statistics"):
        prepare(toy_models.batch_stats_cnn())


def test_prepare_refuses_a_baked_batch():
    with pytest.raises(PipelineError, match="baked into forward"):
        prepare(toy_models.baked_batch_cnn())


def test_check_names_the_reshape_that_baked_the_batch(tmp_path):
    spec = toy_models.baked_batch_cnn()
    spec.module.eval()
    with pytest.raises(PipelineError, match=r"Reshape node .* constant shape \[2, -1\]"):
        export_onnx(spec, tmp_path / "model.onnx", exporter="torchscript")  # export runs check_onnx on its graph
    assert not (tmp_path / "model.onnx").exists()


def test_check_refuses_another_opset(tmp_path):
    graph, _ = exported(toy_models.tiny_cnn(), tmp_path)
    model = onnx.load(str(graph))
    model.opset_import[0].version = 13
    onnx.save(model, str(graph))
    with pytest.raises(PipelineError, match="not 17"):
        check_onnx(graph)


def test_parity_fails_with_a_clear_message_past_tolerance(tmp_path):
    graph, reference = exported(toy_models.tiny_cnn(), tmp_path)
    model = onnx.load(str(graph))
    bias = next(i for i in model.graph.initializer if i.name.endswith("fc.bias"))
    values = onnx.numpy_helper.to_array(bias) + 1.0  # a wrong graph: every logit shifted by 1
    bias.CopyFrom(onnx.numpy_helper.from_array(values, bias.name))
    onnx.save(model, str(graph))
    with pytest.raises(PipelineError, match="disagrees with PyTorch at batch 1 on output 'logits'"):
        check_parity(graph, reference, graph=graph_record(Precision.FP32))


def test_simplify_keeps_the_checked_graph_when_onnxsim_fails(tmp_path, capsys):
    graph, _ = exported(toy_models.tiny_cnn(), tmp_path)
    model = onnx.load(str(graph))
    # A node reading a tensor that nothing produces: onnxsim's own checker rejects the graph.
    model.graph.node.append(onnx.helper.make_node("Relu", ["nowhere"], ["dangling"]))
    broken = tmp_path / "custom.onnx"
    onnx.save(model, str(broken))
    record = simplify_onnx(broken, tmp_path / "out.onnx")
    assert record["status"] == "kept" and "onnxsim failed" in record["reason"]
    assert "kept the checked graph" in capsys.readouterr().out
    assert onnx.load(str(tmp_path / "out.onnx")).graph.node[-1].output == ["dangling"]


def test_simplify_stops_where_the_file_system_refuses_its_graph(tmp_path):
    """A full disk, or here a file size limit, is the user's to fix (the command line says how), not a reason to
    serve the graph unsimplified: onnxsim's write failing for it was kept as "onnxsim failed" and the build went on."""
    graph, _ = exported(toy_models.overflow_ffn(), tmp_path)
    before = graph.read_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (len(before) // 2, hard))  # Python ignores SIGXFSZ: writes get EFBIG
    try:
        with pytest.raises(OSError) as refused:
            simplify_onnx(graph, graph)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert refused.value.errno == errno.EFBIG
    assert graph.read_bytes() == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.onnx", "reference.npz"]  # no temporaries


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


def test_compare_is_relative_to_output_scale():
    reference = np.array([1000.0, -2000.0])
    assert compare(reference, reference + 1.0, rtol=1e-3).ok  # 1 / 2000 = 5e-4
    assert not compare(reference, reference + 3.0, rtol=1e-3).ok
    assert not compare(reference, np.array([np.nan, 0.0]), rtol=1.0).ok


def test_torch_transformer_encoder_exports_with_its_fast_path_off(tmp_path):
    """nn.TransformerEncoder in eval mode uses aten::_transformer_encoder_layer_fwd, which no ONNX opset has."""
    import json

    import torch

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


def test_a_data_dependent_output_size_is_refused_saying_what_it_is_and_the_two_fixes():
    with pytest.raises(PipelineError, match=r"output 0 has a size that depends on the input values") as caught:
        prepare(toy_models.score_filter())
    assert "topk" in caught.value.fix and "filtering outside the graph" in caught.value.fix


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
