"""Hugging Face transformers models as users hold them: a loaded model with the tokenizer's dict, or a folder.

Every model is a tiny config built here (nothing is downloaded); the tokenizer is a real BertTokenizer on a
vocabulary written by the test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from trt_pipeline import load_runner, models
from trt_pipeline.models.huggingface import (
    DECODER_SEQUENCE_AXIS,
    SEQUENCE_AXIS,
    WAVEFORM_AXIS,
    HuggingFaceModule,
)
from trt_pipeline.models.spec import DynamicAxis
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.settings import BatchProfile, Settings
from trt_pipeline.pipeline.stages.export import sample_inputs
from trt_pipeline.pipeline.stages.sequence import make_engine, run_stage

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
VOCABULARY = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", "a", "dog"]
MAX_POSITIONS = 64


def _tokenize(vocabulary_file: Path):
    """A real tokenizer's BatchEncoding (input_ids, token_type_ids, attention_mask: not forward()'s order)."""
    tokenizer = transformers.BertTokenizer(str(vocabulary_file))
    return tokenizer(["the cat sat", "a dog sat on the mat"], padding=True, return_tensors="pt")


def _vocabulary(tmp: Path) -> Path:
    path = tmp / "vocab.txt"
    path.write_text("\n".join(VOCABULARY))
    return path


def tiny_bert(**overrides):
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(VOCABULARY),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=MAX_POSITIONS,
        **overrides,
    )
    return transformers.BertModel(config)


def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=len(VOCABULARY), n_embd=32, n_layer=2, n_head=2, n_positions=MAX_POSITIONS
    )
    return transformers.GPT2Model(config)


ROBERTA_POSITIONS = 130  # a small config's position table (roberta-base: 514)


def mpt_with_dict():
    torch.manual_seed(0)
    config = transformers.MptConfig(
        vocab_size=len(VOCABULARY), d_model=32, n_layers=2, n_heads=2, max_seq_len=MAX_POSITIONS
    )
    ids = torch.tensor([[5, 6, 7, 8]])
    return transformers.MptModel(config), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def tiny_roberta():
    torch.manual_seed(0)
    config = transformers.RobertaConfig(
        vocab_size=len(VOCABULARY),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=ROBERTA_POSITIONS,
    )
    return transformers.RobertaModel(config)


# Factories as users write them (MODEL=tests.models.test_huggingface:<name>); the vocabulary goes in a temporary folder.
_VOCABULARY_DIR: list[Path] = []


def bert_with_tokenizer():
    return tiny_bert(), _tokenize(_VOCABULARY_DIR[0] / "vocab.txt")


def bert_with_hidden_states():
    return tiny_bert(output_hidden_states=True), _tokenize(_VOCABULARY_DIR[0] / "vocab.txt")


def llama_one_row():
    """A causal LM handed over with one row of token ids, as language models usually are."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(VOCABULARY), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=MAX_POSITIONS,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config), {"input_ids": torch.randint(0, len(VOCABULARY), (1, 8))}


def gpt2_with_dict():
    encoded = _tokenize(_VOCABULARY_DIR[0] / "vocab.txt")
    return tiny_gpt2(), {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


def roberta_as_loaded():
    """A RoBERTa handed over as loaded, with a batch of token ids (no padding) and its mask."""
    ids = torch.randint(3, len(VOCABULARY), (2, 8), generator=torch.Generator().manual_seed(0))
    return tiny_roberta(), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def bert_with_lists():
    encoded = transformers.BertTokenizer(str(_VOCABULARY_DIR[0] / "vocab.txt"))(["the cat"])  # no return_tensors
    return tiny_bert(), encoded


def bert_with_wrong_name():
    encoded = _tokenize(_VOCABULARY_DIR[0] / "vocab.txt")
    return tiny_bert(), {"ids": encoded["input_ids"]}


@pytest.fixture(autouse=True)
def vocabulary(tmp_path: Path):
    _VOCABULARY_DIR[:] = [tmp_path]
    return _vocabulary(tmp_path)


def test_bert_with_the_tokenizers_dict_is_bound_by_keyword_with_named_outputs_and_a_dynamic_sequence():
    spec = models.load_model("tests.models.test_huggingface:bert_with_tokenizer")
    assert isinstance(spec.module, HuggingFaceModule)
    assert list(spec.example_inputs) == ["input_ids", "attention_mask", "token_type_ids"]  # forward()'s order
    assert spec.output_names == ["last_hidden_state", "pooler_output"]
    axes = {name: axes[1] for name, axes in spec.dynamic_axes.items()}
    assert set(axes) == {"input_ids", "attention_mask", "token_type_ids"}
    assert {(a.name, a.min, a.opt, a.max) for a in axes.values()} == {(SEQUENCE_AXIS, 1, 8, MAX_POSITIONS)}
    # The wrapper computes what the model does when called by keyword.
    inner = spec.module.model.eval()
    encoded = dict(spec.example_inputs)
    with torch.no_grad():
        expected = inner(**encoded).last_hidden_state
        actual = spec.module(*encoded.values())["last_hidden_state"]
    torch.testing.assert_close(actual, expected)


# Hugging Face models as users hand them, through the dynamo exporter (EXPORTER=auto picks it past 1 GiB, so every
# large language model meets these): HuggingFaceModule's forward(*inputs) is one parameter to torch.export (the
# inputs' dynamic shapes go in as one tuple), and torch.export specializes a dimension whose example is 1 (Llama
# handed over with one row of token ids had its batch of 1 baked into the graph).
@pytest.mark.parametrize("factory", ["bert_with_tokenizer", "llama_one_row"])
def test_the_dynamo_exporter_takes_hugging_face_models_as_users_hand_them(factory: str, tmp_path: Path):
    pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript (the build extra)")
    settings = Settings(model=f"tests.models.test_huggingface:{factory}", exporter="dynamo", out_root=tmp_path)
    for stage in ("export", "check", "simplify", "parity"):
        folder = run_stage(settings, stage)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["exporter"] == "dynamo"
    assert manifest["parity_fp32"]["max_rel"] < 1e-3  # at every reference batch (1, 8, 32), the sequence dynamic


def test_gpt2_with_a_dict_runs_without_its_cache():
    spec = models.load_model("tests.models.test_huggingface:gpt2_with_dict")
    assert spec.output_names == ["last_hidden_state"]  # past_key_values is off, not an output
    assert spec.module.extra_arguments == {"use_cache": False}


def test_dynamic_replaces_the_default_sequence_axis_and_none_keeps_it_static():
    static = models.load_model("tests.models.test_huggingface:bert_with_tokenizer", dynamic="none")
    assert static.dynamic_axes == {}
    custom = models.load_model("tests.models.test_huggingface:bert_with_tokenizer", dynamic="input_ids:1=4:8:16")
    assert list(custom.dynamic_axes) == ["input_ids"]
    assert custom.dynamic_axes["input_ids"][1].max == 16


def test_tokenizer_output_without_tensors_is_a_clear_error():
    with pytest.raises(PipelineError) as error:
        models.load_model("tests.models.test_huggingface:bert_with_lists")
    assert "BatchEncoding of list" in error.value.problem
    assert "return_tensors='pt'" in (error.value.fix or "")


def test_an_input_forward_does_not_take_is_refused():
    with pytest.raises(PipelineError) as error:
        models.load_model("tests.models.test_huggingface:bert_with_wrong_name")
    assert "['ids']" in error.value.problem and "BertModel.forward" in error.value.problem


@pytest.mark.parametrize(
    ("factory", "longest"),
    [
        ("bert_with_tokenizer", MAX_POSITIONS),
        ("gpt2_with_dict", MAX_POSITIONS),
        ("roberta_as_loaded", ROBERTA_POSITIONS - 2),  # positions count from its padding index (1) + 1
        ("mpt_with_dict", MAX_POSITIONS),  # its config's max_seq_len: its ALiBi bias is built that long
    ],
)
def test_the_default_sequence_range_ends_at_the_longest_sequence_the_model_embeds(factory: str, longest: int):
    spec = models.load_model(f"tests.models.test_huggingface:{factory}")
    assert {axes[1].max for axes in spec.dynamic_axes.values()} == {longest}
    model = spec.module.model.eval()

    def run(length: int) -> None:
        ids = torch.full((1, length), 5)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=torch.ones_like(ids), **spec.module.extra_arguments)

    run(longest)
    with pytest.raises((IndexError, RuntimeError)):  # one more has no position to embed: the range is the longest
        run(longest + 1)


def test_a_folders_tokenizer_config_bounds_the_sequence_range_and_is_in_the_fingerprint(tmp_path: Path):
    folder = tmp_path / "tiny-roberta"
    tiny_roberta().save_pretrained(folder)
    assert models.load_model(str(folder)).dynamic_axes["input_ids"][1].max == ROBERTA_POSITIONS - 2
    unset = models.load_model(str(folder)).fingerprint
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": int(1e30)}))  # saved unset
    assert models.load_model(str(folder)).dynamic_axes["input_ids"][1].max == ROBERTA_POSITIONS - 2
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 40}))
    spec = models.load_model(str(folder))
    assert spec.dynamic_axes["input_ids"][1].max == 40
    assert spec.fingerprint != unset


@pytest.mark.slow
def test_bert_from_the_tokenizers_dict_builds_an_fp16_engine(tmp_path: Path):
    settings = Settings(
        model="tests.models.test_huggingface:bert_with_tokenizer",
        precision="fp16",
        batch=BatchProfile(1, 2, 4),
        out_root=tmp_path / "engines",
        builder="tensorrt_rtx",
    )
    folder = make_engine(settings)
    from trt_pipeline.pipeline.folder.layout import MANIFEST

    manifest = json.loads((folder / MANIFEST).read_text())  # as written on disk
    assert [i["name"] for i in manifest["inputs"]] == ["input_ids", "attention_mask", "token_type_ids"]
    assert all(i["shape"] == ["batch", SEQUENCE_AXIS] for i in manifest["inputs"])
    assert [o["name"] for o in manifest["outputs"]] == ["last_hidden_state", "pooler_output"]
    assert manifest["axis_ranges"] == {SEQUENCE_AXIS: [1, 8, MAX_POSITIONS]}
    assert manifest["parity_fp16"]["max_rel"] < 3e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_folder_saved_in_half_precision_builds_from_float32_and_serves(tmp_path: Path, dtype: torch.dtype):
    """Hub folders are mostly saved in bfloat16 or float16, and transformers loads them as saved: the reference stopped
    at a traceback (numpy holds no bfloat16), and a float16 model.onnx failed FP32 parity."""
    folder = tmp_path / "tiny-bert"
    tiny_bert().to(dtype).save_pretrained(folder)
    settings = Settings(model=str(folder), precision="fp16", batch=BatchProfile(1, 2, 4), out_root=tmp_path / "out")
    built = make_engine(settings)
    spec = models.load_model(str(folder))
    assert {tensor.dtype for tensor in spec.module.parameters()} == {torch.float32}
    assert any("widened to float32" in note for note in spec.notes)
    ids = torch.randint(0, len(VOCABULARY), (3, 7))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    with torch.no_grad():
        expected = spec.module.eval()(*inputs.values())["last_hidden_state"].numpy()
    with load_runner(built, "onnxruntime") as runner:
        served = runner.infer({name: tensor.numpy() for name, tensor in inputs.items()})["last_hidden_state"]
    assert abs(served - expected).max() < 1e-2  # the float16 graph against the widened model, rows it never saw


def test_a_generating_encoder_decoder_folder_takes_the_tokens_so_far_and_greedy_decoding_matches_generate(tmp_path):
    """T5, BART, Marian, Whisper ...ForConditionalGeneration: the decoder reads the tokens generated so far, which
    no input derived gave it (T5: "You must specify exactly one of input_ids or inputs_embeds").  They get their own
    axis, and a service decoding greedily through the served graph, one whole pass a token, writes what generate()
    writes."""
    folder = tmp_path / "tiny-t5"
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=len(VOCABULARY), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=2, decoder_start_token_id=2
    )  # from 2, this random model's greedy tokens differ by row (from 0, every one is 0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    model.save_pretrained(folder)
    spec = models.load_model(str(folder))
    assert list(spec.example_inputs) == ["input_ids", "attention_mask", "decoder_input_ids"]
    assert spec.dynamic_axes["decoder_input_ids"][1].name == DECODER_SEQUENCE_AXIS
    assert spec.dynamic_axes["input_ids"][1].name == SEQUENCE_AXIS
    settings = Settings(model=str(folder), precision="fp32", batch=BatchProfile(1, 2, 4), out_root=tmp_path / "out")
    built = make_engine(settings)
    ids = torch.tensor([[5, 9, 3, 7, 11, 1], [4, 4, 8, 1, 0, 0]])  # rows the build never drew, one padded
    mask = (ids != 0).long()
    greedy = transformers.GenerationConfig(max_new_tokens=5, do_sample=False, num_beams=1, eos_token_id=None)
    expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=greedy)
    decoded = np.full((2, 1), config.decoder_start_token_id, np.int64)
    with load_runner(built, "onnxruntime") as runner:
        for _ in range(5):
            feed = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "decoder_input_ids": decoded}
            logits = runner.infer(feed)["logits"]
            decoded = np.concatenate([decoded, logits[:, -1].argmax(-1)[:, None]], axis=1)
        final = runner.infer({**feed, "decoder_input_ids": decoded})["logits"]
    np.testing.assert_array_equal(decoded, expected.numpy())
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask, decoder_input_ids=torch.from_numpy(decoded)).logits
    np.testing.assert_allclose(final, reference.numpy(), atol=1e-4)


def test_an_image_to_text_folder_takes_images_of_its_encoders_size_and_the_tokens_so_far(tmp_path: Path):
    """A VisionEncoderDecoderModel (TrOCR's, Donut's form) keeps the image size in its encoder's config: the folder
    was refused for want of an image size."""
    config = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(
        transformers.ViTConfig(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32,
            patch_size=8,
        ),
        transformers.BertConfig(
            vocab_size=len(VOCABULARY), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=MAX_POSITIONS, is_decoder=True, add_cross_attention=True,
        ),
    )  # fmt: skip
    transformers.VisionEncoderDecoderModel(config).save_pretrained(tmp_path / "ocr")
    spec = models.load_model(str(tmp_path / "ocr"))
    assert {name: list(tensor.shape) for name, tensor in spec.example_inputs.items()} == {
        "pixel_values": [2, 3, 32, 32],
        "decoder_input_ids": [2, 8],
    }
    assert spec.dynamic_axes == {"decoder_input_ids": {1: DynamicAxis(DECODER_SEQUENCE_AXIS, 1, 8, MAX_POSITIONS)}}


def test_an_image_model_that_reads_text_too_takes_images_and_token_ids(tmp_path: Path):
    """BLIP's captioner (the caption so far) and OWL-ViT's detector (text queries) take images and token ids: both
    folders were refused, BLIP's for want of an image size its vision config gives without a channel count."""
    text = {"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    text |= {"intermediate_size": 64, "max_position_embeddings": 16}
    vision = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
    vision |= {"image_size": 32, "patch_size": 8}
    blip = transformers.BlipConfig(text_config={**text, "encoder_hidden_size": 32}, vision_config=vision)
    transformers.BlipForConditionalGeneration(blip).save_pretrained(tmp_path / "blip")
    owl = transformers.OwlViTConfig(text_config=text, vision_config=vision, projection_dim=32)
    transformers.OwlViTForObjectDetection(owl).save_pretrained(tmp_path / "owl")
    for folder in ("blip", "owl"):
        spec = models.load_model(str(tmp_path / folder))
        shapes = {name: list(tensor.shape) for name, tensor in spec.example_inputs.items()}
        assert shapes == {"pixel_values": [2, 3, 32, 32], "input_ids": [2, 16], "attention_mask": [2, 16]}, folder
        assert spec.dynamic_axes["input_ids"] == {1: DynamicAxis(SEQUENCE_AXIS, 1, 16, 16)}, folder


def _hub_cache(cache: Path, name: str, saved: Path) -> None:
    """The Hugging Face cache as huggingface_hub leaves it after fetching `name`: the files in a snapshot that
    refs/main names."""
    repository = cache / f"models--{name.replace('/', '--')}"
    snapshot = repository / "snapshots" / ("0" * 40)
    shutil.copytree(saved, snapshot)
    (repository / "refs").mkdir()
    (repository / "refs" / "main").write_text("0" * 40)


def test_a_hub_name_is_fetched_into_the_cache_and_built_as_its_folder(tmp_path: Path):
    """MODEL=owner/name, as optimum and the Hub's pages name a model: read offline from a cache holding it (no network
    here), and a name the Hub cannot give is one error naming both readings of the text."""
    tiny_bert().to(torch.bfloat16).save_pretrained(tmp_path / "saved")
    _hub_cache(tmp_path / "cache", "trt-test/tiny-bert", tmp_path / "saved")
    environment = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}

    def export(name: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "trt_pipeline", "export", "--model", name, "--out", str(tmp_path / "out")]
        return subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300)

    built = export("trt-test/tiny-bert")
    assert built.returncode == 0, built.stderr
    graph = onnx.load(str(tmp_path / "out" / "tiny-bert-fp16" / "model.onnx")).graph
    assert [entry.name for entry in graph.input] == ["input_ids", "attention_mask", "token_type_ids"]
    missing = export("trt-test/no-such-model")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "is no file or folder here, and fetching it from the Hugging Face Hub failed" in missing.stderr


# The transformers architectures tests/end_to_end/test_coverage.py covers (its CASES give some a DYNAMIC=), and RoBERTa:
# the longest size of each axis the loader gives by default: a token model's sequence, a speech model's waveform
# (its encoder's receptive field, 20 samples, and 2047 frames of 10 past it: 2048 frames).
WAVEFORM = {WAVEFORM_AXIS: 20 + 2047 * 10}
DEFAULT_AXES = {
    "tests.end_to_end.test_coverage:bert": {SEQUENCE_AXIS: 32},
    "tests.end_to_end.test_coverage:distilbert": {SEQUENCE_AXIS: 32},
    "tests.end_to_end.test_coverage:gpt2": {SEQUENCE_AXIS: 32},
    "tests.end_to_end.test_coverage:t5_encoder": {SEQUENCE_AXIS: 512},  # relative positions: no limit, the default
    "tests.end_to_end.test_coverage:bart": {SEQUENCE_AXIS: 32, DECODER_SEQUENCE_AXIS: 32},  # the tokens so far
    "tests.end_to_end.test_coverage:llama": {SEQUENCE_AXIS: 32},
    "tests.models.test_huggingface:roberta_as_loaded": {SEQUENCE_AXIS: ROBERTA_POSITIONS - 2},
    "tests.end_to_end.test_coverage:vit": {},
    "tests.end_to_end.test_coverage:swin": {},
    "tests.end_to_end.test_coverage:beit": {},
    "tests.end_to_end.test_coverage:segformer": {},
    "tests.end_to_end.test_coverage:wav2vec2": WAVEFORM,
    "tests.end_to_end.test_coverage:hubert": WAVEFORM,
    "tests.end_to_end.test_coverage:whisper_encoder": {},
}


@pytest.mark.slow
@pytest.mark.parametrize("model", list(DEFAULT_AXES), ids=lambda model: model.split(":")[1])
def test_every_covered_architecture_builds_with_the_defaults_alone(model: str, tmp_path: Path):
    """No DYNAMIC=: the axis the loader gives token inputs or a waveform runs in PyTorch and ONNX Runtime at its
    longest (the reference and the check run it there) and TensorRT-RTX builds its profile."""
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed: pip install tensorrt-rtx-cu13")
    from trt_pipeline.pipeline.folder.manifest import MANIFEST

    settings = Settings(
        model=model, precision="fp32", batch=BatchProfile(1, 2, 4), out_root=tmp_path, builder="tensorrt_rtx"
    )
    folder = make_engine(settings)
    manifest = json.loads((folder / MANIFEST).read_text())  # as written on disk
    assert {name: bounds[2] for name, bounds in manifest["axis_ranges"].items()} == DEFAULT_AXES[model]
    assert manifest["build"]["engine_bytes"] > 0


# ---------------------------------------------------------------- a save_pretrained folder


@pytest.mark.parametrize("safe_serialization", [True, False], ids=["safetensors", "bin"])
def test_a_save_pretrained_folder_loads_with_derived_token_inputs(tmp_path: Path, safe_serialization: bool):
    folder = tmp_path / "tiny-bert"
    model = transformers.BertForSequenceClassification(tiny_bert().config)
    model.save_pretrained(folder, safe_serialization=safe_serialization)
    spec = models.load_model(str(folder))
    assert spec.name == "tiny-bert"
    assert isinstance(spec.module.model, transformers.BertForSequenceClassification)  # config's architectures
    assert list(spec.example_inputs) == ["input_ids", "attention_mask", "token_type_ids"]  # forward()'s order
    assert spec.output_names == ["logits"]
    with torch.no_grad():  # eval mode: prepare's job in the pipeline
        expected = model.eval()(**spec.example_inputs).logits
        actual = spec.module.eval()(*spec.example_inputs.values())["logits"]
    torch.testing.assert_close(actual, expected)


def test_a_folders_reference_masks_tokens_so_every_gate_sees_padding(tmp_path: Path):
    """The reference's masks are drawn within the derived mask's values: with a mask of ones alone, no gate and no
    host check would ever see a masked token.  The segments likewise: each token's is drawn."""
    folder = tmp_path / "tiny-bert"
    tiny_bert().save_pretrained(folder)
    spec = models.load_model(str(folder))
    drawn = sample_inputs(spec, 8, seed=0)
    assert set(drawn["attention_mask"].unique().tolist()) == set(drawn["token_type_ids"].unique().tolist()) == {0, 1}


@pytest.mark.parametrize(("segments", "derived"), [(2, ["input_ids", "token_type_ids"]), (1, ["input_ids"])])
def test_a_folder_with_segment_embeddings_takes_the_token_type_ids(tmp_path: Path, segments: int, derived: list):
    """A cross-encoder (a reranker) scores a sentence pair by its segments: a graph without the input would fix them
    at 0 and score the pair as one sentence.  A model with one segment (RoBERTa's family) has nothing to take."""
    folder = tmp_path / "tiny-bert"
    tiny_bert(type_vocab_size=segments).save_pretrained(folder)
    spec = models.load_model(str(folder))
    assert [name for name in spec.example_inputs if name != "attention_mask"] == derived


def test_a_sequence_range_left_off_the_token_type_ids_names_them_in_the_fix(tmp_path: Path):
    """DYNAMIC declared on the ids and the mask alone (as for a DistilBERT): the segments stay at their example's
    length, PyTorch refuses the sizes, and the fix names the input to declare with the range to give it."""
    folder = tmp_path / "tiny-bert"
    tiny_bert().save_pretrained(folder)
    dynamic = "input_ids:1=1:16:32,attention_mask:1=1:16:32"
    settings = Settings(model=str(folder), batch=BatchProfile(1, 2, 4), out_root=tmp_path, dynamic=dynamic)
    with pytest.raises(PipelineError) as error:
        run_stage(settings, "export")
    assert (error.value.fix or "").startswith("declare the range on token_type_ids:1=1:16:32 too")


def test_the_folders_weights_are_in_the_fingerprint(tmp_path: Path):
    folder = tmp_path / "tiny-bert"
    tiny_bert().save_pretrained(folder)
    before = models.load_model(str(folder)).fingerprint
    torch.manual_seed(1)
    transformers.BertModel(tiny_bert().config).save_pretrained(folder)
    assert models.load_model(str(folder)).fingerprint != before


def _segformer_folder(folder: Path, processor: dict | None) -> Path:
    """A tiny SegFormer as save_pretrained writes it (its config has no image_size: any size runs), with the image
    processor's config a folder from the Hub holds beside it."""
    config = transformers.SegformerConfig(num_labels=3, hidden_sizes=[8, 16, 24, 32], decoder_hidden_size=16)
    transformers.SegformerForSemanticSegmentation(config).save_pretrained(folder)
    if processor is not None:
        (folder / "preprocessor_config.json").write_text(json.dumps(processor))
    return folder


@pytest.mark.parametrize(
    ("processor", "size"),
    [
        ({"do_resize": True, "size": {"height": 48, "width": 40}}, (48, 40)),
        ({"size": {"shortest_edge": 64}, "do_center_crop": True, "crop_size": {"height": 32, "width": 32}}, (32, 32)),
    ],
    ids=["resized", "cropped"],
)
def test_a_folder_of_a_model_of_any_image_size_takes_the_size_its_image_processor_gives(tmp_path, processor, size):
    folder = _segformer_folder(tmp_path / "segformer", processor)
    spec = models.load_model(str(folder))
    assert spec.example_inputs["pixel_values"].shape == (2, 3, *size)
    assert folder / "preprocessor_config.json" in models.huggingface.folder_sources(folder)  # in the fingerprint


def test_a_configs_image_size_as_height_and_width_sizes_the_example_images(tmp_path: Path):
    """YOLOS's config gives [height, width]."""
    config = transformers.YolosConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=[64, 96]
    )
    transformers.YolosForObjectDetection(config).save_pretrained(tmp_path / "yolos")
    spec = models.load_model(str(tmp_path / "yolos"))
    assert spec.example_inputs["pixel_values"].shape == (2, 3, 64, 96)


def _speech_folder(folder: Path, sampling_rate: int | None) -> Path:
    """A tiny wav2vec2 CTC model: a convolutional feature encoder of kernels 10, 3 and strides 5, 2 (a frame sees 10
    + 2 x 5 = 20 samples, and frames are 10 apart)."""
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        vocab_size=20,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=[16, 16],
        conv_stride=[5, 2],
        conv_kernel=[10, 3],
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
    )
    transformers.Wav2Vec2ForCTC(config).save_pretrained(folder)
    if sampling_rate is not None:
        (folder / "preprocessor_config.json").write_text(json.dumps({"sampling_rate": sampling_rate}))
    return folder


@pytest.mark.parametrize(("sampling_rate", "longest"), [(None, 16000 * 30), (100, 100 * 30)])
def test_a_speech_folder_takes_a_second_of_waveform_over_a_range_its_encoder_takes(tmp_path, sampling_rate, longest):
    """One second at its feature extractor's sampling rate (16 kHz where it gives none), from the encoder's receptive
    field to 30 s or 2048 frames, whichever is shorter; each end runs in PyTorch."""
    from trt_pipeline.models.huggingface import DEFAULT_SEQUENCE_CAP

    spec = models.load_model(str(_speech_folder(tmp_path / "w2v", sampling_rate)))
    one_second = sampling_rate or 16000
    assert spec.example_inputs["input_values"].shape == (2, one_second)
    axis = spec.dynamic_axes["input_values"][1]
    assert (axis.min, axis.opt, axis.max) == (20, one_second, min(longest, 20 + (DEFAULT_SEQUENCE_CAP - 1) * 10))
    with torch.no_grad():
        for samples in (axis.min, axis.max):
            assert spec.module.eval()(torch.zeros(1, samples))["logits"].shape[1] >= 1


def test_a_spectrogram_models_folder_takes_the_spectrogram_its_config_sizes(tmp_path: Path):
    """AST's input_values are max_length frames of num_mel_bins; Whisper's input_features num_mel_bins by twice its
    max_source_positions frames (its encoder's strided convolution halves them): fixed sizes, no extra axis."""
    small = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
    transformers.ASTForAudioClassification(
        transformers.ASTConfig(**small, max_length=64, num_mel_bins=32)
    ).save_pretrained(tmp_path / "ast")
    whisper = transformers.WhisperConfig(
        d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, decoder_layers=1,
        decoder_attention_heads=2, decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=50, vocab_size=100,
    )  # fmt: skip
    transformers.WhisperForAudioClassification(whisper).save_pretrained(tmp_path / "whisper")
    ast, whisper_spec = models.load_model(str(tmp_path / "ast")), models.load_model(str(tmp_path / "whisper"))
    assert ast.example_inputs["input_values"].shape == (2, 64, 32) and not ast.dynamic_axes
    assert whisper_spec.example_inputs["input_features"].shape == (2, 16, 100) and not whisper_spec.dynamic_axes
    # The whole model transcribes: its decoder reads the tokens so far, up to its max_target_positions.
    whisper.update({"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1})
    transformers.WhisperForConditionalGeneration(whisper).save_pretrained(tmp_path / "whisper-whole")
    whole = models.load_model(str(tmp_path / "whisper-whole"))
    assert list(whole.example_inputs) == ["input_features", "decoder_input_ids"]
    assert whole.dynamic_axes == {"decoder_input_ids": {1: DynamicAxis(DECODER_SEQUENCE_AXIS, 1, 8, 448)}}


@pytest.mark.parametrize(
    "processor", [None, {"size": {"shortest_edge": 64}}, {"do_resize": False, "size": {"height": 48, "width": 40}}]
)
def test_a_folder_whose_image_size_nothing_gives_names_where_it_is_read_and_asks_for_input_shape(tmp_path, processor):
    folder = _segformer_folder(tmp_path / "segformer", processor)
    with pytest.raises(PipelineError) as error:
        models.load_model(str(folder))
    assert "preprocessor_config.json (crop_size, or size as height and width)" in error.value.problem
    assert "input_shape as DIMS without the batch" in (error.value.fix or "")
    spec = models.load_model(str(folder), input_shape="3x64x64")  # as the fix says: the one input is pixel_values
    assert list(spec.example_inputs) == ["pixel_values"] and spec.example_inputs["pixel_values"].shape[1:] == (
        3,
        64,
        64,
    )


def test_a_text_image_folder_takes_token_ids_and_images_and_its_text_towers_longest_sequence(tmp_path: Path):
    """CLIP: the main input is token ids, forward() takes images too (of its vision config's size), and the longest
    sequence is its text config's (the top-level config has none: the default 512 failed at export)."""
    text = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
    config = transformers.CLIPConfig(
        text_config={**text, "vocab_size": 100, "max_position_embeddings": 24},
        vision_config={**text, "image_size": 32, "patch_size": 8},
        projection_dim=16,
    )
    transformers.CLIPModel(config).save_pretrained(tmp_path / "clip")
    spec = models.load_model(str(tmp_path / "clip"))
    assert {name: tuple(value.shape) for name, value in spec.example_inputs.items()} == {
        "input_ids": (2, 16),
        "pixel_values": (2, 3, 32, 32),
        "attention_mask": (2, 16),
    }
    assert {axes[1].max for axes in spec.dynamic_axes.values()} == {24}


def test_a_folder_without_weights_or_config_names_the_form(tmp_path: Path):
    folder = tmp_path / "no-weights"
    tiny_bert().config.save_pretrained(folder)
    with pytest.raises(PipelineError) as error:
        models.load_model(str(folder))
    assert "no weights" in error.value.problem and "model.safetensors" in (error.value.fix or "")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(PipelineError) as error:
        models.load_model(str(empty))
    assert "without config.json" in error.value.problem and "pytorch_model.bin" in (error.value.fix or "")


def test_hidden_states_a_tuple_in_the_output_are_outputs_named_by_their_place(vocabulary):
    """ModelOutput.hidden_states is a tuple (embeddings, then each layer): each is an output, hidden_states.<i>."""
    spec = models.load_model("tests.models.test_huggingface:bert_with_hidden_states")
    layers = [f"hidden_states.{i}" for i in range(3)]  # the embeddings and 2 layers
    assert spec.output_names == ["last_hidden_state", "pooler_output", *layers]
    with torch.inference_mode():
        outputs = spec.module(*spec.example_inputs.values())
    assert list(outputs) == spec.output_names and outputs["hidden_states.2"].shape == outputs["last_hidden_state"].shape


def test_a_models_very_long_sequence_is_left_to_dynamic_with_a_note():
    """A default range to a config's 131072 positions (Mistral's) ran the reference at 131072 tokens: the build was
    killed for memory.  The range stops at DEFAULT_SEQUENCE_CAP, and the note gives the DYNAMIC for the rest."""
    from trt_pipeline.models.huggingface import DEFAULT_SEQUENCE_CAP

    spec = models.load_model("tests.models.test_huggingface:long_context_bert")
    assert {axes[1].max for axes in spec.dynamic_axes.values()} == {DEFAULT_SEQUENCE_CAP}
    assert any("input_ids:1=1:" in note and f":{LONG_CONTEXT}" in note for note in spec.notes), spec.notes


LONG_CONTEXT = 131072


def long_context_bert():
    model = tiny_bert()
    model.config.max_position_embeddings = LONG_CONTEXT  # the table stays small: only the range is derived from it
    ids = torch.tensor([[5, 6, 7, 8]])
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _bart_classifier_folder(folder: Path) -> Path:
    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32, num_labels=3,
    )  # fmt: skip
    transformers.BartForSequenceClassification(config).save_pretrained(folder)
    return folder


def test_a_classifier_that_reads_each_rows_eos_is_built_and_served_from_its_folder(tmp_path: Path):
    """BART's classifier (zero-shot's bart-large-mnli) reads each row's state at its EOS and refuses a batch whose
    rows hold different counts of it: ids drawn at random over the EOS's value stopped the reference.  The derived ids
    stay clear of the special ones and end with the EOS, and every draw keeps it there."""
    folder = _bart_classifier_folder(tmp_path / "bart-mnli")
    ids = models.load_model(str(folder)).example_inputs["input_ids"]
    assert (ids[:, -1] == 2).all() and ids[:, :-1].min() >= 3  # bos 0, pad 1, eos 2
    settings = Settings(model=str(folder), precision="fp32", batch=BatchProfile(1, 2, 4), out_root=tmp_path / "e")
    built = make_engine(settings)
    model = transformers.BartForSequenceClassification.from_pretrained(folder).eval()
    rows = torch.tensor([[0, 5, 6, 7, 2, 1], [0, 9, 10, 11, 12, 2]])  # padded on the right, one EOS each
    with torch.no_grad():
        expected = model(input_ids=rows, attention_mask=(rows != 1).long()).logits.numpy()
    with load_runner(built, "onnxruntime") as runner:
        served = runner.infer({"input_ids": rows.numpy(), "attention_mask": (rows != 1).long().numpy()})["logits"]
    assert abs(served - expected).max() < 1e-4
