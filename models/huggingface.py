"""Hugging Face `transformers` models as users hold them: a loaded model and the tokenizer's dict, or a folder.

`adapt(spec)` turns a spec whose module is a `transformers.PreTrainedModel` into one the pipeline exports:
  - the inputs are bound by keyword to the model's forward() (a tokenizer's dict is in its own order);
  - the key/value cache is off (`use_cache=False`): a cache is not a tensor the graph can return;
  - the outputs are the ModelOutput's tensors by name (`last_hidden_state`, `pooler_output`, `logits`, ...);
    a model that returns a plain tuple (`return_dict=False` in its config) gets output_0, output_1, ...;
  - 2-D integer inputs (token ids, attention masks) get one shared dynamic sequence axis by default,
    from 1 to the longest sequence the model takes (max_sequence_length: the config's maximum, what its position
    embeddings can embed, a folder's tokenizer_config.json model_max_length), at most DEFAULT_SEQUENCE_CAP (a
    note says so); a generating encoder-decoder's decoder inputs (decoder_input_ids: the tokens so far) get their
    own, DECODER_SEQUENCE_AXIS; DYNAMIC= replaces them;
    DYNAMIC=none keeps every axis static.

A local folder (MODEL=path/to/folder) is the form `save_pretrained` writes: `config.json` and the weights as
`model.safetensors` (or sharded `model-0000x-of-0000y.safetensors` with an index) or `pytorch_model.bin`.
The class is the config's `architectures[0]` (else AutoModel); code in the folder is never run.

`transformers` is an optional dependency (`pip install '.[hf]'`): nothing here imports it unless a
model needs it.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeGuard

import torch
from torch import nn

from ..pipeline.core.errors import PipelineError
from ..pipeline.core.settings import mention, mention_name
from .inputs import SINGLE_INPUT_NAME
from .spec import DynamicAxis, ModelSpec, forward_parameters, named_outputs

SEQUENCE_AXIS = "sequence"
DECODER_SEQUENCE_AXIS = "decoder_sequence"  # a generating encoder-decoder's decoder inputs: the tokens so far
# When the config names no maximum length (T5's relative positions): a common encoder limit.
DEFAULT_MAX_SEQUENCE = 512
# The default sequence range ends here even where the model takes longer: the reference and every gate run a batch at
# the range's top, in eager attention, whose scores grow with its square (a Mistral config's 131072 positions: 275 GB
# for two rows of two heads, and the build was killed for memory with no message).  DYNAMIC= widens it.
DEFAULT_SEQUENCE_CAP = 2048
WAVEFORM_AXIS = "samples"
# A raw waveform's default range ends at this many seconds: Whisper's window, the chunk speech pipelines cut long audio
# into.  Its opt is one second, the derived example's length.
LONGEST_AUDIO_S = 30
DEFAULT_SAMPLING_RATE = 16000  # wav2vec2's family, where a folder's feature extractor gives none
# The config fields that give a model's longest input, by family (max_seq_len: MPT's).
MAX_LENGTH_FIELDS = ("max_position_embeddings", "n_positions", "max_source_positions", "n_ctx", "max_seq_len")
CONFIG_FILE = "config.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # its model_max_length bounds the default sequence axis
# Its crop_size (or size as a height and width) sizes the example images where config.json has no image_size: a
# SegFormer's or DETR's config has none (any size runs), but a folder from the Hub holds the image processor's.
PREPROCESSOR_CONFIG_FILE = "preprocessor_config.json"
WEIGHT_FORMS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
FOLDER_FORM = (
    "a folder as save_pretrained writes it: config.json and the weights as model.safetensors "
    "(or a sharded model.safetensors.index.json) or pytorch_model.bin"
)
INSTALL_FIX = "install the Hugging Face extra: pip install 'trt-pipeline[hf]' (or pip install transformers)"


def is_transformers_model(module: Any) -> bool:
    """A `transformers.PreTrainedModel`; False without importing transformers when the user never did."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(module, transformers.PreTrainedModel)


class HuggingFaceModule(nn.Module):
    """A transformers model called by keyword with its cache off, returning its tensors by name.

    forward() takes the inputs by position in `input_names` order (the graph's input order), so every
    caller (export, the reference, the torch runner) binds them the same way.
    """

    def __init__(self, model: nn.Module, input_names: list[str], output_names: list[str]) -> None:
        super().__init__()
        self.model = model
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.extra_arguments = cache_off_arguments(model)

    def forward(self, *inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        result = self.model(**dict(zip(self.input_names, inputs, strict=True)), **self.extra_arguments)
        named = tensor_outputs(result)
        return {name: named[name] for name in self.output_names}


def cache_off_arguments(model: nn.Module) -> dict[str, Any]:
    """`use_cache=False` where forward() takes it by name (passing it through **kwargs could reach a layer
    that does not know it)."""
    names = forward_parameters(model) or []
    return {"use_cache": False} if "use_cache" in names else {}


def tensor_outputs(result: Any) -> dict[str, torch.Tensor]:
    """The tensors of a ModelOutput by name, a tuple of them (hidden states, attentions) as name.0, name.1, ...
    (spec.named_outputs); None fields are absent from it, and fields that hold something besides
    tensors (a cache) are left out.  A tuple's tensors are output_0, output_1, ..."""
    if isinstance(result, torch.Tensor):
        return {"output": result}
    if isinstance(result, Mapping):
        fields = {str(key): value for key, value in result.items()}
    elif isinstance(result, (tuple, list)):
        fields = {f"output_{i}": value for i, value in enumerate(result)}
    else:
        return {}
    return {name: tensor for key, value in fields.items() for name, tensor in _servable(key, value)}


def _servable(key: str, value: Any) -> list[tuple[str, torch.Tensor]]:
    try:
        return named_outputs({key: value})
    except PipelineError:  # not tensors all the way down: nothing a graph returns
        return []


def adapt(spec: ModelSpec, model: str, *, dynamic_given: bool) -> ModelSpec:
    """The spec with its transformers model wrapped in HuggingFaceModule (see the module docstring)."""
    inner = spec.module
    inputs = _bind_by_keyword(inner, spec.example_inputs, model)
    with torch.no_grad():
        was_training = inner.training
        inner.eval()
        try:
            result = inner(**inputs, **cache_off_arguments(inner))
        except Exception as error:  # the user's model: any failure on its own inputs is theirs to see
            raise PipelineError(
                f"{mention(model=model)}: the transformers model {type(inner).__name__} does not run on its example "
                f"inputs ({', '.join(f'{n} {list(t.shape)}' for n, t in inputs.items())}): "
                f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}",
                "give the tokenizer's output for a sample (return_tensors='pt'), or "
                f"{mention_name('input_shape')} with the model's input names",
            ) from None
        finally:
            inner.train(was_training)
    outputs = tensor_outputs(result)
    if not outputs:
        raise PipelineError(
            f"{mention(model=model)}: {type(inner).__name__} returned no tensors (a {type(result).__name__})",
            "wrap the model in an nn.Module whose forward() returns the tensors to serve",
        )
    names = list(spec.output_names or outputs)
    unknown = [name for name in names if name not in outputs]
    if unknown:
        raise PipelineError(
            f"{mention(model=model)}: output names {unknown} are not outputs of {type(inner).__name__}",
            f"name outputs among {', '.join(outputs)}",
        )
    spec.module = HuggingFaceModule(inner, list(inputs), names)
    spec.example_inputs = inputs
    spec.output_names = names
    if not dynamic_given and not spec.dynamic_axes:
        spec.dynamic_axes = _default_axes(spec, inner, inputs)
    spec.notes.append(
        f"{type(inner).__name__} (transformers): called by keyword with "
        f"{', '.join(f'{k}={v}' for k, v in cache_off_arguments(inner).items()) or 'its defaults'}; "
        f"outputs {', '.join(names)}"
    )
    return spec


def _default_axes(spec: ModelSpec, model: nn.Module, inputs: dict[str, torch.Tensor]) -> dict:
    """A raw waveform's axis (waveform_axes), else the token inputs' shared sequence (token_sequence_axes) up to the
    longest the model takes, at most DEFAULT_SEQUENCE_CAP (noted in `spec` where the model takes longer)."""
    waveform = waveform_axes(model, inputs, processor_sampling_rate(model))
    if waveform:
        return waveform
    longest = max_sequence_length(model, tokenizer_limit(model))
    decoder_longest = _decoder_limit(model) or longest
    axes = token_sequence_axes(inputs, min(longest, DEFAULT_SEQUENCE_CAP), min(decoder_longest, DEFAULT_SEQUENCE_CAP))
    for name, top in ((SEQUENCE_AXIS, longest), (DECODER_SEQUENCE_AXIS, decoder_longest)):
        capped = {input_name: axes_of for input_name, axes_of in axes.items() if axes_of[1].name == name}
        if top > DEFAULT_SEQUENCE_CAP and capped:
            spec.notes.append(_capped_sequence(capped, top))
    return axes


def _decoder_limit(model: nn.Module) -> int | None:
    """The longest a decoder's input may grow where its config says apart from the encoder's (Whisper's
    max_target_positions; an encoder-decoder of two models, TrOCR's, in its decoder's config), else None."""
    config = getattr(model, "config", None)
    value = getattr(config, "max_target_positions", None)
    return value if positive_int(value) else _limit_in(getattr(config, "decoder", None))


def _capped_sequence(axes: dict[str, dict[int, DynamicAxis]], longest: int) -> str:
    """The note for a default sequence range cut to DEFAULT_SEQUENCE_CAP, with the DYNAMIC that serves the rest."""
    ranges = ",".join(f"{name}:1=1:{axes_of[1].opt}:{longest}" for name, axes_of in axes.items())
    return (
        f"sequence range 1 to {DEFAULT_SEQUENCE_CAP}, of the {longest} tokens the model takes: every check runs the "
        f"range's top, whose attention grows with its square; {mention(dynamic=ranges)} for longer"
    )


def _bind_by_keyword(model: nn.Module, inputs: dict[str, torch.Tensor], reference: str) -> dict[str, torch.Tensor]:
    """The inputs in forward()'s order; a name forward() does not take is refused (**kwargs would swallow it).  One
    input INPUT_SHAPE left unnamed (3x512x512) is the model's main input (pixel_values), as a bare module's one input
    is its forward()'s first."""
    names = forward_parameters(model) or []
    main = getattr(model, "main_input_name", None)
    if list(inputs) == [SINGLE_INPUT_NAME] and SINGLE_INPUT_NAME not in names and main in names:
        inputs = {main: inputs[SINGLE_INPUT_NAME]}
    unknown = [name for name in inputs if name not in names]
    if unknown:
        raise PipelineError(
            f"{mention(model=reference)}: inputs {unknown} are not parameters of {type(model).__name__}.forward "
            f"({', '.join(names[:8])}, ...)",
            "give the tokenizer's output (return_tensors='pt') or name the inputs after forward()'s parameters",
        )
    return {name: inputs[name] for name in names if name in inputs}


def max_sequence_length(model: nn.Module, tokenizer_limit: int | None = None) -> int:
    """The longest sequence the model takes: its config's maximum, cut to what its position embeddings can embed
    and to the tokenizer's model_max_length where one is given; DEFAULT_MAX_SEQUENCE where none says."""
    limits = [limit for limit in (_config_limit(model), _embeddable_positions(model), tokenizer_limit) if limit]
    return min(limits) if limits else DEFAULT_MAX_SEQUENCE


def _config_limit(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    # A text-image model's text tower (CLIP) has it in its own config.
    return _limit_in(config) or _limit_in(getattr(config, "text_config", None))


def _limit_in(config: Any) -> int | None:
    """The first of MAX_LENGTH_FIELDS that `config` sets."""
    return next((value for field in MAX_LENGTH_FIELDS if positive_int(value := getattr(config, field, None))), None)


def _embeddable_positions(model: nn.Module) -> int | None:
    """The positions a learned position table with a padding row can embed.  RoBERTa's family (XLM-R, CamemBERT,
    Longformer, ESM, MPNet, ...) numbers the tokens from padding_idx + 1, as fairseq does, so a table of
    max_position_embeddings rows (514 in roberta-base) embeds sequences of up to 514 - 2 = 512 tokens."""
    tables = [
        module.num_embeddings - module.padding_idx - 1
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] == "position_embeddings"
        and isinstance(module, nn.Embedding)
        and module.padding_idx is not None
    ]
    return min(tables) if tables else None


# A tokenizer saved without a limit writes transformers' VERY_LARGE_INTEGER (1e30): no limit.
UNSET_TOKENIZER_LIMIT = 10**9


def tokenizer_limit(model: nn.Module) -> int | None:
    """`model_max_length` from the tokenizer_config.json beside the model (saved_folder), where it sets one."""
    value = _beside(model, TOKENIZER_CONFIG_FILE).get("model_max_length")
    return value if isinstance(value, int) and 0 < value < UNSET_TOKENIZER_LIMIT else None


def saved_folder(model: nn.Module) -> Path | None:
    """The save_pretrained folder a transformers model was loaded from (its config's name_or_path, as from_pretrained
    records it), whether MODEL named the folder or a factory loaded it; None for a model made from a config or
    fetched by its Hub name."""
    name = getattr(getattr(model, "config", None), "name_or_path", None)
    return Path(name) if isinstance(name, str) and name and is_model_folder(Path(name)) else None


def _beside(model: nn.Module, file_name: str) -> dict:
    """The JSON object `file_name` in the model's saved_folder (the tokenizer's or image processor's config), or {}
    where there is no folder, or the file is missing or unreadable: the pipeline runs neither, so such a file only
    leaves a default (a sequence range, an image size) as it is."""
    folder = saved_folder(model)
    path = folder / file_name if folder else None
    try:
        config = json.loads(path.read_text()) if path and path.is_file() else {}
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def token_sequence_axes(
    inputs: dict[str, torch.Tensor], longest: int, decoder_longest: int
) -> dict[str, dict[int, DynamicAxis]]:
    """One shared axis 1 over every [batch, sequence] integer input (ids, masks, token types) of one length, up to
    `longest`; an encoder-decoder's decoder inputs (decoder_input_ids, ...) share one of their own, up to
    `decoder_longest`."""
    axes: dict[str, dict[int, DynamicAxis]] = {}
    for decoder, name, top in ((False, SEQUENCE_AXIS, longest), (True, DECODER_SEQUENCE_AXIS, decoder_longest)):
        tokens = [
            input_name
            for input_name, t in inputs.items()
            if t.dim() == 2 and not t.is_floating_point() and input_name.startswith("decoder_") == decoder
        ]
        lengths = {int(inputs[input_name].shape[1]) for input_name in tokens}
        if len(lengths) != 1:
            continue  # no such inputs, or inputs of different lengths: nothing to share
        length = lengths.pop()
        axis = DynamicAxis(name, 1, length, max(top, length))
        axes |= {input_name: {1: axis} for input_name in tokens}
    return axes


# ---------------------------------------------------------------- a save_pretrained folder


def waveform_axes(model: nn.Module, inputs: dict[str, torch.Tensor], sampling_rate: int) -> dict:
    """One shared axis 1 over a raw waveform (wav2vec2's family: input_values [batch, samples]) and any 2-D input of
    its length (its attention mask), from the shortest clip the convolutional feature encoder takes (its receptive
    field: 400 samples in wav2vec2-base) to LONGEST_AUDIO_S seconds or DEFAULT_SEQUENCE_CAP frames, whichever is
    shorter (the attention runs over the frames: a tiny encoder striding 10 samples made 48000 frames of 30 s, and
    the reference asked for 37 GB); {} for any other model."""
    encoder = _feature_encoder(getattr(model, "config", None))
    waveform = inputs.get("input_values")
    if encoder is None or waveform is None or waveform.dim() != 2 or not waveform.is_floating_point():
        return {}
    shortest, stride = encoder
    longest = min(LONGEST_AUDIO_S * sampling_rate, shortest + (DEFAULT_SEQUENCE_CAP - 1) * stride)
    length = int(waveform.shape[1])
    axis = DynamicAxis(WAVEFORM_AXIS, min(shortest, length), length, max(length, longest))
    return {name: {1: axis} for name, tensor in inputs.items() if tensor.dim() == 2 and tensor.shape[1] == length}


def _feature_encoder(config: Any) -> tuple[int, int] | None:
    """A convolutional feature encoder's receptive field (the samples one frame sees) and stride (the samples between
    frames), from config conv_kernel and conv_stride as wav2vec2's family gives them; None where it has none."""
    kernels, strides = getattr(config, "conv_kernel", None), getattr(config, "conv_stride", None)
    if not (isinstance(kernels, (list, tuple)) and isinstance(strides, (list, tuple)) and kernels):
        return None
    if len(kernels) != len(strides) or not all(positive_int(v) for v in [*kernels, *strides]):
        return None
    field, step = 1, 1
    for kernel, stride in zip(kernels, strides, strict=True):
        field, step = field + (kernel - 1) * step, step * stride
    return field, step


def processor_sampling_rate(model: nn.Module) -> int:
    """The sampling rate the model's feature extractor reads audio at (preprocessor_config.json beside it), else
    DEFAULT_SAMPLING_RATE."""
    rate = _beside(model, PREPROCESSOR_CONFIG_FILE).get("sampling_rate")
    return rate if positive_int(rate) else DEFAULT_SAMPLING_RATE


# A model's name on the Hugging Face Hub: owner/name (letters, digits, '-', '_', '.').
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# What a Hub model's folder needs fetched: its configs (the model's, the tokenizer's, the image processor's, a
# sentence-transformers folder's modules) and its weights at the top of the repository (safetensors where it has
# them, else pytorch_model.bin); other formats and copies in subfolders (onnx/, ...) stay on the Hub.
HUB_CONFIGS = ["*.json"]
HUB_WEIGHTS = (["*.safetensors"], ["*.bin"])
HUB_SUBFOLDER_WEIGHTS = ["*/*.safetensors", "*/*.bin"]


def is_hub_name(model: str) -> bool:
    return HUB_NAME.fullmatch(model) is not None


def hub_folder(name: str) -> Path:
    """The folder of the Hub model `name` as save_pretrained wrote it, fetched into the Hugging Face cache, or found
    there (HF_HUB_OFFLINE=1: the cache alone; HF_TOKEN: a gated or private model)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise PipelineError(
            f"{mention(model=name)} names a Hugging Face Hub model, but huggingface_hub is not installed", INSTALL_FIX
        ) from None
    try:
        for weights in HUB_WEIGHTS:
            folder = Path(
                snapshot_download(name, allow_patterns=HUB_CONFIGS + weights, ignore_patterns=HUB_SUBFOLDER_WEIGHTS)
            )
            if any((folder / form).is_file() for form in WEIGHT_FORMS):
                return folder
    except Exception as error:  # huggingface_hub's: not found, gated, offline, the network's
        raise PipelineError(
            f"{mention(model=name)} is no file or folder here, and fetching it from the Hugging Face Hub failed: "
            f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}",
            "check the path, or the name on huggingface.co (and the network, or HF_TOKEN for a gated or private "
            f"model); or fetch it yourself (hf download {name} --local-dir <folder>) and give {FOLDER_FORM}",
        ) from None
    return folder  # no weights in either form: load_folder says what the folder lacks


def is_model_folder(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG_FILE).is_file()


def folder_sources(folder: Path) -> list[Path]:
    """The files whose bytes make the model: config and weights, and the tokenizer's and image processor's configs
    where there are (model_max_length sets the default sequence range; the image size, the example images'); the
    fingerprint covers them (and a sentence-transformers folder's modules: models.sentence_embedding)."""
    weights = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin") or p.name in WEIGHT_FORMS)
    configs = [folder / name for name in (TOKENIZER_CONFIG_FILE, PREPROCESSOR_CONFIG_FILE) if (folder / name).is_file()]
    return [folder / CONFIG_FILE, *weights, *configs]


def load_folder(folder: Path) -> ModelSpec:
    """A save_pretrained folder as a ModelSpec, its example inputs left for models.described to derive."""
    try:
        import transformers
    except ImportError:
        raise PipelineError(
            f"{mention(model=folder)} is a Hugging Face model folder, but transformers is not installed", INSTALL_FIX
        ) from None
    if not any((folder / name).is_file() for name in WEIGHT_FORMS):
        raise PipelineError(f"{mention(model=folder)} has {CONFIG_FILE} but no weights", f"give {FOLDER_FORM}")
    config = _read_config(folder)
    class_name = (config.get("architectures") or ["AutoModel"])[0]
    model_class = getattr(transformers, class_name, None)
    if model_class is None:
        raise PipelineError(
            f"{mention(model=folder)}: its config names the class {class_name!r}, which transformers "
            f"{transformers.__version__} does not have (code in the folder is never run)",
            f"write a factory ({mention(model='package.module:factory')}) that loads the model and returns it with the "
            "tokenizer's output",
        )
    try:
        module = model_class.from_pretrained(str(folder), local_files_only=True)
    except Exception as error:  # transformers raises OSError, ValueError, safetensors errors, ...
        raise PipelineError(
            f"{mention(model=folder)}: transformers could not load it as {class_name}: {type(error).__name__}: "
            f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}",
            f"give {FOLDER_FORM}",
        ) from None
    return ModelSpec(name=folder.name, module=module, example_inputs={})  # derived as any model's (models.described)


def _read_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as error:
        raise PipelineError(f"{folder / CONFIG_FILE} is not readable JSON: {error}", f"give {FOLDER_FORM}") from None
    if not isinstance(config, dict):
        raise PipelineError(f"{folder / CONFIG_FILE} is not a JSON object", f"give {FOLDER_FORM}")
    return config


EXAMPLE_TOKENS = 16
# The config fields that name special tokens, which derived ids for a model that reads each row's EOS stay clear of.
SPECIAL_TOKEN_FIELDS = ("bos_token_id", "pad_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id")


def processor_image_size(model: nn.Module) -> tuple[int, int] | None:
    """(height, width) of the images the model's image processor (preprocessor_config.json beside it) hands it: its
    crop_size where it crops, else its size where that is a height and a width; None where it gives none (a
    shortest_edge: the images vary)."""
    config = _beside(model, PREPROCESSOR_CONFIG_FILE)
    if config.get("do_resize") is False:
        return None
    sizes = [config.get("crop_size")] if config.get("do_center_crop") else []
    for size in [*sizes, config.get("size")]:
        if isinstance(size, dict) and positive_int(size.get("height")) and positive_int(size.get("width")):
            return size["height"], size["width"]
    return None


def _height_width(size: Any) -> tuple[int, int] | None:
    """A config's image_size as (height, width): one int for both, or a pair (YOLOS: [512, 864])."""
    if positive_int(size):
        return size, size
    if isinstance(size, (list, tuple)) and len(size) == 2 and all(positive_int(side) for side in size):
        return size[0], size[1]
    return None


def positive_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def derived_example_inputs(module: nn.Module) -> dict[str, torch.Tensor]:
    """Examples for a model whose main input says what it is (token ids; images of the size its config gives, else
    its image processor's, processor_image_size; a text-image model such as CLIP, or an image model that reads text
    too (BLIP's captioner, OWL-ViT's detector), token ids and images of its vision config's size; audio as its
    feature extractor hands it over, see _audio_shape; and a generating encoder-decoder's tokens so far); {}
    otherwise, so INPUT_SHAPE is required."""
    image_size = processor_image_size(module)
    main = getattr(module, "main_input_name", None)
    config = getattr(module, "config", None)
    parameters = forward_parameters(module) or []
    generator = torch.Generator().manual_seed(0)
    if main == "input_ids" or (main == "pixel_values" and "input_ids" in parameters):
        ids = _token_ids(config, _eos_read_by(module), generator)
        derived = {"input_ids": ids, "attention_mask": padded_mask(ids)}
        if int(getattr(config, "type_vocab_size", 0) or 0) > 1:  # segments (BERT's): a reranker reads sentence pairs
            derived["token_type_ids"] = pair_segments(ids)
        derived |= _images(_vision_config(config), image_size, generator)
    elif main == "pixel_values":
        derived = _images(_vision_config(config), image_size, generator)
    else:
        shape = _audio_shape(config, main, processor_sampling_rate(module))
        derived = {str(main): torch.randn(2, *shape, generator=generator)} if shape else {}
    if derived and _generates(module, parameters):
        derived["decoder_input_ids"] = _decoder_ids(config, generator)
    return {name: derived[name] for name in [str(main), *parameters] if name in derived}


DECODER_EXAMPLE_TOKENS = 8  # not EXAMPLE_TOKENS: the decoder's length is its own axis


def _generates(module: nn.Module, parameters: list[str]) -> bool:
    """An encoder-decoder whose decoder reads the tokens generated so far (T5's, BART's, Marian's, Whisper's
    ForConditionalGeneration and bare models): a classifier or a question-answering head makes its decoder's input
    from input_ids itself."""
    head = type(module).__name__.endswith(("ForSequenceClassification", "ForQuestionAnswering"))
    return _encoder_decoder(module) and "decoder_input_ids" in parameters and not head


def _encoder_decoder(module: nn.Module) -> bool:
    return getattr(getattr(module, "config", None), "is_encoder_decoder", False) is True


def _decoder_ids(config: Any, generator: torch.Generator) -> torch.Tensor:
    """Two rows of decoder ids as generation feeds them: the config's decoder_start_token_id (0 where it names none
    in the vocabulary), then ids from 0 to 9."""
    ids = _ids(config, 0, DECODER_EXAMPLE_TOKENS, generator)
    start = getattr(config, "decoder_start_token_id", None)
    ids[:, 0] = start if positive_int(start) and start < _vocabulary(config) else 0
    return ids


def _token_ids(config: Any, eos: int | None, generator: torch.Generator) -> torch.Tensor:
    """Two rows of token ids: ten ids from 0, or, for a model that reads each row's EOS (`eos`), ten ids clear of the
    config's special ones with the EOS closing each row, as a tokenizer writes them; the reference, the gates and the
    bench then draw them so (pipeline.core.random_inputs.end_token)."""
    if eos is None:
        return _ids(config, 0, EXAMPLE_TOKENS, generator)
    special = {getattr(config, field, None) for field in SPECIAL_TOKEN_FIELDS}
    low = next((first for first in range(_vocabulary(config)) if special.isdisjoint(range(first, first + 10))), 0)
    ids = _ids(config, low, EXAMPLE_TOKENS, generator)
    ids[:, -1] = eos
    return ids


def _ids(config: Any, low: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """Two rows of `length` ids drawn from the ten from `low`, within the config's vocabulary."""
    return torch.randint(low, min(_vocabulary(config), low + 10), (2, length), generator=generator)


def _vocabulary(config: Any) -> int:
    return int(getattr(config, "vocab_size", 10) or 10)


def _eos_read_by(module: nn.Module) -> int | None:
    """The EOS id an encoder-decoder classifier reads each row's state at (BART's, T5's, LED's
    ForSequenceClassification: they refuse a batch whose rows hold different counts of it), else None."""
    config = getattr(module, "config", None)
    eos = getattr(config, "eos_token_id", None)
    reads = type(module).__name__.endswith("ForSequenceClassification") and _encoder_decoder(module)
    return eos if reads and isinstance(eos, int) and not isinstance(eos, bool) and eos >= 0 else None


def _audio_shape(config: Any, main: Any, sampling_rate: int) -> tuple[int, ...] | None:
    """One clip as an audio model's feature extractor hands it over, without the batch: a spectrogram of the size its
    config gives (AST's input_values, max_length frames of num_mel_bins; Whisper's input_features, num_mel_bins by
    twice max_source_positions frames, which its encoder's strided convolution halves), else one second of raw
    waveform (input_values of wav2vec2's family, whose config describes its convolutional feature encoder); None
    for anything else."""
    mels, frames = getattr(config, "num_mel_bins", None), getattr(config, "max_length", None)
    positions = getattr(config, "max_source_positions", None)
    if main == "input_values" and positive_int(mels) and positive_int(frames):
        return frames, mels
    if main == "input_features" and positive_int(mels) and positive_int(positions):
        return mels, 2 * positions
    if main == "input_values" and _feature_encoder(config) is not None:
        return (sampling_rate,)
    return None


def _vision_config(config: Any) -> Any:
    """The config that describes a model's images: its vision tower's (CLIP's, BLIP's, OWL-ViT's vision_config), an
    image encoder-decoder's encoder's (TrOCR's, Donut's), else the model's own."""
    return next(
        (part for part in (getattr(config, name, None) for name in ("vision_config", "encoder")) if part is not None),
        config,
    )


def _images(config: Any, image_size: tuple[int, int] | None, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Two images with `config`'s channels (3 where it names none: BLIP's vision config), of the size it gives, else
    `image_size`; {} where there is no config or no size."""
    height_width = _height_width(getattr(config, "image_size", None)) or image_size
    channels = getattr(config, "num_channels", 3) if config is not None else None
    if height_width is None or not isinstance(channels, int):
        return {}
    return {"pixel_values": torch.randn(2, channels, *height_width, generator=generator)}


def pair_segments(ids: torch.Tensor) -> torch.Tensor:
    """Token type ids of a sentence pair, the first half segment 0 and the rest 1, as a tokenizer writes them for a
    pair: a model with segment embeddings takes them as an input (else the graph would fix them at 0, and a
    cross-encoder served a pair would score it as one sentence); drawn within their example's range, each token's
    segment is random in the reference and every check."""
    segments = torch.zeros_like(ids)
    segments[:, ids.shape[1] // 2 :] = 1
    return segments


def padded_mask(ids: torch.Tensor) -> torch.Tensor:
    """The attention mask of a batch whose last row is padded on the right, as a tokenizer pads a batch.  The random
    inputs of the reference, the gates and auto's host check draw each integer input within its example's range: with
    a mask of ones alone, no check would see a masked token (a row of padding, the float16 graph's mask fill, a fused
    attention's mask); with this one, each token is kept or masked at random."""
    mask = torch.ones_like(ids)
    mask[-1, ids.shape[1] // 2 :] = 0
    return mask
