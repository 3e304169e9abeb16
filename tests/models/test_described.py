"""A model a factory hands over bare, which says itself what it takes: a timm model's pretrained_cfg, or a
transformers model's config and the files beside the folder it was loaded from (models.described)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from trt_pipeline import models
from trt_pipeline.models.huggingface import SEQUENCE_AXIS
from trt_pipeline.pipeline.core.errors import PipelineError

HERE = "tests.models.test_described"
FOLDER_VARIABLE = "DESCRIBED_TEST_FOLDER"


def _small_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))


def timm_style():
    """As timm.create_model returns a model: its pretrained_cfg names the size it was trained at."""
    model = _small_cnn()
    model.pretrained_cfg = {"input_size": (3, 20, 24), "num_classes": 2, "architecture": "small_cnn"}
    return model


def older_timm_style():
    model = _small_cnn()
    model.default_cfg = {"input_size": [3, 16, 16]}  # timm before 0.9 kept it under this name, in a list
    return model


def timm_style_without_a_size():
    model = _small_cnn()
    model.pretrained_cfg = {"num_classes": 2}
    return model


def bert_from_a_config():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=30, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    return transformers.BertForSequenceClassification(config)


def bert_from_its_folder():
    """As a service's factory loads a model: from_pretrained on the folder it was saved to."""
    transformers = pytest.importorskip("transformers")
    return transformers.BertForSequenceClassification.from_pretrained(os.environ[FOLDER_VARIABLE])


@pytest.mark.parametrize(("factory", "shape"), [("timm_style", (2, 3, 20, 24)), ("older_timm_style", (2, 3, 16, 16))])
def test_a_module_with_timms_input_size_needs_no_input_shape(factory: str, shape: tuple):
    spec = models.load_model(f"{HERE}:{factory}")
    assert {name: tuple(tensor.shape) for name, tensor in spec.example_inputs.items()} == {"input": shape}
    assert any("pretrained_cfg" in note for note in spec.notes)
    assert models.load_model(f"{HERE}:{factory}", input_shape="3x32x32").example_inputs["input"].shape[-1] == 32
    with pytest.raises(PipelineError, match="does not say what its inputs are"):  # a record without the size
        models.load_model(f"{HERE}:timm_style_without_a_size")


def test_a_transformers_model_from_a_factory_takes_the_inputs_its_folder_would(tmp_path: Path):
    from_factory = models.load_model(f"{HERE}:bert_from_a_config")
    folder = tmp_path / "bert"
    bert_from_a_config().save_pretrained(folder)
    from_folder = models.load_model(str(folder))
    assert list(from_factory.example_inputs) == ["input_ids", "attention_mask", "token_type_ids"]
    for name, tensor in from_folder.example_inputs.items():
        torch.testing.assert_close(from_factory.example_inputs[name], tensor)
    assert from_factory.dynamic_axes == from_folder.dynamic_axes
    assert from_factory.dynamic_axes["input_ids"][1].name == SEQUENCE_AXIS


def test_a_factorys_model_loaded_from_a_folder_reads_the_files_beside_it_and_fingerprints_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    folder = tmp_path / "bert"
    bert_from_a_config().save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 40}))
    monkeypatch.setenv(FOLDER_VARIABLE, str(folder))
    spec = models.load_model(f"{HERE}:bert_from_its_folder")
    assert spec.dynamic_axes["input_ids"][1].max == 40  # the tokenizer's limit, beside the weights
    torch.manual_seed(1)
    type(spec.module.model)(spec.module.model.config).save_pretrained(folder)  # new weights, the factory unchanged
    assert models.load_model(f"{HERE}:bert_from_its_folder").fingerprint != spec.fingerprint
