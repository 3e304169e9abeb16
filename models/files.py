"""MODEL=<file>: a TorchScript, torch.export (.pt2) or whole pickled nn.Module file, told apart by its zip layout."""

from __future__ import annotations

import inspect
import pickle
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..pipeline.core.errors import PipelineError
from ..pipeline.core.settings import mention
from .factories import put_cwd_on_sys_path
from .inputs import EXAMPLE_BATCH, example_tensor, seeded
from .spec import ModelSpec, first_line
from .state_dicts import refused_by_weights_only, refused_global, unreadable, unwrap_state_dict

MODEL_FILE_FIX = "give a TorchScript file, a torch.export .pt2 file, or a whole nn.Module saved with torch.save"
MODEL_FILE_SUFFIXES = (".pt", ".pth", ".pt2", ".ts", ".torchscript", ".jit", ".ckpt", ".bin")


@dataclass
class LoadedFile:
    """A model read from a file; example_inputs is empty when they must come from INPUT_SHAPE."""

    spec: ModelSpec
    kind: str  # "torchscript", "exported_program" or "pickled_module"
    class_source: Path | None = None  # for a pickled module: the file defining its class


def load_model_file(path: Path, *, trust: bool = False) -> LoadedFile:
    """Read a TorchScript, ExportedProgram or whole pickled nn.Module file.

    A whole pickled module loads only with `trust` (TRUST_MODEL_FILE=1): unpickling it runs whatever
    code the file names, so, as PyTorch's weights_only=True default and Hugging Face's
    trust_remote_code, that is the user's explicit choice, never a fallback.
    """
    if not path.is_file():
        raise PipelineError(
            f"model file {path} does not exist", "give an existing .pt/.pth/.pt2/TorchScript file, or a registry name"
        )
    kind = model_file_kind(path)
    if kind == "exported_program":
        return _load_exported_program(path)
    if kind == "torchscript":
        return _load_torchscript(path)
    return _load_pickled_module(path, trust)


def model_file_kind(path: Path) -> str:
    """Tell the three formats apart by their zip layout, not by the suffix users pick."""
    if not zipfile.is_zipfile(path):
        return "pickled_module"  # torch.save's legacy (non-zip) format
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
    if any(n.endswith("/archive_format") or n == "archive_format" for n in names):
        return "exported_program"
    if any(n.endswith("/constants.pkl") for n in names) and any("/code/" in n for n in names):
        return "torchscript"
    return "pickled_module"


def _load_torchscript(path: Path) -> LoadedFile:
    try:
        module = torch.jit.load(str(path), map_location="cpu")
    except RuntimeError as exc:
        raise PipelineError(f"TorchScript file {path} could not be loaded: {first_line(exc)}", None) from exc
    return LoadedFile(ModelSpec(name=path.stem, module=module, example_inputs={}), "torchscript")


def _load_exported_program(path: Path) -> LoadedFile:
    try:
        program = torch.export.load(str(path))
    except Exception as exc:  # a .pt2 can also be an AOTInductor package or from another torch version
        raise PipelineError(
            f"{path} could not be read by torch.export.load: {type(exc).__name__}: {first_line(exc)}",
            "give a file written by torch.export.save with this torch version",
        ) from exc
    examples, notes = example_inputs_from_program(program, path)
    spec = ModelSpec(name=path.stem, module=module_from_program(program), example_inputs=examples, notes=notes)
    return LoadedFile(spec, "exported_program")


def module_from_program(program: Any) -> nn.Module:
    """`program.module()`, with train()/eval() that only set the flags instead of raising.

    torch.export's unlifted module raises NotImplementedError on train()/eval() because its
    graph's mode was fixed at export.  The prepare stage calls eval() on every model; as a
    flag-only call it is truthful for a program exported in eval mode, and a program exported
    in train mode still shows itself to prepare's checks (dropout makes two calls differ).
    """
    module = program.module()
    module.train = types.MethodType(nn.Module.train, module)
    module.eval = types.MethodType(nn.Module.eval, module)
    return module


def example_inputs_from_program(program: Any, path: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Example inputs from an ExportedProgram's input placeholders (their fake tensors give shape and dtype).

    A symbolic dim gets size 2 (clamped into its range), so a dynamic batch gets the usual example batch.
    Returns ({}, []) when some input cannot be derived; INPUT_SHAPE is then required.
    """
    placeholders = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}
    examples, notes = {}, []
    with seeded():
        for name in program.graph_signature.user_inputs:
            fake = placeholders[name].meta.get("val") if name in placeholders else None
            if not isinstance(fake, torch.Tensor) or fake.dim() == 0:
                return {}, []
            sizes = [_example_size(dim, program.range_constraints) for dim in fake.shape]
            if None in sizes:
                return {}, []
            if isinstance(fake.shape[0], int):
                notes.append(
                    f"{path.name} was exported with a static batch of {fake.shape[0]} on {name}: "
                    "only that batch size will run"
                )
            examples[name] = example_tensor(tuple(int(size) for size in sizes if size is not None), fake.dtype)
    return examples, notes


def _example_size(dim: Any, range_constraints: dict) -> int | None:
    if isinstance(dim, int):
        return dim
    value_range = range_constraints.get(getattr(getattr(dim, "node", None), "expr", None))
    if value_range is None:
        return None  # a derived dim such as 2*s0: no range of its own to pick from
    low = int(value_range.lower) if value_range.lower.is_finite else 1
    high = int(value_range.upper) if value_range.upper.is_finite else EXAMPLE_BATCH
    return min(max(EXAMPLE_BATCH, low), high)


def _load_pickled_module(path: Path, trust: bool) -> LoadedFile:
    # A plain state_dict loads with weights_only=True; try that first so a file that is
    # only tensors never runs pickle code, and so we can say what to do with it.
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if not refused_by_weights_only(exc):
            raise unreadable(f"model file {path}", exc, MODEL_FILE_FIX) from exc
        if not trust:
            raise PipelineError(
                f"model file {path} is a pickled Python object ({refused_global(exc)}): loading it runs code "
                "the file contains, so it is not loaded unless you say you trust it",
                f"if you wrote the file or trust where it came from, add {mention(trust_model_file=True)}; "
                "safer: save it with torch.jit.save or torch.export.save, or give "
                f"{mention(model='package.module:factory', weights='<state_dict>')}",
            ) from exc
        loaded = _load_pickle_trusting_user(path)
    except Exception as exc:  # the unpickler fails on a non-torch file in many ways (KeyError, ValueError, ...)
        raise unreadable(f"model file {path}", exc, MODEL_FILE_FIX) from exc
    if unwrap_state_dict(loaded) is not None:
        raise PipelineError(
            f"model file {path} is a state_dict (weights only), which has no architecture",
            "give the architecture and the weights separately: "
            f"{mention(model='<registry name or package.module:factory>', weights=path)}",
        )
    if not isinstance(loaded, nn.Module):
        raise PipelineError(
            f"model file {path} holds a {type(loaded).__name__}, not an nn.Module",
            "save the model with torch.save(model, path), torch.jit.save or torch.export.save",
        )
    class_source = inspect.getsourcefile(type(loaded)) if not isinstance(loaded, torch.jit.ScriptModule) else None
    spec = ModelSpec(name=path.stem, module=loaded, example_inputs={})
    return LoadedFile(spec, "pickled_module", Path(class_source) if class_source else None)


def _load_pickle_trusting_user(path: Path) -> Any:
    # weights_only=False runs arbitrary pickle code: only for a file the user said they trust.
    put_cwd_on_sys_path()  # the pickle names the model's class by module; import it like a factory
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except (pickle.UnpicklingError, EOFError, RuntimeError) as exc:
        raise unreadable(f"model file {path}", exc, MODEL_FILE_FIX) from exc
    except (AttributeError, ImportError) as exc:
        raise PipelineError(
            f"model file {path} is a pickled model whose class cannot be imported: {exc}",
            "run from the directory where the model's module is importable, or use "
            f"{mention(model='package.module:factory')}",
        ) from exc
