"""The command that writes an artifact folder again, for every error about a folder to end with.

From the manifest's settings where it has them, else from the folder's name (engines/<model>-<precision>).
It names MODEL and PRECISION, the settings that decide a folder of that precision where they differ from their
default (core/settings.py `deciding`), then OUT: a span that each front end words (core/mentions.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from ..core.settings import DEFAULTS, PRECISIONS, Settings, deciding, engine_command


class _Named(Protocol):
    @property
    def name(self) -> str: ...


class Recorded(Protocol):
    """What a hint reads of a folder's record (a Manifest): the settings it was written with, the model's name and
    where it was read from.  Typed by what it reads, not by Manifest, which names this module's hint in its own
    errors: the two would import each other."""

    @property
    def settings(self) -> dict | None: ...

    @property
    def model(self) -> _Named | None: ...

    @property
    def folder(self) -> Path | None: ...


def rebuild_hint(manifest: Recorded | None, folder: Path | None = None, *, force: bool = False) -> str:
    """The command that writes this folder again, into the place where it lies now (`folder`, else where the
    manifest was read from; a copy's too, not the OUT it was built in): from the manifest's settings, else what the
    folder's name tells (engines/<model>-<precision>: its precision; its model part is a file name made from the
    model's, not a MODEL to give).  force: FORCE=1 too, for a folder the pipeline would reuse."""
    folder = Path(folder) if folder is not None else (manifest.folder if manifest is not None else None)
    if manifest is not None and manifest.settings:
        settings = manifest.settings if folder is None else {**manifest.settings, "out_root": str(folder.parent)}
        return make_engine_command(settings, force=force) + _written_elsewhere(manifest, settings, folder)
    precision = folder.name.rpartition("-")[2] if folder is not None else ""
    if folder is None or precision not in PRECISIONS:
        where = "  (it writes engines/<model>-<precision>/)"
        return engine_command(model="<model>", precision="<precision>") + where
    command = make_engine_command({"model": "<model>", "precision": precision, "out_root": str(folder.parent)})
    return command + f"  (<model>: the one {folder.name} was built from; the folder has no manifest to name it)"


def _written_elsewhere(manifest: Recorded, settings: Mapping[str, Any], folder: Path | None) -> str:
    """Where a renamed folder's rebuild writes, which is not the folder itself; "" otherwise."""
    if folder is None or manifest.model is None:
        return ""
    written = Settings(precision=settings.get("precision", DEFAULTS["precision"]), out_root=folder.parent)
    expected = written.artifact_dir(manifest.model.name)
    return "" if expected.name == folder.name else f"  (it writes {expected}, beside this folder)"


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
