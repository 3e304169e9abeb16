"""manifest.json: what built the artifacts in a folder, and their sha256, read by every later stage."""

from __future__ import annotations

import json
import platform
from importlib import metadata
from pathlib import Path

from pipeline.artifacts import sha256_file, write_json
from pipeline.errors import PipelineError
from pipeline.settings import PRECISIONS

MANIFEST = "manifest.json"


def read_manifest(folder: Path) -> dict:
    """The folder's manifest, or {} where there is none yet."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise PipelineError(f"{path} is not valid JSON ({error})", "delete the folder and rebuild it") from None


def require_manifest(folder: Path, hint: str | None = None) -> dict:
    """The manifest of an artifact folder, or a PipelineError naming the `make engine` (or `hint`) that creates it."""
    folder = Path(folder)
    hint = hint or make_engine_hint(folder)
    if not folder.is_dir():
        raise PipelineError(f"artifact folder {folder} does not exist", f"create it with `{hint}`")
    manifest = read_manifest(folder)
    if not manifest:
        raise PipelineError(f"{folder} has no {MANIFEST}: it is not an artifact folder", f"create one with `{hint}`")
    return manifest


def make_engine_hint(folder: Path, manifest: dict | None = None) -> str:
    """The `make engine` command that (re)creates `folder`: from its manifest, else from its name."""
    settings = (manifest or {}).get("settings")
    if settings:
        return f"make engine MODEL={settings['model']} PRECISION={settings['precision']} OUT={settings['out_root']}"
    model, _, precision = Path(folder).name.rpartition("-")
    if model and precision in PRECISIONS:
        return f"make engine MODEL={model} PRECISION={precision} OUT={Path(folder).parent}"
    return "make engine MODEL=<model> PRECISION=<precision>  (it writes engines/<model>-<precision>/)"


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
