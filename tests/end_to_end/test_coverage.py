"""The coverage set: architectures nobody here wrote, each through the whole pipeline (export to a tensorrt_rtx
engine) in FP32, FP16 and INT8, from small configs built in code (nothing is downloaded).

INT8 is calibrated from a .npz of inputs like each model's own (token ids in its vocabulary with padded masks,
images, audio), written per case and given as CALIB, as a user would.  The weights are random, so an INT8 build
may be refused by the agreement gate (pipeline/stages/parity.py): a refusal is a result, recorded with the gate's
message; a crash is a bug.

The table for a closing note: `.venv/bin/python -m tests.end_to_end.test_coverage [--out coverage.md]` (model x
precision: pass/fail, parity numbers, INT8 agreement and Q/DQ counts, seconds); --models and --precisions pick a part.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from tests.helpers import toy_models
from trt_pipeline.models import canonical_name
from trt_pipeline.models.spec import ModelSpec
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.settings import BatchProfile, Settings
from trt_pipeline.pipeline.evaluation import INT8_MAX_ERROR

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


def transformer_encoder_dynamic() -> ModelSpec:
    """The same encoder with a dynamic sequence (Case.dynamic): TorchScript bakes it into MultiheadAttention's
    Reshape, so auto exports it with dynamo."""
    return toy_models.transformer_encoder()


def nested_output() -> ModelSpec:
    return toy_models.nested_outputs()  # {"logits": a, "aux": (b, c)}: outputs logits, aux.0, aux.1


class _Tokens(nn.Module):
    """A one-input model given as a one-tuple: its input is named `tokens` after forward(), as longer tuples are."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCABULARY, 16)
        self.mix = nn.Conv1d(16, 16, kernel_size=3, padding=1)
        self.head = nn.Linear(16, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mixed = torch.relu(self.mix(self.embedding(tokens).transpose(1, 2))).transpose(1, 2)
        return self.head(mixed)


def one_input_tuple():
    torch.manual_seed(0)
    return _Tokens(), (torch.randint(0, 10, (2, SEQUENCE)),)


def bart():
    """An encoder-decoder, whole (with its LM head), fed decoder_input_ids of their own length."""
    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=VOCABULARY, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2,
    )  # fmt: skip
    return transformers.BartForConditionalGeneration(config), _tokens(
        "input_ids", "attention_mask", "decoder_input_ids"
    )


def llama():
    """A causal LM with its head: rotary positions, grouped-query attention (2 heads, 1 key/value head), RMSNorm."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCABULARY, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config), _tokens("input_ids", "attention_mask")


def swin():
    """A vision transformer that patches in shifted windows and merges patches between stages."""
    torch.manual_seed(0)
    config = transformers.SwinConfig(
        image_size=32, patch_size=4, num_channels=3, embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=4,
        mlp_ratio=2.0,
    )  # fmt: skip
    return transformers.SwinModel(config), {"pixel_values": torch.randn(2, 3, 32, 32)}


def hubert():
    """A speech encoder (convolutional feature extractor, then attention) on raw audio of a dynamic length."""
    torch.manual_seed(0)
    config = transformers.HubertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
        vocab_size=VOCABULARY,
    )  # fmt: skip
    return transformers.HubertModel(config), {"input_values": torch.randn(2, 800)}


def whisper_encoder():
    """A speech encoder on log-mel features: two convolutions, then attention over a length its positions fix."""
    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        vocab_size=VOCABULARY, d_model=32, encoder_layers=2, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=20,
        max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
    )  # fmt: skip
    return transformers.WhisperModel(config).get_encoder(), {"input_features": torch.randn(2, 16, 40)}


def beit():
    """A vision transformer with a relative position bias in every attention (not ViT's absolute positions)."""
    torch.manual_seed(0)
    config = transformers.BeitConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        use_relative_position_bias=True,
    )  # fmt: skip
    return transformers.BeitModel(config), {"pixel_values": torch.randn(2, 3, 32, 32)}


def segformer():
    """A segmentation head: a hierarchical encoder with reduced-sequence attention, an all-MLP decoder."""
    torch.manual_seed(0)
    config = transformers.SegformerConfig(
        num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
        patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2], decoder_hidden_size=32,
        num_labels=4,
    )  # fmt: skip
    return transformers.SegformerForSemanticSegmentation(config), {"pixel_values": torch.randn(2, 3, 32, 32)}


# --------------------------------------------------------------------------- INT8 calibration data
# Model-ready inputs like the ones each case serves, keyed by the graph's input names (calibration/readers.py binds
# a .npz by name and ignores keys the graph dropped).  Same shapes as the example inputs: every case's graph takes
# those, whatever its dynamic axes.
Calibration = Callable[[np.random.Generator, int], dict[str, np.ndarray]]


def _tokens_like(*names: str, vocabulary: int = VOCABULARY, mask_dtype: type = np.int64) -> Calibration:
    """Token ids in the vocabulary (0 is padding) with a padded tail of random length per row, as a tokenizer's
    padded batch has; token_type_ids split each row into two segments."""

    def make(rng: np.random.Generator, rows: int) -> dict[str, np.ndarray]:
        lengths = rng.integers(SEQUENCE // 2, SEQUENCE + 1, rows)
        inside = np.arange(SEQUENCE)[None, :] < lengths[:, None]
        ids = np.where(inside, rng.integers(1, vocabulary, (rows, SEQUENCE)), 0)
        segments = (np.arange(SEQUENCE)[None, :] >= lengths[:, None] // 2) & inside
        arrays = {
            "input_ids": ids,
            "attention_mask": inside.astype(mask_dtype),
            "token_type_ids": segments,
            "decoder_input_ids": np.where(inside, rng.integers(3, vocabulary, (rows, SEQUENCE)), 0),
            "tokens": ids,
        }
        return {name: arrays[name].astype(mask_dtype if name == "attention_mask" else np.int64) for name in names}

    return make


def _images(name: str, channels: int, size: int) -> Calibration:
    """Smooth images (noise at a quarter of the resolution, upsampled) normalised per channel, as a photograph
    after mean/std normalisation is, rather than white noise."""

    def make(rng: np.random.Generator, rows: int) -> dict[str, np.ndarray]:
        coarse = rng.standard_normal((rows, channels, size // 4, size // 4))
        images = coarse.repeat(4, axis=2).repeat(4, axis=3) + 0.1 * rng.standard_normal((rows, channels, size, size))
        images = (images - images.mean(axis=(2, 3), keepdims=True)) / images.std(axis=(2, 3), keepdims=True)
        return {name: images.astype(np.float32)}

    return make


def _audio(name: str, samples: int) -> Calibration:
    """A few tones and noise at 16 kHz, each clip normalised to zero mean and unit variance as Wav2Vec2's feature
    extractor normalises them."""

    def make(rng: np.random.Generator, rows: int) -> dict[str, np.ndarray]:
        time_s = np.arange(samples) / 16_000
        tones = rng.uniform(100, 2_000, (rows, 3, 1))
        clips = np.sin(2 * np.pi * tones * time_s).sum(axis=1) + 0.3 * rng.standard_normal((rows, samples))
        clips = (clips - clips.mean(axis=1, keepdims=True)) / clips.std(axis=1, keepdims=True)
        return {name: clips.astype(np.float32)}

    return make


def _features(name: str, *shape: int) -> Calibration:
    """Standard normal features: what these cases' example inputs are, and what their layers were drawn for."""

    def make(rng: np.random.Generator, rows: int) -> dict[str, np.ndarray]:
        return {name: rng.standard_normal((rows, *shape)).astype(np.float32)}

    return make


@dataclass(frozen=True)
class Case:
    name: str
    calibration: Calibration
    keep_fp32: str | None = None  # FP16: what must stay FP32 beyond the automatic fallback, with the reason
    dynamic: str | None = None  # DYNAMIC= as a user gives it (transformers' token inputs get a sequence axis anyway)
    dynamo: bool = False  # exported by the dynamo exporter (EXPORTER=auto picks it), which needs onnxscript


CASES = [
    Case("bert", _tokens_like("input_ids", "attention_mask", "token_type_ids")),
    Case("distilbert", _tokens_like("input_ids", "attention_mask")),
    Case("vit", _images("pixel_values", 3, 32)),
    Case("gpt2", _tokens_like("input_ids", "attention_mask")),
    Case("t5_encoder", _tokens_like("input_ids", "attention_mask")),
    Case("wav2vec2", _audio("input_values", 800)),
    Case("transformer_encoder", _features("x", 8, 16)),
    Case("lstm", _features("x", 10, 8)),
    Case("unet", _images("image", 3, 32)),
    Case("dict_output", _tokens_like("input_ids", "attention_mask", vocabulary=100, mask_dtype=np.float32)),
    Case("topk_head", _features("features", 16)),
    Case("transformer_encoder_dynamic", _features("x", 8, 16), dynamic="x:1=1:8:16", dynamo=True),
    Case("nested_output", _features("x", 6)),
    Case("one_input_tuple", _tokens_like("tokens"), dynamic="tokens:1=1:8:16"),
    # decoder_input_ids on an axis of their own (another range), as generation feeds them
    Case(
        "bart",
        _tokens_like("input_ids", "attention_mask", "decoder_input_ids"),
        dynamic="input_ids:1=1:8:16,attention_mask:1=1:8:16,decoder_input_ids:1=1:8:12",
    ),  # fmt: skip
    Case("llama", _tokens_like("input_ids", "attention_mask")),
    Case("swin", _images("pixel_values", 3, 32)),
    Case("hubert", _audio("input_values", 800), dynamic="input_values:1=400:800:1600"),
    Case("segformer", _images("pixel_values", 3, 32)),
    Case("whisper_encoder", _features("input_features", 16, 40)),  # its length is fixed: an unseen batch only
    Case("beit", _images("pixel_values", 3, 32)),
]
# FP16 for every case in CI would double the set's time; these cover the families (encoder, decoder, relative
# attention, speech, CNN, recurrent, integer outputs).  The table runs FP16 for all.
FP16_IN_CI = ("bert", "gpt2", "t5_encoder", "wav2vec2", "unet", "lstm", "topk_head", "transformer_encoder_dynamic")
# INT8 in CI (about 30 s): a text encoder, a speech encoder (convolutions, one weight in a Constant node), a recurrent
# net and a CNN with a skip; the others run with COVERAGE_INT8=all and in the table.
INT8_IN_CI = ("bert", "wav2vec2", "lstm", "unet", "transformer_encoder_dynamic")  # the last: a dynamo graph
NAMES = [case.name for case in CASES]
CALIBRATION_ROWS = 64  # 4 batches of 16: the gate judges these rows too
HELD_OUT_ROWS = 32  # judged like them, never calibrated on


def write_calibration(case: Case, folder: Path) -> Path:
    """The case's calibration .npz (seeded: the same file on every run, so a rebuild reuses its ranges)."""
    path = folder / f"{case.name}.calibration.npz"
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(path, allow_pickle=False, **case.calibration(np.random.default_rng(0), CALIBRATION_ROWS))
    return path


def run_case(case: Case, precision: str, out_root: Path) -> dict:
    """One case through make_engine, as a user runs it (INT8: CALIB= the case's .npz); its row for the table.

    A PipelineError is a result (the row says which stage refused, and why); anything else is a bug and raises.
    """
    from trt_pipeline.pipeline.stages.sequence import make_engine

    settings = Settings(
        model=f"tests.end_to_end.test_coverage:{case.name}",
        precision=precision,
        batch=BatchProfile(1, 2, 4),
        out_root=out_root,
        builder="tensorrt_rtx",
        keep_fp32=case.keep_fp32 if precision == "fp16" else None,
        dynamic=case.dynamic,
        # CALIB's settings only where they change the folder: at another precision they are refused
        **(
            {"calib": write_calibration(case, out_root / "calibration"), "calib_samples": CALIBRATION_ROWS}
            if precision == "int8"
            else {}
        ),
    )
    folder = settings.artifact_dir(canonical_name(settings.model))
    started = time.perf_counter()
    try:
        folder = make_engine(settings)
    except PipelineError as error:
        seconds = time.perf_counter() - started
        parity_fp32 = _manifest(folder).get("parity_fp32", {}).get("max_rel")
        return {"model": case.name, "precision": precision, "ok": False, "error": error.problem, "fix": error.fix,
                "refused_after": _last_stage(folder), "parity_fp32": parity_fp32, **_int8_record(folder, case),
                **_gate_numbers(error.problem), "seconds": seconds}  # fmt: skip
    seconds = time.perf_counter() - started
    manifest = _manifest(folder)
    return {
        "model": case.name,
        "precision": precision,
        "ok": True,
        "exporter": manifest["exporter"],
        "unseen": _unseen_sizes(folder),
        "parity_fp32": manifest["parity_fp32"]["max_rel"],
        "parity_fp16": manifest.get("parity_fp16", {}).get("max_rel"),
        "parity_int8": manifest.get("parity_int8", {}).get("max_rel"),
        "kept_fp32": len(manifest.get("fp16", {}).get("kept_fp32", [])),
        "dynamic": manifest.get("axis_ranges", {}),
        **_int8_record(folder, case),
        "seconds": seconds,
    }


UNSEEN_BATCH = 3  # the profile is 1:2:4 and the reference runs batches 1, 2 and 4


def _unseen_sizes(folder: Path) -> dict:
    """The graph the runner serves here (ONNX Runtime) against the model itself (the torch runner) at a batch and
    dynamic-axis sizes no stage ran (the reference runs the example's size and each axis's max), on random inputs
    drawn as the reference's are (integers in the range of the reference's own)."""
    from trt_pipeline.pipeline.core.compare import compare
    from trt_pipeline.pipeline.core.random_inputs import random_inputs
    from trt_pipeline.pipeline.folder.graph_io import load_reference
    from trt_pipeline.pipeline.folder.layout import REFERENCE
    from trt_pipeline.pipeline.folder.reader import open_folder
    from trt_pipeline.pipeline.runners import load_runner

    opened = open_folder(folder)
    manifest = opened.manifest
    sizes = {name: _unused_size(*bounds) for name, bounds in manifest.axis_ranges.items()}
    reference_inputs = load_reference(folder / REFERENCE)[0][0]
    ranges = {name: (int(a.min()), int(a.max())) for name, a in reference_inputs.items() if a.dtype.kind in "iu"}
    records = [tensor.as_record() for tensor in manifest.inputs]
    feed = random_inputs(records, UNSEEN_BATCH, seed=7, axis_sizes=sizes, int_ranges=ranges)
    with load_runner(opened, "onnxruntime") as graph, load_runner(opened, "torch") as model:
        served, expected = graph.infer(feed), model.infer(feed)
    errors = {name: compare(expected[name], served[name], rtol=1.0).max_rel for name in expected}
    return {"batch": UNSEEN_BATCH, "sizes": sizes, "max_rel": max(errors.values())}


def _unused_size(low: int, opt: int, high: int) -> int:
    """A size in the axis's range that the reference did not run: it runs the example's (opt) and the max."""
    unused = [size for size in ((opt + high) // 2, low, high - 1) if low <= size <= high and size not in (opt, high)]
    return unused[0] if unused else opt  # a range of one or two sizes: the reference ran them all


def _manifest(folder: Path) -> dict:
    from trt_pipeline.pipeline.folder.layout import MANIFEST

    path = folder / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {}  # as written on disk


def _last_stage(folder: Path) -> str | None:
    """The last stage that finished before a refusal (the manifest lists timings in order)."""
    stages = list(_manifest(folder).get("timings") or ())
    return stages[-1] if stages else None


def _constants_quantized_as_activations(model: onnx.ModelProto) -> list[str]:
    """Constants that reach a QuantizeLinear: weights the quantizer did not take for weights (one per-tensor scale
    from a calibrated range instead of exact per-channel ones; calibration/qdq.py _weights_as_initializers)."""
    constants = {init.name for init in model.graph.initializer}
    constants |= {out for node in model.graph.node if node.op_type == "Constant" for out in node.output}
    return [
        node.input[0] for node in model.graph.node if node.op_type == "QuantizeLinear" and node.input[0] in constants
    ]


def _gate_numbers(problem: str) -> dict:
    """The INT8 gate's number and cosine from its refusal (check_int8_agreement records them only when it passes);
    nothing for another refusal."""
    found = re.search(r"is off by (\S+) of its norm .*?cosine (\S+?)\)", problem)
    return {"agreement_error": float(found[1]), "agreement_cosine": float(found[2])} if found else {}


def _int8_record(folder: Path, case: Case) -> dict:
    """What the INT8 stages left in the folder, refused or not: the Q/DQ counts of model.int8.onnx and its problems
    for TensorRT, the CPU graphs ORT's quantizer could not make, the gate's numbers (worst output) and the same
    measure on held-out inputs."""
    from trt_pipeline.calibration.qdq import qdq_problems

    manifest = _manifest(folder)
    if "int8" not in manifest:
        return {}
    path = folder / "model.int8.onnx"
    model = onnx.load(str(path)) if path.is_file() else None
    record: dict = {
        "qdq": manifest["int8"]["qdq"],
        "qdq_problems": qdq_problems(model) if model else ["model.int8.onnx is missing"],
        "constants_quantized_as_activations": _constants_quantized_as_activations(model) if model else [],
        "cpu_graphs_failed": {
            kind: cpu["failed"]
            for kind, cpu in manifest["int8"].get("qdq_onnxruntime_cpu", {}).items()
            if "failed" in cpu
        },
    }
    agreement = manifest.get("agreement_int8", {}).get("graphs", {}).get("model.int8.onnx")
    if agreement is not None:  # the gate's rows: held out from calibration where the set allowed it
        judged = agreement["judged"]
        record.update(agreement_error=judged["error_mean"], agreement_cosine=judged["cosine_mean"])
    if model is not None:
        record.update(_held_out_agreement(folder, case))
    return record


def _held_out_agreement(folder: Path, case: Case) -> dict:
    """The gate's measure (pipeline/stages/parity.py) on rows the calibration never saw: in-sample, a calibrated range
    holds every value it is judged on; here values past it are clipped as served inputs' would be."""
    from trt_pipeline.pipeline.evaluation.agreement import Fp32Reference
    from trt_pipeline.pipeline.stages.parity import check_int8_agreement

    arrays = case.calibration(np.random.default_rng(1), HELD_OUT_ROWS)  # seed 0 is the calibration set
    batches = [
        {name: array[start : start + 16] for name, array in arrays.items()} for start in range(0, HELD_OUT_ROWS, 16)
    ]
    graphs = [folder / "model.onnx", folder / "model.int8.onnx"]
    try:
        record = check_int8_agreement(Fp32Reference(graphs[0]), graphs[1:], _graph_feeds(graphs[0], batches))
    except PipelineError as error:  # past the gate on held-out rows: the numbers are in the message
        numbers = _gate_numbers(error.problem)
        return {f"held_out_{key.removeprefix('agreement_')}": value for key, value in numbers.items()}
    _, worst = record.graphs["model.int8.onnx"].worst()
    return {"held_out_error": worst.error_mean, "held_out_cosine": worst.cosine_mean}


def _graph_feeds(fp32: Path, batches: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """Only the arrays the graph takes (an exporter drops inputs the model ignores), as the calibration reader does."""
    from trt_pipeline.calibration.readers import graph_inputs

    names = [graph_input.name for graph_input in graph_inputs(fp32)]
    return [{name: feeds[name] for name in names} for feeds in batches]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "precision"),
    [(case, "fp32") for case in CASES] + [(case, "fp16") for case in CASES if case.name in FP16_IN_CI],
    ids=lambda value: value.name if isinstance(value, Case) else value,
)
def test_coverage(case: Case, precision: str, tmp_path: Path):
    _skip_without_its_exporter(case)
    row = run_case(case, precision, tmp_path)
    assert row["ok"], row.get("error")
    assert row["parity_fp32"] < 1e-3
    assert row["unseen"]["max_rel"] < (3e-2 if precision == "fp16" else 1e-3)  # at a batch and sizes never built at
    if precision == "fp16":
        assert row["parity_fp16"] < 3e-2


def _skip_without_its_exporter(case: Case) -> None:
    if case.dynamo:
        pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript (the build extra)")


def _int8_params() -> list:
    """The INT8 cases: those in INT8_IN_CI run in CI; the rest are skipped unless COVERAGE_INT8=all."""
    every = os.environ.get("COVERAGE_INT8") == "all"
    reason = "INT8 beyond the CI subset: COVERAGE_INT8=all, or the table (python -m tests.end_to_end.test_coverage)"
    return [
        pytest.param(case, id=case.name, marks=() if every or case.name in INT8_IN_CI else pytest.mark.skip(reason))
        for case in CASES
    ]


@pytest.mark.slow
@pytest.mark.parametrize("case", _int8_params())
def test_coverage_int8(case: Case, tmp_path: Path):
    """Each INT8 build passes the agreement gate, or a gate refuses it with a PipelineError that names the fix (the
    command line's exit 2): never a crash.  Either way model.int8.onnx was written in the form TensorRT accepts, with
    Q/DQ on the model's weighted ops."""
    _skip_without_its_exporter(case)
    row = run_case(case, "int8", tmp_path)
    assert row["qdq_problems"] == []
    assert row["qdq"]["quantized_ops"] > 0 and row["qdq"]["quantized_weights"] > 0
    assert row["constants_quantized_as_activations"] == []  # Wav2Vec2 had a conv weight in a Constant node
    assert row["qdq"]["per_channel_weights"] == row["qdq"]["quantized_weights"]
    assert row["held_out_error"] >= 0 and -1 <= row["held_out_cosine"] <= 1  # measured on rows never calibrated on
    if row["ok"]:
        assert row["parity_fp32"] < 1e-3
        assert row["agreement_error"] <= INT8_MAX_ERROR
        # Ran at a batch and sizes never built at (a wrong shape raises).  Random inputs, as the smoke parity's: INT8
        # fails there only on inf or NaN (a float mask's clipped noise is 0.96 of the scale on dict_output).
        assert np.isfinite(row["unseen"]["max_rel"])
        return
    # refused after the Q/DQ graph was written: by the agreement gate, or the smoke parity on the reference inputs
    assert row["refused_after"] in GATED_AFTER, row["error"]
    assert "CALIB" in row["fix"], row["fix"]


@pytest.mark.slow
def test_an_int8_refusal_is_a_row_with_the_gates_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The refusal path of the table, for real: the UNet (about 0.002 off on its calibration data) against a gate 20
    times stricter than its error is refused after the Q/DQ graph is written; the row carries the gate's number and
    cosine read back from the message, the diagnosis's sentence, the fix, and the graph's Q/DQ counts."""
    from trt_pipeline.pipeline.stages import parity

    monkeypatch.setattr(parity, "INT8_MAX_ERROR", 1e-4)
    row = run_case(CASES[NAMES.index("unet")], "int8", tmp_path)
    assert not row["ok"]
    assert row["refused_after"] in GATED_AFTER
    assert "departs from FP32 on the held-out calibration rows" in row["error"] and "(gate 0.0001" in row["error"]
    assert 1e-4 < row["agreement_error"] < INT8_MAX_ERROR and 0.99 < row["agreement_cosine"] <= 1.0
    assert "node" in row["error"].rsplit(";", 1)[-1]  # the diagnosis: the first node past it, or that none is
    assert "Settings(calib=" in row["fix"] and "diagnose" in row["fix"]
    assert row["qdq_problems"] == [] and row["qdq"]["quantized_ops"] > 0
    lines = table([row]).splitlines()
    assert "| refused after " in lines[2] and lines[-1].startswith(f"1. unet int8: {row['error']}. Fix: ")


@pytest.mark.slow
def test_calibration_ids_outside_the_vocabulary_are_refused_naming_the_lookup(tmp_path: Path):
    """Token ids of another vocabulary (BERT's here has 32 rows) are the user's mistake: refused while the data is
    read, naming the embedding lookup and the ids' range, not ONNX Runtime's "indices element out of data bounds"
    traceback from the calibration run."""

    def other_vocabulary(rng: np.random.Generator, rows: int) -> dict[str, np.ndarray]:
        arrays = bert_case.calibration(rng, rows)
        return {**arrays, "input_ids": arrays["input_ids"] + VOCABULARY}

    bert_case = CASES[NAMES.index("bert")]
    row = run_case(dataclasses.replace(bert_case, calibration=other_vocabulary), "int8", tmp_path)
    assert not row["ok"] and row["refused_after"] == "parity_fp32"  # before calibration: nothing half-made
    assert f"but the graph looks them up in a table of {VOCABULARY} rows" in row["error"]
    assert "word_embeddings" in row["error"] and f"give ids from 0 to {VOCABULARY - 1}" in row["fix"]


# The stages after which an INT8 refusal is a gate's (pipeline/stages/sequence.py run_precision): the smoke parity of a
# CPU graph on the reference inputs follows "int8", the agreement gate follows the last of those, the engine graph's
# smoke parity follows the agreement gate.
GATED_AFTER = ("int8", "parity_int8_onnxruntime_vnni", "parity_int8_onnxruntime_no_vnni", "agreement_int8")


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}"


def _pair(row: dict, prefix: str) -> str:
    """ "error / cosine" of an agreement measure, or nothing where the row has none."""
    if f"{prefix}_error" not in row:
        return ""
    return f"{row[f'{prefix}_error']:.3g} / {row[f'{prefix}_cosine']:.4f}"


def _unseen(row: dict) -> str:
    """ "max rel (axis=size, ...)" of the check at unseen sizes, or nothing where the row has none."""
    if "unseen" not in row:
        return ""
    sizes = ", ".join(f"{axis}={size}" for axis, size in row["unseen"]["sizes"].items())
    return _number(row["unseen"]["max_rel"]) + (f" ({sizes})" if sizes else "")


def table(rows: list[dict]) -> str:
    """Markdown: one line per row, then every refusal's whole message and fix."""
    lines = [
        "| model | precision | result | exporter | parity fp32 (max rel) | parity fp16 / int8 (max rel) | "
        f"unseen: batch {UNSEEN_BATCH}, other axis sizes (max rel) | "
        f"int8 vs fp32: error (gate {INT8_MAX_ERROR}) / cosine | held out: error / cosine | "
        "quantized ops / Q acts / DQ weights | "
        "FP32 nodes kept | s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    refusals: list[str] = []
    for row in rows:
        if row["ok"]:
            result = "pass"
        else:
            after = f" after {row['refused_after']}" if row["refused_after"] else ""
            result = f"refused{after} [{len(refusals) + 1}]"
            refusals.append(
                f"{len(refusals) + 1}. {row['model']} {row['precision']}: {row['error']}. Fix: {row['fix']}"
            )
        lower = row.get("parity_fp16") if row["precision"] == "fp16" else row.get("parity_int8")
        agreement, held_out = _pair(row, "agreement"), _pair(row, "held_out")
        qdq = row.get("qdq")
        counts = f"{qdq['quantized_ops']} / {qdq['quantized_activations']} / {qdq['quantized_weights']}" if qdq else ""
        if row.get("cpu_graphs_failed"):
            counts += f" (CPU graphs not made: {', '.join(row['cpu_graphs_failed'])})"
        kept = str(row["kept_fp32"]) if row["precision"] == "fp16" and row["ok"] else ""
        lines.append(
            f"| {row['model']} | {row['precision']} | {result} | {row.get('exporter', '')} | "
            f"{_number(row.get('parity_fp32'))} | {_number(lower)} | {_unseen(row)} | {agreement} | {held_out} | "
            f"{counts} | {kept} | {row['seconds']:.1f} |"
        )
    return "\n".join(lines + ([""] if refusals else []) + refusals)


def main() -> None:
    parser = argparse.ArgumentParser(description="the coverage table: every case in FP32, FP16 and INT8")
    parser.add_argument("--out", type=Path, help="write the markdown table here too")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here (every number, whole messages)")
    parser.add_argument("--models", help="comma-separated case names (default: all): " + ",".join(NAMES))
    parser.add_argument("--precisions", default="fp32,fp16,int8", help="comma-separated (default: %(default)s)")
    args = parser.parse_args()
    cases = [CASES[NAMES.index(name)] for name in args.models.split(",")] if args.models else CASES
    rows = []
    with tempfile.TemporaryDirectory(prefix="coverage.") as folder:
        for case in cases:
            for precision in args.precisions.split(","):
                rows.append(run_case(case, precision, Path(folder)))
                print(table(rows[-1:]).splitlines()[2], flush=True)
    text = table(rows)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
