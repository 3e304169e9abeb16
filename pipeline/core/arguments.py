"""The settings as command-line options, declared once (core/settings.py) for every command that takes them: the
build stages, bench, serve and accuracy add the options they read with `add_settings_arguments` and get back what
the user gave with `given_settings`, so each setting has one spelling, one help and one check everywhere."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .mentions import option_of
from .precision import Precision
from .settings import DECLARED, DEFAULTS, Declared, Settings

# The settings that name an artifact folder, engines/<model>-<precision> (Settings.artifact_dir): what a command
# that reads a folder (bench, serve) takes instead of the folder's path.
FOLDER_SETTINGS = ("model", "precision", "out_root")


def given_path(text: str) -> Path:
    """A path option's value; an empty one (OUT= with nothing after it) would mean the current directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (it would mean the current directory); give a path")
    return Path(text)


def add_settings_arguments(
    parser: argparse.ArgumentParser, names: Iterable[str] = tuple(DECLARED), defaults: dict[str, Any] | None = None
) -> None:
    """An option for each of `names` (every setting by default), from its declaration (core/settings.py).  An
    option not given leaves no attribute (argparse.SUPPRESS), so `given_settings` tells what the user gave;
    `defaults`: a command's own defaults where they differ from the declaration's (shown in its help)."""
    for name in names:
        default = (defaults or {}).get(name, DEFAULTS[name])
        parser.add_argument(option_of(DECLARED[name].make), **_argument(name, default))


def _argument(name: str, default: object) -> dict:
    """add_argument's keywords for a setting: a bool is a switch that sets the value opposite its default."""
    declared = DECLARED[name]
    common = {"dest": name, "default": argparse.SUPPRESS, "help": _help(declared, default)}
    if isinstance(default, bool):
        return {**common, "action": "store_false" if default else "store_true"}
    parse = given_path if declared.parse is Path else declared.parse
    return {
        **common,
        "type": parse,
        "choices": declared.choices,
        "metavar": None if declared.choices else declared.make,
    }


def _help(declared: Declared, default: object) -> str:
    """The declared help with the precisions (or the post-processing) it is for, its default and its make variable
    (argparse's %% escaped)."""
    text = declared.help
    if declared.precisions != tuple(Precision):
        text = f"{' and '.join(declared.precisions)}: {text}"
    if declared.postprocess is not None:
        text = f"{declared.postprocess}: {text}"
    if default is not None and not isinstance(default, bool):
        text += f" (default: {default})"
    return f"{text} [{declared.make}]".replace("%", "%%")


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the options gave, by field name (add_settings_arguments leaves out those not given)."""
    return {name: getattr(args, name) for name in DECLARED if hasattr(args, name)}


def settings_from(args: argparse.Namespace) -> Settings:
    """The options' settings, checked: an option given for a precision it does not change is refused, even
    at its default value."""
    given = given_settings(args)
    return Settings(**given).check(given=given)
