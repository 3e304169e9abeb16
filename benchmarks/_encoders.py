"""Transformer encoders for benchmarks/fp16_autocast.py: random init, seeded, as `benchmarks._encoders:<name>`.

Both take input_ids / attention_mask (int64, [2, 32], the second row padded after 24 tokens) and return
last_hidden_state.  No weights are downloaded: the configs are built in code.
"""

from __future__ import annotations

import torch
from torch import nn

from trt_pipeline.models.spec import ModelSpec

BATCH, SEQ = 2, 32


class _LastHiddenState(nn.Module):
    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def _spec(name: str, encoder: nn.Module, vocab: int) -> ModelSpec:
    input_ids = torch.randint(0, vocab, (BATCH, SEQ), dtype=torch.int64)
    attention_mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    attention_mask[1, 24:] = 0
    return ModelSpec(
        name=name,
        module=_LastHiddenState(encoder).eval(),
        example_inputs={"input_ids": input_ids, "attention_mask": attention_mask},
        output_names=["last_hidden_state"],
    )


def bert_base() -> ModelSpec:
    """BertModel(BertConfig()) without the pooler: 12 layers, hidden 768."""
    from transformers import BertConfig, BertModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = BertConfig()
        return _spec("bert_base", BertModel(config, add_pooling_layer=False), config.vocab_size)


def t5_small() -> ModelSpec:
    """T5EncoderModel, T5-small sizes: d_model 512, d_ff 2048, 6 layers, 8 heads."""
    from transformers import T5Config, T5EncoderModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = T5Config(d_model=512, d_ff=2048, d_kv=64, num_layers=6, num_heads=8)
        return _spec("t5_small", T5EncoderModel(config), config.vocab_size)
