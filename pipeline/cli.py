"""`trt-pipeline <stage|all|command> ...`: the command line that `make` wraps.

Stages run on the artifact folder engines/<model>-<precision>/; `all` runs every
stage and reuses a finished folder.  User mistakes print one `error:` line with the
fix and exit 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import re
import sys
from pathlib import Path

from .core.errors import PipelineError
from .core.extras import missing_module_error
from .core.settings import BUILDERS, CALIB_AUTO, CALIB_METHODS, EXPORTERS, PRECISIONS, BatchProfile, Settings

PROG = "trt-pipeline"
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
        "top-1 of the FP32, FP16 and INT8 graphs (each calibration method) through ONNX Runtime",
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
    "build": "serialize engine.plan with TensorRT (GPU) or TensorRT-RTX (no GPU needed)",
}


def given_path(text: str) -> Path:
    """A path option's value; an empty one (OUT= with nothing after it) would mean the current directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (it would mean the current directory); give a path")
    return Path(text)


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every build stage shares; each maps to a field of Settings (and a make variable)."""
    defaults = Settings()
    parser.add_argument(
        "--model",
        default=defaults.model,
        help="registry name (resnet = resnet50, resnet18..152), package.module:factory, or a checkpoint, "
        "TorchScript (.pt) or torch.export (.pt2) file [MODEL]",
    )
    parser.add_argument("--precision", default=defaults.precision, choices=PRECISIONS, help="[PRECISION]")
    parser.add_argument(
        "--batch", type=BatchProfile.parse, default=defaults.batch, help="engine batch profile min:opt:max [BATCH]"
    )
    parser.add_argument(
        "--weights", type=given_path, help="a torchvision-style state_dict for a registry model [WEIGHTS]"
    )
    parser.add_argument(
        "--input-shape",
        help="input dims without the batch: 3x224x224, or name=DIMS[:dtype],... e.g. "
        "input_ids=128:int64,attention_mask=128:int64 [INPUT_SHAPE]",
    )
    parser.add_argument(
        "--dynamic", help="extra dynamic axes NAME:AXIS[=min:opt:max],... e.g. input_ids:1=1:64:128 [DYNAMIC]"
    )
    parser.add_argument("--out", type=given_path, default=defaults.out_root, help="artifact root folder [OUT]")
    parser.add_argument("--workspace-mib", type=int, default=defaults.workspace_mib, help="builder workspace limit")
    parser.add_argument("--builder", default=defaults.builder, choices=BUILDERS, help="TensorRT module to build with")
    parser.add_argument(
        "--exporter",
        default=defaults.exporter,
        choices=EXPORTERS,
        help="torch.onnx exporter: torchscript, dynamo, or auto (dynamo where TorchScript's graph fails) [EXPORTER]",
    )
    parser.add_argument(
        "--target",
        default=defaults.target,
        help="GPUs a TensorRT-RTX engine runs on: default, current (this machine's GPU) or e.g. sm86,sm89 [TARGET]",
    )
    parser.add_argument(
        "--keep-fp32", help="fp16: node names or op types to keep in FP32, comma-separated (e.g. TopK) [KEEP_FP32]"
    )
    parser.add_argument(
        "--no-float-search",
        dest="float_search",
        action="store_false",
        help="int8: do not try leaving the op where the held-out error starts in float: every op INT8 "
        "[NO_FLOAT_SEARCH]",
    )
    parser.add_argument(
        "--no-auto-fp32",
        dest="auto_fp32",
        action="store_false",
        help="fp16: do not keep the nodes whose values float16 cannot hold in FP32 [NO_AUTO_FP32]",
    )
    parser.add_argument(
        "--trust-model-file",
        action="store_true",
        help="load a whole pickled nn.Module MODEL file: unpickling runs the code it names [TRUST_MODEL_FILE]",
    )
    parser.add_argument(
        "--calib",
        type=given_path,
        help="inputs like the served ones (int8 calibrates on them, fp16 scans them for overflow): "
        "image folder or .npy/.npz [CALIB]",
    )
    parser.add_argument(
        "--calib-method", default=defaults.calib_method, choices=(CALIB_AUTO, *CALIB_METHODS), help="[CALIB_METHOD]"
    )
    parser.add_argument("--calib-samples", type=int, default=defaults.calib_samples, help="calibration samples")
    parser.add_argument("--calib-batch", type=int, default=defaults.calib_batch, help="calibration batch size")
    parser.add_argument(
        "--smooth",
        default=defaults.smooth,
        help="int8: SmoothQuant alpha for the activations MatMul/Gemm read, in (0, 1], off, or auto (0.9 and off "
        "both built, the better on the held-out calibration rows kept) [SMOOTH]",
    )
    parser.add_argument("--recalibrate", action="store_true", help="ignore the calibration cache")
    parser.add_argument(
        "--strict-calib",
        action="store_true",
        help="int8: refuse, instead of warning, when INT8 is much worse on the held-out calibration rows than on "
        "the rows its ranges were fit on, or none could be held out [STRICT_CALIB]",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even when the folder is up to date [FORCE]")


def settings_from(args: argparse.Namespace) -> Settings:
    return Settings(
        model=args.model,
        precision=args.precision,
        batch=args.batch,
        weights=args.weights,
        input_shape=args.input_shape,
        dynamic=args.dynamic,
        out_root=args.out,
        workspace_mib=args.workspace_mib,
        builder=args.builder,
        exporter=args.exporter,
        target=args.target,
        keep_fp32=args.keep_fp32,
        auto_fp32=args.auto_fp32,
        float_search=args.float_search,
        trust_model_file=args.trust_model_file,
        calib=args.calib,
        calib_method=args.calib_method,
        calib_samples=args.calib_samples,
        calib_batch=args.calib_batch,
        smooth=args.smooth,
        recalibrate=args.recalibrate,
        strict_calib=args.strict_calib,
        force=args.force,
    )


def _run_stage(args: argparse.Namespace) -> int:
    from .stages.sequence import make_engine, run_stage

    settings = settings_from(args)
    if args.stage in ("engine", "all"):
        make_engine(settings)
    else:
        run_stage(settings, args.stage)
    return 0


class _HelpWithDefaults(argparse.HelpFormatter):
    """Shows each option's default, except the empty ones (None, False) that would only add noise."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            action.option_strings
            and action.default not in (None, False, argparse.SUPPRESS)
            and "%(default)" not in text
        ):
            text += " (default: %(default)s)"
        return text


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; the arguments of an extra command are added (and its module imported) only for `command`."""
    parser = argparse.ArgumentParser(
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


def _version() -> str:
    from .. import __version__

    return __version__


_FILE_SYSTEM_FIXES = {
    errno.ENOSPC: "free disk space (or point OUT= at a disk with room), then run again",
    errno.EDQUOT: "free disk space within your quota (or point OUT= at another disk), then run again",
    errno.EACCES: "choose a folder you may write to (OUT=...), or fix its permissions",
    errno.EROFS: "choose a folder on a writable file system (OUT=...)",
    errno.ENOTDIR: "a part of the path is a file, not a folder: choose another path (OUT=...)",
    errno.ENOENT: "check the path; a relative path is taken from the current directory",
    errno.EFBIG: "a file size limit stopped the write: raise it (ulimit -f) or point OUT= at another file system",
}


def _file_system_fix(error: OSError) -> str:
    return _FILE_SYSTEM_FIXES.get(error.errno or 0, "check the path and the disk, then run again")


def _print_error(text: str) -> None:
    if os.environ.get(FRONT_END_VARIABLE) != "make":
        text = in_command_line_terms(text)
    print(f"error: {text}", file=sys.stderr)


def in_command_line_terms(text: str) -> str:
    """A message written in make's terms (`make engine MODEL=x FORCE=1`, `CALIB=...`) in the command line's
    (`trt-pipeline engine --model x --force`, `--calib ...`): the options' help names their make variable."""
    parser = argparse.ArgumentParser(add_help=False)
    add_settings_arguments(parser)
    options = {}
    for action in parser._actions:
        variable = re.search(r"\[([A-Z_0-9]+)\]$", action.help or "")
        if variable:
            options[variable.group(1)] = (action.option_strings[-1], action.nargs == 0)
    text = re.sub(r"\bmake (engine|bench|serve|accuracy|calibration-images)\b", rf"{PROG} \1", text)

    def option(match: re.Match[str]) -> str:
        flag, takes_no_value = options[match.group(1)]
        return flag if takes_no_value else f"{flag} {match.group(2) or ''}"

    names = "|".join(sorted(options, key=len, reverse=True))
    return re.sub(rf"\b({names})=(1\b)?", option, text)


def main(argv: list[str] | None = None) -> int:
    try:
        arguments = sys.argv[1:] if argv is None else argv
        command = next(
            (word for word in arguments if not word.startswith("-")), None
        )  # the first word that is no option
        args = build_parser(command).parse_args(arguments)
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
