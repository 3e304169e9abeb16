"""The command that writes an artifact folder again, for every error about a folder to end with.

From the manifest's settings where it has them, else from the folder's name (engines/<model>-<precision>).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.settings import PRECISIONS, Settings

if TYPE_CHECKING:
    from .manifest import Manifest

# The `make engine` variables that decide a folder besides MODEL, PRECISION and OUT, by Settings field:
# a rebuild must repeat the ones that differ from the default to write the same folder again.
_MAKE_VARIABLES = {
    "batch": "BATCH",
    "weights": "WEIGHTS",
    "input_shape": "INPUT_SHAPE",
    "dynamic": "DYNAMIC",
    "exporter": "EXPORTER",
    "target": "TARGET",
    "keep_fp32": "KEEP_FP32",
    "calib": "CALIB",
    "calib_method": "CALIB_METHOD",
    "smooth": "SMOOTH",
}
# Settings switches whose make variable is set (=1) when the setting has this value.
_MAKE_SWITCHES = {
    "auto_fp32": (False, "NO_AUTO_FP32"),
    "float_search": (False, "NO_FLOAT_SEARCH"),
    "trust_model_file": (True, "TRUST_MODEL_FILE"),
    "strict_calib": (True, "STRICT_CALIB"),
}


def rebuild_hint(manifest: Manifest | None, folder: Path | None = None, *, force: bool = False) -> str:
    """The `make engine` command that writes this folder again: from the manifest's settings, else from the
    folder's name (engines/<model>-<precision>).  force: add FORCE=1, for a folder the pipeline would reuse."""
    settings = manifest.settings if manifest is not None else None
    named = _name_parts(Path(folder)) if folder is not None else None
    if settings:
        command = make_engine_command(settings["model"], settings["precision"], settings["out_root"], settings)
    elif named and folder is not None:
        command = make_engine_command(*named, Path(folder).parent)
    else:
        return "make engine MODEL=<model> PRECISION=<precision>  (it writes engines/<model>-<precision>/)"
    return f"{command} FORCE=1" if force else command


def make_engine_command(model: str, precision: str, out: str | Path, settings: dict | None = None) -> str:
    """`make engine MODEL=... PRECISION=... [the non-default settings] OUT=...`, each value quoted for a shell."""
    settings = settings or {}
    defaults = Settings().as_record()
    words = [f"MODEL={model}", f"PRECISION={precision}"]
    words += [
        f"{variable}={settings[key]}"
        for key, variable in _MAKE_VARIABLES.items()
        if settings.get(key) is not None and settings[key] != defaults[key]
    ]
    words += [f"{variable}=1" for key, (value, variable) in _MAKE_SWITCHES.items() if settings.get(key) is value]
    words.append(f"OUT={out}")
    return "make engine " + " ".join(shlex.quote(word) for word in words)


def _name_parts(folder: Path) -> tuple[str, str] | None:
    model, _, precision = folder.name.rpartition("-")
    return (model, precision) if model and precision in PRECISIONS else None
