"""state_dict files: read with weights_only=True, unwrapped from training checkpoints, applied strictly.

The registry builders, WEIGHTS= and the model-file loader share them (and the words for a file torch.load refuses).
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..pipeline.core.errors import PipelineError
from ..pipeline.core.settings import mention, mention_name
from .spec import first_line

# Keys that wrap a state_dict in common training checkpoints ({"state_dict": ..., "epoch": ...}).
STATE_DICT_WRAPPERS = ("state_dict", "model_state_dict", "model")


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Read a state_dict (optionally wrapped under STATE_DICT_WRAPPERS) with weights_only=True."""
    path = Path(path)
    if not path.is_file():
        raise PipelineError(
            f"weights file {path} does not exist", "give the path of a state_dict saved with torch.save"
        )
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if not refused_by_weights_only(exc):
            raise unreadable(f"weights file {path}", exc, "give a file written by torch.save") from exc
        raise PipelineError(
            f"weights file {path} holds pickled Python objects ({refused_global(exc)}), not just tensors",
            f"save model.state_dict() with torch.save; a whole pickled model goes in {mention(model='<file>')} instead",
        ) from exc
    except Exception as exc:  # the unpickler fails on a non-torch file in many ways (KeyError, ValueError, ...)
        raise unreadable(f"weights file {path}", exc, "give a file written by torch.save") from exc
    state_dict = unwrap_state_dict(loaded)
    if state_dict is None:
        raise PipelineError(
            f"weights file {path} is not a state_dict (it holds a {type(loaded).__name__})",
            "save model.state_dict() with torch.save",
        )
    return state_dict


def unwrap_state_dict(loaded: Any) -> dict[str, torch.Tensor] | None:
    """The name -> tensor mapping inside `loaded`, or None if there is none."""
    if _is_tensor_mapping(loaded):
        state_dict = dict(loaded)  # plain dict: see apply_state_dict for why _metadata is dropped
    elif isinstance(loaded, dict):
        inner = next((loaded[key] for key in STATE_DICT_WRAPPERS if _is_tensor_mapping(loaded.get(key))), None)
        if inner is None:
            return None
        state_dict = dict(inner)
    else:
        return None
    # nn.DataParallel / DistributedDataParallel save every key under "module."
    if all(key.startswith("module.") for key in state_dict):
        state_dict = {key.removeprefix("module."): value for key, value in state_dict.items()}
    return state_dict


def _is_tensor_mapping(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and bool(value)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())
    )


def apply_state_dict(module: nn.Module, state_dict: dict[str, torch.Tensor], source: Path | str) -> None:
    """Load `state_dict` strictly, or raise a PipelineError naming the keys that do not match."""
    expected = module.state_dict()
    # Old torchvision checkpoints predate BatchNorm's num_batches_tracked; without _metadata,
    # BatchNorm's loader fills it in, so its absence is not a mismatch.
    missing = [k for k in expected if k not in state_dict and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in state_dict if k not in expected]
    wrong_shape = [
        f"{k} (file {list(state_dict[k].shape)}, model {list(v.shape)})"
        for k, v in expected.items()
        if k in state_dict and state_dict[k].shape != v.shape
    ]
    if missing or unexpected or wrong_shape:
        raise PipelineError(
            f"checkpoint {source} does not fit the model: "
            + "; ".join(
                f"{len(keys)} {label}: {', '.join(keys[:5])}{', ...' if len(keys) > 5 else ''}"
                for label, keys in (
                    ("missing keys", missing),
                    ("unexpected keys", unexpected),
                    ("shapes differ", wrong_shape),
                )
                if keys
            ),
            f"give {mention_name('weights')} saved from the same architecture as {mention_name('model')} (e.g. a "
            f"resnet18 checkpoint with {mention(model='resnet18')})",
        )
    module.load_state_dict(state_dict, strict=True)


def refused_by_weights_only(exc: pickle.UnpicklingError) -> bool:
    """True when weights_only=True declined a class the pickle names (the file holds Python objects),
    False when the bytes are not a torch file at all (torch words both as "Weights only load failed")."""
    # torch words it "Unsupported global: GLOBAL x" or "unsupported GLOBAL posix.system whose module ..."
    return "unsupported global" in str(exc).lower()


def refused_global(exc: pickle.UnpicklingError) -> str:
    found = re.search(r"GLOBAL (\S+)", str(exc))
    return found.group(1) if found else "a class"


def unreadable(what: str, exc: BaseException, fix: str) -> PipelineError:
    return PipelineError(f"{what} is not a file torch.load can read ({type(exc).__name__}: {first_line(exc)})", fix)
