"""The timing core: warm-up excluded, one call per sample, the clock stopped only after the work is done.

Every sample is the wall time of one call, measured with `time.perf_counter` from just before
the call until `sync()` returns.  For host-in/host-out calls the copy back to the host already
waits for the device; for device-resident calls `sync` waits for the device explicitly
(e.g. `torch.cuda.synchronize`), so queued-but-unfinished GPU work is never counted as done.
Synchronizing after every call also keeps calls from overlapping, so a sample is a latency,
not a pipelined throughput figure.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from ..core.errors import PipelineError

# Fewer samples than this make p90 meaningless; the time budget never stops a run earlier.
MIN_SAMPLES = 5


@dataclass(frozen=True)
class Share:
    """One round's part of the policy for one backend."""

    warmup: int
    iterations: int
    budget_s: float
    min_samples: int


@dataclass(frozen=True)
class TimingPolicy:
    """How many runs to throw away and how many to time (whichever of `iterations`/`budget_s` ends first).

    The timed calls are split into `rounds` that alternate between backends, so a burst of load
    from another process on a shared machine lands on every backend instead of on one.
    """

    warmup: int = 5
    iterations: int = 100
    budget_s: float = 10.0
    rounds: int = 5
    # The rounds agree (the run is stable) when every row's per-round p50s lie within this fraction of each other.
    agree_within: float = 0.10

    def check(self) -> TimingPolicy:
        if self.warmup < 1:
            raise PipelineError(
                f"--warmup {self.warmup}: at least one warm-up run is needed",
                "give --warmup 1 or more (the first run pays for allocation, autotuning and compilation)",
            )
        if self.iterations < MIN_SAMPLES:
            raise PipelineError(
                f"--iterations {self.iterations} is too few for percentiles",
                f"give --iterations {MIN_SAMPLES} or more",
            )
        if self.budget_s <= 0:
            raise PipelineError(f"--budget-s {self.budget_s} is not positive", "give a time budget in seconds, e.g. 10")
        if not 1 <= self.rounds <= self.iterations:
            raise PipelineError(
                f"--rounds {self.rounds} must be between 1 and --iterations ({self.iterations})", "give e.g. --rounds 5"
            )
        if not 0 < self.agree_within < 1:
            raise PipelineError(
                f"--agree-within {self.agree_within} is not a fraction between 0 and 1", "give e.g. 0.10 (10%)"
            )
        return self

    def share(self, round_index: int) -> Share:
        """Round 0 carries the full warm-up; later rounds re-warm with one call after the other backends ran."""
        return Share(
            warmup=self.warmup if round_index == 0 else 1,
            iterations=math.ceil(self.iterations / self.rounds),
            budget_s=self.budget_s / self.rounds,
            min_samples=math.ceil(MIN_SAMPLES / self.rounds),
        )

    def as_record(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class LatencyStats:
    """Latency percentiles in milliseconds over `samples` timed calls of `batch` items each."""

    batch: int
    samples: int
    p10_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    min_ms: float
    max_ms: float
    # batch / p50: one request at a time, no concurrency.  The median, like the latency column, so the two
    # never disagree about which backend wins (a mean would let one slow outlier flip the order).
    items_per_s: float

    def as_record(self) -> dict:
        return asdict(self)


def summarize(seconds: list[float], batch: int) -> LatencyStats:
    """Percentiles (linear interpolation, so p10 <= p50 <= p90 <= p99) and throughput from per-call seconds."""
    if not seconds:
        raise ValueError("no samples to summarize")
    ms = np.asarray(seconds, dtype=np.float64) * 1e3
    p10, p50, p90, p99 = (float(v) for v in np.percentile(ms, [10, 50, 90, 99]))
    return LatencyStats(
        batch=batch,
        samples=len(seconds),
        p10_ms=p10,
        p50_ms=p50,
        p90_ms=p90,
        p99_ms=p99,
        mean_ms=float(ms.mean()),
        min_ms=float(ms.min()),
        max_ms=float(ms.max()),
        items_per_s=batch / (p50 / 1e3),
    )


def round_spread(rounds: list[list[float]]) -> dict:
    """Each round's p50 (ms) and their spread: (largest - smallest) / smallest.

    The rounds of one cell ran minutes apart, interleaved with the other backends; on an idle machine
    their medians agree to a few percent, and a busy neighbour shows up as one round far from the rest.
    """
    medians = [float(np.median(samples)) * 1e3 for samples in rounds if samples]
    if not medians:
        raise ValueError("no samples to summarize")
    return {"round_p50_ms": medians, "spread": (max(medians) - min(medians)) / min(medians)}


def measure(call: Callable[[], object], sync: Callable[[], None], share: Share) -> list[float]:
    """Warm up, then time calls one at a time; returns seconds per timed call."""
    for _ in range(share.warmup):
        call()
    sync()
    samples: list[float] = []
    # The collector would otherwise pause at random calls and land in the tail percentiles of
    # whichever backend happened to be running (timeit disables it for the same reason).
    collecting = gc.isenabled()
    gc.disable()
    try:
        started = time.perf_counter()
        while len(samples) < share.iterations:
            begin = time.perf_counter()
            call()
            sync()
            end = time.perf_counter()
            samples.append(end - begin)
            if end - started >= share.budget_s and len(samples) >= share.min_samples:
                break
    finally:
        if collecting:
            gc.enable()
    return samples
