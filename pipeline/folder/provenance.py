"""What a folder's build recorded to be checked or repeated later: each artifact's sha256 and size, and the versions
of the packages that made it (both part of the manifest: readers check the first, the reuse key covers both)."""

from __future__ import annotations

import platform
from importlib import metadata
from pathlib import Path

from .artifacts import sha256_file
from .records import Artifact


def describe_artifacts(folder: Path, names: list[str]) -> dict[str, Artifact]:
    """sha256 and size of each artifact present in the folder."""
    paths = {name: Path(folder) / name for name in names}
    return {name: Artifact(sha256_file(p), p.stat().st_size) for name, p in paths.items() if p.is_file()}


def artifact_problems(folder: Path, artifacts: dict[str, Artifact]) -> list[str]:
    """The artifacts (a manifest's) that are missing from the folder or whose sha256 differs from the recorded one."""
    problems = []
    for name, recorded in artifacts.items():
        path = Path(folder) / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif sha256_file(path) != recorded.sha256:
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
