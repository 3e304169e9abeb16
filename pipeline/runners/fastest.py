"""backend="auto" where no engine runs here: the fastest of the folder's graphs ONNX Runtime serves on this host,
chosen by measuring them, not by rule.

No rule holds on every host: ONNX Runtime's CPU provider has almost no float16 kernels and runs an FP16 graph
through casts (0.6x of its own FP32 graph on a Xeon, issue 26), while an INT8 graph shaped for this CPU's kernels
runs 3x faster than FP32 there.  So each candidate (a graph the folder promises the accuracy of, whose gate passed,
on each provider present) is timed briefly in alternating rounds (so that a slow moment of a shared host hits all
alike), at the profile's opt batch and, while the time budget lasts, at its max and min batches too: one batch is a
rule of its own (on an H100, ResNet-50's FP32 graph led at batch 8 and trailed its FP16 graph by 26% at 32,
docs/benchmarks/resnet50-h100-cuda.md).  The candidate served is the one whose time, relative to the fastest at
each measured batch, is worst least (ranked()), of those that pass the host check.  The choice is cached in the folder
(SERVED_CHOICE) keyed by all that decides the speed: the CPU and its instruction sets, the GPU, the onnxruntime
version, the thread count and the candidates' sha256.  A different key measures again.
"""

from __future__ import annotations

import json
import math
import os
import stat
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..core.cpu import cpu_instruction_sets, cpu_model, int8_cpu_kind
from ..core.errors import PipelineError
from ..core.precision import Precision
from ..core.trt_module import describe_gpu
from ..evaluation.host import HostCheck
from ..folder.artifacts import write_json
from ..folder.graph_io import load_reference
from ..folder.layout import REFERENCE, SERVED_CHOICE
from ..folder.reader import ArtifactFolder
from ..folder.rebuild import rebuild_hint
from ..folder.records import GraphRecord
from .base import Runner
from .device_memory import available_layers
from .host_check import SKIP, check_runner, describe, first_passing, refused_on_host
from .onnxruntime import CPU, CUDA, OnnxRuntimeRunner, choose_providers
from .onnxruntime_cuda import CaptureRefused, OnnxRuntimeCudaRunner, what_the_runner_computes

# Alternating rounds: at least MIN_ROUNDS (a median of fewer says little), then more while within BUDGET_S.
MIN_ROUNDS, MAX_ROUNDS = 3, 9
BUDGET_S = 1.5
BEHIND = 3.0  # times the fastest at a batch: not timed at the next batches (measure_batches)


@dataclass(frozen=True)
class Candidate:
    """One graph of the folder on one ONNX Runtime provider (the CPU provider is always the last fallback).  On the
    CUDA provider the candidate is the onnxruntime-cuda runner (IO binding to buffers on the GPU), which serves it."""

    record: GraphRecord
    providers: tuple[str, ...]

    @property
    def graph(self) -> str:
        return self.record.file

    @property
    def precision(self) -> Precision:
        return self.record.precision

    @property
    def label(self) -> str:
        return f"{self.graph} on {self.providers[0].removesuffix('ExecutionProvider')}"

    @property
    def on_cuda(self) -> bool:
        return self.providers[0] == CUDA

    def open(self, folder: ArtifactFolder, options: dict[str, Any]) -> Runner:
        """Its runner; the CUDA runner takes only the options both runners share (the CPU's threads do not apply),
        with a CUDA graph per input shape where ONNX Runtime can capture the graph (on an H100 it took ResNet-50's
        FP16 graph from 1.26 to 0.65 ms at batch 1 and the encoder's from 1.42 to 1.19 ms at 32)."""
        if self.on_cuda:
            shared = {name: value for name, value in options.items() if name == "split_large_batches"}
            try:
                return OnnxRuntimeCudaRunner(folder, graph=self.graph, cuda_graph=True, **shared)
            except CaptureRefused:  # nodes on the CPU: they run between the CUDA kernels, uncaptured
                return OnnxRuntimeCudaRunner(folder, graph=self.graph, **shared)
        return OnnxRuntimeRunner(folder, **{**options, "graph": self.graph, "providers": list(self.providers)})


def fastest_onnxruntime_runner(
    folder: ArtifactFolder, options: dict[str, Any], *, verify: bool = True
) -> tuple[Runner, str]:
    """(the runner on the fastest candidate, why it won: what was measured, or that the cache said so).  verify: the
    fastest that passes the host check serves (runners/host_check.py); its result is cached with the times."""
    candidates, refused = find_candidates(folder, usable_providers())
    key = host_key(folder, candidates, options.get("intra_op_threads"))
    cached = _cached_choice(folder, key, candidates, verify=verify)
    if cached is not None:
        winner, ms, checks = cached
        runner = winner.open(folder, options)
        how = f"measured earlier with this host's key, cached in {SERVED_CHOICE}"
        return runner, _why(winner, ms, how, refused, checks)
    return _measure_and_serve(folder, candidates, key, options, refused, verify=verify)


def _measure_and_serve(
    folder: ArtifactFolder,
    candidates: list[Candidate],
    key: dict[str, Any],
    options: dict[str, Any],
    refused: list[str],
    *,
    verify: bool,
) -> tuple[Runner, str]:
    runners = _open_all(folder, candidates, options)
    served: Candidate | None = None
    try:
        by_batch, rounds = measure_batches(runners, folder)
        served, checks = _first_served(folder, runners, ranked(by_batch), verify=verify)
    finally:
        for candidate, runner in runners.items():
            if candidate != served:
                runner.close()
    ms = {batch: {candidate.label: t for candidate, t in medians.items()} for batch, medians in by_batch.items()}
    cached_note = _save_choice(folder, key, served, ms, checks)
    how = f"measured now, medians of {rounds} rounds; {cached_note}"
    return runners[served], _why(served, ms, how, refused, checks)


def _first_served(
    folder: ArtifactFolder, runners: dict[Candidate, Runner], ranked: list[Candidate], *, verify: bool
) -> tuple[Candidate, dict[str, HostCheck]]:
    """The fastest candidate, or with `verify` the fastest that passes the host check (a PipelineError where none
    does), and the checks made."""
    if not verify:
        return ranked[0], {}
    by_label = {candidate.label: candidate for candidate in ranked}
    label, checks = first_passing(
        list(by_label), lambda label: check_runner(folder, by_label[label].record, runners[by_label[label]])
    )
    if label is None:
        raise refused_on_host(folder, checks)
    return by_label[label], checks


def usable_providers() -> list[str]:
    """The ONNX Runtime providers that can serve here: CUDA where onnxruntime-gpu, a GPU and a device-memory layer
    (pycuda or cuda-python, for the onnxruntime-cuda runner's buffers) are all present (the engine could not run, or
    auto would have served it), and the CPU."""
    providers, _ = choose_providers(None)
    return providers if CUDA not in providers or available_layers() else [CPU]


def profile_batches(folder: ArtifactFolder) -> list[int]:
    """The batches timed, in order while the budget lasts: the profile's opt, then its max, then its min."""
    profile = folder.manifest.batch_profile  # open_folder requires one
    assert profile is not None
    return list(dict.fromkeys([profile.opt, profile.max, profile.min]))


def measure_batches(
    runners: dict[Candidate, Runner], folder: ArtifactFolder
) -> tuple[dict[int, dict[Candidate, float]], int]:
    """({batch: {candidate: median ms}}, rounds at the first batch): the opt batch always, the next ones only
    while the calls of the candidates still timed have taken BUDGET_S or less (on a GPU all three; on a CPU a large
    model's opt batch alone).  A candidate BEHIND times the fastest at a batch is not timed at the next ones, and its
    calls do not count: it cannot be served ahead of one timed at every batch (ranked()), and on an H100 the CPU's
    graphs of ResNet-50 (11x to 83x behind) spent the whole budget at the opt batch, so the CUDA graphs were
    compared at that batch alone."""
    by_batch: dict[int, dict[Candidate, float]] = {}
    first_rounds, spent_s = 0, 0.0
    timed = dict(runners)
    for batch in profile_batches(folder):
        if by_batch and spent_s > BUDGET_S:
            break
        medians, rounds = measure(timed, timing_feed(folder, batch))
        by_batch[batch], first_rounds = medians, first_rounds or rounds
        fastest = min(medians.values())
        timed = {candidate: timed[candidate] for candidate, ms in medians.items() if ms <= BEHIND * fastest}
        spent_s += sum(medians[candidate] for candidate in timed) * (rounds + 1) / 1e3  # with the warm-up call
    return by_batch, first_rounds


def ranked(by_batch: dict[int, dict[Candidate, float]]) -> list[Candidate]:
    """The candidates timed at every measured batch by their worst ratio to the fastest at each, least first (ties:
    in order), then those left behind (measure_batches) by the same rule over the batches they were timed at."""
    candidates = list(next(iter(by_batch.values())))

    def order(candidate: Candidate) -> tuple[int, float]:
        timed = [medians for medians in by_batch.values() if candidate in medians]
        return -len(timed), max(medians[candidate] / min(medians.values()) for medians in timed)

    return sorted(candidates, key=order)


def find_candidates(folder: ArtifactFolder, providers: list[str]) -> tuple[list[Candidate], list[str]]:
    """(what may serve the folder here, why each other graph may not), on `providers`: those ONNX Runtime can run
    here (usable_providers()); the graphs are ArtifactFolder.servable's for this kind of CPU."""
    servable = folder.servable(int8_cpu_kind())
    candidates = [Candidate(graph, (CPU,)) for graph in servable.on_cpu]
    if CUDA in providers:
        candidates = [Candidate(graph, (CUDA, CPU)) for graph in servable.on_cuda] + candidates
    if not candidates:
        raise PipelineError(
            f"no graph of {folder.path} may be served: {'; '.join(servable.refused)}",
            f"rebuild the folder: {rebuild_hint(folder.manifest, folder.path)}",
        )
    return candidates, list(servable.refused)


def host_key(folder: ArtifactFolder, candidates: list[Candidate], threads: int | None) -> dict[str, Any]:
    """All that decides which candidate is fastest; a cached choice under another key is measured again."""
    import onnxruntime as ort

    gpu = describe_gpu(0)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": cpu_model(),
        "instruction_sets": cpu_instruction_sets(),
        "gpu": gpu["name"] if gpu else None,
        "onnxruntime": ort.__version__,
        "intra_op_threads": threads if threads is not None else f"default, {cores} cores",
        # Every file of each graph: its data file too, where it has one.
        "graphs": {c.graph: [folder.artifacts[f].sha256 for f in folder.graph_files(c.graph)] for c in candidates},
        "candidates": [c.label for c in candidates],
        # How the CUDA runner opens and runs the graphs (its check and timing were of that).
        "onnxruntime_cuda": what_the_runner_computes() if any(c.on_cuda for c in candidates) else None,
    }


def timing_feed(folder: ArtifactFolder, batch: int) -> dict[str, np.ndarray]:
    """The first reference case's inputs (real sizes and token ids in range), its rows repeated to `batch`."""
    inputs, _ = load_reference(folder.read(REFERENCE))[0]
    return {name: np.take(array, np.arange(batch) % len(array), axis=0) for name, array in inputs.items()}


def measure(runners: dict[Candidate, Runner], feed: dict[str, np.ndarray]) -> tuple[dict[Candidate, float], int]:
    """({candidate: median ms per call}, rounds): one warm-up call each, then alternating rounds (every other round
    in reverse order, so no candidate always runs right after the same one) until the budget is spent."""
    for runner in runners.values():
        runner.infer(feed)
    order = list(runners)
    times: dict[Candidate, list[float]] = {candidate: [] for candidate in order}
    start, rounds = time.perf_counter(), 0
    while rounds < MIN_ROUNDS or (rounds < MAX_ROUNDS and time.perf_counter() - start < BUDGET_S):
        for candidate in order if rounds % 2 == 0 else reversed(order):
            begin = time.perf_counter()
            runners[candidate].infer(feed)
            times[candidate].append((time.perf_counter() - begin) * 1e3)
        rounds += 1
    # Rounded to the microsecond the cache stores: the pick, the description and served.json say the same numbers.
    return {candidate: round(statistics.median(ms), 3) for candidate, ms in times.items()}, rounds


def _open_all(folder: ArtifactFolder, candidates: list[Candidate], options: dict[str, Any]) -> dict[Candidate, Runner]:
    runners: dict[Candidate, Runner] = {}
    try:
        for candidate in candidates:
            runners[candidate] = candidate.open(folder, options)
    except BaseException:
        for runner in runners.values():
            runner.close()
        raise
    return runners


def _cached_choice(
    folder: ArtifactFolder, key: dict[str, Any], candidates: list[Candidate], *, verify: bool
) -> tuple[Candidate, dict[int, dict[str, float]], dict[str, HostCheck]] | None:
    """(winner, {batch: ms by label}, the host checks made) from SERVED_CHOICE where it was measured under this key
    (and, to `verify`, its winner passed the host check), else None.  A cache file that is not what _save_choice
    writes is measured again and overwritten (_save_choice says so)."""
    record, _ = _read_record(folder)
    if record is None or record["key"] != key:
        return None
    by_label = {candidate.label: candidate for candidate in candidates}
    ms = {int(batch): medians for batch, medians in record["ms"].items()}
    checks = {label: HostCheck.from_json(check) for label, check in record.get("checks", {}).items()}
    labels = {label for medians in ms.values() for label in medians} | {record["served"]}
    served_check = checks.get(record["served"])
    if not labels <= set(by_label) or (verify and not (served_check and served_check.passed)):
        return None
    return by_label[record["served"]], ms, {label: check for label, check in checks.items() if check}


# What _save_choice writes is a few hundred bytes a candidate: a file far larger is no cache of it, and is not read.
SERVED_MAX_BYTES = 64 << 10


def _read_record(folder: ArtifactFolder) -> tuple[dict[str, Any] | None, str]:
    """(SERVED_CHOICE's record, "") where it has the form _save_choice writes, else (None, what is wrong with it; ""
    where there is none).  Bounded before it is read, and every value's type checked: a cache with "fast" for a time
    made every load fail, and a 1.5 GiB one was read at every load."""
    try:
        text = _read_bounded(folder.path / SERVED_CHOICE)
    except FileNotFoundError:
        return None, ""
    except (OSError, ValueError) as error:
        return None, str(error)
    try:
        record = json.loads(text)
    except ValueError as error:  # UnicodeDecodeError too
        return None, f"not JSON ({error})"
    problem = _record_problem(record)
    return (None, problem) if problem else (record, "")


def _read_bounded(path: Path) -> bytes:
    """The file's bytes, where it is a plain file of at most SERVED_MAX_BYTES (O_NONBLOCK: a FIFO is refused, not
    waited on)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a plain file")
        if info.st_size > SERVED_MAX_BYTES:
            raise ValueError(f"{info.st_size} bytes, more than a measurement takes ({SERVED_MAX_BYTES})")
        return handle.read(SERVED_MAX_BYTES + 1)


def _record_problem(record: Any) -> str:
    """What makes `record` other than {"key": {...}, "ms": {"<batch>": {label: ms}}, "served": label} ("" if
    nothing)."""
    if not isinstance(record, dict) or not isinstance(record.get("key"), dict):
        return "no key"
    if not isinstance(record.get("served"), str):
        return f"served is {record.get('served')!r}, not a candidate's label"
    ms = record.get("ms")
    if not isinstance(ms, dict) or not ms:
        return "no times"
    for batch, medians in ms.items():
        if not (batch.isdigit() and int(batch) > 0 and isinstance(medians, dict) and medians):
            return f"times for batch {batch!r} are {medians!r}"
        for label, value in medians.items():
            if not _is_milliseconds(value):
                return f"the time of {label} at batch {batch} is {value!r}, not a number of milliseconds"
    checks = record.get("checks", {})
    if not isinstance(checks, dict) or not all(HostCheck.from_json(check) for check in checks.values()):
        return f"its host checks are {checks!r}, not what a check records"
    return ""


def _is_milliseconds(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _save_choice(
    folder: ArtifactFolder,
    key: dict[str, Any],
    winner: Candidate,
    ms: dict[int, dict[str, float]],
    checks: dict[str, HostCheck],
) -> str:
    """Write the choice to SERVED_CHOICE ({batch: ms by label}, the batches in the order measured); what
    happened, for the description (a read-only folder is served anyway, measured at every load), including what was
    wrong with a cache file it replaces (or, read-only, ignores)."""
    _, problem = _read_record(folder)
    damaged = f"{SERVED_CHOICE} there held no valid measurement ({problem})" if problem else ""
    record = {"key": key, "ms": {str(batch): medians for batch, medians in ms.items()}, "served": winner.label}
    record["checks"] = {label: check.as_json() for label, check in checks.items()}
    try:
        write_json(folder.path / SERVED_CHOICE, record)
    except OSError as error:
        ignored = f"; {damaged}: ignored" if damaged else ""
        return f"not cached: {folder.path} is not writable ({error.strerror}), so every load measures again{ignored}"
    return f"cached in {SERVED_CHOICE}" + (f", replacing it: {damaged}" if damaged else "")


def _fastest_first(medians: dict[str, float]) -> str:
    return ", ".join(f"{label} {t:.2f} ms" for label, t in sorted(medians.items(), key=lambda item: item[1]))


def _why(
    winner: Candidate, ms: dict[int, dict[str, float]], how: str, refused: list[str], checks: dict[str, HostCheck]
) -> str:
    """What was measured (ms per call by candidate, by batch), why the winner won and what the host check found, for
    runner.description."""
    timed = "; ".join(f"batch {batch}: {_fastest_first(medians)}" for batch, medians in ms.items())
    batches = ", ".join(str(batch) for batch in ms)
    fastest = (
        "the fastest" if all(check.passed for check in checks.values()) else "the fastest that passed the host check"
    )
    text = (
        f"{winner.label} ({winner.precision}) was {fastest} over batch {batches} ({how}; the least "
        f"worst ratio to the fastest at each): {timed}"
    )
    if refused:
        text += f"; not candidates: {'; '.join(refused)}"
    return f"{text}; {describe(checks)}" if checks else f"{text}; not checked on this host ({SKIP})"
