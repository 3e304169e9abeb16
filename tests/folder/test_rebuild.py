"""The command an error gives to write a folder again (pipeline/folder/rebuild.py): it writes the folder where it
lies now, and names no MODEL it cannot know."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from trt_pipeline.pipeline.core.mentions import MAKE, render, spoken_in
from trt_pipeline.pipeline.core.settings import Settings
from trt_pipeline.pipeline.folder.manifest import read_manifest
from trt_pipeline.pipeline.folder.rebuild import rebuild_hint
from trt_pipeline.pipeline.stages.sequence import make_engine

TINY = "tests.helpers.toy_models:tiny_cnn"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_engine(Settings(model=TINY, precision="fp32", out_root=tmp_path_factory.mktemp("engines")))


def _words(hint: str) -> str:
    with spoken_in(MAKE):
        return render(hint)


def test_a_copied_folder_is_rebuilt_where_it_lies_not_where_it_was_built(built, tmp_path):
    # The hint named the OUT of the build the folder was copied from.
    copy = Path(shutil.copytree(built, tmp_path / "served" / built.name))
    hint = _words(rebuild_hint(read_manifest(copy)))
    assert hint == f"make engine MODEL={TINY} PRECISION=fp32 OUT={copy.parent}"
    assert str(built.parent) not in hint


def test_a_renamed_copy_says_where_its_rebuild_writes(built, tmp_path):
    copy = Path(shutil.copytree(built, tmp_path / "mine"))
    hint = _words(rebuild_hint(read_manifest(copy)))
    written = tmp_path / built.name
    assert hint == f"make engine MODEL={TINY} PRECISION=fp32 OUT={tmp_path}  (it writes {written}, beside this folder)"


def test_without_a_manifest_the_hint_names_no_model_it_cannot_know(tmp_path):
    # The folder's name holds a file name made from the model's (toy_models-tiny_cnn), which is no MODEL.
    folder = tmp_path / "toy_models-tiny_cnn-fp16"
    folder.mkdir()
    hint = _words(rebuild_hint(read_manifest(folder), folder))
    assert hint.startswith(f"make engine MODEL=<model> PRECISION=fp16 OUT={tmp_path}  (<model>: the one ")
    assert "MODEL=toy_models" not in hint
