"""backend="auto" where no engine runs here: the fastest of the folder's graphs ONNX Runtime serves on this host,
chosen by measuring them, not by rule.

No rule holds on every host: ONNX Runtime's CPU provider has almost no float16 kernels and runs an FP16 graph
through casts (0.6x of its own FP32 graph on a Xeon, issue 26), while an INT8 graph shaped for this CPU's kernels
runs 3x faster than FP32 there.  So each candidate (a graph the folder promises the accuracy of, whose gate passed,
on each provider present; on CUDA tuned and untuned, candidate.py) is timed briefly in alternating rounds (so that a
slow moment of a shared host hits all alike), at the profile's opt batch and, while the time budget lasts, at its
max and min batches too: one batch is a rule of its own (on an H100, ResNet-50's FP32 graph led at batch 8 and
trailed its FP16 graph by 26% at 32, docs/benchmarks/resnet50-h100-cuda.md).  The candidate served is the one whose
time, relative to the fastest at each measured batch, is worst least (ranked()), of those that pass the host
check.  The choice is cached in the folder (SERVED_CHOICE) keyed by all that decides the speed: the CPU and its
instruction sets, the GPU, the onnxruntime version, the thread count and the candidates' sha256.  A different key
measures again.

A candidate that cannot serve, whatever it raises while it opens, is timed or is checked (a PipelineError, an error of
ONNX Runtime, a CUDA error), is skipped, its reason in runner.description and served.json, and the next one is tried;
only where none can serve does the load fail, with every candidate's reason and the fixes its errors call for.  A
risky candidate (Candidate.risky: the onnxruntime-cuda runner's) proves itself in a child process first
(runners/proving.py), so a sticky CUDA error never reaches the process that serves; its verdict is cached with the
choice, so a later load with the same key proves nothing again.
"""

from __future__ import annotations

import json
import math
import os
import stat
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..core.cpu import cpu_instruction_sets, cpu_model, int8_cpu_kind
from ..core.errors import PipelineError
from ..core.trt_module import describe_gpu
from ..evaluation.host import HostCheck
from ..folder.artifacts import write_json
from ..folder.layout import SERVED_CHOICE
from ..folder.reader import ArtifactFolder
from ..folder.rebuild import rebuild_hint
from .base import Runner
from .candidate import Candidate, Failure, close_quietly, profile_batches, timing_feed
from .device_memory import available_layers
from .host_check import SKIP, describe, refused_on_host
from .onnxruntime import CPU, CUDA, choose_providers
from .onnxruntime_cuda import what_the_runner_computes
from .proving import RISKY_IN_A_CHILD, Isolation, prove_in_child

# Alternating rounds: at least MIN_ROUNDS (a median of fewer says little), then more while within BUDGET_S.
MIN_ROUNDS, MAX_ROUNDS = 3, 9
BUDGET_S = 1.5
BEHIND = 3.0  # times the fastest at a batch: not timed at the next batches (measure_batches)
# Times the fastest in the first round at a batch: not timed in the next rounds there either.  A call that far behind
# is not noise, and on a GPU host a large model's CPU graphs cost seconds a call (a 1B-parameter ViT's, on two cores:
# 3.2 s FP32 and 2.7 s FP16 an image), rounds that only delay the load.
FAR_BEHIND = 10.0


@dataclass
class Trials:
    """What auto found of its candidates on this host: their times ({batch: {label: ms}}), the host checks made (in
    this process or, for a risky candidate, in a child's), and the candidates skipped, with why and the fix."""

    ms: dict[int, dict[str, float]] = field(default_factory=dict)
    checks: dict[str, HostCheck] = field(default_factory=dict)
    skipped: dict[str, Failure] = field(default_factory=dict)


def fastest_onnxruntime_runner(
    folder: ArtifactFolder, options: dict[str, Any], *, verify: bool = True, isolation: Isolation = RISKY_IN_A_CHILD
) -> tuple[Runner, str]:
    """(the runner on the fastest candidate, why it won: what was measured, or that the cache said so).  verify: the
    fastest that passes the host check serves (runners/host_check.py); its result is cached with the times.
    isolation: which candidates prove themselves in a child process first, and how (runners/proving.py)."""
    candidates, refused = find_candidates(folder, usable_providers())
    key = host_key(folder, candidates, options.get("intra_op_threads"))
    cached = _cached_choice(folder, key, candidates, verify=verify)
    note = ""
    if cached is not None:
        winner, trials = cached
        try:
            runner = winner.open(folder, options)
        except Exception as error:  # anything at all: measured again, the others may serve
            note = f"{winner.label}, served under this key before, failed {Failure.of(error, 'opening it').reason}; "
        else:
            how = f"measured earlier with this host's key, cached in {SERVED_CHOICE}"
            return runner, _why(winner, trials, how, refused)
    trials = Trials()
    _prove_isolated(folder, candidates, options, trials, verify=verify, isolation=isolation)
    return _measure_and_serve(folder, candidates, key, options, refused, trials, verify=verify, note=note)


def _prove_isolated(
    folder: ArtifactFolder,
    candidates: list[Candidate],
    options: dict[str, Any],
    trials: Trials,
    *,
    verify: bool,
    isolation: Isolation,
) -> None:
    """Each candidate `isolation` isolates, proved in a child process: its check into trials.checks (to `verify`), or
    why it gave none into trials.skipped.  Only one whose check passed is opened here."""
    for candidate in candidates:
        if isolation.isolate(candidate):
            verdict = prove_in_child(folder, candidate, options, verify=verify, isolation=isolation)
            if isinstance(verdict, Failure):
                trials.skipped[candidate.label] = verdict
            elif verify:
                trials.checks[candidate.label] = verdict


def _measure_and_serve(
    folder: ArtifactFolder,
    candidates: list[Candidate],
    key: dict[str, Any],
    options: dict[str, Any],
    refused: list[str],
    trials: Trials,
    *,
    verify: bool,
    note: str,
) -> tuple[Runner, str]:
    """Open, time and check the candidates not yet ruled out, serve the first of them that passes, and cache it."""
    failed = set(trials.skipped) | {label for label, check in trials.checks.items() if not check.passed}
    runners = _open_all(folder, [c for c in candidates if c.label not in failed], options, trials.skipped)
    served: Candidate | None = None
    try:
        by_batch, rounds = measure_batches(runners, folder, trials.skipped)
        if not by_batch:
            raise _none_served(folder, trials)
        served = _first_served(folder, runners, ranked(by_batch), trials, verify=verify)
    finally:
        for candidate, runner in runners.items():
            if candidate != served:
                close_quietly(runner)
    trials.ms = {batch: {c.label: t for c, t in medians.items()} for batch, medians in by_batch.items()}
    cached_note = _save_choice(folder, key, served, trials)
    rule = f"of one call for any {FAR_BEHIND:g}x behind in the first"
    how = f"{note}measured now, medians of {rounds} rounds, {rule}; {cached_note}"
    return runners[served], _why(served, trials, how, refused)


def _first_served(
    folder: ArtifactFolder, runners: dict[Candidate, Runner], ranked: list[Candidate], trials: Trials, *, verify: bool
) -> Candidate:
    """The fastest candidate, or with `verify` the fastest that passes the host check (a PipelineError where none
    does): checked here, or in the child process it proved itself in (trials.checks has that check already)."""
    if not verify:
        return ranked[0]
    for candidate in ranked:
        check = trials.checks.get(candidate.label) or _check(folder, candidate, runners[candidate], trials)
        if check is not None and check.passed:
            return candidate
    raise _none_served(folder, trials)


def _check(folder: ArtifactFolder, candidate: Candidate, runner: Runner, trials: Trials) -> HostCheck | None:
    """The candidate's host check, recorded in `trials`; None where it raised (skipped, with why)."""
    try:
        check = candidate.check(folder, runner)
    except Exception as error:  # anything at all: the next candidate is checked
        trials.skipped[candidate.label] = Failure.of(error, "running its host check")
        return None
    trials.checks[candidate.label] = check
    return check


def _none_served(folder: ArtifactFolder, trials: Trials) -> PipelineError:
    """No candidate can serve: every one's reason, and the fixes their errors call for."""
    refused = refused_on_host(folder, trials.checks)
    if not trials.skipped:  # every one ran, and computed here what its build did not
        return refused
    reasons = [f"{label}: {failure.reason}" for label, failure in trials.skipped.items()]
    reasons += [f"{label}: refused on this host: {c.verdict}" for label, c in trials.checks.items() if not c.passed]
    fixes = [failure.fix for failure in trials.skipped.values()]
    if any(not check.passed for check in trials.checks.values()):
        fixes.append(str(refused.fix))
    return PipelineError(
        f"no candidate can serve {folder.path} on this host ({'; '.join(reasons)})", "; or ".join(dict.fromkeys(fixes))
    )


def usable_providers() -> list[str]:
    """The ONNX Runtime providers that can serve here: CUDA where onnxruntime-gpu, a GPU and a device-memory layer
    (pycuda or cuda-python, for the onnxruntime-cuda runner's buffers) are all present (the engine could not run, or
    auto would have served it), and the CPU."""
    providers, _ = choose_providers(None)
    return providers if CUDA not in providers or available_layers() else [CPU]


def measure_batches(
    runners: dict[Candidate, Runner], folder: ArtifactFolder, skipped: dict[str, Failure]
) -> tuple[dict[int, dict[Candidate, float]], int]:
    """({batch: {candidate: median ms}}, rounds at the first batch): the opt batch always, the next ones only
    while the calls of the candidates still timed have taken BUDGET_S or less (on a GPU all three; on a CPU a large
    model's opt batch alone).  A candidate BEHIND times the fastest at a batch is not timed at the next ones, and its
    calls do not count: it cannot be served ahead of one timed at every batch (ranked()), and on an H100 the CPU's
    graphs of ResNet-50 (11x to 83x behind) spent the whole budget at the opt batch, so the CUDA graphs were
    compared at that batch alone.  A candidate whose call raises leaves the race and `runners` (closed), its reason in
    `skipped`; none of its times are kept."""
    by_batch: dict[int, dict[Candidate, float]] = {}
    first_rounds, spent_s = 0, 0.0
    timed = dict(runners)
    for batch in profile_batches(folder):
        if not timed or (by_batch and spent_s > BUDGET_S):
            break
        medians, rounds = measure(timed, timing_feed(folder, batch), batch, skipped)
        if not medians:
            break
        by_batch[batch], first_rounds = medians, first_rounds or rounds
        fastest = min(medians.values())
        timed = {candidate: timed[candidate] for candidate, ms in medians.items() if ms <= BEHIND * fastest}
        spent_s += sum(medians[candidate] for candidate in timed) * (rounds + 1) / 1e3  # with the warm-up call
    for candidate in [candidate for candidate in runners if candidate.label in skipped]:
        close_quietly(runners.pop(candidate))
    kept = {batch: {c: ms for c, ms in medians.items() if c in runners} for batch, medians in by_batch.items()}
    return {batch: medians for batch, medians in kept.items() if medians}, first_rounds


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
    if CUDA in providers:  # each graph tuned, then each untuned (onnxruntime_cuda.UNTUNED)
        on_cuda = [Candidate(graph, (CUDA, CPU), tuned) for tuned in (True, False) for graph in servable.on_cuda]
        candidates = on_cuda + candidates
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


def measure(
    runners: dict[Candidate, Runner], feed: dict[str, np.ndarray], batch: int, skipped: dict[str, Failure]
) -> tuple[dict[Candidate, float], int]:
    """({candidate: median ms per call}, rounds): one warm-up call each, then alternating rounds (every other round
    in reverse order, so no candidate always runs right after the same one) until the budget is spent.  A candidate
    FAR_BEHIND the fastest in the first round is timed in no other (its median is of that call).  A candidate whose
    call raises is timed no more, and left out, its reason in `skipped`."""
    warmed = {candidate: _timed_call(candidate, runners[candidate], feed, batch, skipped) for candidate in runners}
    order = [candidate for candidate, ms in warmed.items() if ms is not None]
    times: dict[Candidate, list[float]] = {candidate: [] for candidate in order}
    timed = set(order)  # those the next round times
    start, rounds = time.perf_counter(), 0
    while timed and (rounds < MIN_ROUNDS or (rounds < MAX_ROUNDS and time.perf_counter() - start < BUDGET_S)):
        for candidate in [c for c in (order if rounds % 2 == 0 else reversed(order)) if c in timed]:
            ms = _timed_call(candidate, runners[candidate], feed, batch, skipped)
            if ms is None:
                times.pop(candidate)
                timed.discard(candidate)
            else:
                times[candidate].append(ms)
        rounds += 1
        if rounds == 1 and times:
            fastest = min(ms[0] for ms in times.values())
            timed = {candidate for candidate in timed if times[candidate][0] <= FAR_BEHIND * fastest}
    # Rounded to the microsecond the cache stores: the pick, the description and served.json say the same numbers.
    return {candidate: round(statistics.median(ms), 3) for candidate, ms in times.items()}, rounds


def _timed_call(
    candidate: Candidate, runner: Runner, feed: dict[str, np.ndarray], batch: int, skipped: dict[str, Failure]
) -> float | None:
    """Milliseconds of one call, or None where it raised (anything at all: the reason goes to `skipped`)."""
    begin = time.perf_counter()
    try:
        runner.infer(feed)
    except Exception as error:
        skipped[candidate.label] = Failure.of(error, f"timing it at batch {batch}")
        return None
    return (time.perf_counter() - begin) * 1e3


def _open_all(
    folder: ArtifactFolder, candidates: list[Candidate], options: dict[str, Any], skipped: dict[str, Failure]
) -> dict[Candidate, Runner]:
    """The candidates' runners; one that fails to open, for any reason, is left out with why in `skipped`."""
    runners: dict[Candidate, Runner] = {}
    try:
        for candidate in candidates:
            try:
                runners[candidate] = candidate.open(folder, options)
            except Exception as error:  # anything at all: the others may serve
                skipped[candidate.label] = Failure.of(error, "opening it")
    except BaseException:  # interrupted: nothing stays open
        for runner in runners.values():
            close_quietly(runner)
        raise
    return runners


def _cached_choice(
    folder: ArtifactFolder, key: dict[str, Any], candidates: list[Candidate], *, verify: bool
) -> tuple[Candidate, Trials] | None:
    """(winner, what was found: times, host checks, candidates skipped) from SERVED_CHOICE where it was measured
    under this key (and, to `verify`, its winner passed the host check), else None.  A cache file that is not what
    _save_choice writes is measured again and overwritten (_save_choice says so)."""
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
    skipped = {label: Failure(**failure) for label, failure in record.get("skipped", {}).items()}
    trials = Trials(ms, {label: check for label, check in checks.items() if check}, skipped)
    return by_label[record["served"]], trials


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
    """What makes `record` other than {"key": {...}, "ms": {"<batch>": {label: ms}}, "served": label, "checks":
    {label: HostCheck}, "skipped": {label: {"reason": ..., "fix": ...}}} ("" if nothing)."""
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
    skipped = record.get("skipped", {})
    if not isinstance(skipped, dict) or not all(_is_failure(failure) for failure in skipped.values()):
        return f"its skipped candidates are {skipped!r}, not what a skip records"
    return ""


def _is_failure(raw: Any) -> bool:
    return isinstance(raw, dict) and set(raw) == {"reason", "fix"} and all(isinstance(v, str) for v in raw.values())


def _is_milliseconds(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _save_choice(folder: ArtifactFolder, key: dict[str, Any], winner: Candidate, trials: Trials) -> str:
    """Write the choice to SERVED_CHOICE ({batch: ms by label}, the batches in the order measured, the host checks and
    the candidates skipped); what happened, for the description (a read-only folder is served anyway, measured at
    every load), including what was wrong with a cache file it replaces (or, read-only, ignores)."""
    _, problem = _read_record(folder)
    damaged = f"{SERVED_CHOICE} there held no valid measurement ({problem})" if problem else ""
    record = {
        "key": key,
        "ms": {str(batch): medians for batch, medians in trials.ms.items()},
        "served": winner.label,
        "checks": {label: check.as_json() for label, check in trials.checks.items()},
        "skipped": {label: {"reason": failure.reason, "fix": failure.fix} for label, failure in trials.skipped.items()},
    }
    try:
        write_json(folder.path / SERVED_CHOICE, record)
    except OSError as error:
        ignored = f"; {damaged}: ignored" if damaged else ""
        return f"not cached: {folder.path} is not writable ({error.strerror}), so every load measures again{ignored}"
    return f"cached in {SERVED_CHOICE}" + (f", replacing it: {damaged}" if damaged else "")


def _fastest_first(medians: dict[str, float]) -> str:
    return ", ".join(f"{label} {t:.2f} ms" for label, t in sorted(medians.items(), key=lambda item: item[1]))


def _why(winner: Candidate, trials: Trials, how: str, refused: list[str]) -> str:
    """What was measured (ms per call by candidate, by batch), why the winner won, which candidates were skipped and
    why, and what the host check found, for runner.description."""
    timed = "; ".join(f"batch {batch}: {_fastest_first(medians)}" for batch, medians in trials.ms.items())
    batches = ", ".join(str(batch) for batch in trials.ms)
    fastest = (
        "the fastest"
        if all(check.passed for check in trials.checks.values())
        else "the fastest that passed the host check"
    )
    text = (
        f"{winner.label} ({winner.precision}) was {fastest} over batch {batches} ({how}; the least "
        f"worst ratio to the fastest at each): {timed}"
    )
    if refused:
        text += f"; not candidates: {'; '.join(refused)}"
    if trials.skipped:
        text += "; skipped: " + "; ".join(f"{label}: {failure.reason}" for label, failure in trials.skipped.items())
    checks = trials.checks
    return f"{text}; {describe(checks)}" if checks else f"{text}; not checked on this host ({SKIP})"
