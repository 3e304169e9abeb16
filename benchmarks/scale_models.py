"""The models benchmarks/scale.py builds, each a factory the pipeline loads as MODEL=scale_models:<name>.

A family grows one model's weights through sizes; benchmarks/scale.py's FAMILIES names the members.  The
weights are random (seeded): the stages' cost depends on the bytes and the graph, not on what the weights say.
"""

from __future__ import annotations

import torch
from torch import nn


def mlp(layers: int, width: int) -> tuple[nn.Module, torch.Tensor]:
    """`layers` x (Linear(width, width) + GELU): layers * (width + 1) * width FP32 parameters."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]
    return nn.Sequential(*blocks), torch.randn(1, width)


# The MLP family's sizes, by their FP32 weights; 1.2 GB and 2.4 GB are issue 38's models.
def mlp_100mb() -> tuple[nn.Module, torch.Tensor]:
    return mlp(6, 2048)  # 25.2M parameters, 0.10 GB


def mlp_600mb() -> tuple[nn.Module, torch.Tensor]:
    return mlp(9, 4096)  # 151M parameters, 0.60 GB


def mlp_1200mb() -> tuple[nn.Module, torch.Tensor]:
    return mlp(18, 4096)  # 302M parameters, 1.21 GB


def mlp_2400mb() -> tuple[nn.Module, torch.Tensor]:
    return mlp(9, 8192)  # 604M parameters, 2.42 GB: past protobuf's 2 GB


def mlp_5gb() -> tuple[nn.Module, torch.Tensor]:
    return mlp(19, 8192)  # 1.28G parameters, 5.10 GB


# Real architectures from their configs, random weights (no download): what the MLP family stands for.
def llama_1b() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A Llama-style causal LM sized as TinyLlama-1.1B (22 layers, hidden 2048, grouped-query attention with 4
    key/value heads, a 32000-token vocabulary, untied head): 1.10G parameters, 4.40 GB in FP32.  Token ids in,
    logits out; the pipeline turns the cache off (models/huggingface.py)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    return model, {"input_ids": torch.randint(0, config.vocab_size, (1, 16))}


def vit_large() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """ViT-L/16 as an image encoder (24 layers, hidden 1024, 16 heads, MLP 4096, 224x224 images): 304M
    parameters, 1.22 GB in FP32; last_hidden_state and pooler_output out."""
    import transformers

    torch.manual_seed(0)
    config = transformers.ViTConfig(
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096, image_size=224
    )
    return transformers.ViTModel(config).eval(), {"pixel_values": torch.randn(1, 3, 224, 224)}
