"""load_runner's options, checked for every backend before a runner is made: each name is a keyword of the backend's
runner, each value of the type that keyword declares (the runner's signature is the one declaration), and each count
1 or more.  What a value means (a device string, provider names, an execution mode) is checked where it is read.

Unchecked, `device=0` failed as AttributeError deep inside, `sessions="2"` as TypeError, and
`providers="CPUExecutionProvider"` was split into letters by ONNX Runtime.
"""

from __future__ import annotations

import inspect
import types
import typing
from typing import Any

from ..core.errors import PipelineError

# Options that count something: 1 or more (None, where the runner takes it, keeps a default).
COUNTS = {"intra_op_threads": "intra-op threads", "sessions": "sessions", "contexts": "execution contexts"}


def check_options(runner_class: type, backend: str, options: dict[str, Any]) -> None:
    parameters = inspect.signature(runner_class, eval_str=True).parameters  # annotations as types, not strings
    known = [name for name, p in parameters.items() if p.kind is p.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise PipelineError(
            f"the {backend} runner takes no option {', '.join(unknown)}",
            f"give only {', '.join(known)} (keywords of load_runner for backend={backend!r})",
        )
    for name, value in options.items():
        hint = parameters[name].annotation
        if not _matches(value, hint):
            raise PipelineError(
                f"{name}={value!r} is {_kind(value)}; the {backend} runner takes {_words(hint)}",
                f"give {name} as {_words(hint)} (its default is {parameters[name].default!r})",
            )
        if name in COUNTS and value is not None and value < 1:
            none = ", or None for the default" if _matches(None, hint) else ""
            raise PipelineError(f"{name}={value}: a number of {COUNTS[name]} is 1 or more", f"give 1 or more{none}")


def _matches(value: Any, hint: Any) -> bool:
    if hint is Any:
        return True
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return any(_matches(value, option) for option in typing.get_args(hint))
    if typing.get_origin(hint) is list:
        return isinstance(value, list) and all(_matches(item, typing.get_args(hint)[0]) for item in value)
    if typing.get_origin(hint) is dict:
        key, item = typing.get_args(hint)
        return isinstance(value, dict) and all(_matches(k, key) and _matches(v, item) for k, v in value.items())
    if hint is type(None):
        return value is None
    if hint in (int, float):  # True is no count: bool is an int to Python, not to a caller
        return isinstance(value, (int, float) if hint is float else int) and not isinstance(value, bool)
    return isinstance(value, hint)


_WORDS = {int: "a whole number", float: "a number", str: "a string", bool: "True or False", type(None): "None"}


def _words(hint: Any) -> str:
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return " or ".join(_words(option) for option in typing.get_args(hint))
    if typing.get_origin(hint) is list:
        return f"a list of {_words(typing.get_args(hint)[0]).removeprefix('a ')}s"
    if typing.get_origin(hint) is dict:
        key, item = (_words(arg).removeprefix("a ") for arg in typing.get_args(hint))
        return f"a dict of {key}s to {item}s"
    return _WORDS.get(hint, getattr(hint, "__name__", str(hint)))


def _kind(value: Any) -> str:
    noun = type(value).__name__
    return "None" if value is None else f"an {noun}" if noun[0] in "aeiou" else f"a {noun}"
