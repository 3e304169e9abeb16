"""How `auto` picks what a folder serves (pipeline/runners/fastest.py): the candidates timed at the profile's batches,
the least slow at its worst batch served, candidates far behind left untimed, and the measurement cached in the
folder, validated when read and measured again when it does not validate."""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path

import pytest

from tests.helpers.runner_feeds import cnn_batch
from tests.helpers.runner_folders import copy_folder, edit_manifest
from trt_pipeline.pipeline.core.cpu import int8_cpu_kind
from trt_pipeline.pipeline.core.precision import Precision
from trt_pipeline.pipeline.folder.layout import CPU_TARGETS, SERVED_CHOICE, graph_record
from trt_pipeline.pipeline.folder.reader import open_folder
from trt_pipeline.pipeline.runners import fastest, load_runner
from trt_pipeline.pipeline.runners.candidate import timing_feed
from trt_pipeline.pipeline.runners.fastest import Candidate, ranked


def _served_record(folder: Path) -> dict:
    return json.loads((folder / SERVED_CHOICE).read_text())


def _assert_serves_the_fastest_measured(runner, record: dict) -> None:
    """The served graph, of those timed at every recorded batch, has the least worst ratio to the fastest there (a
    tiny model's calls are quick enough for all three of the profile's), and the description shows every
    measurement."""
    by_batch = record["ms"]
    assert list(by_batch) == ["8", "32", "1"]  # opt, max, min
    labels = list(by_batch["8"])

    def worst(label: str) -> tuple[int, float]:
        timed = [medians for medians in by_batch.values() if label in medians]
        return -len(timed), max(medians[label] / min(medians.values()) for medians in timed)

    assert record["served"] == min(labels, key=worst) == f"{runner.graph} on CPU"
    for batch, medians in by_batch.items():
        assert f"batch {batch}: " in runner.description
        for label, ms in medians.items():
            assert f"{label} {ms:.2f} ms" in runner.description


def test_auto_picks_the_graph_least_slow_at_its_worst_batch_not_the_fastest_at_one():
    """As on the H100 (docs/benchmarks/resnet50-h100-cuda.md): FP32 a little faster at the opt batch, FP16 much
    faster at the max one: FP16 is served (worst ratio 1.03 against 1.26)."""
    fp32 = Candidate(graph_record(Precision.FP32), ("CUDAExecutionProvider",))
    fp16 = Candidate(graph_record(Precision.FP16), ("CUDAExecutionProvider",))
    by_batch = {8: {fp32: 3.53, fp16: 3.63}, 32: {fp32: 8.27, fp16: 6.55}, 1: {fp32: 1.86, fp16: 1.81}}
    assert ranked(by_batch) == [fp16, fp32]
    assert ranked({8: by_batch[8]}) == [fp32, fp16]
    # A candidate left behind at the opt batch (not timed at the others) ranks after those timed at every batch.
    cpu = Candidate(graph_record(Precision.FP32), ("CPUExecutionProvider",))
    assert ranked({8: {**by_batch[8], cpu: 40.0}, 32: by_batch[32], 1: by_batch[1]}) == [fp16, fp32, cpu]


@pytest.mark.parametrize(
    ("precision", "graphs"),
    [("fp32", {"model.onnx"}), ("fp16", {"model.onnx", "model.fp16.onnx"}), ("int8", {"model.onnx", "int8-cpu"})],
)
def test_auto_serves_the_fastest_graph_the_folder_promises_the_accuracy_of(
    folders, fp16_folder, int8_folder, tmp_path, precision, graphs
):
    folder = copy_folder({"fp32": folders["tiny_cnn"], "fp16": fp16_folder, "int8": int8_folder}[precision], tmp_path)
    expected = {
        graph_record(Precision.INT8, CPU_TARGETS[int8_cpu_kind()]).file if name == "int8-cpu" else name
        for name in graphs
    }
    with load_runner(folder) as runner:
        record = _served_record(folder)
        # Never a graph less accurate than the folder's precision (an fp32 folder never serves INT8), and the
        # TensorRT-shaped INT8 graph is not timed on the CPU where the graph for its kernels exists.
        assert set(record["key"]["graphs"]) == expected
        _assert_serves_the_fastest_measured(runner, record)
        assert runner.infer(cnn_batch(2))["logits"].shape == (2, 10)


def test_a_candidate_far_behind_at_a_batch_is_not_timed_at_the_next(fp16_folder, tmp_path, monkeypatch):
    """On an H100 the CPU's graphs of ResNet-50, 11x to 83x behind the CUDA ones, spent auto's whole budget at the
    opt batch, so the CUDA graphs were compared at that batch alone.  With BEHIND at 1, only the fastest at a batch
    (those tied with it, at the microsecond the medians keep) go on to the next, and one of them is served."""
    monkeypatch.setattr(fastest, "BEHIND", 1.0)
    folder = copy_folder(fp16_folder, tmp_path)
    with load_runner(folder) as runner:
        record = _served_record(folder)
        _assert_serves_the_fastest_measured(runner, record)
    by_batch = list(record["ms"].values())
    assert len(by_batch[0]) == 2, by_batch  # model.onnx and model.fp16.onnx on the CPU
    for medians, following in itertools.pairwise(by_batch):
        assert list(following) == [label for label, ms in medians.items() if ms == min(medians.values())], by_batch
    with load_runner(folder) as again:  # a measurement with candidates left behind is a cache like any other
        assert "measured earlier" in again.description and again.graph == runner.graph


class _Slowed:
    """A real runner whose every call takes `seconds` longer: a candidate far behind the others, as the CPU's graphs
    are on a GPU host."""

    def __init__(self, runner, seconds: float):
        self.runner, self.seconds, self.calls = runner, seconds, 0

    def infer(self, feed):
        self.calls += 1
        time.sleep(self.seconds)
        return self.runner.infer(feed)


def test_a_candidate_left_behind_does_not_use_up_the_budget_of_the_others(fp16_folder, monkeypatch):
    """Its calls (here 0.05 s each, at least four: more than the budget) do not count: the candidates still timed go
    on to the max and min batches, which the whole measurement's time had stopped at the opt batch."""
    monkeypatch.setattr(fastest, "BUDGET_S", 0.1)
    folder = open_folder(fp16_folder)
    fp32, fp16 = (Candidate(graph_record(p), ("CPUExecutionProvider",)) for p in (Precision.FP32, Precision.FP16))
    with (
        load_runner(folder, "onnxruntime", graph=fp32.graph) as fast,
        load_runner(folder, "onnxruntime", graph=fp16.graph) as slow,
    ):
        by_batch, _ = fastest.measure_batches({fp32: fast, fp16: _Slowed(slow, 0.05)}, folder, {})
    assert {batch: list(medians) for batch, medians in by_batch.items()} == {8: [fp32, fp16], 32: [fp32], 1: [fp32]}


def test_a_candidate_far_behind_in_the_first_round_is_timed_in_no_other_round(fp16_folder):
    """On a GPU host a large model's CPU graphs take seconds a call, 100x and more the CUDA ones: after its warm-up
    and one call in the first round (here 0.2 s each, the tiny CNN's calls well under 20 ms), such a candidate is
    timed no more at that batch, its median that call's, while the others go on for every round."""
    folder = open_folder(fp16_folder)
    fp32, fp16 = (Candidate(graph_record(p), ("CPUExecutionProvider",)) for p in (Precision.FP32, Precision.FP16))
    with (
        load_runner(folder, "onnxruntime", graph=fp32.graph) as fast,
        load_runner(folder, "onnxruntime", graph=fp16.graph) as slow,
    ):
        slowed = _Slowed(slow, 0.2)
        medians, rounds = fastest.measure({fp32: fast, fp16: slowed}, timing_feed(folder, 8), 8, {})
    assert slowed.calls == 2  # the warm-up and the first round's
    assert rounds >= fastest.MIN_ROUNDS and medians[fp16] >= 200 > fastest.FAR_BEHIND * medians[fp32]


def test_auto_never_serves_a_graph_whose_gate_failed(int8_folder, tmp_path):
    folder = copy_folder(int8_folder, tmp_path)
    cpu_graph = graph_record(Precision.INT8, CPU_TARGETS[int8_cpu_kind()]).file
    edit_manifest(folder, lambda m: m["agreement_int8"]["graphs"].update({cpu_graph: {"left_out": "too far off"}}))
    with load_runner(folder) as runner:
        assert f"not candidates: {cpu_graph}: it failed the INT8 agreement gate (too far off)" in runner.description
        record = _served_record(folder)
        # The TensorRT-shaped INT8 graph (its Q/DQ simulated in float) stands in for the CPU graph left out.
        assert set(record["key"]["graphs"]) == {"model.onnx", "model.int8.onnx"}
        _assert_serves_the_fastest_measured(runner, record)


def test_auto_reuses_its_measurement_under_the_same_key_and_measures_again_under_another(fp16_folder, tmp_path):
    folder = copy_folder(fp16_folder, tmp_path)
    with load_runner(folder):
        record = _served_record(folder)
    # The cache is what decides under the same key: make it name the slower graph, checked on this host as the
    # faster one was, and that one is served.
    opt = record["ms"]["8"]
    slower = max(opt, key=opt.get)
    checks = {slower: record["checks"][record["served"]]}
    (folder / SERVED_CHOICE).write_text(json.dumps({**record, "served": slower, "checks": checks}))
    with load_runner(folder) as runner:
        assert f"{runner.graph} on CPU" == slower
        assert f"cached in {SERVED_CHOICE}" in runner.description
    # Another onnxruntime version recorded: the key differs, so the graphs are timed again and the cache rewritten.
    (folder / SERVED_CHOICE).write_text(json.dumps({**record, "key": {**record["key"], "onnxruntime": "0.0.0"}}))
    with load_runner(folder) as runner:
        assert "measured now" in runner.description
        again = _served_record(folder)
        assert again["key"] == record["key"]
        _assert_serves_the_fastest_measured(runner, again)


def _time_of_opt_batch(value) -> object:
    def damage(path: Path) -> None:
        record = json.loads(path.read_text())
        record["ms"]["8"]["model.onnx on CPU"] = value
        path.write_text(json.dumps(record))

    return damage


def _skipped_as_words(path: Path) -> None:
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "skipped": {"model.fp16.onnx on CPU": "it failed"}}))


DAMAGED_CACHES = {
    "fast": (_time_of_opt_batch("fast"), "the time of model.onnx on CPU at batch 8 is 'fast', not a number"),
    "null": (_time_of_opt_batch(None), "at batch 8 is None, not a number of milliseconds"),
    "true": (_time_of_opt_batch(True), "at batch 8 is True, not a number of milliseconds"),
    "nan": (_time_of_opt_batch(float("nan")), "at batch 8 is nan, not a number of milliseconds"),
    "batch-word": (lambda path: path.write_text('{"key": {}, "ms": {"many": {}}, "served": "x"}'), "batch 'many'"),
    "not-json": (lambda path: path.write_bytes(b"\xff{"), "not JSON"),
    "skipped-words": (_skipped_as_words, "its skipped candidates are {'model.fp16.onnx on CPU': 'it failed'}"),
    # Sparse: 1.5 GiB that take no disk, and were read (5 s, 3 GB) at every load.
    "huge": (lambda path: os.truncate(path, 1536 << 20), "1610612736 bytes, more than a measurement takes"),
    "fifo": (lambda path: (path.unlink(), os.mkfifo(path)), "not a plain file"),
    "dev-zero": (lambda path: (path.unlink(), path.symlink_to("/dev/zero")), "not a plain file"),
}


@pytest.mark.parametrize("case", DAMAGED_CACHES)
def test_a_measurement_cache_that_does_not_validate_is_measured_again_and_rewritten(folders, tmp_path, case):
    # A cache with the right key but "fast" or null for a time made every auto load fail (ValueError from the
    # description's format), and `serve` answered 503 until someone deleted the file.
    damage, problem = DAMAGED_CACHES[case]
    folder = copy_folder(folders["tiny_cnn"], tmp_path)
    with load_runner(folder):
        pass
    damage(folder / SERVED_CHOICE)
    with load_runner(folder) as runner:
        assert "measured now, medians of" in runner.description
        assert f"cached in {SERVED_CHOICE}, replacing it: {SERVED_CHOICE} there held no valid measurement (" in (
            runner.description
        )
        assert problem in runner.description
        assert runner.infer(cnn_batch(2))["logits"].shape == (2, 10)
    again = _served_record(folder)
    assert all(isinstance(ms, float) for medians in again["ms"].values() for ms in medians.values())
    with load_runner(folder) as runner:  # the rewritten cache serves the next load
        assert "measured earlier with this host's key" in runner.description


def test_a_cache_that_does_not_validate_where_it_cannot_be_rewritten_is_ignored_saying_so(folders, tmp_path):
    folder = copy_folder(folders["tiny_cnn"], tmp_path)
    with load_runner(folder):
        pass
    _time_of_opt_batch("fast")(folder / SERVED_CHOICE)
    (folder / f".{SERVED_CHOICE}.{os.getpid()}.tmp").mkdir()  # where the rewrite goes first: the write fails
    with load_runner(folder) as runner:
        assert "not cached: " in runner.description and "so every load measures again; " in runner.description
        assert f"{SERVED_CHOICE} there held no valid measurement (the time of model.onnx on CPU" in runner.description
        assert runner.description.count("is 'fast', not a number of milliseconds): ignored") == 1


def test_explicit_graph_or_backend_skips_the_measurement(fp16_folder, tmp_path):
    folder = copy_folder(fp16_folder, tmp_path)
    with load_runner(folder, graph="model.fp16.onnx") as runner:
        assert runner.graph == "model.fp16.onnx"
    with load_runner(folder, "onnxruntime") as runner:
        assert runner.graph == "model.fp16.onnx"  # the engine's graph, as asked: no measuring
    assert not (folder / SERVED_CHOICE).exists()
