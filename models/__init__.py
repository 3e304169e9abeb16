"""From a MODEL string to a ModelSpec: the registry, users' factories and model files.

`load_model(model, weights=..., input_shape=..., dynamic=...)` accepts:
  - a registry name (`known_models()`, or an alias such as `resnet` -> `resnet50`);
  - `package.module:factory`, imported with the current directory on sys.path; the
    factory returns a ModelSpec, an nn.Module or `(module, example_inputs)`; a bare module
    needs INPUT_SHAPE unless it describes its inputs (a transformers or timm model:
    models.described);
  - a file: a whole nn.Module saved with torch.save, a TorchScript file (both need
    INPUT_SHAPE), or a torch.export `.pt2` program (inputs derived from the program);
  - a Hugging Face folder as save_pretrained writes it (config.json + safetensors/bin weights), or a
    Hub name (owner/name), fetched into the Hugging Face cache and loaded as that folder.
A `transformers` model, however it came, is called by keyword with its cache off and returns its
tensors by name (models.huggingface).
WEIGHTS, a state_dict file, is loaded into whichever model that gives.  The INPUT_SHAPE
and DYNAMIC grammars are documented in `models.inputs`.  INPUT_SHAPE, when given, always
replaces the model's own example inputs; DYNAMIC, when given, replaces its dynamic axes.

The returned spec has been through one eval-mode forward pass on its example inputs
(skipped for a registry model on its own inputs; the module's train/eval mode is left as
it was, since setting it is the prepare stage's job),
its `name` is `canonical_name(model)`, and its `fingerprint` changes whenever the model's
source, its weights or checkpoint file, INPUT_SHAPE or DYNAMIC change.
"""

from __future__ import annotations

import hashlib
import inspect
import re
from pathlib import Path

import torch

from ..pipeline.core.errors import PipelineError
from ..pipeline.core.settings import engine_command, mention
from . import described, factories, files, forward_check, huggingface, inputs, sentence_embedding, state_dicts
from .registry import ALIASES, REGISTRY
from .spec import ModelSpec

__all__ = ["canonical_name", "known_models", "load_model"]


def known_models() -> list[str]:
    """The registry's model names, in registry order (aliases such as `resnet` are not listed)."""
    return list(REGISTRY)


def canonical_name(model: str) -> str:
    """The name artifacts are filed under: `resnet` -> `resnet50`, `pkg.mod:make_net` -> `mod-make_net`,
    `/path/to/net.pt` -> `net`."""
    kind, target = _resolve(model)
    if kind == "registry":
        return str(target)
    if kind == "factory":
        module_name, _, attr_path = str(target).partition(":")
        return _slug(f"{module_name.rsplit('.', 1)[-1]}-{attr_path}")
    if kind == "folder":
        return _slug(Path(target).resolve().name)
    if kind == "hub":
        return _slug(str(target).rsplit("/", 1)[-1])
    return _slug(Path(target).stem)


def load_model(
    model: str,
    *,
    weights: Path | str | None = None,
    input_shape: str | None = None,
    dynamic: str | None = None,
    trust_model_file: bool = False,
) -> ModelSpec:
    """Load MODEL into a checked ModelSpec (see the module docstring for the accepted forms).

    trust_model_file: load a whole pickled nn.Module file, which runs the code it names (TRUST_MODEL_FILE=1).
    """
    weights = Path(weights) if weights not in (None, "") else None
    input_shape = (input_shape or "").strip() or None
    dynamic = (dynamic or "").strip() or None
    # Parse the user's strings before building anything: a typo should not cost a ResNet-50 build.
    shapes = inputs.parse_input_shape(input_shape) if input_shape else None
    requests = inputs.parse_dynamic(dynamic) if dynamic else None

    kind, target = _resolve(model)
    if kind == "hub":  # fetched once into the Hugging Face cache, then a folder like any other
        kind, target = "folder", huggingface.hub_folder(str(target))
    if kind == "file" and Path(target).suffix.lower() == ".onnx":
        raise PipelineError(
            f"{mention(model=model)} is an ONNX graph, which holds no PyTorch model",
            f"build it with `{engine_command(model='<file>.onnx')}` (the pipeline starts at check) and run it with the "
            "onnxruntime or tensorrt backend, not torch",
        )
    spec, sources, form = _load_by_kind(kind, target, weights, trust_model_file)
    forward_check.refuse_deep_nesting(spec.module, model)  # before anything walks the module tree
    if shapes is not None:
        spec.example_inputs = inputs.example_inputs_from_shapes(shapes)
    elif not spec.example_inputs:
        spec.example_inputs = described.described_inputs(spec)
    if not spec.example_inputs:
        raise PipelineError(
            f"{mention(model=model)} is {form}, which does not say what its inputs are", inputs.INPUT_SHAPE_HELP
        )
    _in_float32(spec)
    if huggingface.is_transformers_model(spec.module):
        spec = huggingface.adapt(spec, model, dynamic_given=requests is not None)
        pooling = sentence_embedding.sentence_pooling(Path(target)) if kind == "folder" else None
        if pooling is not None:  # a sentence-transformers folder: its embedding, as encode() returns it
            spec = sentence_embedding.pooled(spec, Path(target), pooling)
    else:
        spec.example_inputs = factories.bind_to_forward(spec.module, spec.example_inputs, model)
    if requests is not None and dynamic is not None:
        spec.dynamic_axes = inputs.dynamic_axes_from_requests(requests, spec.example_inputs, dynamic)
    inputs.check_dynamic_axes(spec)

    # A registry model on its own example inputs is proven by tests/models/test_registry.py; skipping the
    # check saves a ResNet-50 forward pass (seconds on a busy CPU) on every run.
    if kind != "registry" or shapes is not None:
        outputs = forward_check.run_example_forward(spec.module, spec.example_inputs, input_shape)
        spec.output_names = spec.output_names or forward_check.output_names_from(outputs)
    spec.name = canonical_name(model)
    spec.fingerprint = _fingerprint(spec, sources, weights, input_shape, dynamic)
    return spec


HALF_PRECISIONS = (torch.float16, torch.bfloat16)


def _in_float32(spec: ModelSpec) -> None:
    """A model held in float16 or bfloat16 (a Hub folder saved so, which transformers loads as saved; a factory's
    model.half()) computes in float32 from here on, as do its example inputs in its dtype: the graphs start from
    float32 (the FP16 and INT8 steps convert float32 tensors), and widening loses nothing, so PRECISION alone says
    what the engine computes in.  A note says so.  Half-precision inputs of a float32 model are the user's choice."""
    tensors = [*spec.module.parameters(), *spec.module.buffers()]
    held = sorted({str(tensor.dtype).removeprefix("torch.") for tensor in tensors if tensor.dtype in HALF_PRECISIONS})
    if not held:
        return
    spec.module.float()
    spec.example_inputs = {
        name: tensor.float() if tensor.dtype in HALF_PRECISIONS else tensor
        for name, tensor in spec.example_inputs.items()
    }
    spec.notes.append(f"the model came in {' and '.join(held)}: it and its inputs are widened to float32 (exactly)")


def _resolve(model: str) -> tuple[str, str | Path]:
    """("registry", name) | ("factory", "pkg.mod:attr") | ("file", path) | ("folder", path), or a PipelineError."""
    key = model.strip().lower()
    key = ALIASES.get(key, key)
    if key in REGISTRY:
        return "registry", key
    path = Path(model).expanduser()
    if path.is_file():
        return "file", path
    if huggingface.is_model_folder(path):
        return "folder", path
    if path.is_dir():
        raise PipelineError(
            f"{mention(model=model)} is a folder without {huggingface.CONFIG_FILE}", f"give {huggingface.FOLDER_FORM}"
        )
    if factories.is_factory_reference(model):
        return "factory", model
    if huggingface.is_hub_name(model) and path.suffix.lower() not in (*files.MODEL_FILE_SUFFIXES, ".onnx"):
        return "hub", model  # owner/name, not a file's path
    if path.suffix.lower() in files.MODEL_FILE_SUFFIXES or "/" in model:
        raise PipelineError(
            f"model file {model} does not exist (or is not a file)",
            "check the path; a relative path is taken from the current directory",
        )
    aliases = ", ".join(f"{alias} -> {name}" for alias, name in ALIASES.items())
    raise PipelineError(
        f"unknown model {model!r}",
        f"use a registry name ({', '.join(known_models())}; aliases: {aliases}), "
        "a factory package.module:function, or the path of a model file "
        "(torch.save'd nn.Module, TorchScript, or a torch.export .pt2), or a Hugging Face model folder or Hub name "
        "(owner/name)",
    )


# How each form is described when INPUT_SHAPE is needed but missing.
_FORMS = {
    "registry": "a registry model",
    "factory": "a factory returning a bare nn.Module",
    "pickled_module": "a pickled nn.Module",
    "torchscript": "a TorchScript file",
    "exported_program": "an ExportedProgram whose input shapes could not be derived",
    "folder": "a Hugging Face model folder whose main input is neither token ids, nor images of a size its "
    "config.json (image_size) or preprocessor_config.json (crop_size, or size as height and width) gives, nor audio "
    "its config describes (a spectrogram's size, or a waveform's feature encoder)",
}


def _load_by_kind(
    kind: str, target: str | Path, weights: Path | None, trust_model_file: bool
) -> tuple[ModelSpec, list[Path], str]:
    """The spec, the source files its fingerprint covers (besides weights and INPUT_SHAPE/DYNAMIC),
    and the model's form in words."""
    if kind == "registry":
        builder = REGISTRY[str(target)]
        with inputs.seeded():  # random init must repeat: the runner reloads the model the engine was built from
            spec = builder(weights)
        return spec, [Path(inspect.getsourcefile(builder) or str(target))], _FORMS[kind]
    if kind == "factory":
        with factories.process_state_kept(str(target)):
            factory, module_file = factories.import_factory(str(target))
            with inputs.seeded():
                result = factories.call_factory(factory, str(target))
        spec = factories.spec_from_factory_result(result, str(target))
        _apply_weights(spec, weights)
        # A transformers model the factory loaded from a folder is that folder's files as much as the factory's code.
        folder = huggingface.saved_folder(spec.module)
        sources = [*([module_file] if module_file else []), *(huggingface.folder_sources(folder) if folder else [])]
        return spec, sources, _FORMS[kind]
    if kind == "folder":
        spec = huggingface.load_folder(Path(target))
        _apply_weights(spec, weights)
        sources = [*huggingface.folder_sources(Path(target)), *sentence_embedding.sentence_sources(Path(target))]
        return spec, sources, _FORMS[kind]
    loaded = files.load_model_file(Path(target), trust=trust_model_file)
    _apply_weights(loaded.spec, weights)
    sources = [Path(target)] + ([loaded.class_source] if loaded.class_source else [])
    return loaded.spec, sources, _FORMS[loaded.kind]


def _apply_weights(spec: ModelSpec, weights: Path | None) -> None:
    if weights is not None:
        state_dicts.apply_state_dict(spec.module, state_dicts.read_state_dict(weights), weights)


def _fingerprint(
    spec: ModelSpec, sources: list[Path], weights: Path | None, input_shape: str | None, dynamic: str | None
) -> str:
    """sha256 over the model's name, source/checkpoint files, weights file, INPUT_SHAPE and DYNAMIC.

    Each part is length-prefixed, so moving bytes from one part into the next changes the hash.
    A factory's own fingerprint (if it set one) is folded in too.
    """
    digest = hashlib.sha256()
    _hash_text(digest, "name", spec.name)
    for source in sources:
        _hash_file(digest, "source", source)
    _hash_file(digest, "weights", weights)
    _hash_text(digest, "input_shape", input_shape or "")
    _hash_text(digest, "dynamic", dynamic or "")
    _hash_text(digest, "spec_fingerprint", spec.fingerprint)
    return digest.hexdigest()


def _hash_text(digest: hashlib._Hash, label: str, text: str) -> None:
    data = text.encode()
    digest.update(f"{label}:{len(data)}:".encode())
    digest.update(data)


def _hash_file(digest: hashlib._Hash, label: str, path: Path | None) -> None:
    if path is None:
        _hash_text(digest, label, "")
        return
    digest.update(f"{label}:{path.stat().st_size}:".encode())
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)


def _slug(text: str) -> str:
    """Safe as a folder name: letters, digits, `_`, `-` and `.` only."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("._") or "model"
