"""The settings' options are one library (pipeline/core/arguments.py): every command that takes a setting (the
build stages, bench, serve, accuracy) takes it under its declared spelling, with its declared parsing and help."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from trt_pipeline import models
from trt_pipeline.pipeline.cli import build_parser
from trt_pipeline.pipeline.core.arguments import FOLDER_SETTINGS
from trt_pipeline.pipeline.core.mentions import option_of
from trt_pipeline.pipeline.core.settings import DECLARED, Settings
from trt_pipeline.pipeline.serve.cli import resolve_folder

# Each command and the settings it reads (accuracy: CALIB_METHOD names the INT8 methods it compares).
COMMAND_SETTINGS = {
    "bench": FOLDER_SETTINGS,
    "serve": FOLDER_SETTINGS,
    "accuracy": ("model", "weights", "out_root", "calib", "calib_method", "calib_samples", "calib_batch"),
}


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser(command)
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[command]


@pytest.mark.parametrize("command", sorted(COMMAND_SETTINGS))
def test_a_commands_settings_are_the_declared_options(command: str):
    actions = {action.dest: action for action in _subparser(command)._actions}
    for name in COMMAND_SETTINGS[command]:
        assert name in actions, f"{command} does not take {DECLARED[name].make} as the setting {name}"
        action, declared = actions[name], DECLARED[name]
        assert action.option_strings == [option_of(declared.make)], name
        assert action.choices == declared.choices and f"[{declared.make}]" in (action.help or ""), name
    assert "methods" not in actions  # CALIB_METHOD's one spelling


def test_serve_finds_the_folder_make_engine_writes(tmp_path: Path):
    model = "tests.helpers.toy_models:tiny_cnn"
    argv = ["serve", "--model", model, "--precision", "fp32", "--out", str(tmp_path)]
    folder = resolve_folder(build_parser("serve").parse_args(argv))
    settings = Settings(model=model, precision="fp32", out_root=tmp_path)
    assert folder == settings.artifact_dir(models.canonical_name(model)) == tmp_path / "toy_models-tiny_cnn-fp32"


def test_serve_refuses_an_empty_out_as_the_build_does(capsys):
    # OUT= with nothing after it would mean the current directory.
    with pytest.raises(SystemExit) as exited:
        build_parser("serve").parse_args(["serve", "--model", "resnet18", "--out", ""])
    assert exited.value.code == 2 and "argument --out: an empty path" in capsys.readouterr().err
