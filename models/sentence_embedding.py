"""A sentence-transformers folder served as the embedding it computes.

`SentenceTransformer.save` (and a folder from the Hub: all-MiniLM, bge, e5, gte, ...) writes the transformer as
save_pretrained does, at the folder's root, and beside it `modules.json`, which names what follows it: a Pooling
(`1_Pooling/config.json`) and often a Normalize.  The transformer alone returns one vector per token; what a service
embeds with is the pooled, normalized vector `SentenceTransformer.encode` returns.  So a folder whose modules.json
names the transformer, a Pooling and optionally a Normalize is served with one output, `sentence_embedding`, computed
as sentence-transformers 6 computes it (its Pooling's "cls" or "mean" over the tokens the attention mask keeps;
Normalize's L2 norm); the graph computes it too, so every gate judges the embedding.  Any other module (a Dense, a
pooling mode besides these) is refused, naming it: served without it, the vectors would not be the model's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..pipeline.core.errors import PipelineError
from ..pipeline.core.settings import mention
from .huggingface import HuggingFaceModule
from .spec import ModelSpec

MODULES_FILE = "modules.json"
OUTPUT = "sentence_embedding"
# Not "max": on a row whose every token is masked (the checks draw such rows) it is -inf, and normalized NaN.
POOLING_MODES = ("cls", "mean")
# sentence-transformers before 5 wrote one boolean a mode, which it reads still, in this order (several: concatenated).
LEGACY_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


@dataclass(frozen=True)
class SentencePooling:
    """What follows the transformer: the Pooling's mode, and whether a Normalize follows it."""

    mode: str
    normalize: bool


def sentence_pooling(folder: Path) -> SentencePooling | None:
    """The pooling the folder's modules.json names; None where it has none (a plain save_pretrained folder)."""
    modules = _modules(folder)
    if not modules:
        return None
    kinds = [str(module.get("type", "")).rsplit(".", 1)[-1] for module in modules]
    if kinds not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
        raise _refused(folder, f"its {MODULES_FILE} names the modules {kinds}")
    if str(modules[0].get("path", "")) not in ("", "."):
        raise _refused(folder, f"its transformer is in {modules[0].get('path')!r}, not at the folder's root")
    config = _read_json(folder / str(modules[1].get("path", "")) / "config.json", folder)
    return SentencePooling(_pooling_mode(config, folder), normalize=len(kinds) == 3)


def sentence_sources(folder: Path) -> list[Path]:
    """modules.json and the config of each module it names (the fingerprint covers them)."""
    modules = _modules(folder)
    configs = [folder / str(module.get("path", "")) / "config.json" for module in modules[1:]]
    return [folder / MODULES_FILE, *(config for config in configs if config.is_file())] if modules else []


def _modules(folder: Path) -> list[dict]:
    """modules.json's list of modules, each a JSON object; [] where the folder has none."""
    path = folder / MODULES_FILE
    if not path.is_file():
        return []
    modules = _read_json(path, folder)
    if not isinstance(modules, list) or not modules or not all(isinstance(module, dict) for module in modules):
        raise _refused(folder, f"its {MODULES_FILE} holds {modules!r}, not a list of modules")
    return modules


def _pooling_mode(config: Any, folder: Path) -> str:
    if not isinstance(config, dict):
        raise _refused(folder, f"its Pooling's config.json holds {config!r}")
    mode = config.get("pooling_mode")
    if mode is None:  # the booleans of sentence-transformers before 5 (it takes "mean" where none is set)
        modes = [name for key, name in LEGACY_MODES.items() if config.get(key)] or ["mean"]
        mode = modes[0] if len(modes) == 1 else modes
    if mode not in POOLING_MODES:
        raise _refused(folder, f"its Pooling's mode is {mode!r}")
    return str(mode)


class SentenceEmbedding(nn.Module):
    """The transformer (models.huggingface.HuggingFaceModule), then its Pooling and Normalize, as one module: forward
    takes the same inputs and returns {"sentence_embedding": [batch, hidden]}."""

    def __init__(self, transformer: HuggingFaceModule, pooling: SentencePooling) -> None:
        super().__init__()
        self.transformer: HuggingFaceModule = transformer
        self.pooling = pooling
        self.input_names = list(transformer.input_names)
        self.output_names = [OUTPUT]
        transformer.output_names = ["last_hidden_state"]  # all the Pooling reads: its other outputs leave the graph

    def forward(self, *inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        tokens = self.transformer(*inputs)["last_hidden_state"]
        mask = inputs[self.input_names.index("attention_mask")]
        pooled = pool(tokens, mask, self.pooling.mode)
        return {OUTPUT: F.normalize(pooled, p=2, dim=-1) if self.pooling.normalize else pooled}


def pool(tokens: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """sentence-transformers 6's Pooling of [batch, sequence, hidden] over the tokens `mask` keeps."""
    if mode == "cls":  # the first token kept (the first of all, with padding on the right)
        first = mask.to(torch.int32).argmax(dim=1)
        return tokens[torch.arange(tokens.shape[0]), first]
    kept = mask.unsqueeze(-1).to(tokens.dtype)
    return (tokens * kept).sum(dim=1) / torch.clamp(kept.sum(dim=1), min=1e-9)


def pooled(spec: ModelSpec, folder: Path, pooling: SentencePooling) -> ModelSpec:
    """The adapted spec (models.huggingface.adapt) with its transformer's outputs pooled as the folder says."""
    if "attention_mask" not in spec.example_inputs:
        raise _refused(folder, "its transformer takes no attention_mask, which says the tokens a Pooling keeps")
    spec.module = SentenceEmbedding(cast(HuggingFaceModule, spec.module), pooling)
    spec.output_names = [OUTPUT]
    norm = ", L2-normalized" if pooling.normalize else ""
    spec.notes.append(
        f"sentence-transformers folder: {OUTPUT} is the {pooling.mode} pooling of last_hidden_state{norm}"
    )
    return spec


def _read_json(path: Path, folder: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise _refused(folder, f"{path} is not readable JSON ({error})") from None


def _refused(folder: Path, problem: str) -> PipelineError:
    return PipelineError(
        f"{mention(model=folder)} is a sentence-transformers folder, but {problem}: only a transformer, a Pooling of "
        f"mode {', '.join(POOLING_MODES)} and a Normalize are computed here",
        "write a factory (MODEL=package.module:factory) returning an nn.Module that computes the embedding from the "
        "tokenizer's output, or build the transformer alone from a folder without modules.json",
    )
