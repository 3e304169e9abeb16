"""Graphs whose weights live in external data, on small models: graph_files.EXTERNAL_DATA_BYTES is lowered so that
the paths a model past protobuf's 2 GB takes (export, check, simplify, build) run here in seconds.  The model past
2 GB itself is phase 2's slow test; benchmarks/scale.py measures the sizes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from trt_pipeline.models.prepare import prepare
from trt_pipeline.models.spec import ModelSpec
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.sessions import onnxruntime_session
from trt_pipeline.pipeline.core.settings import BatchProfile
from trt_pipeline.pipeline.folder import graph_files
from trt_pipeline.pipeline.folder.artifacts import remove_stale_temporaries
from trt_pipeline.pipeline.folder.graph_files import data_files, gather_weights, graph_without_weights, weight_bytes
from trt_pipeline.pipeline.folder.graph_io import load_reference
from trt_pipeline.pipeline.stages.check import check_onnx
from trt_pipeline.pipeline.stages.export import export_onnx, write_reference
from trt_pipeline.pipeline.stages.simplify import simplify_onnx

PROFILE = BatchProfile(1, 2, 4)
WIDTH = 256  # 256 x 256 FP32 weights: 256 KiB a layer, far past INLINE_TENSOR_BYTES


def mlp_spec() -> ModelSpec:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(), torch.nn.Linear(WIDTH, 8))
    spec = ModelSpec(name="mlp", module=module, example_inputs={"input": torch.randn(2, WIDTH)})
    prepare(spec)
    return spec


@pytest.fixture
def external(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every graph with more than a few bytes of weights keeps them in external data, as one past 2 GB does."""
    monkeypatch.setattr(graph_files, "EXTERNAL_DATA_BYTES", 0)


def exported(folder: Path, exporter: str = "torchscript") -> tuple[Path, Path]:
    spec = mlp_spec()
    graph, reference = folder / "model.onnx", folder / "reference.npz"
    write_reference(spec, PROFILE, reference)
    export_onnx(spec, graph, reference, exporter=exporter)
    return graph, reference


def locations(graph: Path) -> set[str]:
    model = onnx.load(str(graph), load_external_data=False)
    return {entry.value for t in model.graph.initializer for entry in t.external_data if entry.key == "location"}


def assert_runs_as_pytorch(graph: Path, reference: Path) -> None:
    """ONNX Runtime, which reads the weights from wherever the graph says, gives PyTorch's outputs."""
    session = onnxruntime_session(graph)
    for inputs, outputs in load_reference(reference):
        (result,) = session.run(None, inputs)
        np.testing.assert_allclose(result, next(iter(outputs.values())), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_export_writes_the_graph_and_one_data_file_beside_it(external, tmp_path, exporter):
    graph, reference = exported(tmp_path, exporter)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data", "reference.npz"]
    assert locations(graph) == {"model.onnx.data"}
    assert data_files(graph) == [tmp_path / "model.onnx.data"]
    assert weight_bytes(onnx.load(str(graph), load_external_data=False)) >= WIDTH * WIDTH * 4
    check_onnx(graph, reference)  # by path: the checker, shape inference and every reference case
    assert_runs_as_pytorch(graph, reference)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_below_the_threshold_a_graph_stays_one_file(tmp_path, exporter):
    """The dynamo exporter writes external data always; below 2 GB it is brought back into the graph."""
    graph, reference = exported(tmp_path, exporter)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.onnx", "reference.npz"]
    assert locations(graph) == set()
    assert_runs_as_pytorch(graph, reference)


def test_simplify_keeps_the_weights_in_the_graphs_data_file(external, tmp_path):
    graph, reference = exported(tmp_path)
    record = simplify_onnx(graph, graph)
    assert record["status"] == "simplified", record
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data", "reference.npz"]
    assert locations(graph) == {"model.onnx.data"}
    assert_runs_as_pytorch(graph, reference)


def test_a_graph_kept_unsimplified_under_another_name_takes_its_data_file_along(external, tmp_path):
    graph, reference = exported(tmp_path)
    model = onnx.load(str(graph), load_external_data=False)
    model.graph.node.append(helper.make_node("Relu", ["nowhere"], ["dangling"]))  # onnxsim refuses this graph
    onnx.save(model, str(graph))  # the weights stay in model.onnx.data
    record = simplify_onnx(graph, tmp_path / "kept.onnx")
    assert record["status"] == "kept"
    assert locations(tmp_path / "kept.onnx") == {"kept.onnx.data"}
    kept = onnx.load(str(tmp_path / "kept.onnx"))  # loads the copied weights, or raises
    assert weight_bytes(kept) == weight_bytes(onnx.load(str(graph)))


def test_the_engine_is_built_from_the_path_its_weights_read_from_beside_it(external, tmp_path):
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed: pip install tensorrt-rtx-cu13")
    from trt_pipeline.pipeline.stages.build import build_engine

    graph, _ = exported(tmp_path)
    assert data_files(graph) == [tmp_path / "model.onnx.data"]
    record = build_engine(graph, tmp_path / "engine.plan", batch=PROFILE, builder="tensorrt_rtx")
    weights = weight_bytes(onnx.load(str(graph), load_external_data=False))
    assert (tmp_path / "engine.plan").stat().st_size == record["engine_bytes"] > weights  # the weights are in it


def test_per_tensor_files_become_one_data_file(tmp_path, monkeypatch):
    """What torch.onnx's TorchScript exporter writes past 2 GB (a file per tensor, named after it) becomes
    model.onnx.data, the tensors' files gone, the values the same."""
    monkeypatch.setattr(graph_files, "EXTERNAL_DATA_BYTES", 0)
    graph, reference = exported(tmp_path)
    model = onnx.load(str(graph))
    onnx.save_model(model, str(graph), save_as_external_data=True, all_tensors_to_one_file=False, size_threshold=1024)
    (tmp_path / "model.onnx.data").unlink()
    assert len(data_files(graph)) == 3  # a file for each tensor of 1 KiB or more: two weights and a bias
    gather_weights(graph)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data", "reference.npz"]
    assert_runs_as_pytorch(graph, reference)


def test_a_data_file_outside_the_graphs_folder_is_refused(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    weights = np.ones((4, 4), np.float32)
    (tmp_path / "outside.bin").write_bytes(weights.tobytes())
    tensor = helper.make_tensor("w", TensorProto.FLOAT, [4, 4], weights.tobytes(), raw=True)
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", "../outside.bin"
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [x], [y], [tensor])
    path = folder / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    with pytest.raises(PipelineError, match=r"keeps weights in '\.\./outside\.bin', outside its own folder"):
        check_onnx(path)
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed: pip install tensorrt-rtx-cu13")
    from trt_pipeline.pipeline.stages.build import build_engine

    with pytest.raises(PipelineError, match="outside its own folder"):
        build_engine(path, folder / "engine.plan", batch=PROFILE, builder="tensorrt_rtx")
    assert not (folder / "engine.plan").exists()


def test_the_graph_read_without_its_weights_is_the_graph_less_their_bytes(tmp_path):
    """graph_without_weights reads protobuf's wire format itself: everything but the large tensors' bytes is the
    file's, for a graph of one file and for one with external data."""
    graph, _ = exported(tmp_path)
    full = onnx.load(str(graph))
    light = graph_without_weights(graph)
    assert light.graph.node == full.graph.node and light.graph.input == full.graph.input
    assert light.opset_import == full.opset_import and light.graph.output == full.graph.output
    for kept, tensor in zip(light.graph.initializer, full.graph.initializer, strict=True):
        assert (kept.name, kept.dims, kept.data_type) == (tensor.name, tensor.dims, tensor.data_type)
        small = len(tensor.raw_data) < graph_files.INLINE_TENSOR_BYTES
        assert kept.raw_data == (tensor.raw_data if small else b"")
    assert weight_bytes(light) == weight_bytes(full)
    assert light.ByteSize() < 4096 < weight_bytes(full)


def test_check_reads_files_it_checked_in_this_process_once(tmp_path):
    graph, reference = exported(tmp_path)  # the export checked model.onnx at every reference case
    assert "checked earlier in this run" in check_onnx(graph, reference)["summary"]
    model = onnx.load(str(graph))
    onnx.save(model, str(graph))  # the same graph, written again: its file is new, so it is checked again
    assert "checked earlier" not in check_onnx(graph, reference)["summary"]


def test_a_killed_runs_graph_folder_is_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    staging = tmp_path / f".model.onnx.{int(dead.stdout)}.tmp"
    staging.mkdir()
    (staging / "model.onnx.data").write_bytes(b"\0" * 16)
    live = tmp_path / f".model.fp16.onnx.{os.getpid()}.tmp"
    live.mkdir()
    assert remove_stale_temporaries(tmp_path) == [staging]
    assert not staging.exists() and live.is_dir()


def test_intermediate_tensors_of_a_model_in_memory_run_with_its_weights_written_aside_and_put_back(tmp_path):
    """tensor_values takes each large weight's bytes out of the model while it copies the graph (the copy then
    maps them from a scratch data file) and puts them back: the values are ONNX Runtime's on the model itself,
    and the model holds every byte it held."""
    from trt_pipeline.pipeline.evaluation.tensors import tensor_values

    graph, reference = exported(tmp_path)
    model = onnx.load(str(graph))
    before = model.SerializeToString()
    inputs, outputs = load_reference(reference)[-1]
    hidden = next(node.output[0] for node in model.graph.node if node.op_type in ("Gemm", "MatMul"))
    (values,) = tensor_values(model, [hidden, "output"], [inputs])
    np.testing.assert_allclose(values["output"], next(iter(outputs.values())), rtol=1e-4, atol=1e-5)
    assert values[hidden].shape == (len(inputs["input"]), WIDTH)
    assert model.SerializeToString() == before


def test_an_initializer_read_from_where_it_lies_is_what_onnx_reads(tmp_path):
    """initializer_array reads an external tensor's bytes once, as numpy_helper.to_array would give them, for every
    type numpy holds as stored, and hands the others (bfloat16) to it."""
    rng = np.random.default_rng(0)
    arrays = {
        dtype: (rng.standard_normal((8, 40)) * 50).astype(dtype)
        for dtype in (np.float32, np.float16, np.float64, np.int8, np.uint8, np.int16, np.int32, np.int64, np.uint64)
    }
    tensors = [numpy_helper.from_array(array, f"t_{np.dtype(dtype).name}") for dtype, array in arrays.items()]
    tensors.append(helper.make_tensor("t_bfloat16", TensorProto.BFLOAT16, [300], np.linspace(-3, 3, 300).tolist()))
    graph = helper.make_graph(
        [], "g", [], [helper.make_tensor_value_info("t_int8", TensorProto.INT8, [8, 40])], tensors
    )
    onnx.save_model(
        helper.make_model(graph), str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.onnx.data"
    )
    model = graph_without_weights(tmp_path / "m.onnx")
    for tensor in model.graph.initializer:
        read = graph_files.initializer_array(tensor, tmp_path)
        expected = numpy_helper.to_array(tensor, str(tmp_path))
        assert read.dtype == expected.dtype and read.shape == expected.shape, tensor.name
        assert read.tobytes() == expected.tobytes(), tensor.name
