"""A model made ready for export (models/prepare.py): eval mode proved, and what export could not keep refused."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import toy_models
from trt_pipeline.models.prepare import prepare
from trt_pipeline.models.spec import ModelSpec
from trt_pipeline.pipeline.core.errors import PipelineError


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


def test_a_data_dependent_output_size_is_refused_saying_what_it_is_and_the_two_fixes():
    with pytest.raises(PipelineError, match=r"output 0 has a size that depends on the input values") as caught:
        prepare(toy_models.score_filter())
    assert "topk" in caught.value.fix and "filtering outside the graph" in caught.value.fix
