"""The coverage set: architectures nobody here wrote, each through the whole pipeline (export to a tensorrt_rtx
engine) in FP32 and FP16, from small configs built in code (nothing is downloaded).

The table for a closing note: `.venv/bin/python -m tests.test_coverage [--out coverage.md]` (model x precision:
pass/fail, parity numbers, seconds).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from tests import toy_models
from trt_pipeline.models.spec import ModelSpec
from trt_pipeline.pipeline.errors import PipelineError
from trt_pipeline.pipeline.settings import BatchProfile, Settings

transformers = pytest.importorskip("transformers")

VOCABULARY = 32
SEQUENCE = 8


def _tokens(*names: str) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 10, (2, SEQUENCE))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return {name: inputs.get(name, torch.zeros_like(ids)) for name in names}


def bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCABULARY, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32,
    )  # fmt: skip
    return transformers.BertModel(config), _tokens("input_ids", "attention_mask", "token_type_ids")


def distilbert():
    torch.manual_seed(0)
    config = transformers.DistilBertConfig(
        vocab_size=VOCABULARY, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=32
    )
    return transformers.DistilBertModel(config), _tokens("input_ids", "attention_mask")


def vit():
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64,
    )  # fmt: skip
    return transformers.ViTModel(config), {"pixel_values": torch.randn(2, 3, 32, 32)}


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCABULARY, n_embd=32, n_layer=2, n_head=2, n_positions=32)
    config.bos_token_id = config.eos_token_id = 0  # GPT-2's own 50256 is outside this vocabulary
    return transformers.GPT2Model(config), _tokens("input_ids", "attention_mask")


def t5_encoder():
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=VOCABULARY, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, decoder_start_token_id=0
    )
    return transformers.T5EncoderModel(config), _tokens("input_ids", "attention_mask")


def wav2vec2():
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
        vocab_size=VOCABULARY,
    )  # fmt: skip
    return transformers.Wav2Vec2Model(config), {"input_values": torch.randn(2, 800)}


class _Lstm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(input_size=8, hidden_size=16, num_layers=2, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sequence, _ = self.lstm(x)
        return self.head(sequence[:, -1])


def lstm():
    torch.manual_seed(0)
    return _Lstm(), {"x": torch.randn(2, 10, 8)}


class _UNet(nn.Module):
    """Two levels: conv blocks, a max-pool down, a transposed conv up, and the skip concatenation."""

    def __init__(self) -> None:
        super().__init__()
        self.down = self._block(3, 8)
        self.bottom = self._block(8, 16)
        self.up = nn.ConvTranspose2d(16, 8, kernel_size=2, stride=2)
        self.merge = self._block(16, 8)
        self.out = nn.Conv2d(8, 2, kernel_size=1)

    @staticmethod
    def _block(inputs: int, outputs: int) -> nn.Sequential:
        return nn.Sequential(
            nn.Conv2d(inputs, outputs, 3, padding=1), nn.BatchNorm2d(outputs), nn.ReLU(),
            nn.Conv2d(outputs, outputs, 3, padding=1), nn.BatchNorm2d(outputs), nn.ReLU(),
        )  # fmt: skip

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        skip = self.down(image)
        bottom = self.bottom(nn.functional.max_pool2d(skip, 2))
        return self.out(self.merge(torch.cat([self.up(bottom), skip], dim=1)))


def unet():
    torch.manual_seed(0)
    return _UNet(), {"image": torch.randn(2, 3, 32, 32)}


class _TopK(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.classifier = nn.Linear(16, 10)

    def forward(self, features: torch.Tensor) -> dict[str, torch.Tensor]:
        scores, classes = self.classifier(features).softmax(-1).topk(3, dim=-1)
        return {"scores": scores, "classes": classes}


def topk_head():
    torch.manual_seed(0)
    return _TopK(), {"features": torch.randn(2, 16)}


def dict_output() -> ModelSpec:
    return toy_models.text_classifier()  # two inputs, a dict of two outputs, a dynamic sequence


def transformer_encoder() -> ModelSpec:
    return toy_models.transformer_encoder()  # torch's own nn.TransformerEncoder (fast path off at export)


@dataclass(frozen=True)
class Case:
    name: str
    keep_fp32: str | None = None  # FP16: what must stay FP32 beyond the automatic fallback, with the reason


CASES = [
    Case("bert"),
    Case("distilbert"),
    Case("vit"),
    Case("gpt2"),
    Case("t5_encoder"),
    Case("wav2vec2"),
    Case("transformer_encoder"),
    Case("lstm"),
    Case("unet"),
    Case("dict_output"),
    Case("topk_head"),
]
# FP16 for every case in CI would double the set's time; these cover the families (encoder, decoder, relative
# attention, speech, CNN, recurrent, integer outputs).  The table runs FP16 for all.
FP16_IN_CI = ("bert", "gpt2", "t5_encoder", "wav2vec2", "unet", "lstm", "topk_head")


def run_case(case: Case, precision: str, out_root: Path) -> dict:
    """One case through make_engine; its row for the table."""
    from trt_pipeline.pipeline.manifest import MANIFEST
    from trt_pipeline.pipeline.stages import make_engine

    settings = Settings(
        model=f"tests.test_coverage:{case.name}",
        precision=precision,
        batch=BatchProfile(1, 2, 4),
        out_root=out_root,
        builder="tensorrt_rtx",
        keep_fp32=case.keep_fp32 if precision == "fp16" else None,
    )
    started = time.perf_counter()
    try:
        folder = make_engine(settings)
    except PipelineError as error:
        return {"model": case.name, "precision": precision, "ok": False, "error": error.problem,
                "seconds": time.perf_counter() - started}  # fmt: skip
    manifest = json.loads((folder / MANIFEST).read_text())  # as written on disk
    return {
        "model": case.name,
        "precision": precision,
        "ok": True,
        "parity_fp32": manifest["parity_fp32"]["max_rel"],
        "parity_fp16": manifest.get("parity_fp16", {}).get("max_rel"),
        "kept_fp32": len(manifest.get("fp16", {}).get("kept_fp32", [])),
        "dynamic": manifest.get("axis_ranges", {}),
        "seconds": time.perf_counter() - started,
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "precision"),
    [(case, "fp32") for case in CASES] + [(case, "fp16") for case in CASES if case.name in FP16_IN_CI],
    ids=lambda value: value.name if isinstance(value, Case) else value,
)
def test_coverage(case: Case, precision: str, tmp_path: Path):
    row = run_case(case, precision, tmp_path)
    assert row["ok"], row.get("error")
    assert row["parity_fp32"] < 1e-3
    if precision == "fp16":
        assert row["parity_fp16"] < 3e-2


def table(rows: list[dict]) -> str:
    lines = [
        "| model | precision | result | parity fp32 (max rel) | parity fp16 (max rel) | FP32 nodes kept | s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        if not row["ok"]:
            lines.append(f"| {row['model']} | {row['precision']} | FAIL: {row['error'][:120]} | | | | "
                         f"{row['seconds']:.1f} |")  # fmt: skip
            continue
        fp16 = f"{row['parity_fp16']:.3g}" if row["parity_fp16"] is not None else ""
        kept = str(row["kept_fp32"]) if row["precision"] == "fp16" else ""
        lines.append(
            f"| {row['model']} | {row['precision']} | pass | {row['parity_fp32']:.3g} | {fp16} | {kept} | "
            f"{row['seconds']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description="the coverage table: every case in FP32 and FP16")
    parser.add_argument("--out", type=Path, help="write the markdown table here too")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="coverage.") as folder:
        for case in CASES:
            for precision in ("fp32", "fp16"):
                rows.append(run_case(case, precision, Path(folder)))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    text = table(rows)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
