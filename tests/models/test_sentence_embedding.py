"""A sentence-transformers folder served as the embedding it computes (models/sentence_embedding.py): the folder's
transformer, then the Pooling and Normalize its modules.json names, each computed here independently of
sentence-transformers (which is not installed) as its version 6 computes them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from trt_pipeline import models
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.settings import Settings
from trt_pipeline.pipeline.stages.sequence import make_engine

transformers = pytest.importorskip("transformers")

LEGACY = "sentence_transformers.models."  # the module types sentence-transformers 2 to 4 wrote (most of the Hub)
CURRENT = "sentence_transformers.base.modules.transformer."


def _sentence_folder(folder: Path, pooling: dict, modules: list[str]) -> Path:
    """A tiny BERT at the folder's root, with modules.json naming `modules` and the Pooling's `pooling` config."""
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    transformers.BertModel(config).save_pretrained(folder)
    paths = {"Transformer": "", "Pooling": "1_Pooling", "Normalize": "2_Normalize", "Dense": "2_Dense"}
    entries = [
        {"idx": i, "name": str(i), "path": paths[kind], "type": f"{LEGACY}{kind}"} for i, kind in enumerate(modules)
    ]
    (folder / "modules.json").write_text(json.dumps(entries))
    for kind in modules[1:]:
        (folder / paths[kind]).mkdir()
        (folder / paths[kind] / "config.json").write_text(json.dumps(pooling if kind == "Pooling" else {}))
    return folder


def _expected(folder: Path, inputs: dict[str, torch.Tensor], mode: str, normalize: bool) -> np.ndarray:
    """The embedding from the folder's BertModel, pooled and normalized as sentence-transformers 6 does."""
    with torch.no_grad():
        tokens = transformers.BertModel.from_pretrained(str(folder)).eval()(**inputs).last_hidden_state
    mask = inputs["attention_mask"]
    if mode == "cls":
        pooled = tokens[torch.arange(len(tokens)), mask.argmax(dim=1)]
    else:
        kept = mask.unsqueeze(-1).float()
        pooled = (tokens * kept).sum(dim=1) / kept.sum(dim=1).clamp(min=1e-9)
    return (torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled).numpy()


@pytest.mark.parametrize(
    ("pooling", "modules", "mode", "normalize"),
    [
        (
            {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True},
            ["Transformer", "Pooling", "Normalize"],
            "mean",
            True,
        ),
        ({"embedding_dimension": 32, "pooling_mode": "cls"}, ["Transformer", "Pooling"], "cls", False),
    ],
    ids=["legacy-mean-normalized", "cls"],
)
def test_a_sentence_transformers_folder_serves_its_pooled_embedding(tmp_path: Path, pooling, modules, mode, normalize):
    folder = _sentence_folder(tmp_path / "minilm", pooling, modules)
    spec = models.load_model(str(folder))
    assert spec.output_names == ["sentence_embedding"]
    inputs = {
        "input_ids": torch.tensor([[1, 5, 7, 9, 2, 0], [1, 8, 2, 0, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]]),
        "token_type_ids": torch.zeros(2, 6, dtype=torch.int64),
    }
    with torch.no_grad():
        served = spec.module.eval()(*(inputs[name] for name in spec.example_inputs))["sentence_embedding"]
    np.testing.assert_allclose(served.numpy(), _expected(folder, inputs, mode, normalize), rtol=1e-5, atol=1e-6)


def test_the_built_graph_computes_the_embedding(tmp_path: Path):
    pooling = {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True}
    folder = _sentence_folder(tmp_path / "minilm", pooling, ["Transformer", "Pooling", "Normalize"])
    built = make_engine(Settings(model=str(folder), precision="fp32", batch="1:2:4", out_root=tmp_path / "out"))
    session = ort.InferenceSession(str(built / "model.onnx"))
    assert [output.name for output in session.get_outputs()] == ["sentence_embedding"]
    ids = np.array([[1, 5, 7, 9, 2, 0, 0], [1, 8, 2, 0, 0, 0, 0], [1, 3, 4, 2, 0, 0, 0]])
    mask = (ids > 0).astype(np.int64)
    feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
    (served,) = session.run(None, {i.name: feed[i.name] for i in session.get_inputs()})
    expected = _expected(folder, {name: torch.from_numpy(value) for name, value in feed.items()}, "mean", True)
    np.testing.assert_allclose(served, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("pooling", "modules", "named"),
    [
        ({"pooling_mode_mean_tokens": True}, ["Transformer", "Pooling", "Dense", "Normalize"], "'Dense'"),
        ({"pooling_mode": "lasttoken"}, ["Transformer", "Pooling"], "mode is 'lasttoken'"),
        ({"pooling_mode_max_tokens": True}, ["Transformer", "Pooling"], "mode is 'max'"),
        (
            {"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True},
            ["Transformer", "Pooling"],
            "['max', 'mean']",
        ),
    ],
    ids=["dense", "lasttoken", "max", "two-modes"],
)
def test_a_module_not_computed_here_is_refused_naming_it(tmp_path: Path, pooling, modules, named):
    folder = _sentence_folder(tmp_path / "minilm", pooling, modules)
    with pytest.raises(PipelineError) as refused:
        models.load_model(str(folder))
    assert "is a sentence-transformers folder, but" in refused.value.problem and named in refused.value.problem
    assert "factory" in (refused.value.fix or "")


def test_a_modules_json_that_is_no_list_of_modules_is_refused(tmp_path: Path):
    folder = _sentence_folder(tmp_path / "minilm", {"pooling_mode_mean_tokens": True}, ["Transformer", "Pooling"])
    (folder / "modules.json").write_text("3")
    with pytest.raises(PipelineError, match="its modules.json holds 3, not a list of modules"):
        models.load_model(str(folder))
