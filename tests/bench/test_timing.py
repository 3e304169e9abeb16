"""The benchmark's clock (pipeline/bench/timing.py): what `measure` times, where it stops, the summary statistics,
and how a timing policy shares its iterations and budget between rounds."""

from __future__ import annotations

import pytest

from trt_pipeline.pipeline.bench import TimingPolicy
from trt_pipeline.pipeline.bench.timing import MIN_SAMPLES, Share, measure, summarize


def test_measure_times_exactly_the_calls_after_warm_up() -> None:
    calls: list[int] = []
    samples = measure(lambda: calls.append(1), lambda: None, Share(warmup=3, iterations=7, budget_s=60, min_samples=1))
    assert len(calls) == 10
    assert len(samples) == 7
    assert all(s >= 0 for s in samples)


def test_measure_stops_at_the_budget_but_not_below_the_minimum() -> None:
    calls: list[int] = []
    share = Share(warmup=1, iterations=1000, budget_s=1e-9, min_samples=4)
    assert len(measure(lambda: calls.append(1), lambda: None, share)) == 4


def test_summary_statistics() -> None:
    stats = summarize([0.001, 0.002, 0.003, 0.010], batch=2)
    assert (stats.p50_ms, stats.mean_ms, stats.min_ms, stats.max_ms) == pytest.approx((2.5, 4.0, 1.0, 10.0))
    assert (stats.p10_ms, stats.p90_ms) == pytest.approx((1.3, 7.9))
    assert stats.items_per_s == pytest.approx(800.0)  # batch / p50, not batch / mean (500)


def test_policy_rounds_share_the_iterations_and_budget() -> None:
    policy = TimingPolicy(warmup=4, iterations=100, budget_s=10, rounds=5)
    first, later = policy.share(0), policy.share(3)
    assert (first.warmup, later.warmup) == (4, 1)
    assert first.iterations * policy.rounds == 100
    assert first.budget_s == pytest.approx(2.0)
    assert first.min_samples * policy.rounds >= MIN_SAMPLES
