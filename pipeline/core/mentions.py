"""Settings named in messages, held as data and worded by the front end that shows them.

A message that names a setting or a command (a fix such as "add CALIB=<folder>", the command that writes a
folder again) holds it as a span: the settings' fields, their make variables and values, as JSON between two
control characters.  core/settings.py writes the spans (`mention`, `mention_name`, `engine_command`) from the
settings' declaration.  A span is plain text to Python, so it survives f-strings and re-wrapping
(`PipelineError(f"...: {error.problem}", error.fix)`); it is worded only when the text is read:
PipelineError renders its problem, its fix and str() (core/errors.py), and text shown another way (a printed
warning, a report) goes through `render`.  The words are those of the front end this process speaks, set once
by cli.main (the Makefile sets TRT_PIPELINE_FRONT_END=make); Python by default:

    make          CALIB=<folder>            make engine MODEL=x PRECISION=fp32 OUT=d FORCE=1
    command line  --calib <folder>          trt-pipeline engine --model x --precision fp32 --out d --force
    python        Settings(calib=<folder>)  make_engine(Settings(model="x", precision="fp32", out_root="d", force=True))

A value in angle brackets (<folder>) or "..." is a placeholder, shown as it is.  A switch (a bool setting) is
shown given: FORCE=1, --force, force=True.  A setting named without a value: CALIB, --calib, Settings.calib.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
from collections.abc import Iterator

PYTHON, COMMAND_LINE, MAKE = "python", "command line", "make"
FRONT_ENDS = (PYTHON, COMMAND_LINE, MAKE)
PROG = "trt-pipeline"
# ASCII's start and end of text: characters no message writes itself, and JSON escapes inside a string.
_START, _END = "\x02", "\x03"
_SPAN = re.compile(f"{_START}(.*?){_END}", re.S)
_front_end = PYTHON


def option_of(variable: str) -> str:
    """The command line's option for a make variable, CALIB_METHOD -> --calib-method (the Makefile's rule too)."""
    return "--" + variable.lower().replace("_", "-")


@contextlib.contextmanager
def spoken_in(front_end: str) -> Iterator[None]:
    """Word the spans read inside the block for `front_end` (cli.main: the whole run of a command)."""
    global _front_end
    if front_end not in FRONT_ENDS:
        raise ValueError(f"unknown front end {front_end!r}: one of {FRONT_ENDS}")
    before, _front_end = _front_end, front_end
    try:
        yield
    finally:
        _front_end = before


def span(settings: list[tuple], command: str | None = None, *, more: bool = False) -> str:
    """A span naming `settings`, each (field, make variable, value) or, named without a value, (field, variable);
    as a `command`'s arguments where one is given ("engine": the command that writes a folder), followed by
    "..." (more arguments to give) where `more`."""
    return _START + json.dumps({"command": command, "settings": settings, "more": more}) + _END


def command(name: str) -> str:
    """A command with no settings: make calibration-images, or trt-pipeline calibration-images (Python too, which
    has no call of its own for it)."""
    return span([], name)


def render(text: str) -> str:
    """`text` with its spans worded for the front end this process speaks."""
    return _SPAN.sub(lambda match: _words(json.loads(match.group(1)), _front_end), text)


def _words(span: dict, front_end: str) -> str:
    command, settings, more = span["command"], span["settings"], span["more"]
    if front_end == PYTHON and command in (None, "engine"):
        return _python_words(command, settings, more)
    words = [_shell_words(front_end, *setting) for setting in settings] + (["..."] if more else [])
    if command is not None:
        words.insert(0, f"make {command}" if front_end == MAKE else f"{PROG} {command}")
    return " ".join(words)


def _shell_words(front_end: str, field: str, variable: str, *value: object) -> str:
    """A setting as make (CALIB=x) or the command line (--calib x) gives it; the field is Python's word alone."""
    name = variable if front_end == MAKE else option_of(variable)
    if not value:
        return name
    if isinstance(value[0], bool):  # a switch, given
        return f"{name}=1" if front_end == MAKE else name
    text = str(value[0]) if _placeholder(value[0]) else shlex.quote(str(value[0]))
    # --batch=-1:2:3: argparse would read a separate -1:2:3 as an option
    return f"{name}={text}" if front_end == MAKE or text.startswith("-") else f"{name} {text}"


def _python_words(command: str | None, settings: list, more: bool) -> str:
    if command is None and len(settings) == 1 and len(settings[0]) == 2:
        return f"Settings.{settings[0][0]}"
    arguments = [f"{field}={_literal(value)}" for field, _, value in settings] + (["..."] if more else [])
    call = f"Settings({', '.join(arguments)})"
    return call if command is None else f"make_engine({call})"


def _literal(value: object) -> str:
    """A value as Python source: "x" for a string (placeholders as they are), True, 4096."""
    if isinstance(value, str) and not _placeholder(value):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def _placeholder(value: object) -> bool:
    return isinstance(value, str) and (value == "..." or (value.startswith("<") and value.endswith(">")))
