"""What the model tests share: the toy models' import path, and a user's directory with modules written into it."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

TOY = "tests.helpers.toy_models"


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The current directory of a user running the pipeline; sys.path and sys.modules restored afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path
    for name in [n for n, m in sys.modules.items() if str(getattr(m, "__file__", "")).startswith(str(tmp_path))]:
        del sys.modules[name]


def write_module(directory: Path, name: str, source: str) -> Path:
    path = directory / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return path
