"""manifest.json: what built the artifacts in a folder, and their sha256, read by every later stage.

This module owns the record itself (reading, updating, the folder's fixed file names, its layout version)
and the one "rebuild it" hint every error about a folder ends with.  Readers open a folder through
pipeline/folder.py, which enforces what a finished folder must be.
"""

from __future__ import annotations

import json
import platform
import shlex
from importlib import metadata
from pathlib import Path

from pipeline.artifacts import sha256_file, write_json
from pipeline.errors import PipelineError
from pipeline.settings import PRECISIONS, Settings

MANIFEST = "manifest.json"
ENGINE = "engine.plan"
REFERENCE = "reference.npz"
# The shape of a folder and its manifest, recorded in it as "layout".  Bump it when the stages write
# different artifacts or manifest entries: a folder of another layout is rebuilt, never reused, and
# readers refuse it.  4: the manifest records its layout; readers check every graph's sha256.
ARTIFACT_LAYOUT = 4

# The `make engine` variables that decide a folder besides MODEL, PRECISION and OUT, by Settings field:
# a rebuild must repeat the ones that differ from the default to write the same folder again.
_MAKE_VARIABLES = {
    "batch": "BATCH",
    "weights": "WEIGHTS",
    "input_shape": "INPUT_SHAPE",
    "dynamic": "DYNAMIC",
    "target": "TARGET",
    "keep_fp32": "KEEP_FP32",
    "calib": "CALIB",
    "calib_method": "CALIB_METHOD",
}
# Settings switches whose make variable is set (=1) when the setting has this value.
_MAKE_SWITCHES = {"auto_fp32": (False, "NO_AUTO_FP32"), "trust_model_file": (True, "TRUST_MODEL_FILE")}


def read_manifest(folder: Path) -> dict:
    """The folder's manifest, or {} where there is none yet."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return {}
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise PipelineError(
            f"{path} is not valid JSON ({error})", f"rebuild the folder: {rebuild_hint({}, folder)}"
        ) from None
    if not isinstance(manifest, dict):
        raise PipelineError(
            f"{path} holds a JSON {type(manifest).__name__}, not the object a manifest is",
            f"rebuild the folder: {rebuild_hint({}, folder)}",
        )
    return manifest


def require_manifest(folder: Path, hint: str | None = None) -> dict:
    """The manifest of an artifact folder, finished or not, or a PipelineError naming the `make engine` (or `hint`)
    that creates it.  Loading artifacts goes through pipeline.folder.open_folder, which also requires it finished."""
    folder = Path(folder)
    hint = hint or rebuild_hint({}, folder)
    if not folder.is_dir():
        raise PipelineError(f"artifact folder {folder} does not exist", f"create it with `{hint}`")
    manifest = read_manifest(folder)
    if not manifest:
        raise PipelineError(f"{folder} has no {MANIFEST}: it is not an artifact folder", f"create one with `{hint}`")
    return manifest


def rebuild_hint(manifest: dict, folder: Path | None = None, *, force: bool = False) -> str:
    """The `make engine` command that writes this folder again: from the manifest's settings, else from the
    folder's name (engines/<model>-<precision>).  force: add FORCE=1, for a folder the pipeline would reuse."""
    settings = manifest.get("settings")
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


def update_manifest(folder: Path, **entries) -> dict:
    """Set top-level entries and rewrite the manifest atomically."""
    manifest = read_manifest(folder)
    manifest.update(entries)
    write_json(Path(folder) / MANIFEST, manifest)
    return manifest


def describe_artifacts(folder: Path, names: list[str]) -> dict:
    """sha256 and size of each artifact present in the folder."""
    paths = [Path(folder) / name for name in names]
    return {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in paths if p.is_file()}


def artifact_problems(folder: Path, manifest: dict) -> list[str]:
    """Artifacts that are missing or whose sha256 differs from the manifest's."""
    problems = []
    for name, recorded in manifest.get("artifacts", {}).items():
        path = Path(folder) / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif sha256_file(path) != recorded["sha256"]:
            problems.append(f"{name} does not match its sha256 in the manifest (truncated or modified)")
    return problems


def package_versions(packages: tuple[str, ...]) -> dict[str, str]:
    """Python's version and each installed package's; packages not installed are left out."""
    found = {"python": platform.python_version()}
    for package in packages:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return found
