"""The benchmark run: the same inputs through every backend at every batch, timed the same way.

Order of work: open every backend once (loading, session creation and compilation are not
timed) and check that PyTorch still reproduces the build's reference outputs; then for each
batch size: one untimed call per backend whose outputs are compared with PyTorch eager FP32 on
the same inputs, then the warm-up and timed calls in rounds that alternate between backends.
A backend that cannot run here is recorded as skipped with the reason; one that raises is
recorded as failed with its error, and the others go on.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from ..core.compare import compare_outputs, cosine
from ..core.errors import PipelineError
from ..core.mentions import render
from ..core.nms_config import NmsConfig
from ..core.precision import Precision
from ..core.random_inputs import end_token, integer_range, random_inputs
from ..core.settings import engine_command, mention
from ..evaluation import RTOL
from ..evaluation.detections import MIN_AGREEMENT, detection_agreement
from ..folder.graph_io import load_reference
from ..folder.layout import REFERENCE as REFERENCE_FILE
from ..folder.manifest import Manifest
from ..folder.reader import open_folder
from ..postprocess.nms import detections_of
from .backends import REFERENCE, Backend, Choice, Context, Unavailable, choices_for
from .environment import describe_environment, load_average, physical_cores
from .report import DEVICE_RESIDENT, END_TO_END, agreement_text
from .timing import TimingPolicy, measure, round_spread, summarize

SEED = 0

Progress = Callable[[str], None]


def check_batches(batches: list[int] | None, manifest: Manifest) -> list[int]:
    """The batch sizes to sweep: the profile's min, opt and max by default; others must lie inside the profile."""
    profile = manifest.batch_profile
    assert profile is not None  # open_folder requires it
    low, high = profile.min, profile.max
    if batches is None:
        return sorted({low, profile.opt, high})
    outside = [b for b in batches if not low <= b <= high]
    if outside or not batches:
        raise PipelineError(
            f"batch size(s) {outside or batches} are outside the engine profile {profile}",
            f"choose batches from {low} to {high}, or rebuild with a wider {mention(batch='min:opt:max')} "
            f"({engine_command(more=True)})",
        )
    return sorted(set(batches))


@dataclass(frozen=True)
class IntegerDraws:
    """How the bench draws each integer input: within [low, high], each row ending with its end token where the
    reference's rows show one (random_inputs.end_token), as the export drew them."""

    ranges: dict[str, tuple[int, int]]
    end_tokens: dict[str, int]


def integer_draws(manifest: Manifest, reference: Path) -> IntegerDraws:
    """The draws of each integer input, from every case of the export's reference inputs (token ids must stay in the
    vocabulary; a classifier that reads each row's EOS needs it there)."""
    integer_inputs = [t.name for t in manifest.inputs if t.numpy_dtype.kind in "iu"]
    cases = [inputs for inputs, _ in load_reference(reference)] if integer_inputs else []
    ranges, ends = {}, {}
    for name in integer_inputs:
        rows = [case[name] for case in cases]
        end = end_token(rows)
        if end is not None:
            ends[name] = end
        ranges[name] = integer_range(rows, end)
    return IntegerDraws(ranges, ends)


def make_inputs(manifest: Manifest, draws: IntegerDraws, batch: int, seed: int) -> dict[str, np.ndarray]:
    """Random inputs shaped like the manifest's, at `batch` and every other dynamic axis at its opt size."""
    axis_opt = {name: r[1] for name, r in manifest.axis_ranges.items()}
    records = [tensor.as_record() for tensor in manifest.inputs]
    return random_inputs(
        records, batch, seed, axis_sizes=axis_opt, int_ranges=draws.ranges, end_tokens=draws.end_tokens
    )


def open_backends(choices: list[Choice], context: Context, progress: Progress) -> tuple[list[Backend], list[dict]]:
    """(opened backends, one record per chosen backend): skipped ones carry a reason, failed ones the error."""
    opened: list[Backend] = []
    records: list[dict] = []
    for choice in choices:
        try:
            backend = choice.open(context)
        except Unavailable as why:
            records.append({"name": choice.name, "status": "skipped", "reason": str(why)})
            progress(f"{choice.name:<20} skipped: {why}")
            continue
        except PipelineError as error:
            reason = error.problem if error.fix is None else f"{error.problem} (fix: {error.fix})"
            records.append({"name": choice.name, "status": "skipped", "reason": reason})
            progress(f"{choice.name:<20} skipped: {reason}")
            continue
        except Exception as error:  # a broken backend must not stop the others; its error goes in the report
            records.append({"name": choice.name, "status": "failed", "error": _error_text(error)})
            progress(f"{choice.name:<20} failed to open: {_error_text(error)}")
            continue
        opened.append(backend)
        records.append(
            {
                "name": backend.name,
                "status": "ran",
                "label": backend.label,
                "precision": backend.precision,
                "description": backend.description,
                "threads": backend.threads,
                "device_resident": backend.device_note or "measured",
                "peak_memory": backend.memory_note,
            }
        )
        progress(f"{backend.name:<20} {backend.description}")
    return opened, records


def check_reference_model(backends: list[Backend], reference_path: Path, nms: NmsConfig | None = None) -> dict:
    """Does PyTorch still compute what it computed when the artifacts were built (reference.npz)?

    Agreement is judged against the PyTorch model loaded now.  If its code or weights changed since
    `make engine`, every other backend "disagrees" for a reason that has nothing to do with it, so
    the report must say so rather than blame the graph or the engine.
    """
    torch_backend = next((b for b in backends if b.name == REFERENCE), None)
    if torch_backend is None:
        return {"status": "n/a", "reason": "PyTorch eager FP32 did not open"}
    inputs, expected = load_reference(reference_path)[0]  # the model's own outputs; nms: what the runners return
    expected = expected if nms is None else detections_of(expected, nms)
    result = agreement(expected, torch_backend.infer(inputs), Precision.FP32, detections=nms is not None)
    if result["status"] == "ok":
        result["summary"] = "PyTorch reproduces the outputs stored at build time (reference.npz)"
    else:
        result["summary"] = render(  # a report's text: worded here
            "PyTorch no longer reproduces the outputs stored at build time (reference.npz): the model's code or "
            f"weights changed since the folder was built, so agreement below compares against a different model; "
            f"rebuild the folder ({engine_command(more=True)}) before trusting it"
        )
    return result


def agreement(
    reference: dict[str, np.ndarray] | None,
    outputs: dict[str, np.ndarray],
    precision: Precision,
    *,
    detections: bool = False,
) -> dict:
    """The worst output's difference from PyTorch eager FP32, judged with the parity tolerance of `precision`;
    `detections` (a POSTPROCESS=nms folder): the detections matched instead (pipeline/evaluation/detections.py), as a
    score moved across a threshold changes a row, which no relative error can judge."""
    if reference is None:
        return {"status": "n/a", "reason": "PyTorch eager FP32 did not produce a reference at this batch"}
    if detections:
        return detections_agreement(reference, outputs, precision)
    rtol = RTOL[precision]
    try:
        results = compare_outputs(reference, outputs, rtol=rtol)
    except ValueError as error:  # a missing output or a wrong shape is a wrong answer, not a crash
        return {"status": "mismatch", "rtol": rtol, "reason": str(error)}
    worst = max(results.values(), key=lambda c: c.max_rel)
    return {
        "status": "ok" if all(c.ok for c in results.values()) else "mismatch",
        "rtol": rtol,
        "max_abs": worst.max_abs,
        "max_rel": worst.max_rel,
        "cosine": cosine(reference, outputs),
    }


def detections_agreement(
    reference: dict[str, np.ndarray], outputs: dict[str, np.ndarray], precision: Precision
) -> dict:
    """NMS outputs against PyTorch eager FP32 + the reference NMS: the matched share, gated as the build's NMS gate.
    INT8 on the benchmark's random inputs (clipped by its input's Q/DQ) is recorded, not judged, as at the build,
    which judges it on the held-out calibration rows (the manifest's nms_int8)."""
    try:
        matched = detection_agreement(reference, outputs)
    except (KeyError, ValueError, IndexError) as error:  # a missing output or a wrong shape is a wrong answer
        return {"status": "mismatch", "reason": f"not detections like PyTorch's: {type(error).__name__}: {error}"}
    status = "ok" if matched.passes(precision) else "mismatch"
    if precision is Precision.INT8:
        status = "not judged on random inputs"
    return {"status": status, "min_agreement": MIN_AGREEMENT[precision], **matched.as_record()}


@dataclass
class Cell:
    """One (backend, batch, mode): the call to time, its agreement, and the samples gathered round by round."""

    backend: Backend
    batch: int
    mode: str
    call: Callable[[], object]
    agreement: dict
    peak_memory_bytes: int | None
    first_call_s: float  # the checked call, untimed: it pays for allocation, and for compilation where there is one
    rounds: list[list[float]] = field(default_factory=list)
    error: str | None = None

    def record(self) -> dict:
        head = {"backend": self.backend.name, "batch": self.batch, "mode": self.mode}
        if self.error is not None:
            return head | {"status": "failed", "error": self.error}
        samples = [seconds for samples in self.rounds for seconds in samples]
        return head | {
            "status": "ok",
            "latency": summarize(samples, self.batch).as_record(),
            "rounds": round_spread(self.rounds),
            "first_call_s": self.first_call_s,
            "agreement": self.agreement,
            "peak_device_memory_bytes": self.peak_memory_bytes,
        }


def check_backend(
    backend: Backend, feed: dict[str, np.ndarray], reference: dict[str, np.ndarray] | None, detections: bool = False
):
    """(outputs, cells): one untimed call per mode, its outputs compared with the reference (`detections`: as
    detections), peak memory read."""
    batch = int(next(iter(feed.values())).shape[0])
    backend.reset_peak_memory()
    started = time.perf_counter()
    outputs = backend.infer(feed)
    first_call_s = time.perf_counter() - started
    staged = backend.stage(feed)
    if staged is not None:
        staged()
    backend.sync()
    peak = backend.peak_memory_bytes()
    if backend.name == REFERENCE:
        agreed = {"status": "reference", "max_abs": 0.0, "max_rel": 0.0}
    else:
        agreed = agreement(reference, outputs, backend.precision, detections=detections)
    cells = [Cell(backend, batch, END_TO_END, lambda: backend.infer(feed), agreed, peak, first_call_s)]
    if staged is not None:
        cells.append(Cell(backend, batch, DEVICE_RESIDENT, staged, agreed, peak, first_call_s))
    return outputs, cells


def time_rounds(cells: list[Cell], policy: TimingPolicy) -> None:
    """Time every cell, alternating between them round by round; a cell that raises keeps its error."""
    for round_index in range(policy.rounds):
        share = policy.share(round_index)
        for cell in cells:
            if cell.error is not None:
                continue
            try:
                cell.rounds.append(measure(cell.call, cell.backend.sync, share))
            except Exception as error:  # recorded, not raised: one broken backend must not hide the others
                cell.error = _error_text(error)


def stability(results: list[dict], policy: TimingPolicy, load: dict) -> dict:
    """Do the rounds agree?  Stable when every row's per-round p50s lie within policy.agree_within of each other.

    A judgement on the numbers themselves, not on the load average: a machine can be busy and still give
    each backend the same share in every round, or look idle at the start and not stay so.
    """
    record = {"agree_within": policy.agree_within, "rounds": policy.rounds, "load_average": load}
    ok = [r for r in results if r["status"] == "ok"]
    if policy.rounds < 2 or not ok:
        why = "one round" if policy.rounds < 2 else "no row was timed"
        return record | {"status": "not judged", "verdict": f"not judged: {why} (give --rounds 2 or more)"}
    worst = sorted(ok, key=lambda r: r["rounds"]["spread"], reverse=True)
    apart = [r for r in worst if r["rounds"]["spread"] > policy.agree_within]
    record["worst"] = [
        {"backend": r["backend"], "batch": r["batch"], "mode": r["mode"], "spread": r["rounds"]["spread"]}
        for r in worst[:3]
    ]
    within = f"{policy.agree_within:.0%}"
    if not apart:
        verdict = f"stable: every row's {policy.rounds} per-round p50s lie within {within} of each other"
        return record | {"status": "stable", "verdict": verdict}
    verdict = (
        f"unstable: rerun on an idle machine ({len(apart)} of {len(ok)} rows have per-round p50s more than {within} "
        f"apart; worst {worst[0]['backend']} at batch {worst[0]['batch']}, {worst[0]['rounds']['spread']:.0%})"
    )
    return record | {"status": "unstable", "verdict": verdict}


def run_sweep(
    backends: list[Backend],
    inputs: dict[int, dict[str, np.ndarray]],
    policy: TimingPolicy,
    progress: Progress,
    detections: bool = False,
) -> list[dict]:
    """Every backend at every batch; a failing backend is recorded with its error and the sweep goes on.
    detections: the outputs are a detector's NMS outputs, compared as detections."""
    results: list[dict] = []
    for batch, feed in inputs.items():
        reference: dict[str, np.ndarray] | None = None
        cells: list[Cell] = []
        progress(f"batch {batch}: checking outputs, then timing in {policy.rounds} rounds that alternate backends")
        for backend in backends:
            try:
                outputs, checked = check_backend(backend, feed, reference, detections)
            except Exception as error:  # recorded, not raised: one broken backend must not hide the others
                failed = {"backend": backend.name, "batch": batch, "mode": END_TO_END, "status": "failed"}
                results.append(failed | {"error": _error_text(error)})
                progress(f"{backend.name:<20} batch {batch:>4}  failed: {_error_text(error)}")
                continue
            if backend.name == REFERENCE:
                reference = outputs
            cells += checked
        time_rounds(cells, policy)
        for cell in cells:
            results.append(cell.record())
            progress(_progress_line(results[-1]))
    add_speedups(results)
    return results


def add_speedups(results: list[dict]) -> None:
    """speedup_vs_torch = p50 of PyTorch eager FP32 / p50 of the row, same batch and mode, same run."""
    baseline = {
        (r["batch"], r["mode"]): r["latency"]["p50_ms"]
        for r in results
        if r["backend"] == REFERENCE and r["status"] == "ok"
    }
    for r in results:
        base = baseline.get((r["batch"], r["mode"]))
        ok = r["status"] == "ok" and base is not None
        r["speedup_vs_torch"] = base / r["latency"]["p50_ms"] if ok else None


@contextlib.contextmanager
def torch_settings(threads: int) -> Iterator[None]:
    """torch as the benchmark needs it; the caller's settings come back afterwards.

    Intra-op threads: the same count as ONNX Runtime's intra-op pool (see backends), so neither side
    wins by using more cores.  TF32 off: cuDNN convolutions default to TF32 (10-bit mantissa) on
    Ampere and later, so "PyTorch FP32" would not be FP32 and the agreement reference would carry
    errors of about 1e-3 of its own.
    """
    saved = (torch.get_num_threads(), torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.set_num_threads(threads)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_num_threads(saved[0])
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved[1], saved[2]


def run_benchmark(
    folder: Path,
    *,
    backends: list[str] | None = None,
    batches: list[int] | None = None,
    policy: TimingPolicy | None = None,
    threads: int | None = None,
    make_hint: str | None = None,
    progress: Progress = print,
    extra: Sequence[Choice] = (),
) -> dict:
    """Benchmark the artifact folder; returns the report (see pipeline.bench.report for the files).  `extra`:
    backends a tool defines beside the bench's own (tools/device/ort_cuda.py's ONNX Runtime CUDA rows), timed
    in the same alternating rounds."""
    opened_folder = open_folder(folder, make_hint)
    folder, manifest = opened_folder.path, opened_folder.manifest
    policy = (policy or TimingPolicy()).check()
    chosen = [*choices_for(backends), *extra]
    sizes = check_batches(batches, manifest)
    threads = threads or physical_cores()
    if threads < 1:
        raise PipelineError(f"--threads {threads} is not positive", "give a thread count of 1 or more")
    load_before = load_average()
    started = datetime.now(timezone.utc)
    draws = integer_draws(manifest, folder / REFERENCE_FILE)
    inputs = {b: make_inputs(manifest, draws, b, SEED) for b in sizes}
    context = Context(folder=opened_folder, threads=threads, cuda=torch.cuda.is_available())
    opened: list[Backend] = []
    with torch_settings(threads):
        try:
            opened, records = open_backends(chosen, context, progress)
            reference_check = check_reference_model(opened, folder / REFERENCE_FILE, manifest.nms())
            progress(f"reference check: {reference_check.get('summary', reference_check.get('reason'))}")
            results = run_sweep(opened, inputs, policy, progress, detections=manifest.nms() is not None)
        finally:
            for backend in opened:
                backend.close()
    environment = describe_environment(threads)
    environment["load_average"] = {"before": load_before, "after": load_average()}
    verdict = stability(results, policy, environment["load_average"])
    progress(f"{verdict['verdict']}; load average before {load_before}, after {environment['load_average']['after']}")
    return {
        "schema": 2,
        "model": opened_folder.model,
        "folder": str(folder),
        "precision": opened_folder.precision,
        "created": started.isoformat(timespec="seconds"),
        "command": environment["command"],
        "batches": sizes,
        "policy": policy.as_record(),
        "inputs": {"seed": SEED, "note": "random inputs shaped like the manifest's, the same for every backend"},
        "environment": environment,
        "reference_check": reference_check,
        "stability": verdict,
        "backends": records,
        "results": results,
    }


def _progress_line(result: dict) -> str:
    head = f"{result['backend']:<20} batch {result['batch']:>4}  {result['mode']:<15}"
    if result["status"] != "ok":
        return f"{head} failed: {result['error']}"
    stats = result["latency"]
    return (
        f"{head} p50 {stats['p50_ms']:9.3f} ms  p10-p90 {stats['p10_ms']:.3f}-{stats['p90_ms']:.3f} ms  "
        f"{stats['items_per_s']:10.1f} items/s  rounds {result['rounds']['spread']:5.1%} apart  "
        f"n={stats['samples']:<4} first call {result['first_call_s']:.2f} s  "
        f"agreement {agreement_text(result['agreement'])}"
    )


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".strip()
