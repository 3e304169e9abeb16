"""`trt-pipeline bench` / `make bench MODEL=resnet`: latency of one artifact folder through every backend.

The same inputs go through PyTorch eager FP32 (the reference), what `serve` runs on this machine
(load_runner(folder, backend="auto"): the engine, or ONNX Runtime on the graph it picks), PyTorch
AMP FP16 (GPU), torch.compile (inductor: AMP FP16 on a GPU, FP32 on a CPU), ONNX Runtime on the
FP32 graph (through the runner and in a bare session) and on the INT8 graph, and the TensorRT
engine (GPU), at each batch size, in two stated modes (end to end, device-resident), in rounds
whose agreement gives the stability verdict.  bench.json, bench.md and bench.png land in the folder.

    from . import run_benchmark, write_reports
    report = run_benchmark(Path("engines/resnet50-fp16"), batches=[1, 8])
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ... import models
from ..core.arguments import FOLDER_SETTINGS, add_settings_arguments, given_settings
from ..core.errors import PipelineError
from ..core.settings import Settings
from ..folder.rebuild import make_engine_command
from .backends import NAMES
from .harness import run_benchmark
from .report import DEVICE_RESIDENT, END_TO_END, markdown_table, write_reports
from .timing import TimingPolicy

__all__ = ["TimingPolicy", "add_arguments", "main", "run_benchmark", "write_reports"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    policy = TimingPolicy()
    add_settings_arguments(parser, FOLDER_SETTINGS)
    parser.add_argument("--folder", type=Path, help="the artifact folder itself (instead of model/precision/out)")
    parser.add_argument(
        "--backends",
        type=_names,
        help=f"comma-separated, from {', '.join(NAMES)} (default: all; torch always runs) [BACKENDS]",
    )
    parser.add_argument(
        "--batches", type=_batches, help="comma-separated batch sizes (default: the profile's min,opt,max) [BATCHES]"
    )
    parser.add_argument("--warmup", type=int, default=policy.warmup, help="untimed calls per backend and batch")
    parser.add_argument("--iterations", type=int, default=policy.iterations, help="timed calls (at most)")
    parser.add_argument(
        "--budget-s", type=float, default=policy.budget_s, help="seconds of timed calls per backend and batch (at most)"
    )
    parser.add_argument(
        "--rounds", type=int, default=policy.rounds, help="timed calls are split into rounds alternating backends"
    )
    parser.add_argument(
        "--agree-within",
        type=float,
        default=policy.agree_within,
        help="the run is stable when every row's per-round p50s lie within this fraction of each other",
    )
    parser.add_argument("--threads", type=int, help="CPU threads for torch and ONNX Runtime (default: physical cores)")
    parser.add_argument("--report-dir", type=Path, help="where bench.json/.md/.png go (default: the artifact folder)")


def main(args: argparse.Namespace) -> int:
    folder, hint = _folder_and_hint(args)
    report = run_benchmark(
        folder,
        backends=args.backends,
        batches=args.batches,
        policy=TimingPolicy(args.warmup, args.iterations, args.budget_s, args.rounds, args.agree_within),
        threads=args.threads,
        make_hint=hint,
        progress=lambda line: print(line, flush=True),
    )
    paths = write_reports(report, args.report_dir or folder)
    for mode in (END_TO_END, DEVICE_RESIDENT):
        if any(r["mode"] == mode for r in report["results"]):
            print(f"\n{mode} ({report['model']}, {report['environment']['threads']} threads):\n")
            print(markdown_table(report, mode))
    print(f"\nwrote {paths['md']}, {paths['json'].name}, {paths['png'].name}")
    return 0


def _folder_and_hint(args: argparse.Namespace) -> tuple[Path, str | None]:
    if args.folder is not None:
        return args.folder, None

    settings = Settings(**given_settings(args))
    folder = settings.artifact_dir(models.canonical_name(settings.model))
    return folder, make_engine_command(settings.as_record())


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _batches(text: str) -> list[int]:
    parts = _names(text)
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise PipelineError(f"--batches {text!r} is not a list of positive whole numbers", "give e.g. 1,8,32")
    return [int(p) for p in parts]
