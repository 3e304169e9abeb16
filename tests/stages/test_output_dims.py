"""Output dims named after the input dims they follow (pipeline/stages/output_dims.py, run by the check stage), in the
graph and the manifest, through simplify and the FP16 graph; a dim only the data decides keeps its name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import toy_models
from tests.helpers.output_dims import PROFILE, column_filter_folder, output_dims
from trt_pipeline.models.prepare import prepare
from trt_pipeline.pipeline.core.settings import Settings
from trt_pipeline.pipeline.folder.graph_io import dim_size
from trt_pipeline.pipeline.folder.manifest import MANIFEST
from trt_pipeline.pipeline.runners import load_runner
from trt_pipeline.pipeline.stages.export import export_onnx, write_reference
from trt_pipeline.pipeline.stages.sequence import make_engine


def test_an_encoders_output_follows_the_inputs_sequence(tmp_path: Path):
    """The TorchScript exporter (the one that names an output dim after its node) on a BERT-like toy whose sequence
    axis is declared on the input only: the check the export runs names the output's axis 1 after it."""
    spec = toy_models.sequence_encoder()
    prepare(spec)
    write_reference(spec, PROFILE, tmp_path / "reference.npz")
    record = export_onnx(spec, tmp_path / "model.onnx", tmp_path / "reference.npz", exporter="torchscript")
    assert output_dims(tmp_path / "model.onnx") == {"hidden": ["batch", "seq", 16]}
    assert record["outputs"] == ["hidden"]


def test_dims_computed_from_an_input_dim_are_named_by_their_expression(tmp_path: Path):
    """A strided convolution's height and a doubled sequence: named by the expression symbolic shape inference gives,
    which says the size at every input size (checked here where the reference did not go), in the graph and the
    manifest."""
    folder = make_engine(Settings(model="tests.helpers.toy_models:computed_dims", precision="fp32", out_root=tmp_path))
    dims = output_dims(folder / "model.onnx")
    manifest = json.loads((folder / MANIFEST).read_text())
    assert {output["name"]: output["shape"] for output in manifest["outputs"]} == dims
    assert dims["features"][:2] == ["batch", 4] and dims["features"][3] == 8
    assert dims["doubled"][0] == "batch" and dims["doubled"][2] == 4
    height, doubled = dims["features"][2], dims["doubled"][1]
    for size in range(8, 33):
        assert dim_size(height, {"height": size}) == (size - 1) // 2 + 1
        assert dim_size(doubled, {"seq": size}) == 2 * size


def test_a_distilbert_folders_last_hidden_state_is_batch_sequence_hidden_in_every_graph_and_the_manifest(
    tmp_path: Path,
):
    """The folder save_pretrained writes (MODEL=<folder>, FP16): the TorchScript exporter named axis 1
    LayerNormalizationlast_hidden_state_dim_1; the check names it after the inputs' sequence, simplify and the FP16
    graph keep it, and the binding runner, which refused the folder, serves it from buffers sized ahead.  A feed-forward
    of 256: its first bias (1 KiB) is left where it lies by the check's graph reading, as a real DistilBERT's weights
    are, and the inference, which reads any initializer an Add touches, must not stop at it."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DistilBertConfig(
        vocab_size=30, dim=32, n_layers=2, n_heads=2, hidden_dim=256, max_position_embeddings=64
    )
    transformers.DistilBertModel(config).save_pretrained(tmp_path / "distilbert")
    settings = Settings(model=str(tmp_path / "distilbert"), precision="fp16", batch=PROFILE, out_root=tmp_path)
    folder = make_engine(settings)
    expected = ["batch", "sequence", 32]
    for graph in ("model.onnx", "model.fp16.onnx"):
        assert output_dims(folder / graph) == {"last_hidden_state": expected}, graph
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["outputs"] == [{"name": "last_hidden_state", "dtype": "float32", "shape": expected}]
    rng = np.random.default_rng(0)
    with load_runner(folder, "onnxruntime-cuda", device="cpu") as runner, load_runner(folder, "onnxruntime") as plain:
        assert "allocated by ONNX Runtime" not in runner.description
        for rows, length in ((1, 5), (3, 17)):
            feed = {
                "input_ids": rng.integers(1, 30, (rows, length)),
                "attention_mask": np.ones((rows, length), dtype=np.int64),
            }
            got, want = runner.infer(feed), plain.infer(feed)
            assert got["last_hidden_state"].shape == (rows, length, 32)
            np.testing.assert_array_equal(got["last_hidden_state"], want["last_hidden_state"])


def test_a_dim_only_the_data_decides_keeps_its_name_and_the_folder_serves(tmp_path: Path):
    """An imported graph (MODEL=<file>.onnx) whose output width is a count of values: no input dim gives it, so the
    graph and the manifest keep the file's name for it, and the binding runner, which refused the folder, loads it
    (tests/runners/test_onnxruntime_cuda.py serves it)."""
    folder = column_filter_folder(tmp_path)
    assert output_dims(folder / "model.onnx") == {"kept": ["batch", "columns"], "total": ["batch", 1]}
    outputs = json.loads((folder / MANIFEST).read_text())["outputs"]
    assert [output["shape"] for output in outputs] == [["batch", "columns"], ["batch", 1]]
    with load_runner(folder, "onnxruntime-cuda", device="cpu") as runner:
        assert "outputs ['kept'] allocated by ONNX Runtime at each run" in runner.description
