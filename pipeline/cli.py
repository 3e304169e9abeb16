"""`trt-pipeline <stage|all|command> ...`: the command line that `make` wraps.

Stages run on the artifact folder engines/<model>-<precision>/; `all` runs every
stage and reuses a finished folder.  User mistakes print one `error:` line with the
fix and exit 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import functools
import importlib
import os
import signal
import subprocess
import sys

from .core.arguments import add_settings_arguments, settings_from
from .core.errors import PipelineError
from .core.extras import missing_module_error
from .core.mentions import COMMAND_LINE, MAKE, PROG, render, spoken_in
from .core.settings import mention, mention_name

# The Makefile sets this, so errors speak make's language (CALIB=...) there and the command line's (--calib) here.
FRONT_END_VARIABLE = "TRT_PIPELINE_FRONT_END"

# Commands beyond the build stages: name -> (module, help).  A module is imported only when its command runs,
# so `serve` starts without the build (torch) and a slim install runs what it has; each module has
# add_arguments(parser) and main(args) -> int.
EXTRA_COMMANDS: dict[str, tuple[str, str]] = {
    "bench": (
        "trt_pipeline.pipeline.bench",
        "latency of the same inputs through PyTorch, ONNX Runtime and the engine: bench.json/.md/.png",
    ),
    "serve": (
        "trt_pipeline.pipeline.serve.cli",
        "serve a folder with the Open Inference Protocol (KServe v2, Triton's): REST and gRPC, dynamic batching",
    ),
    "accuracy": (
        "trt_pipeline.pipeline.quality.accuracy",
        "top-1 of the FP32, FP16 and INT8 graphs (each method --calib-method names) through ONNX Runtime",
    ),
    "triton": (
        "trt_pipeline.pipeline.triton.repository",
        "write a Triton Inference Server model repository (config.pbtxt + engine or ONNX graph) for an artifact folder",
    ),
    "diagnose": (
        "trt_pipeline.pipeline.quality.diagnose",
        "compare a float16 or INT8 graph with the FP32 graph tensor by tensor; name the first node that goes wrong",
    ),
    "calibration-images": (
        "trt_pipeline.calibration.photos",
        "write the 40 calibration photographs (10 photos x 4 views) that scikit-image and scikit-learn ship",
    ),
}

STAGE_HELP = {
    "engine": "every stage in order (= make engine); reuses a finished folder whose inputs and settings are unchanged",
    "prepare": "load the model, switch it to eval mode and prove it (no dropout, BatchNorm on running stats)",
    "export": "prepare, then export model.onnx (opset 17, dynamic batch) and PyTorch's reference outputs",
    "check": "onnx.checker (full), shape inference, opset 17, batch axis still symbolic",
    "simplify": "onnxsim with the batch axis kept dynamic; keeps the checked graph if it fails",
    "parity": "model.onnx through ONNX Runtime against PyTorch at several batch sizes",
    "precision": "write model.fp16.onnx (or model.int8.onnx) and check its parity",
    "postprocess": "with --postprocess nms: append NMS to each graph that serves (model.nms.onnx, ...) and check it",
    "build": "serialize engine.plan with TensorRT (GPU) or TensorRT-RTX (no GPU needed)",
}


def _run_stage(args: argparse.Namespace) -> int:
    from .stages.sequence import make_engine, run_stage

    settings = settings_from(args)
    if args.stage in ("engine", "all"):
        make_engine(settings)
    else:
        run_stage(settings, args.stage)
    return 0


class _HelpWithDefaults(argparse.HelpFormatter):
    """Shows each option's default, except the empty ones (None) and a switch's (--no-batching's True would read
    as if the switch were on)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            action.option_strings
            and action.default not in (None, argparse.SUPPRESS)
            and not isinstance(action.default, bool)
            and "%(default)" not in text
        ):
            text += " (default: %(default)s)"
        return text


class _EachOptionOnce(argparse.ArgumentParser):
    """Refuses an option given twice (`--precision int8 --precision fp32`): argparse keeps the last value without a
    word.  Every subcommand's parser is of this class (add_subparsers makes them of the parser's own)."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def, override]
        repeated = _repeated_option(self, sys.argv[1:] if args is None else list(args))
        if repeated:
            self.error(repeated)
        return super().parse_known_args(args, namespace)


def _repeated_option(parser: argparse.ArgumentParser, words: list[str]) -> str | None:
    """What is wrong where an option is given twice among `words`, naming both values; None where each is given at
    most once.  Options that gather (append, count) and those that exit (help, version) may come again."""
    seen: dict[argparse.Action, str | None] = {}
    remaining = iter(words)
    for word in remaining:
        if word == "--":  # the rest are positional arguments
            break
        action = _option_action(parser, word.partition("=")[0]) if word.startswith("--") else None
        if action is None or not isinstance(action, _SET_ONCE):
            continue
        value = word.partition("=")[2] if "=" in word else None
        if value is None and action.nargs not in (0, "?"):  # a switch's word (--force 0) is optional: not taken
            value = next(remaining, "")
        if action in seen:
            option, first = action.option_strings[-1], seen[action]
            values = "" if value is None or first is None else f" ({first!r}, then {value!r})"
            return f"{option} is given twice{values}: give it once" + (", with the value meant" if values else "")
        seen[action] = value
    return None


# The actions whose value a second use would replace without a word.
_SET_ONCE = (argparse._StoreAction, argparse._StoreConstAction)  # store_true/false are store_const too


def _option_action(parser: argparse.ArgumentParser, name: str) -> argparse.Action | None:
    """The action of an option as argparse reads it: its whole name, or a prefix of one option's only."""
    options = parser._option_string_actions
    if name in options:
        return options[name]
    matches = {action for option, action in options.items() if option.startswith(name)}
    return matches.pop() if len(matches) == 1 else None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; the arguments of an extra command are added (and its module imported) only for `command`."""
    parser = _EachOptionOnce(
        prog=PROG,
        description="Take a PyTorch model to a checked ONNX graph and a serialized TensorRT engine. "
        "The subcommands mirror the make targets (make engine = trt-pipeline engine).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="stage", required=True, metavar="<stage|command>")
    for name, help_text in STAGE_HELP.items():
        # `all` is the stage's older name, kept so existing scripts still run.
        aliases = ["all"] if name == "engine" else []
        stage = commands.add_parser(
            name, aliases=aliases, help=help_text, description=help_text, formatter_class=_HelpWithDefaults
        )
        add_settings_arguments(stage)
        stage.set_defaults(handler=_run_stage)
    for name, (module_name, help_text) in EXTRA_COMMANDS.items():
        subparser = commands.add_parser(name, help=help_text, description=help_text, formatter_class=_HelpWithDefaults)
        if name == command:
            module = importlib.import_module(module_name)
            module.add_arguments(subparser)
            subparser.set_defaults(handler=module.main)
    return parser


def _command(arguments: list[str]) -> str | None:
    """The command among the arguments: the first word that is no option."""
    return next((word for word in arguments if not word.startswith("-")), None)


def _version() -> str:
    from .. import __version__

    return __version__


_FILE_SYSTEM_FIXES = {
    errno.ENOSPC: f"free disk space (or point {mention(out_root='...')} at a disk with room), then run again",
    errno.EDQUOT: f"free disk space within your quota (or point {mention(out_root='...')} at another disk), "
    "then run again",
    errno.EACCES: f"choose a folder you may write to ({mention(out_root='...')}), or fix its permissions",
    errno.EROFS: f"choose a folder on a writable file system ({mention(out_root='...')})",
    errno.ENOTDIR: f"a part of the path is a file, not a folder: choose another path ({mention(out_root='...')})",
    errno.ENOENT: "check the path; a relative path is taken from the current directory",
    errno.EFBIG: "a file size limit stopped the write: raise it (ulimit -f) or point "
    f"{mention(out_root='...')} at another file system",
}


def _file_system_fix(error: OSError) -> str:
    return _FILE_SYSTEM_FIXES.get(error.errno or 0, "check the path and the disk, then run again")


def _print_error(text: str) -> None:
    print(f"error: {render(text)}", file=sys.stderr)


# The commands that load and run a model.  A crash in a native library (torch, ONNX Runtime, onnxsim, TensorRT) or
# the kernel's out-of-memory killer ends the process that runs them without a word, so the command line runs them in a
# child and explains such an end (run_watched); the child, marked by this variable, runs the command itself.
WATCHED_COMMANDS = frozenset([*STAGE_HELP, "all", "bench", "accuracy", "diagnose"])
WATCHED_CHILD_VARIABLE = "TRT_PIPELINE_WATCHED_CHILD"
PR_SET_PDEATHSIG = 1  # prctl's option: the signal a process gets when its parent dies
_FORWARDED = (signal.SIGTERM, signal.SIGHUP)  # a stop asked of the command (timeout, a closed terminal) is the child's


def watched(arguments: list[str]) -> bool:
    """Whether the command line should run these arguments in a watched child (run_watched)."""
    return os.environ.get(WATCHED_CHILD_VARIABLE) != "1" and _command(arguments) in WATCHED_COMMANDS


def run_watched(arguments: list[str]) -> int:
    """Run the command in a child process (`python -m trt_pipeline`, its output straight to the terminal) and return
    its exit status; where a signal killed it, print one error that names the signal, what most likely sent it and
    the fix, and return 2.  Ctrl-C reaches the child from the terminal and ends it as it ends a command (130)."""
    child = subprocess.Popen(
        [sys.executable, "-m", "trt_pipeline", *arguments],
        env={**os.environ, WATCHED_CHILD_VARIABLE: "1"},
        preexec_fn=functools.partial(_die_with, os.getpid()),  # noqa: PLW1509 (this process runs one thread)
    )
    signal.signal(signal.SIGINT, lambda number, frame: None)
    for forwarded in _FORWARDED:
        signal.signal(forwarded, lambda number, frame: child.send_signal(number))
    status = child.wait()
    if status >= 0 or -status in (signal.SIGINT, *_FORWARDED):  # it ended, or was stopped as asked
        return status if status >= 0 else 128 - status
    with spoken_in(_front_end()):
        _print_error(_killed(signal.Signals(-status)))
    return 2


def _die_with(parent: int) -> None:
    """In the child before it starts: the kernel kills it when `parent` dies (Linux's parent-death signal), so a
    command killed outright (kill -9, a job's cancellation) leaves no build running on without it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: a killed command's child runs on to its end
        return
    if os.getppid() != parent:  # the parent died before the signal was set
        os._exit(1)


def _killed(number: signal.Signals) -> str:
    """The error for a child a signal killed: SIGKILL, which nothing catches, most often comes from the kernel's
    out-of-memory killer; any other is a crash in native code."""
    if number == signal.SIGKILL:
        why = "killed by SIGKILL, most often the kernel's out-of-memory killer (dmesg names it; else a kill -9): it "
        why += "needed more memory than the machine had free"
        fix = (
            f"give it more memory, or make it need less: a smaller maximum in {mention_name('batch')} or in the "
            f"{mention_name('dynamic')} ranges (every check runs the profile's largest inputs)"
        )
    else:
        why = f"it crashed with {number.name} ({signal.strsignal(number)}) in native code (torch's, ONNX Runtime's, "
        why += "onnxsim's, TensorRT's or the model's own)"
        fix = (
            f"run it again with PYTHONFAULTHANDLER=1 to see where, and report it with the model and `{PROG} "
            f"--version`; a build may get past it with another {mention_name('exporter')} or precision"
        )
    return (
        f"the command stopped: {why}; the last line above is the last step that finished, and nothing it was "
        f"writing was kept (the next run removes what is left and starts that step again)\n  fix: {fix}"
    )


def main(argv: list[str] | None = None) -> int:
    """The command line: errors name settings as make does under make (TRT_PIPELINE_FRONT_END=make), as options
    otherwise (core/mentions.py)."""
    with spoken_in(_front_end()):
        return _main(argv)


def _front_end() -> str:
    return MAKE if os.environ.get(FRONT_END_VARIABLE) == MAKE else COMMAND_LINE


def _main(argv: list[str] | None) -> int:
    try:
        arguments = sys.argv[1:] if argv is None else argv
        args = build_parser(_command(arguments)).parse_args(arguments)
        return int(args.handler(args) or 0)
    except PipelineError as error:
        _print_error(str(error))
        return 2
    except ModuleNotFoundError as error:  # an extra that is not installed; any other module is a bug
        missing = missing_module_error(error)
        if missing is None:
            raise
        _print_error(str(missing))
        return 2
    except OSError as error:  # the file system said no: a full disk, a read-only or missing folder
        _print_error(f"{error}\n  fix: {_file_system_fix(error)}")
        return 2
    except KeyboardInterrupt:
        print("interrupted: finished artifacts are intact; nothing half-written was left", file=sys.stderr)
        return 130
