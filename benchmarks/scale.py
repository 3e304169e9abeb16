"""Time and peak memory of every build stage as a model's weights grow (issue 38).

Each member of a family (benchmarks/scale_models.py, FAMILIES below) goes through the pipeline one command-line
stage at a time, each in its own process: `python -m trt_pipeline <stage> --model scale_models:<name> ...`, the
stages `make engine` runs, in its order, at the member's precision (INT8 members calibrate on random rows, images
or token ids of the model's input, written into the work folder). A stage's own process gives its exact peak: the
kernel's high-water mark of the process's resident memory (ru_maxrss from wait4), which a sampling thread could miss
on a short spike, and which no earlier stage's leftovers inflate. Its time is what the stages it ran recorded in
manifest.json (the "in stages" seconds `make engine` prints; the export process runs prepare, reference and export),
beside the process's wall time (Python, torch and the model's construction included). With --whole the same model
also runs as `make engine` does, every stage in one process, for its total time and peak, and then the finished
folder is loaded as a user loads it, each in its own process: the ONNX Runtime runner (load_runner and one call) and
the service (`trt-pipeline serve` until ready, then one REST request). The floor row is a process that imports the
build stages and does nothing: every stage's peak includes it. How each stage grows with the weights is fitted on
the MLP family's members of 0.5 GB and more: seconds and peak RSS as c * weights^k, k by least squares on the
logarithms.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/scale.py --label after --members mlp-0.1,mlp-0.6,mlp-1.2 \
        --whole --docs docs/benchmarks

measures into a temporary folder and writes scale.json (runs under another label kept), scale.md and scale.png
into --docs.  --source DIR runs the trt_pipeline of another checkout (e.g. `git archive <commit>` unpacked: the
"before" rows) with the models from this one.  --render rewrites scale.md and scale.png from scale.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trt_pipeline.pipeline.bench.environment import describe_environment, physical_cores  # noqa: E402
from trt_pipeline.pipeline.core.cpu import instruction_sets_text  # noqa: E402

# The command-line stages in the order `make engine` runs them (pipeline/stages/sequence.py STAGES; export runs
# prepare first).
STAGES = ("export", "check", "simplify", "parity", "precision", "build")
LOADS = ("runner", "serve")  # the finished folder loaded, after the whole run
BUILDER = "tensorrt_rtx"  # builds with no GPU
GB = 1e9
JSON_NAME, MARKDOWN_NAME, PLOT_NAME = "scale.json", "scale.md", "scale.png"


@dataclass(frozen=True)
class Member:
    """One model of a family: its name in reports, MODEL= as the command line takes it, its nominal FP32 size, the
    precision it is built at, and for INT8 the shape of one calibration sample ({input: dims without the batch}:
    random normal values, CALIBRATION_SAMPLES of them; token ids below `tokens` where it is set)."""

    name: str
    model: str
    nominal_gb: float
    batch: str = "1:8:32"
    options: tuple[str, ...] = ()  # more command-line options, the same for every stage
    precision: str = "fp16"
    calibration: tuple[tuple[str, tuple[int, ...]], ...] = ()
    tokens: int = 0


CALIBRATION_SAMPLES = 256  # the default --calib-samples
ROWS_2048, ROWS_4096 = (("input", (2048,)),), (("input", (4096,)),)
IMAGES = (("pixel_values", (3, 224, 224)),)
# ViT-L on 2 cores: ~0.3 s an image a pass, and calibration makes several passes (ranges, smoothing, biases, the
# candidates' judging), so its INT8 calibrates on 32 images in batches of 8.
FEW_IMAGES = ("--calib-samples", "32", "--calib-batch", "8")
LLM_OPTIONS = ("--dynamic", "input_ids:1=1:16:64")  # sequences of 1 to 64 tokens, 16 at the profile's opt

# Pluggable: a family is a list of members; a member is any MODEL= the pipeline loads.
FAMILIES: dict[str, tuple[Member, ...]] = {
    "mlp": (
        Member("mlp-0.1", "scale_models:mlp_100mb", 0.1),
        Member("mlp-0.6", "scale_models:mlp_600mb", 0.6),
        Member("mlp-1.2", "scale_models:mlp_1200mb", 1.2),
        Member("mlp-2.4", "scale_models:mlp_2400mb", 2.4),
        Member("mlp-5", "scale_models:mlp_5gb", 5.1),
    ),
    "mlp-int8": (
        Member("mlp-0.1-int8", "scale_models:mlp_100mb", 0.1, precision="int8", calibration=ROWS_2048),
        Member("mlp-0.6-int8", "scale_models:mlp_600mb", 0.6, precision="int8", calibration=ROWS_4096),
        Member("mlp-1.2-int8", "scale_models:mlp_1200mb", 1.2, precision="int8", calibration=ROWS_4096),
        Member("mlp-2.4-int8", "scale_models:mlp_2400mb", 2.4, precision="int8", calibration=(("input", (8192,)),)),
    ),
    # The same 1.2 GB model through torch.onnx's other exporter, which writes the weights straight from the
    # model's tensors (external data) where TorchScript's serializes the whole graph in memory.
    "exporters": (Member("mlp-1.2-dynamo", "scale_models:mlp_1200mb", 1.2, options=("--exporter", "dynamo")),),
    "resnet": (Member("resnet50", "resnet", 0.1),),
    # Real architectures: a Llama-style causal LM of 1.1B parameters (sequences of 1 to 64 tokens, 16 at the
    # profile's opt) and ViT-L/16, both from their configs with random weights.
    "llm": (
        Member("llama-1.1b", "scale_models:llama_1b", 4.4, batch="1:2:4", options=LLM_OPTIONS),
        Member(
            "llama-1.1b-int8",
            "scale_models:llama_1b",
            4.4,
            batch="1:2:4",
            options=LLM_OPTIONS,
            precision="int8",
            calibration=(("input_ids", (16,)),),
            tokens=32000,
        ),
    ),
    "vit": (
        Member("vit-l", "scale_models:vit_large", 1.2, batch="1:4:8"),
        Member(
            "vit-l-int8",
            "scale_models:vit_large",
            1.2,
            batch="1:4:8",
            options=FEW_IMAGES,
            precision="int8",
            calibration=IMAGES,
        ),
    ),
}
MEMBERS = {member.name: member for family in FAMILIES.values() for member in family}


@dataclass(frozen=True)
class Measured:
    returncode: int
    wall_seconds: float
    peak_rss_bytes: int
    cpu_seconds: float
    peak_disk_bytes: int = 0


class DiskWatch:
    """The peak rise of the bytes in use on the file systems that hold `folders` (each counted once), sampled every
    DISK_POLL_SECONDS while the block runs: what a stage had on disk at its peak, its scratch files included
    wherever the checkout measured puts them (the INT8 stage's: the system's temporary folder, later beside the
    graphs).  Whatever else writes to those file systems meanwhile counts too: a quiet machine's number."""

    def __init__(self, folders: tuple[Path, ...]) -> None:
        by_device = {os.stat(folder).st_dev: folder for folder in folders}
        self._folders, self._done = list(by_device.values()), threading.Event()
        self._start = self._used()
        self.peak = 0
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _used(self) -> int:
        return sum(shutil.disk_usage(folder).used for folder in self._folders)

    def _poll(self) -> None:
        stopped = False
        while not stopped:  # a last sample once the block is over: a stage shorter than a poll counts too
            stopped = self._done.wait(DISK_POLL_SECONDS)
            self.peak = max(self.peak, self._used() - self._start)

    def __enter__(self) -> DiskWatch:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._done.set()
        self._thread.join()


DISK_POLL_SECONDS = 0.5


def run_measured(command: list[str], cwd: Path, log: Path, disk: tuple[Path, ...] = ()) -> Measured:
    """Run `command`, its output to `log`; its exit code, wall time, peak RSS and CPU time (the kernel's, via
    wait4), and with `disk`, the peak rise of the disk in use there (DiskWatch)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "benchmarks")}  # scale_models; cwd puts the pipeline first
    with open(log, "w") as output, DiskWatch(disk) as watch:
        started = time.perf_counter()
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    cpu = round(usage.ru_utime + usage.ru_stime, 2)
    return Measured(process.returncode, round(wall, 2), usage.ru_maxrss * 1024, cpu, watch.peak)  # maxrss: KiB


def stage_command(stage: str, member: Member, out: Path) -> list[str]:
    calibration = ["--calib", str(calibration_file(member, out.parent))] if member.calibration else []
    return [
        sys.executable, "-m", "trt_pipeline", stage, "--model", member.model, "--precision", member.precision,
        "--batch", member.batch, "--builder", BUILDER, "--out", str(out), *calibration, *member.options,
    ]  # fmt: skip


def calibration_file(member: Member, work: Path) -> Path:
    """The member's calibration data: CALIBRATION_SAMPLES random samples of each input (Member), written once."""
    path = work / f"calibration-{member.name}.npz"
    if not path.is_file():
        rng = np.random.default_rng(0)
        arrays = {name: _samples(rng, (CALIBRATION_SAMPLES, *dims), member.tokens) for name, dims in member.calibration}
        np.savez(path, **arrays)
    return path


def _samples(rng: np.random.Generator, shape: tuple[int, ...], tokens: int) -> np.ndarray:
    if tokens:
        return rng.integers(0, tokens, shape, dtype=np.int64)
    return rng.standard_normal(shape, dtype=np.float32)


def read_raw_manifest(out: Path) -> dict:
    """The manifest as JSON (read raw: the checkout measured may have another manifest type than this one)."""
    found = sorted(out.glob("*/manifest.json"))
    return json.loads(found[0].read_text()) if found else {}


def folder_files(out: Path) -> dict[str, int]:
    """The artifact folder's files and their bytes (which graphs carry external data shows here)."""
    folders = [path.parent for path in out.glob("*/manifest.json")]
    if not folders:
        return {}
    return {path.name: path.stat().st_size for path in sorted(folders[0].iterdir()) if path.is_file()}


def last_error(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or ["(no output)"])[-1][:400]


def measure_stages(member: Member, out: Path, logs: Path, source: Path) -> list[dict]:
    """Every command-line stage in its own process, in order, until one fails."""
    rows = []
    for stage in STAGES:
        before = read_raw_manifest(out).get("timings", {})
        log = logs / f"{member.name}-{stage}.log"
        disk = (out.parent, Path(tempfile.gettempdir()))  # out: made by the first stage
        measured = run_measured(stage_command(stage, member, out), source, log, disk)
        after = read_raw_manifest(out).get("timings", {})
        timings = {name: seconds for name, seconds in after.items() if before.get(name) != seconds}
        row = {
            "stage": stage,
            "timings": timings,
            "seconds": round(sum(timings.values()), 2),
            "wall_seconds": measured.wall_seconds,
            "peak_rss_bytes": measured.peak_rss_bytes,
            "peak_disk_bytes": measured.peak_disk_bytes,
        }
        print(
            f"  {member.name:<9} {stage:<10} {row['seconds']:>8.1f} s {measured.peak_rss_bytes / GB:>6.2f} GB",
            flush=True,
        )
        if measured.returncode != 0:
            rows.append({**row, "failed": last_error(log)})
            print(f"  {member.name:<9} {stage:<10} failed: {rows[-1]['failed']}", flush=True)
            break
        rows.append(row)
    return rows


def measure_whole(member: Member, out: Path, logs: Path, source: Path) -> dict:
    """`make engine` as a user runs it: every stage in one process (the model alive throughout); then the finished
    folder loaded by the runner and the service (measure_loads)."""
    log = logs / f"{member.name}-engine.log"
    measured = run_measured([*stage_command("engine", member, out), "--force"], source, log)
    timings = read_raw_manifest(out).get("timings", {})
    record = {
        "timings": timings,
        "seconds": round(sum(timings.values()), 2),
        "wall_seconds": measured.wall_seconds,
        "peak_rss_bytes": measured.peak_rss_bytes,
    }
    return record if measured.returncode == 0 else {**record, "failed": last_error(log)}


# The runner: load_runner on the ONNX Runtime backend (its graph from a private copy) and one call on the first
# reference case; prints its own load seconds.
RUNNER_CODE = """
import sys, time
from trt_pipeline.pipeline.folder.graph_io import load_reference
from trt_pipeline.pipeline.runners import load_runner
folder = sys.argv[1]
started = time.perf_counter()
with load_runner(folder, backend="onnxruntime") as runner:
    print("loaded", round(time.perf_counter() - started, 2), flush=True)
    inputs, _ = load_reference(folder + "/reference.npz")[0]
    runner.infer(inputs)
"""


def measure_loads(out: Path, logs: Path, source: Path, name: str) -> list[dict]:
    """The finished folder loaded as a user loads it, each in its own process: the runner (load_runner, one call)
    and the service (`trt-pipeline serve` until /v2/health/ready, then one REST request, then stopped)."""
    folders = [path.parent for path in out.glob("*/manifest.json")]
    if not folders:
        return []
    folder = folders[0]
    log = logs / f"{name}-runner.log"
    measured = run_measured([sys.executable, "-c", RUNNER_CODE, str(folder)], source, log)
    loaded = [line.split()[1] for line in log.read_text().splitlines() if line.startswith("loaded ")]
    runner = {"stage": "runner", "seconds": float(loaded[0]) if loaded else 0.0, "timings": {},
              "wall_seconds": measured.wall_seconds, "peak_rss_bytes": measured.peak_rss_bytes}  # fmt: skip
    if measured.returncode != 0:
        runner["failed"] = last_error(log)
    return [runner, measure_service(folder, logs / f"{name}-serve.log", source)]


def measure_service(folder: Path, log: Path, source: Path, port: int = 18431) -> dict:
    """Seconds until the service is ready, its peak RSS (wait4's, after it stops) and one request's answer."""
    import urllib.request

    command = [sys.executable, "-m", "trt_pipeline", "serve", str(folder), "--backend", "onnxruntime",
               "--port", str(port), "--grpc-port", "0", "--host", "127.0.0.1"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "benchmarks")}
    base = f"http://127.0.0.1:{port}"
    with open(log, "w") as output:
        started = time.perf_counter()
        process = subprocess.Popen(command, cwd=source, env=env, stdout=output, stderr=subprocess.STDOUT)
        ready, failed = None, None
        try:
            while ready is None and process.poll() is None and time.perf_counter() - started < 900:
                try:
                    with urllib.request.urlopen(base + "/v2/health/ready", timeout=2) as response:
                        ready = time.perf_counter() - started if response.status == 200 else None
                except OSError:
                    time.sleep(0.5)
            failed = "not ready" if ready is None else _one_request(base, folder.name)
        finally:
            process.send_signal(signal.SIGINT)
            _, status, usage = os.wait4(process.pid, 0)
    wall = round(time.perf_counter() - started, 2)
    row = {"stage": "serve", "seconds": round(ready or 0.0, 2), "timings": {}, "wall_seconds": wall,
           "peak_rss_bytes": usage.ru_maxrss * 1024}  # fmt: skip
    return {**row, "failed": failed or last_error(log)} if failed else row


def _one_request(base: str, model: str) -> str | None:
    """None when the model answers one REST request of the first reference case's inputs, else what went wrong."""
    import urllib.request

    metadata = json.load(urllib.request.urlopen(f"{base}/v2/models/{model}", timeout=10))
    inputs = []
    for tensor in metadata["inputs"]:
        shape = [1 if size == -1 else size for size in tensor["shape"]]
        data = np.zeros(shape, dtype=np.float32 if tensor["datatype"] == "FP32" else np.int64).ravel().tolist()
        inputs.append({"name": tensor["name"], "shape": shape, "datatype": tensor["datatype"], "data": data})
    request = urllib.request.Request(f"{base}/v2/models/{model}/infer", data=json.dumps({"inputs": inputs}).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=300) as response:
        return None if response.status == 200 and json.load(response).get("outputs") else f"HTTP {response.status}"


def measure_floor(source: Path, logs: Path) -> Measured:
    """A process that imports the build stages and exits: the part of every stage's peak that is not its work."""
    code = "import trt_pipeline.pipeline.stages.sequence, trt_pipeline.pipeline.stages.build, onnxsim, tensorrt_rtx"
    return run_measured([sys.executable, "-c", code], source, logs / "floor.log")


def measure_member(member: Member, work: Path, source: Path, whole: bool, commit: str | None = None) -> dict:
    out, logs = work / member.name, work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    record: dict = {"member": member.name, "model": member.model, "nominal_gb": member.nominal_gb}
    record["precision"] = member.precision
    record["commit"] = source_commit(source, commit)  # a run appended to later may span commits
    record["available_memory_bytes"] = available_memory()
    record["load_average"] = [round(v, 2) for v in os.getloadavg()]
    record["stages"] = measure_stages(member, out, logs, source)
    record["files"] = folder_files(out)
    # The FP32 graph's bytes: its weights, and a graph of a few kB.
    record["weight_bytes"] = sum(size for name, size in record["files"].items() if name.startswith("model.onnx"))
    shutil.rmtree(out, ignore_errors=True)  # graphs of several GB: one member's on disk at a time
    if whole:
        record["whole"] = measure_whole(member, out, logs, source)
        if "failed" not in record["whole"]:
            record["loads"] = measure_loads(out, logs, source, member.name)
        shutil.rmtree(out, ignore_errors=True)
    return record


def measure_alternating(member: Member, work: Path, source: Path, args: argparse.Namespace) -> dict:
    """`make engine` (every stage in one process, --force) with this checkout's pipeline and with --compare's, in
    alternating order, --rounds times each: on a machine shared with other jobs one pair of runs says little, and
    alternating lets a busy moment hit both alike."""
    other = Path(args.compare).resolve()
    sources = {"this": source, "other": other}
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rounds = []
    for index in range(args.rounds):
        for which in ("this", "other") if index % 2 == 0 else ("other", "this"):
            out = work / f"{member.name}-{which}"
            load = round(os.getloadavg()[0], 2)
            record = measure_whole(member, out, logs, sources[which])
            rounds.append({"which": which, "load": load, **record})
            print(
                f"  {member.name:<9} {which:<5} {record['seconds']:>8.1f} s {record['peak_rss_bytes'] / GB:>6.2f} GB",
                flush=True,
            )
            shutil.rmtree(out, ignore_errors=True)
    record = {"member": member.name, "model": member.model, "nominal_gb": member.nominal_gb, "stages": []}
    record |= {"precision": member.precision, "available_memory_bytes": available_memory(), "weight_bytes": 0}
    record["load_average"] = [round(v, 2) for v in os.getloadavg()]
    record["alternating"] = {"other_commit": source_commit(other, args.compare_commit), "rounds": rounds}
    return record


def available_memory() -> int | None:
    """MemAvailable: the machine is shared, so what others held when a member ran is part of its record."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def source_commit(source: Path, given: str | None) -> str:
    if given:
        return given
    found = subprocess.run(["git", "-C", str(source), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    # The reports this writes do not count: a second run would otherwise find the first one's.
    status = ["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs/benchmarks"]
    dirty = subprocess.run(status, capture_output=True, text=True).stdout.strip()
    return found.stdout.strip() + (" + uncommitted changes" if dirty else "") if found.returncode == 0 else "unknown"


def measure(args: argparse.Namespace) -> dict:
    source = Path(args.source).resolve()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="scale.", dir=args.work) as work:
        floor = measure_floor(source, Path(work))
        members = []
        for name in args.members:
            print(f"{name} ({MEMBERS[name].model})", flush=True)
            if args.compare:
                members.append(measure_alternating(MEMBERS[name], Path(work), source, args))
            else:
                members.append(measure_member(MEMBERS[name], Path(work), source, args.whole, args.commit))
    return {
        "label": args.label,
        "commit": source_commit(source, args.commit),
        "floor_rss_bytes": floor.peak_rss_bytes,
        "builder": BUILDER,
        "seconds": round(time.perf_counter() - started, 1),
        "environment": describe_environment(threads=physical_cores()),
        "members": members,
    }


# ----------------------------------------------------------------------------------------------- the report


def merged(path: Path, run: dict, append: bool = False) -> dict:
    """scale.json with `run` in place of any earlier run under its label; with `append`, its members added to that
    run's (a member measured again replaces its earlier row), its command and seconds kept beside the earlier ones."""
    report = json.loads(path.read_text()) if path.is_file() else {"runs": []}
    earlier = next((old for old in report["runs"] if old["label"] == run["label"]), None)
    if append and earlier is not None:
        names = {member["member"] for member in run["members"]}
        run = {
            **earlier,
            "members": [m for m in earlier["members"] if m["member"] not in names] + run["members"],
            "seconds": round(earlier["seconds"] + run["seconds"], 1),
            "commands": [*_commands(earlier), *_commands(run)],
            "commit": run["commit"],
        }
    report["runs"] = [old for old in report["runs"] if old["label"] != run["label"]] + [run]
    return report


def _commands(run: dict) -> list[str]:
    return run.get("commands") or [run["environment"]["command"]]


def stage_cell(row: dict) -> str:
    if "failed" in row:
        return f"failed: {row['failed']}"
    return ", ".join(f"{name} {seconds:.1f}" for name, seconds in row["timings"].items())


def precision(run: dict, member: dict) -> str:
    return member.get("precision") or run.get("precision", "fp16")  # runs before phase 2 built fp16 only


ROW_NAMES = {"engine": "**engine, one process**", "runner": "runner: load + 1 call", "serve": "serve: until ready"}


def member_table(run: dict) -> list[str]:
    lines = [
        "| model | precision | FP32 weights | stage (process) | seconds in stages | process wall s | peak RSS | "
        "peak / weights | disk at peak | stages it ran (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for member in run["members"]:
        weights = member["weight_bytes"]
        if "alternating" in member:
            continue  # alternating_table's
        for row in _rows(member):
            lines.append(
                f"| {member['member']} | {precision(run, member)} | {weights / GB:.2f} GB | "
                f"{ROW_NAMES.get(row['stage'], row['stage'])} | {row['seconds']:.1f} | {row['wall_seconds']:.1f} | "
                f"{row['peak_rss_bytes'] / GB:.2f} GB | {_times(row['peak_rss_bytes'], weights)} | {_disk(row)} | "
                f"{stage_cell(row)} |"
            )
    return lines


def _disk(row: dict) -> str:
    """The stage's peak rise of the disk in use (DiskWatch); "-" where it was not measured (earlier runs, loads)."""
    return f"{row['peak_disk_bytes'] / GB:.2f} GB" if "peak_disk_bytes" in row else "-"


def _times(peak: int, weights: int) -> str:
    """Peak RSS over the FP32 weights; "-" where no graph was written to weigh them (an export that failed)."""
    return f"{peak / weights:.1f}x" if weights else "-"


def alternating_table(run: dict) -> list[str]:
    """`make engine` with this commit and another, in alternating rounds: each round's seconds in stages, the
    stages this pipeline changed among them, peak RSS and load."""
    lines = []
    for member in (m for m in run["members"] if "alternating" in m):
        record = member["alternating"]
        commits = {"this": run["commit"], "other": record["other_commit"]}
        lines += [
            f"{member['member']}: `make engine` with commit {commits['this']} and with {commits['other']}, in "
            f"alternating order ({len(record['rounds']) // 2} rounds each), each in its own process; the stages "
            "from check on are the ones the commits differ in (prepare, reference and export run PyTorch and vary "
            "with the machine's load alone).",
            "",
            "| commit | round | seconds in stages | check to build | peak RSS | load | stages (s) |",
            "|---|---|---|---|---|---|---|",
        ]
        for index, row in enumerate(record["rounds"]):
            lines.append(
                f"| {commits[row['which']]} | {index // 2} | {row['seconds']:.1f} | {_later_stages(row):.1f} | "
                f"{row['peak_rss_bytes'] / GB:.2f} GB | {row['load']} | {stage_cell(row)} |"
            )
        for which in ("this", "other"):
            rows = [row for row in record["rounds"] if row["which"] == which]
            total = statistics.median(row["seconds"] for row in rows)
            later = statistics.median(_later_stages(row) for row in rows)
            lines.append(f"| **{commits[which]}, median** | | {total:.1f} | {later:.1f} | | | |")
        lines.append("")
    return lines


def _later_stages(row: dict) -> float:
    """The seconds of the stages from check on (the ones that do not run PyTorch)."""
    return sum(seconds for name, seconds in row["timings"].items() if name not in ("prepare", "reference", "export"))


# Sizes the growth is fitted on: from here the weights outweigh a process's fixed costs (Python, torch, ONNX Runtime,
# the floor row), which at 0.1 GB are most of a stage's time and memory and would flatten any fit.
GROWTH_FROM_BYTES = 0.5e9


def growth(run: dict, family: str) -> dict[str, tuple[float, float, int]]:
    """{stage: (time exponent, memory exponent, sizes)}: seconds and peak RSS fitted as c * weights^k over the
    family's members of GROWTH_FROM_BYTES and more (least squares on the logarithms; two sizes: their ratio)."""
    names = {member.name for member in FAMILIES[family]}
    members = [m for m in run["members"] if m["member"] in names and m["weight_bytes"] >= GROWTH_FROM_BYTES]
    fitted = {}
    for stage in [*STAGES, "engine"]:
        points = [(m["weight_bytes"], row) for m in members for row in _rows(m) if row["stage"] == stage]
        points = [(w, row) for w, row in points if "failed" not in row and row["seconds"] > 0]
        if len({w for w, _ in points}) < 2:
            continue
        x = [math.log(w) for w, _ in points]
        seconds = [math.log(row["seconds"]) for _, row in points]
        memory = [math.log(row["peak_rss_bytes"]) for _, row in points]
        fitted[stage] = (_slope(x, seconds), _slope(x, memory), len(points))
    return fitted


def _slope(x: list[float], y: list[float]) -> float:
    mean_x, mean_y = sum(x) / len(x), sum(y) / len(y)
    return sum((a - mean_x) * (b - mean_y) for a, b in zip(x, y, strict=True)) / sum((a - mean_x) ** 2 for a in x)


def growth_table(run: dict) -> list[str]:
    lines = []
    for family in ("mlp", "mlp-int8"):
        fitted = growth(run, family)
        if not fitted:
            continue
        names = {member.name for member in FAMILIES[family]}
        sizes = sorted({m["weight_bytes"] / GB for m in run["members"] if m["member"] in names})
        sizes = [size for size in sizes if size * GB >= GROWTH_FROM_BYTES]
        lines += [
            f"How each stage grows with the weights, {family} ({', '.join(f'{size:.1f}' for size in sizes)} GB): "
            "seconds and peak RSS fitted as c * weights^k; k = 1 grows like the weights (2x per doubling), k < 1 "
            "slower (what does not grow with them, the process's imports among it, weighs more at small sizes).",
            "",
            "| stage | time k | time per doubling | memory k | memory per doubling | sizes |",
            "|---|---|---|---|---|---|",
        ]
        for stage, (time_k, memory_k, count) in fitted.items():
            lines.append(
                f"| {ROW_NAMES.get(stage, stage)} | {time_k:.2f} | {2**time_k:.2f}x | {memory_k:.2f} | "
                f"{2**memory_k:.2f}x | {count} |"
            )
        lines.append("")
    return lines


# Issue 38's goals, read off the last run (the first run, "before", for ResNet-50's time): who must build and load,
# and the 1.2 GB model's limits.
MUST_BUILD = ("mlp-2.4", "mlp-2.4-int8", "mlp-5")
LIMITS_1_2_GB = (60.0, 3.0)  # seconds in stages of make engine, peak RSS / FP32 weights


def last_whole_run(report: dict) -> dict:
    """The last run that built whole engines (--whole): what the goals and the plot's engine points are judged on (a
    run of single stages, such as the INT8 members alone, measures none of them)."""
    return next((r for r in reversed(report["runs"]) if any("whole" in m for m in r["members"])), report["runs"][-1])


def goals_table(report: dict) -> list[str]:
    """The goals, judged on the last run that built whole engines."""
    first = report["runs"][0]
    run = last_whole_run(report)
    members = {m["member"]: m for m in run["members"] if "whole" in m}
    lines = [f"Goals on the run {run['label']!r}:", "", "| goal | measured | met |", "|---|---|---|"]
    for name in (name for name in MUST_BUILD if name in members):
        rows = [{**members[name]["whole"], "stage": "engine"}, *members[name].get("loads", [])]
        failed = [f"{row['stage']}: {row['failed']}" for row in rows if "failed" in row]
        measured = "; ".join(failed) or ", ".join(f"{row['stage']} {row['seconds']:.1f} s" for row in rows)
        lines.append(f"| {name} builds ({precision(run, members[name])}), the runner and the service load it | "
                     f"{measured} | {'no' if failed else 'yes'} |")  # fmt: skip
    if "mlp-1.2" in members:
        whole, weights = members["mlp-1.2"]["whole"], members["mlp-1.2"]["weight_bytes"]
        ratio, (seconds, times) = whole["peak_rss_bytes"] / weights, LIMITS_1_2_GB
        lines.append(f"| mlp-1.2: make engine at most {seconds:.0f} s in stages, peak RSS at most {times:.0f}x its "
                     f"weights | {whole['seconds']:.1f} s, {ratio:.1f}x | "
                     f"{'yes' if whole['seconds'] <= seconds and ratio <= times else 'no'} |")  # fmt: skip
    earlier = next((m for m in first["members"] if m["member"] == "resnet50" and "whole" in m), None)
    if "resnet50" in members and earlier is not None and first is not run:
        now, then = members["resnet50"]["whole"]["seconds"], earlier["whole"]["seconds"]
        lines.append(f"| resnet50: make engine no slower than {first['label']} ({first['commit']}) | {now:.1f} s "
                     f"against {then:.1f} s | {'yes' if now <= then else 'no'} |")  # fmt: skip
    return [*lines, ""]


def run_header(run: dict) -> list[str]:
    environment = run["environment"]
    cpu = environment["cpu"]
    versions = ", ".join(f"{name} {version}" for name, version in environment["versions"].items() if version)
    commands = "; ".join(f"`{command}`" for command in _commands(run))
    return [
        f"## {run['label']}: commit {run['commit']}",
        "",
        f"{cpu['model']}, {cpu['physical_cores']} physical cores shared with other jobs, "
        f"{instruction_sets_text(cpu['instruction_sets'])}; {versions}. Measured in {run['seconds']:.0f} s by "
        f"{commands}. Builder {run['builder']}. A process that only "
        f"imports the build stages peaks at {run['floor_rss_bytes'] / GB:.2f} GB (in every row's peak). Memory "
        "available (others' jobs excluded) and load average when each model started: "
        + "; ".join(
            f"{m['member']}{_commit_of(run, m)} {m['available_memory_bytes'] / 2**30:.1f} GiB, {m['load_average']}"
            for m in run["members"]
        )
        + ".",
        "",
    ]


def _commit_of(run: dict, member: dict) -> str:
    """ " (at <commit>)" for a member measured at another commit than the run's last."""
    commit = member.get("commit")
    return f" (at {commit})" if commit and commit != run["commit"] else ""


def render_markdown(report: dict) -> str:
    lines = [
        "# Time and peak memory per stage as the weights grow (issue 38)",
        "",
        f"Generated by `benchmarks/scale.py` (with {JSON_NAME}; {PLOT_NAME}: time and peak RSS against the FP32 "
        "weights, one line per stage of the FP16 MLP family, each run its own marker; the real architectures as "
        "points). Every command-line stage runs in its own process "
        "(`python -m trt_pipeline <stage> ...`), so a stage's peak RSS is its process's high-water mark (ru_maxrss), "
        "exact, and no earlier stage's leftovers count in it; its seconds are those the stages it ran recorded in "
        "manifest.json (the export process runs prepare, reference and export). The engine row is `make engine` "
        "as a user runs it: every stage in one process, the PyTorch model alive throughout. The runner row loads "
        "the finished folder with load_runner (ONNX Runtime, its graph from a private copy: pipeline/folder/reader.py) "
        "and calls it once; the serve row is `trt-pipeline serve` until ready (its peak over one REST request). "
        "Peak RSS counts the pages of the weights ONNX Runtime maps from disk, which the kernel keeps or drops as "
        "memory allows, so it moves with what else the page cache holds: the 1.1B LM's INT8 precision stage peaked "
        "at 14.4 GB (3968b0f) and 18.7 GB (3192410), over the same 14.0 GB of anonymous memory (sampled from "
        "/proc/<pid>/status every second, one run each; the second left less scratch in the page cache). "
        "Disk at peak (stage rows of later runs): the most the bytes in use on the file systems of the work folder "
        "and the system's temporary folder rose while the stage ran (sampled every 0.5 s): its scratch files and "
        "what it wrote. "
        "Models: benchmarks/scale_models.py (N x Linear(d, d) + GELU, random weights; a Llama-style causal LM of "
        "1.1B parameters and ViT-L/16 from their transformers configs, random weights; ResNet-50 from the "
        "registry); mlp-1.2-dynamo is mlp-1.2 with EXPORTER=dynamo. INT8 members calibrate on 256 random normal "
        "rows (vit-l-int8: 32 random images; llama-1.1b-int8: 256 sequences of 16 random token ids), with the INT8 "
        "defaults (CALIB_METHOD=auto, SMOOTH=auto, the float "
        "search).",
        "",
        f"![time and peak RSS per stage]({PLOT_NAME})",
        "",
        *goals_table(report),
    ]
    for run in report["runs"]:
        lines += run_header(run) + growth_table(run) + alternating_table(run) + member_table(run) + [""]
    return "\n".join(lines)


def render_plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (time_axis, memory_axis) = plt.subplots(1, 2, figsize=(13, 5.2))
    colors = dict(zip([*STAGES, "engine"], plt.get_cmap("tab10").colors, strict=False))
    family = {member.name for member in FAMILIES["mlp"]}
    last = last_whole_run(report)
    measured = [run for run in report["runs"] if any(m["member"] in family for m in run["members"])]
    for run, marker in zip(measured, itertools.cycle("os^vD")):
        members = sorted((m for m in run["members"] if m["member"] in family), key=lambda m: m["weight_bytes"])
        for stage in [*STAGES, "engine"]:
            points = [(m["weight_bytes"] / GB, row) for m in members for row in _rows(m) if row["stage"] == stage]
            points = [(x, row) for x, row in points if "failed" not in row]
            if not points:
                continue
            xs = [x for x, _ in points]
            style = {"color": colors[stage], "marker": marker, "linestyle": "-" if run is last else ":"}
            label = f"{stage} ({run['label']})"
            time_axis.plot(xs, [row["seconds"] for _, row in points], label=label, **style)
            memory_axis.plot(xs, [row["peak_rss_bytes"] / GB for _, row in points], label=label, **style)
    for member in last["members"]:  # the real architectures and the INT8 builds: their engine rows as points
        if member["member"] in family or "whole" not in member or "failed" in member["whole"]:
            continue
        x, whole = member["weight_bytes"] / GB, member["whole"]
        for axis, y in ((time_axis, whole["seconds"]), (memory_axis, whole["peak_rss_bytes"] / GB)):
            axis.scatter([x], [y], color="black", marker="*", zorder=3)
            axis.annotate(member["member"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    top = max(m["weight_bytes"] for run in report["runs"] for m in run["members"]) / GB
    memory_axis.plot([0, top], [0, 3 * top], color="grey", linestyle="--", label="3x the weights (issue 38's goal)")
    time_axis.set(xlabel="FP32 weights (GB)", ylabel="seconds in the stage", title="time per stage (MLP family, FP16)")
    memory_axis.set(
        xlabel="FP32 weights (GB)", ylabel="peak RSS (GB)", title="peak RSS per stage process (*: engine row)"
    )
    memory_axis.legend(fontsize=6, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=90)


def _rows(member: dict) -> list[dict]:
    whole = [{**member["whole"], "stage": "engine"}] if "whole" in member else []
    return [*member["stages"], *whole, *member.get("loads", [])]


def write_report(report: dict, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / JSON_NAME).write_text(json.dumps(report, indent=2) + "\n")
    (folder / MARKDOWN_NAME).write_text(render_markdown(report))
    render_plot(report, folder / PLOT_NAME)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="after", help="the run's name in the report (a rerun replaces it)")
    parser.add_argument("--members", type=lambda text: text.split(","), default=["mlp-0.1", "mlp-0.6", "mlp-1.2"],
                        help=f"comma-separated, of {', '.join(MEMBERS)}")  # fmt: skip
    parser.add_argument("--whole", action="store_true", help="also run each model's stages in one process")
    parser.add_argument("--source", default=str(ROOT), help="the checkout whose trt_pipeline runs the stages")
    parser.add_argument("--commit", help="the commit --source holds, where it is no git checkout")
    parser.add_argument("--work", help="where the graphs are written (a temporary folder inside it)")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "benchmarks", help="where the report goes")
    parser.add_argument("--render", action="store_true", help="rewrite scale.md and scale.png from scale.json")
    parser.add_argument("--append", action="store_true", help="add the members to the run of the same label")
    parser.add_argument("--compare", help="another checkout: make engine with each, in alternating rounds")
    parser.add_argument("--compare-commit", help="the commit --compare holds, where it is no git checkout")
    parser.add_argument("--rounds", type=int, default=4, help="with --compare: rounds of each")
    args = parser.parse_args()
    if args.render:
        write_report(json.loads((args.docs / JSON_NAME).read_text()), args.docs)
        return
    unknown = [name for name in args.members if name not in MEMBERS]
    if unknown:
        parser.error(f"unknown member(s) {unknown}; choose from {', '.join(MEMBERS)}")
    write_report(merged(args.docs / JSON_NAME, measure(args), append=args.append), args.docs)


if __name__ == "__main__":
    main()
