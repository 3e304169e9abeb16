"""The sweep on a GPU, through the public API only: each model built by make_engine(Settings(...)) with the defaults
(FP16; on a host without TensorRT the folder holds the checked graphs and no engine) and served by load_runner(folder)
with its defaults, beside what a user would run instead: torch AMP eager, torch.compile and
torch.compile(mode="reduce-overhead") (TF32 off).  For each model: what auto served (the runner's description), its
outputs against PyTorch FP32 on the same random inputs (cosine, max abs error; a detector's detections: the share of
PyTorch's found), and end-to-end p50 ms (host arrays
in, host arrays out) at batch 1 / 8 / 32, every row timed by the bench harness in one process, in rounds that
alternate rows (pipeline.bench: the GC paused, the clock stopped after the device syncs).

Each model runs in a process of its own (a CUDA error is sticky for the process that meets it, and the next model
must not inherit it); one that fails records its error and the sweep goes on.

    python benchmarks/gpu_models.py --group 1 --out OUT [--engines /tmp/engines] [--model-timeout-s 300]
    python benchmarks/gpu_models.py --models resnet50,bert --out OUT          # any of MODELS
    python benchmarks/gpu_models.py --dry-run --group dry --out /tmp/dry      # on a CPU: tiny models, a minute
    python benchmarks/gpu_models.py --merge RUN1.json RUN2.json --out docs/benchmarks/gpu-models   # measures nothing

writes OUT.json ({"device", "versions", "models": {NAME: {"error", "description", "batches": {"1": {"served",
"torch-amp", "torch-compile", "torch-compile-reduce-overhead", "served_cosine", "served_max_abs",
"served_detections"}, ...},
"skipped": {row: why}}}}) and OUT.md after each model, and each model's log and whole bench report under
OUT-logs/.  --merge joins runs of the same GPU and software (a model measured again takes the later numbers).

On the GPU machine (no network, no TensorRT; onnxruntime-gpu and onnxsim from `python tools/device/bundle.py ort`,
which writes .devbundle/ort0 and ort1), one group a session (SWEEP=1..6, or MODELS=a,b), in two device calls:
    carry .devbundle/ort0, timeout_s 120:  SWEEP=1 bash tools/device/run.sh sweep_start   # environment, onnxsim
    carry .devbundle/ort1, timeout_s 600:  SWEEP=1 bash tools/device/run.sh sweep         # onnxruntime-gpu, the group
then, here, with the files it brought back (gpu-models-1.json, its .md and logs):
    python benchmarks/gpu_models.py --merge docs/benchmarks/gpu-models.json gpu-models-1.json \
        --out docs/benchmarks/gpu-models      # the first run: --merge gpu-models-1.json alone
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python benchmarks/gpu_models.py` from anywhere: the package and the factories

from benchmarks import sweep_models  # noqa: E402
from trt_pipeline.pipeline.bench.harness import run_benchmark  # noqa: E402
from trt_pipeline.pipeline.bench.timing import TimingPolicy  # noqa: E402
from trt_pipeline.pipeline.core.cpu import cpu_model  # noqa: E402
from trt_pipeline.pipeline.core.errors import PipelineError  # noqa: E402
from trt_pipeline.pipeline.core.settings import Settings  # noqa: E402
from trt_pipeline.pipeline.folder.provenance import package_versions  # noqa: E402
from trt_pipeline.pipeline.stages.sequence import make_engine  # noqa: E402

ROWS = ("served", "torch-amp", "torch-compile", "torch-compile-reduce-overhead")
BATCHES = (1, 8, 32)
VERSIONS = ("torch", "torchvision", "timm", "transformers", "onnx", "onnxruntime-gpu", "onnxruntime", "numpy")
TOKENS_128 = "input_ids:1=1:128:512,attention_mask:1=1:128:512"  # sequence 128 at the opt (issue 54's figures)
SEGMENTS_128 = f"{TOKENS_128},token_type_ids:1=1:128:512"  # BERT's segments share the sequence
FACTORIES = "benchmarks.sweep_models"
FAULT_DUMP = "Fatal Python error: "  # how the fault handler's dump of a crashed child begins


@dataclass(frozen=True)
class Model:
    """One model of the sweep: MODEL= as make_engine takes it (a factory, or a folder written into the work
    folder), its inputs in words, and the settings it builds with besides the defaults."""

    model: Callable[[Path], str]
    inputs: str
    settings: dict[str, Any] = field(default_factory=dict)


def factory(name: str) -> Callable[[Path], str]:
    return lambda work: f"{FACTORIES}:{name}"


def folder(writer: Callable[[Path], Path], name: str) -> Callable[[Path], str]:
    return lambda work: str(writer(work / name))


SWEEP = {
    "resnet50": Model(factory("resnet50"), "3x224x224 images (torchvision)"),
    "convnext": Model(factory("convnext_tiny"), "3x224x224 images (torchvision ConvNeXt-T)"),
    "efficientnet": Model(factory("efficientnet_b0"), "3x224x224 images (torchvision EfficientNet-B0)"),
    "mobilenetv3": Model(factory("mobilenet_v3_large"), "3x224x224 images (torchvision MobileNetV3-L)"),
    "vit": Model(factory("vit_base"), "3x224x224 images (transformers ViT-B/16)"),
    "swin": Model(factory("swin_tiny"), "3x224x224 images (transformers Swin-T)"),
    "detector": Model(
        factory("yolo_detector"), "3x640x640 images, YOLO-style head + NMS (ResNet-18 trunk)", {"postprocess": "nms"}
    ),
    "bert": Model(
        folder(sweep_models.bert_base_folder, "bert-base"),
        "token ids + mask + segments, sequence 128",
        {"dynamic": SEGMENTS_128},
    ),
    "distilbert": Model(
        folder(sweep_models.distilbert_folder, "distilbert"), "token ids + mask, sequence 128", {"dynamic": TOKENS_128}
    ),
    "whisper-encoder": Model(factory("whisper_encoder"), "80 mel bins x 3000 frames (Whisper-base encoder)"),
    "vit-1b": Model(factory("vit_giant"), "3x224x224 images (ViT-g/14 sized: 1.01G parameters, 4 GB FP32)"),
}
# The dry run's, built on a CPU in seconds (tests/benchmarks/test_gpu_models.py).
TINY = {
    "tiny-cnn": Model(factory("tiny_cnn"), "3x32x32 images"),
    "tiny-bert": Model(folder(sweep_models.tiny_bert_folder, "tiny-bert"), "token ids + mask + segments, sequence 16"),
    "tiny-detector": Model(factory("tiny_detector"), "3x64x64 images, YOLO-style head + NMS", {"postprocess": "nms"}),
}
MODELS = {**SWEEP, **TINY}
# A part of the sweep per GPU run, about 8 minutes of the 15 a session has on the device (a model's build, its
# auto measuring its candidates, two torch.compiles at three batch sizes, then the timing: 2 to 4 minutes each):
# tools/device/run.sh's SWEEP=1..6 ("dry" is the CPU's).
GROUPS = {
    "1": "resnet50,convnext",
    "2": "mobilenetv3,efficientnet",
    "3": "bert,distilbert",
    "4": "vit,swin",
    "5": "detector,whisper-encoder",
    "6": "vit-1b",  # a 4 GB export and four torch copies of 1B parameters: alone
    "dry": "tiny-cnn,tiny-bert,tiny-detector",
}


# --------------------------------------------------------------------------- one model, in its own process


def build(name: str, engines: Path) -> Path:
    """The model's folder through make_engine, as a user builds it (reused when up to date)."""
    entry = MODELS[name]
    return make_engine(Settings(model=entry.model(engines / "models"), out_root=engines, **entry.settings))


def measure(name: str, engines: Path, dry_run: bool, logs: Path) -> dict:
    """Build, then the bench harness on the folder: served (load_runner(folder) with its defaults) and the torch
    rows, at BATCHES; the model's record for the report (the harness's whole report goes to logs)."""
    import torch

    if not dry_run and not torch.cuda.is_available():
        raise PipelineError("no CUDA GPU: this benchmark measures on a GPU", "run it with --dry-run on a CPU")
    built = build(name, engines)
    rows = [row for row in ROWS if not (dry_run and row == "torch-compile")]
    policy = TimingPolicy(warmup=3, iterations=10, budget_s=0.2, rounds=2) if dry_run else TimingPolicy(budget_s=1)
    report = run_benchmark(built, backends=rows, batches=list(BATCHES), policy=policy, progress=_progress)
    (logs / f"{name}-bench.json").write_text(json.dumps(report, indent=1, default=str))
    record = model_record(report)
    if dry_run:
        record["skipped"]["torch-compile"] = "not run in a dry run: inductor's C++ build takes minutes on a CPU"
    return record


def model_record(report: dict) -> dict:
    """The bench report as the sweep's record: the served runner's description, each row's end-to-end p50 and
    served's agreement with PyTorch FP32 per batch, the rows that did not run and why."""
    backends = {record["name"]: record for record in report["backends"]}
    served = backends["served"]
    skipped = {name: record.get("reason") or record.get("error") for name, record in backends.items()}
    errors = [f"served did not open: {skipped['served']}"] if served["status"] != "ran" else []
    batches: dict[str, dict] = {}
    for batch in BATCHES:
        cells = {r["backend"]: r for r in report["results"] if r["batch"] == batch and r["mode"] == "end-to-end"}
        row = {name: _p50(cells.get(name)) for name in ROWS}
        agreement = (cells.get("served") or {}).get("agreement", {})
        row["served_cosine"], row["served_max_abs"] = agreement.get("cosine"), agreement.get("max_abs")
        row["served_detections"] = agreement.get("agreement")  # a detector's: the share of PyTorch's detections found
        if agreement.get("status") not in (None, "ok"):
            errors.append(f"batch {batch}: served disagrees with PyTorch FP32 ({agreement})")
        if (cells.get("served") or {}).get("status") == "failed":
            errors.append(f"batch {batch}: served failed: {cells['served']['error']}")
        batches[str(batch)] = row
    return {
        "error": "; ".join(errors) or None,
        "description": served.get("description"),
        "batches": batches,
        "skipped": {name: why for name, why in skipped.items() if backends[name]["status"] != "ran"},
    }


def _p50(cell: dict | None) -> float | None:
    return cell["latency"]["p50_ms"] if cell is not None and cell["status"] == "ok" else None


def _progress(line: str) -> None:
    print(line, flush=True)


def one_model(name: str, engines: Path, dry_run: bool, logs: Path, result: Path) -> None:
    """The child's work: measure, then write the record (or the error) to `result`."""
    try:
        record = measure(name, engines, dry_run, logs)
    except Exception as error:  # recorded: one model's failure must not stop the sweep
        traceback.print_exc()
        text = f"{error.problem} (fix: {error.fix})" if isinstance(error, PipelineError) else f"{error!r}"
        record = {"error": text, "description": None, "batches": {}, "skipped": {}}
    result.write_text(json.dumps(record, default=str))


# --------------------------------------------------------------------------- the sweep


def run_model(name: str, args: argparse.Namespace, logs: Path) -> dict:
    """One model in a child process (its log in logs/NAME.log); a child that dies or runs past --model-timeout-s
    is recorded as that model's error.  The child runs with Python's fault handler on: a crash in native code (the
    ConvNeXt's SIGSEGV on an H200) leaves every thread's Python stack in the log, and so in the error."""
    result = logs / f"{name}.result.json"
    result.unlink(missing_ok=True)
    command = [sys.executable, "-X", "faulthandler", str(Path(__file__).resolve()), "--child", name]
    command += ["--engines", str(args.engines)]
    command += ["--logs", str(logs), *(["--dry-run"] if args.dry_run else [])]
    started = time.perf_counter()
    with (logs / f"{name}.log").open("w") as log:
        try:
            done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=args.model_timeout_s)
            ended = f"exit {done.returncode}"
        except subprocess.TimeoutExpired:
            ended = f"ran past --model-timeout-s {args.model_timeout_s}"
    print(f"{name:<16} {ended} after {time.perf_counter() - started:.0f} s", flush=True)
    if result.is_file():
        return json.loads(result.read_text())
    said = _last_words(logs / f"{name}.log")
    error = f"the model's process ended without a result ({ended}), its last words:\n{said}"
    return {"error": error, "description": None, "batches": {}, "skipped": {}}


def _last_words(log: Path) -> str:
    """What a child that died said last: the fault handler's dump where there is one (from its first line: the
    signal, then the innermost frames first), else the log's end."""
    text = log.read_text()
    dump = text.rfind(FAULT_DUMP)
    return text[dump : dump + 3000] if dump >= 0 else text[-1500:]


def environment(dry_run: bool) -> tuple[str, dict]:
    """(device, versions): the GPU by name (a dry run: the CPU), the packages, CUDA and cuDNN."""
    import torch

    versions = package_versions(VERSIONS)
    if torch.cuda.is_available():
        versions |= {"cuda": str(torch.version.cuda), "cudnn": str(torch.backends.cudnn.version())}
        return torch.cuda.get_device_name(0), versions
    return f"{'dry run on ' if dry_run else ''}CPU: {cpu_model()}", versions


def merged(reports: list[dict]) -> dict:
    """One report of runs on the same device and software (a model measured again takes the later numbers)."""
    first = reports[0]
    for report in reports[1:]:
        for key in ("device", "versions"):
            if report[key] != first[key]:
                raise PipelineError(
                    f"the runs were measured on another {key} ({first[key]}; {report[key]}): their numbers do not "
                    "belong in one table",
                    "merge runs of the same GPU and software only",
                )
    notes = [note for report in reports for note in report.get("notes", [])]
    models = {name: r for report in reports for name, r in report["models"].items()}
    return {**first, "models": models, **({"notes": notes} if notes else {})}


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    if args.child:
        one_model(args.child, args.engines, args.dry_run, args.logs, args.logs / f"{args.child}.result.json")
        return 0
    if args.merge:
        report = merged([json.loads(path.read_text()) for path in args.merge])
        if args.note:
            report["notes"] = report.get("notes", []) + args.note
        write(args.out, report, _command(argv))
        return 0
    names = [name.strip() for name in args.models.split(",")]
    unknown = [name for name in names if name not in MODELS]
    if unknown:
        raise SystemExit(f"error: unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    if args.build_only:
        for name in names:
            try:
                print(f"BUILT {name}: {build(name, args.engines)}", flush=True)
            except Exception as error:  # the measuring pass meets it again and records it
                print(f"FAILED {name}: {error!r}", flush=True)
        return 0
    logs = Path(f"{args.out}-logs")
    logs.mkdir(parents=True, exist_ok=True)
    device, versions = environment(args.dry_run)
    report: dict = {"device": device, "versions": versions, "models": {}}
    for name in names:  # written after each model: a run cut short keeps what it measured
        report["models"][name] = run_model(name, args, logs)
        write(args.out, report, _command(argv))
    return 0


def write(out: Path, report: dict, command: str) -> None:
    Path(f"{out}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    Path(f"{out}.md").write_text(markdown(report, command))
    print(f"wrote {out}.json and {out}.md", flush=True)


def _command(argv: list[str] | None) -> str:
    """The command line (main's `argv`, else the process's), each --note's text left to the report's Notes."""
    words = sys.argv[1:] if argv is None else argv
    shown = ["..." if index and words[index - 1] == "--note" else word for index, word in enumerate(words)]
    return " ".join(["python benchmarks/gpu_models.py", *shown])


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(SWEEP), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--group", choices=sorted(GROUPS), help="a part of the sweep (replaces --models)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "gpu-models")
    parser.add_argument("--engines", type=Path, default=ROOT / "engines" / "gpu-models")
    parser.add_argument("--merge", type=Path, nargs="+", help="no measuring: these runs' JSON as one report in OUT")
    parser.add_argument(
        "--note",
        action="append",
        help="with --merge: a line of the report's notes (say what "
        "changed between the runs merged, and which rows it concerns)",
    )
    parser.add_argument("--dry-run", action="store_true", help="on the CPU: no GPU rows, short timings")
    parser.add_argument("--build-only", action="store_true", help="build the folders, measure nothing")
    parser.add_argument("--model-timeout-s", type=float, default=600.0)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--logs", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.group:
        args.models = GROUPS[args.group]
    return args


# --------------------------------------------------------------------------- the report


def markdown(report: dict, command: str) -> str:
    models = report["models"]
    lines = [
        "# The sweep on a GPU: served by `load_runner(folder)` beside torch",
        "",
        f"Device: {report['device']}.  Versions: "
        + ", ".join(f"{name} {version}" for name, version in report["versions"].items())
        + ".",
        "",
        f"Command: `{command}` (benchmarks/gpu_models.py).  Each folder built by `make_engine(Settings(model=...))` "
        "with the defaults (FP16), served by `load_runner(folder)` with its defaults; end to end (host arrays in "
        "and out), p50 ms, TF32 off, rows alternating in one process per model.  `served / r-o`: served's p50 over "
        "torch.compile(mode='reduce-overhead')'s; cosine and max abs: served's outputs against PyTorch FP32 on the "
        "same random inputs (a detector's: the share of the detections of PyTorch's head through the reference NMS "
        "that served found).",
        "",
    ]
    for batch in map(str, BATCHES):
        lines += [f"## Batch {batch}", "", "| model | served | torch AMP | torch.compile | reduce-overhead | "
                  "served / r-o | cosine | max abs |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for name, record in models.items():
            row = record["batches"].get(batch)
            if row is None:
                lines.append(f"| {name} | error | | | | | | |")
                continue
            cells = [_ms(row[key]) for key in ROWS]
            ratio = _ratio(row)
            lines.append(
                f"| {name} | {' | '.join(cells)} | {'' if ratio is None else f'{ratio:.2f}x'} | {_agreement(row)} |"
            )
        lines += ["", goal_line(models, batch), ""]
    if report.get("notes"):
        lines += ["## Notes", "", *(f"- {note}" for note in report["notes"]), ""]
    lines += ["## What auto served, and what did not run", ""]
    for name, record in models.items():
        first, *rest = (record["error"] or "").splitlines() or [""]
        lines.append(f"- **{name}** ({MODELS[name].inputs if name in MODELS else 'unknown'}): "
                     + (f"ERROR: {first}" if record["error"] else record["description"] or ""))  # fmt: skip
        if rest:  # a dead child's last words (a log, a fault dump): as they were printed, under the item
            lines += ["  ```", *(f"  {line}" for line in rest), "  ```"]
        lines += [f"  - {row} not run: {why}" for row, why in record.get("skipped", {}).items()]
    return "\n".join(lines) + "\n"


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def _agreement(row: dict) -> str:
    """The cosine and max abs cells: served's outputs against PyTorch's, or the share of a detector's detections."""
    cosine, max_abs, detections = row["served_cosine"], row["served_max_abs"], row.get("served_detections")
    if cosine is None and detections is not None:
        return f"{detections:.3f} of detections found | "
    return f"{'' if cosine is None else f'{cosine:.6f}'} | {'' if max_abs is None else f'{max_abs:.3g}'}"


def _ratio(row: dict) -> float | None:
    served, rival = row["served"], row["torch-compile-reduce-overhead"]
    return served / rival if served is not None and rival else None


def goal_line(models: dict, batch: str) -> str:
    """Issue 54's goal at this batch: served no slower than reduce-overhead on the median model, never 1.25x."""
    ratios = {name: _ratio(r["batches"][batch]) for name, r in models.items() if batch in r["batches"]}
    known = {name: ratio for name, ratio in ratios.items() if ratio is not None}
    if not known:
        return "Goal: not judged (no model has both served and reduce-overhead at this batch)."
    worst = max(known, key=lambda name: known[name])
    median = statistics.median(known.values())
    return (
        f"Goal: median served / reduce-overhead {median:.2f}x over {len(known)} models "
        f"({'met' if median <= 1 else 'NOT met'}: at most 1.00x); worst {worst} {known[worst]:.2f}x "
        f"({'met' if known[worst] <= 1.25 else 'NOT met'}: at most 1.25x)."
    )


if __name__ == "__main__":
    try:
        sys.exit(main())
    except PipelineError as error:  # a mistake in what was asked: its fix, no traceback
        print(f"error: {error.problem}\nfix: {error.fix}", file=sys.stderr)
        sys.exit(2)
