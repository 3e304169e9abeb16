"""Output dims named after the input dims they follow (pipeline/stages/output_dims.py, run by the check stage), in the
graph and the manifest, through simplify and the FP16 graph; a dim only the data decides stays so, and the binding
runner (backend="onnxruntime-cuda", here on the CPU provider) serves a graph with such an output."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests import toy_models
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.settings import BatchProfile, Settings
from trt_pipeline.pipeline.folder.graph_io import dim_size
from trt_pipeline.pipeline.folder.manifest import MANIFEST
from trt_pipeline.pipeline.runners import load_runner
from trt_pipeline.pipeline.stages.export import export_onnx, write_reference
from trt_pipeline.pipeline.stages.prepare import prepare
from trt_pipeline.pipeline.stages.sequence import make_engine

PROFILE = BatchProfile(1, 2, 4)


def _output_dims(graph: Path) -> dict[str, list]:
    model = onnx.load(str(graph), load_external_data=False)
    return {
        output.name: [d.dim_param or d.dim_value for d in output.type.tensor_type.shape.dim]
        for output in model.graph.output
    }


def _exported(spec, folder: Path) -> tuple[Path, dict]:
    """The spec's model.onnx from the TorchScript exporter (the one that names an output dim after its node), checked
    on its reference."""
    prepare(spec)
    write_reference(spec, PROFILE, folder / "reference.npz")
    graph = folder / "model.onnx"
    record = export_onnx(spec, graph, folder / "reference.npz", exporter="torchscript")
    return graph, record


def test_an_encoders_output_follows_the_inputs_sequence(tmp_path: Path):
    graph, _ = _exported(toy_models.sequence_encoder(), tmp_path)
    assert _output_dims(graph) == {"hidden": ["batch", "seq", 16]}


def test_dims_computed_from_an_input_dim_are_named_by_their_expression_and_served(tmp_path: Path):
    """A strided convolution's height and a doubled sequence: named by the expression symbolic shape inference gives,
    which says the size at every input size (checked here where the reference did not go), in the graph and the
    manifest.  The binding runner sizes their buffers ahead from the expressions (at the top of the ranges) and binds
    each call's sizes on them."""
    folder = make_engine(Settings(model="tests.toy_models:computed_dims", precision="fp32", out_root=tmp_path))
    dims = _output_dims(folder / "model.onnx")
    manifest = json.loads((folder / MANIFEST).read_text())
    assert {output["name"]: output["shape"] for output in manifest["outputs"]} == dims
    assert dims["features"][:2] == ["batch", 4] and dims["features"][3] == 8
    assert dims["doubled"][0] == "batch" and dims["doubled"][2] == 4
    height, doubled = dims["features"][2], dims["doubled"][1]
    for size in range(8, 33):
        assert dim_size(height, {"height": size}) == (size - 1) // 2 + 1
        assert dim_size(doubled, {"seq": size}) == 2 * size
    rng = np.random.default_rng(0)
    with load_runner(folder, "onnxruntime-cuda", device="cpu") as runner, load_runner(folder, "onnxruntime") as plain:
        assert "allocated by ONNX Runtime" not in runner.description
        for rows, size in ((1, 9), (3, 30), (4, 32), (2, 8)):
            feed = {
                "image": rng.standard_normal((rows, 3, size, 16), dtype=np.float32),
                "tokens": rng.standard_normal((rows, size, 4), dtype=np.float32),
            }
            got, want = runner.infer(feed), plain.infer(feed)
            assert got["features"].shape == (rows, 4, (size - 1) // 2 + 1, 8)
            for name in want:
                np.testing.assert_array_equal(got[name], want[name])


def test_dim_size_reads_expressions_and_never_runs_python():
    assert dim_size("sequence", {"sequence": 7}) == 7
    assert dim_size("2*sequence", {"sequence": 7}) == 14
    assert dim_size("floor(height/2 - 1/2) + 1", {"height": 9}) == 5
    assert dim_size("Min(64, sequence) + Mod(sequence, 3)", {"sequence": 70}) == 65
    assert dim_size("sequence**2", {"sequence": 3}) == 9
    assert dim_size("sequence/2", {"sequence": 3}) is None  # not a whole size
    assert dim_size("LayerNormalizationlast_hidden_state_dim_1", {"sequence": 3}) is None
    assert dim_size("__import__('os').getpid()", {}) is None
    assert dim_size("sequence.real", {"sequence": 3}) is None
    assert dim_size("2**sequence", {"sequence": 99999}) is None


def test_a_distilbert_folders_last_hidden_state_is_batch_sequence_hidden_in_every_graph_and_the_manifest(
    tmp_path: Path,
):
    """The folder save_pretrained writes (MODEL=<folder>, FP16): the TorchScript exporter named axis 1
    LayerNormalizationlast_hidden_state_dim_1; the check names it after the inputs' sequence, simplify and the FP16
    graph keep it, and the binding runner serves the folder."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DistilBertConfig(
        vocab_size=30, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64
    )
    transformers.DistilBertModel(config).save_pretrained(tmp_path / "distilbert")
    settings = Settings(model=str(tmp_path / "distilbert"), precision="fp16", batch=PROFILE, out_root=tmp_path)
    folder = make_engine(settings)
    expected = ["batch", "sequence", 32]
    for graph in ("model.onnx", "model.fp16.onnx"):
        assert _output_dims(folder / graph) == {"last_hidden_state": expected}, graph
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["outputs"] == [{"name": "last_hidden_state", "dtype": "float32", "shape": expected}]
    rng = np.random.default_rng(0)
    with load_runner(folder, "onnxruntime-cuda", device="cpu") as runner, load_runner(folder, "onnxruntime") as plain:
        assert "allocated by ONNX Runtime" not in runner.description  # every output has buffers sized ahead
        for rows, length in ((1, 5), (3, 17)):
            feed = {
                "input_ids": rng.integers(1, 30, (rows, length)),
                "attention_mask": np.ones((rows, length), dtype=np.int64),
            }
            got, want = runner.infer(feed), plain.infer(feed)
            assert got["last_hidden_state"].shape == (rows, length, 32)
            np.testing.assert_array_equal(got["last_hidden_state"], want["last_hidden_state"])


# ---------------------------------------------------------------- a size only the data decides


def _column_filter(path: Path) -> Path:
    """x [batch, 16] -> kept [batch, columns]: the leading columns, as many as there are columns whose largest value
    passes 0.5 (a count only the values decide: NonZero's kind, in ops TensorRT-RTX builds, which NonZero is not),
    and total [batch, 1], each row's sum, an output the inputs size."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    nodes = [
        helper.make_node("ReduceMax", ["x"], ["column_max"], axes=[0], keepdims=0),
        helper.make_node("Greater", ["column_max", "threshold"], ["passes"]),
        helper.make_node("Cast", ["passes"], ["passes_int"], to=i64),
        helper.make_node("ReduceSum", ["passes_int", "zero"], ["count"], keepdims=1),
        helper.make_node("Slice", ["x", "zero", "count", "one"], ["kept"]),
        helper.make_node("ReduceSum", ["x", "one"], ["total"], keepdims=1),
    ]
    graph = helper.make_graph(
        nodes,
        "column_filter",
        [helper.make_tensor_value_info("x", f, ["batch", 16])],
        [
            helper.make_tensor_value_info("kept", f, ["batch", "columns"]),
            helper.make_tensor_value_info("total", f, ["batch", 1]),
        ],
        initializer=[
            helper.make_tensor("threshold", f, [], [0.5]),
            helper.make_tensor("zero", i64, [1], [0]),
            helper.make_tensor("one", i64, [1], [1]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def column_filter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("column_filter")
    source = _column_filter(root / "column_filter.onnx")
    settings = Settings(model=str(source), precision="fp32", batch=PROFILE, out_root=root / "engines")
    return make_engine(settings)


def _rows(rows: int, seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((rows, 16)).astype(np.float32)}


def test_a_data_dependent_dim_keeps_its_name_and_the_binding_runner_serves_it(column_filter: Path):
    """The dim stays the file's own (no input dim gives it) in the graph and the manifest.  The output is bound to
    the device and allocated by ONNX Runtime at each run; the other keeps its buffer.  One session, so calls of other
    sizes go through the same binding, and a call of the same shape after another (which binds nothing anew) still
    gets its own size."""
    assert _output_dims(column_filter / "model.onnx") == {"kept": ["batch", "columns"], "total": ["batch", 1]}
    outputs = json.loads((column_filter / MANIFEST).read_text())["outputs"]
    assert [output["shape"] for output in outputs] == [["batch", "columns"], ["batch", 1]]
    feeds = [_rows(4, seed=1), _rows(1, seed=2), _rows(3, seed=3), _rows(3, seed=4)]
    with (
        load_runner(column_filter, "onnxruntime-cuda", device="cpu", sessions=1) as runner,
        load_runner(column_filter, "onnxruntime") as plain,
    ):
        assert "outputs ['kept'] allocated by ONNX Runtime at each run" in runner.description
        counts = set()
        for feed in feeds:
            got, want = runner.infer(feed), plain.infer(feed)
            assert list(got) == ["kept", "total"]
            for name in want:
                np.testing.assert_array_equal(got[name], want[name])
            counts.add(got["kept"].shape[1])
        assert len(counts) > 1  # the sizes really changed between calls

        feed = feeds[2]
        want = plain.infer(feed)
        written = {name: np.full(value.shape, np.nan, value.dtype) for name, value in want.items()}
        assert runner.infer_on_device(feed, written) is written
        for name in want:
            np.testing.assert_array_equal(written[name], want[name])
        wrong = {**written, "kept": np.empty((3, want["kept"].shape[1] + 1), np.float32)}
        with pytest.raises(PipelineError, match=r"output 'kept' of this call is \(3, \d+\) \(a size its data"):
            runner.infer_on_device(feed, wrong)
