"""The command that writes an artifact folder again, for every error about a folder to end with.

From the manifest's settings where it has them, else from the folder's name (engines/<model>-<precision>).
It names MODEL and PRECISION, the settings that decide a folder of that precision where they differ from their
default (core/settings.py `deciding`), then OUT: a span that each front end words (core/mentions.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from ..core.settings import DEFAULTS, PRECISIONS, deciding, engine_command


class Recorded(Protocol):
    """What a hint reads of a folder's record (a Manifest): the settings it was written with.  Typed by what it
    reads, not by Manifest, which names this module's hint in its own errors: the two would import each other."""

    @property
    def settings(self) -> dict | None: ...


def rebuild_hint(manifest: Recorded | None, folder: Path | None = None, *, force: bool = False) -> str:
    """The command that writes this folder again: from the manifest's settings, else from the folder's name
    (engines/<model>-<precision>).  force: FORCE=1 too, for a folder the pipeline would reuse."""
    named = _name_parts(Path(folder)) if folder is not None else None
    if manifest is not None and manifest.settings:
        return make_engine_command(manifest.settings, force=force)
    if named and folder is not None:
        model, precision = named
        return make_engine_command({"model": model, "precision": precision, "out_root": folder.parent}, force=force)
    where = "  (it writes engines/<model>-<precision>/)"
    return engine_command(model="<model>", precision="<precision>") + where


def make_engine_command(settings: Mapping[str, Any], *, force: bool = False) -> str:
    """The command that writes the folder of `settings` (a Settings.as_record(); a setting it lacks is at its
    default): MODEL, PRECISION, those deciding that precision's folder that differ from their default, OUT."""
    value = {**DEFAULTS, **settings}
    words = {"model": value["model"], "precision": value["precision"]}
    words |= {
        name: value[name]
        for name in deciding(value["precision"], value["postprocess"])
        if name not in words and value[name] is not None and value[name] != DEFAULTS[name]
    }
    words["out_root"] = value["out_root"]
    return engine_command(**words, **({"force": True} if force else {}))


def _name_parts(folder: Path) -> tuple[str, str] | None:
    model, _, precision = folder.name.rpartition("-")
    return (model, precision) if model and precision in PRECISIONS else None
