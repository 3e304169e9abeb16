"""The benchmark harness on tiny_cnn's real artifacts with the CPU backends (no assertion on speed: only the
report's structure and the consistency of its numbers with each other).

The artifact folder is built once per module by the real pipeline (make_engine); every backend
that runs here really runs (PyTorch, ONNX Runtime), the others must say why they were skipped.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch

from trt_pipeline.pipeline import cli
from trt_pipeline.pipeline.bench import TimingPolicy, run_benchmark, write_reports
from trt_pipeline.pipeline.bench.backends import NAMES
from trt_pipeline.pipeline.bench.harness import IntegerDraws, make_inputs, stability
from trt_pipeline.pipeline.bench.timing import MIN_SAMPLES, round_spread
from trt_pipeline.pipeline.core.cpu import cpu_instruction_sets, instruction_sets_text, int8_cpu_kind
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.precision import Precision
from trt_pipeline.pipeline.core.settings import BatchProfile, Settings
from trt_pipeline.pipeline.evaluation import RTOL
from trt_pipeline.pipeline.folder.graph_io import GraphTensor
from trt_pipeline.pipeline.folder.layout import CPU_TARGETS, SERVED_CHOICE, graph_record
from trt_pipeline.pipeline.folder.manifest import Manifest, read_manifest, update_manifest
from trt_pipeline.pipeline.folder.provenance import describe_artifacts
from trt_pipeline.pipeline.runners import load_runner
from trt_pipeline.pipeline.stages.sequence import make_engine

QUICK = TimingPolicy(warmup=2, iterations=20, budget_s=0.5, rounds=2)
BATCHES = [1, 4]
CPU_BACKENDS = ["served", "onnxruntime", "onnxruntime-session"]
# torch.compile compiles for seconds to minutes per batch size: its own test below, marked slow.
FIXTURE_BACKENDS = [name for name in NAMES if name != "torch-compile"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("engines")
    settings = Settings(
        model="tests.helpers.toy_models:tiny_cnn", precision="fp32", batch=BatchProfile(1, 4, 8), out_root=out
    )
    return make_engine(settings)


@pytest.fixture(scope="module")
def report(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict[str, Path]]:
    result = run_benchmark(folder, backends=FIXTURE_BACKENDS, batches=BATCHES, policy=QUICK, progress=lambda _: None)
    paths = write_reports(result, tmp_path_factory.mktemp("report"))
    return result, paths


def ok_rows(result: dict) -> list[dict]:
    return [r for r in result["results"] if r["status"] == "ok"]


def test_report_files_exist_and_parse(report: tuple[dict, dict[str, Path]]) -> None:
    result, paths = report
    assert json.loads(paths["json"].read_text()) == json.loads(json.dumps(result, default=str))
    markdown = paths["md"].read_text()
    assert "| backend | batch | p10 ms | p50 ms | p90 ms | p99 ms | items/s (batch / p50) |" in markdown
    for section in ("End to end", "Device-resident", "First call", "Environment", "Method", "Backends"):
        assert f"## {section}" in markdown
    # The CPU's instruction sets head the report and are in the JSON (the plot's caption shows the same text).
    assert f"CPU instruction sets: {instruction_sets_text(cpu_instruction_sets())}." in markdown
    assert result["environment"]["cpu"]["instruction_sets"] == cpu_instruction_sets()
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "not measured separately" in markdown  # CPU backends: device-resident equals end to end, said so


def test_every_cpu_backend_ran_at_every_batch(report: tuple[dict, dict[str, Path]]) -> None:
    result, _ = report
    measured = {(r["backend"], r["batch"]) for r in ok_rows(result)}
    assert measured >= {(name, b) for name in ["torch", *CPU_BACKENDS] for b in BATCHES}
    assert result["environment"]["threads"] >= 1
    assert all(r["latency"]["samples"] >= MIN_SAMPLES for r in ok_rows(result))


def test_numbers_positive_and_consistent(report: tuple[dict, dict[str, Path]]) -> None:
    result, _ = report
    baseline = {(r["batch"], r["mode"]): r["latency"]["p50_ms"] for r in ok_rows(result) if r["backend"] == "torch"}
    for row in ok_rows(result):
        s = row["latency"]
        assert 0 < s["min_ms"] <= s["p10_ms"] <= s["p50_ms"] <= s["p90_ms"] <= s["p99_ms"] <= s["max_ms"]
        assert s["min_ms"] <= s["mean_ms"] <= s["max_ms"]
        # One statistic for both panels: throughput is batch / p50, so it ranks backends as latency does.
        assert s["items_per_s"] == pytest.approx(row["batch"] / (s["p50_ms"] / 1e3), rel=1e-9)
        expected = baseline[(row["batch"], row["mode"])] / s["p50_ms"]
        assert row["speedup_vs_torch"] == pytest.approx(expected, rel=1e-9)
        medians = row["rounds"]["round_p50_ms"]
        assert len(medians) == QUICK.rounds
        assert row["rounds"]["spread"] == pytest.approx((max(medians) - min(medians)) / min(medians), rel=1e-9)
        assert min(medians) * (1 - 1e-9) <= s["p50_ms"] <= max(medians) * (1 + 1e-9)  # the union's median
        assert row["first_call_s"] > 0


def test_stability_verdict_is_reported_with_the_load(report: tuple[dict, dict[str, Path]]) -> None:
    result, paths = report
    verdict = result["stability"]
    assert verdict["status"] in ("stable", "unstable")
    assert verdict["verdict"].startswith(verdict["status"] + ":")
    assert verdict["load_average"] == result["environment"]["load_average"]
    spreads = [r["rounds"]["spread"] for r in ok_rows(result)]
    assert (verdict["status"] == "stable") == (max(spreads) <= QUICK.agree_within)
    assert verdict["worst"][0]["spread"] == max(spreads)
    markdown = paths["md"].read_text()
    assert f"**Stability: {verdict['verdict']}.**" in markdown
    if verdict["status"] == "unstable":
        assert "unstable: rerun on an idle machine" in markdown


def test_the_served_row_runs_what_load_runner_auto_serves(folder: Path, report: tuple[dict, dict[str, Path]]) -> None:
    result, _ = report
    served = next(b for b in result["backends"] if b["name"] == "served")
    with load_runner(folder, backend="auto") as runner:  # the bench measured auto's choice; this load reads it
        assert f"cached in {SERVED_CHOICE}" in runner.description
        picked = runner.description.partition(" (measured")[0]
    assert served["description"].partition(" (measured")[0] == picked
    assert served["label"] == f"served here: ONNX Runtime (runner) on {folder / 'model.onnx'}"
    assert "picked because auto:" in served["description"]


def test_skipped_backends_carry_a_reason(report: tuple[dict, dict[str, Path]]) -> None:
    result, _ = report
    records = {b["name"]: b for b in result["backends"]}
    assert set(records) == set(FIXTURE_BACKENDS)
    for record in records.values():
        assert record["status"] in ("ran", "skipped", "failed")
        if record["status"] == "skipped":
            assert len(record["reason"]) > 10
    if not torch.cuda.is_available():
        for name in ("torch-amp", "tensorrt"):
            assert records[name]["status"] == "skipped"
        assert "CUDA" in records["torch-amp"]["reason"]
    assert "INT8" in records["onnxruntime-int8"]["reason"]  # this folder has no INT8 graph
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        for name in ("onnxruntime-cuda", "onnxruntime-cuda-graphs"):  # the runner's refusal, with the fix
            assert records[name]["status"] == "skipped"
            assert "get_available_providers() returned" in records[name]["reason"]
            assert "trt-pipeline[gpu]" in records[name]["reason"]


def test_agreement_with_pytorch_is_computed(report: tuple[dict, dict[str, Path]]) -> None:
    result, _ = report
    for row in ok_rows(result):
        agreement = row["agreement"]
        if row["backend"] == "torch":
            assert agreement["status"] == "reference"
        else:
            assert agreement["status"] == "ok"
            assert 0 <= agreement["max_rel"] <= agreement["rtol"]


def test_reference_check_passes_on_fresh_artifacts(report: tuple[dict, dict[str, Path]]) -> None:
    result, paths = report
    assert result["reference_check"]["status"] == "ok"
    assert "Warning" not in paths["md"].read_text()


def test_a_model_changed_since_the_build_is_flagged(folder: Path, tmp_path: Path) -> None:
    stale = shutil.copytree(folder, tmp_path / "stale")
    # As if the model's weights changed after `make engine`: the stored PyTorch outputs no longer match.
    with np.load(stale / "reference.npz") as data:
        arrays = {key: data[key] * (2.0 if "/out/" in key else 1.0) for key in data.files}
    np.savez(stale / "reference.npz", **arrays)
    result = run_benchmark(stale, backends=["onnxruntime"], batches=[1], policy=QUICK, progress=lambda _: None)
    assert result["reference_check"]["status"] == "mismatch"
    paths = write_reports(result, tmp_path / "report")
    assert "Warning: PyTorch no longer reproduces the outputs stored at build time" in paths["md"].read_text()


def record_int8_graph(folder: Path) -> None:
    """Record model.int8.onnx as the folder's graph, with its sha256 and its gate's pass, as make engine
    PRECISION=int8 does."""
    manifest = read_manifest(folder)
    assert manifest is not None
    artifacts = {**manifest.artifacts, **describe_artifacts(folder, ["model.int8.onnx"])}
    graphs = (graph_record(Precision.FP32), graph_record(Precision.INT8))
    gate = {graph_record(Precision.INT8).gate: {"max_abs": 0.0, "max_rel": 0.0, "rtol": RTOL[Precision.INT8]}}
    update_manifest(folder, precision="int8", graphs=graphs, artifacts=artifacts, stages={**manifest.stages, **gate})


def test_int8_graph_is_benchmarked_and_a_broken_backend_does_not_stop_the_others(folder: Path, tmp_path: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    good = shutil.copytree(folder, tmp_path / "good")
    quantize_dynamic(good / "model.onnx", good / "model.int8.onnx", weight_type=QuantType.QInt8)
    record_int8_graph(good)
    quantized = onnx.load(str(good / "model.int8.onnx"))
    assert any(node.op_type == "DynamicQuantizeLinear" for node in quantized.graph.node)
    result = run_benchmark(good, backends=["onnxruntime-int8"], batches=[2], policy=QUICK, progress=lambda _: None)
    rows = {r["backend"]: r for r in result["results"]}
    assert rows["onnxruntime-int8"]["status"] == "ok"
    assert (
        rows["onnxruntime-int8"]["agreement"]["rtol"] == RTOL[Precision.INT8]
    )  # judged with the INT8 parity tolerance
    assert rows["onnxruntime-int8"]["agreement"]["status"] == "ok"
    int8_record = next(b for b in result["backends"] if b["name"] == "onnxruntime-int8")
    # quantize_dynamic makes the Conv a ConvInteger and the Linear a DynamicQuantizeMatMul: both int8 kernels.
    assert "2 of 2 Conv/MatMul/Gemm run as int8 kernels" in int8_record["description"]

    broken = shutil.copytree(folder, tmp_path / "broken")
    (broken / "model.int8.onnx").write_bytes(b"not an onnx graph")
    record_int8_graph(broken)
    result = run_benchmark(
        broken, backends=["onnxruntime", "onnxruntime-int8"], batches=[2], policy=QUICK, progress=lambda _: None
    )
    records = {b["name"]: b for b in result["backends"]}
    # The runner refuses a graph ONNX Runtime cannot read with a PipelineError: listed as skipped, with the fix.
    assert records["onnxruntime-int8"]["status"] == "skipped"
    assert "model.int8.onnx" in records["onnxruntime-int8"]["reason"]
    assert {r["backend"] for r in ok_rows(result)} == {"torch", "onnxruntime"}


def test_int8_row_runs_the_sibling_folders_graph_shaped_for_onnxruntime(folder: Path, tmp_path: Path) -> None:
    """engines/<model>-fp32 benchmarked beside engines/<model>-int8: the INT8 row runs the graph for this CPU's
    kind (pipeline.folder.layout.CPU_TARGETS), whose Conv and Gemm ONNX Runtime's CPU provider really runs as int8
    kernels."""
    fp32 = shutil.copytree(folder, tmp_path / folder.name)
    np.save(tmp_path / "calib.npy", np.random.default_rng(1).standard_normal((32, 3, 16, 16), dtype=np.float32))
    settings = Settings(model="tests.helpers.toy_models:tiny_cnn", precision="int8", batch=BatchProfile(1, 4, 8))
    int8 = make_engine(
        replace(settings, out_root=tmp_path, calib=tmp_path / "calib.npy", calib_samples=32, calib_batch=16)
    )
    assert int8 == fp32.parent / fp32.name.replace("fp32", "int8")
    result = run_benchmark(
        fp32, backends=["onnxruntime", "onnxruntime-int8"], batches=[2], policy=QUICK, progress=lambda _: None
    )
    records = {b["name"]: b for b in result["backends"]}
    assert records["onnxruntime"]["label"] == "ONNX Runtime FP32 (runner) on model.onnx"
    assert "running model.onnx (asked for)" in records["onnxruntime"]["description"]
    graph = graph_record(Precision.INT8, CPU_TARGETS[int8_cpu_kind()]).file
    assert records["onnxruntime-int8"]["label"] == f"ONNX Runtime INT8 (runner) on {int8 / graph}"
    # No graph= for this row: the runner itself picks the CPU-shaped graph, as it would in a service.
    assert f"{graph} (the int8 graph for ONNX Runtime's CPU kernels, for " in records["onnxruntime-int8"]["description"]
    assert "2 of 2 Conv/MatMul/Gemm run as int8 kernels" in records["onnxruntime-int8"]["description"]
    rows = {r["backend"]: r for r in result["results"]}
    assert rows["onnxruntime-int8"]["status"] == "ok" and rows["onnxruntime-int8"]["agreement"]["status"] == "ok"
    markdown = write_reports(result, tmp_path / "report")["md"].read_text()
    assert f"on {int8 / graph}" in markdown  # the report says which graph the row ran

    # On the INT8 folder itself, the served row is the graph a CPU service runs: the faster, as auto measured it,
    # of model.onnx and the one for this CPU's kind (runners/fastest.py).
    served = run_benchmark(int8, backends=["served"], batches=[2], policy=QUICK, progress=lambda _: None)
    record = next(b for b in served["backends"] if b["name"] == "served")
    chosen = json.loads((int8 / SERVED_CHOICE).read_text())["served"].removesuffix(" on CPU")
    assert chosen in ("model.onnx", graph)
    assert record["label"] == f"served here: ONNX Runtime (runner) on {int8 / chosen}"
    if chosen == graph:
        assert "2 of 2 Conv/MatMul/Gemm run as int8 kernels" in record["description"]
    assert {r["backend"]: r["status"] for r in served["results"]} == {"torch": "ok", "served": "ok"}


@pytest.mark.slow
def test_torch_compile_runs_on_the_cpu_with_its_compile_time_apart(folder: Path, tmp_path: Path) -> None:
    result = run_benchmark(folder, backends=["torch-compile"], batches=[2], policy=QUICK, progress=lambda _: None)
    record = next(b for b in result["backends"] if b["name"] == "torch-compile")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: torch.compile runs there with AMP FP16 (covered by the GPU report)")
    if record["status"] == "skipped":  # no C++ compiler here: the reason must say so
        assert "C++ compiler" in record["reason"]
        return
    assert record["status"] == "ran" and "inductor compiles with" in record["description"]
    row = next(r for r in result["results"] if r["backend"] == "torch-compile")
    assert row["status"] == "ok" and row["agreement"]["status"] == "ok"
    assert row["first_call_s"] > 0  # the compile, reported apart from the timed calls
    markdown = write_reports(result, tmp_path)["md"].read_text()
    assert f"- torch-compile: batch 2 {row['first_call_s']:.2f} s" in markdown


def test_the_callers_torch_settings_come_back(folder: Path) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = run_benchmark(folder, backends=[], batches=[1], policy=QUICK, threads=2, progress=lambda _: None)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert result["environment"]["threads"] == 2
    assert [r["backend"] for r in result["results"]] == ["torch"]  # the reference runs even when not asked for


def test_command_line_prints_the_table_and_writes_the_files(folder: Path, tmp_path: Path, capsys) -> None:
    argv = ["bench", "--folder", str(folder), "--backends", "onnxruntime", "--batches", "2", "--warmup", "1"]
    argv += ["--iterations", "5", "--rounds", "1", "--report-dir", str(tmp_path)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "onnxruntime          batch    2  end-to-end" in printed  # the progress line
    assert "| onnxruntime | 2 |" in printed  # the table at the end
    assert {p.name for p in tmp_path.iterdir()} >= {"bench.json", "bench.md", "bench.png"}


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"backends": ["tensorrt", "mxnet"]}, ["unknown backend", "mxnet", "onnxruntime-session"]),
        ({"batches": [1, 64]}, ["[64]", "outside the engine profile", "from 1 to 8"]),
        ({"policy": TimingPolicy(warmup=0)}, ["warm-up"]),
        ({"policy": TimingPolicy(iterations=2)}, ["too few"]),
        ({"policy": TimingPolicy(rounds=0)}, ["--rounds"]),
        ({"policy": TimingPolicy(agree_within=1.5)}, ["--agree-within", "fraction"]),
    ],
)
def test_bad_requests_are_refused_before_anything_runs(folder: Path, kwargs: dict, words: list[str]) -> None:
    with pytest.raises(PipelineError) as caught:
        run_benchmark(folder, progress=lambda _: None, **kwargs)
    for word in words:
        assert word in str(caught.value)


def test_missing_folder_names_the_make_engine_that_creates_it(tmp_path: Path, capsys) -> None:
    # A bare folder has no manifest to name its model (its name holds a file name made from the model's): no MODEL is
    # guessed; the command line, which was given the model, names it.
    with pytest.raises(PipelineError, match=re.escape('make_engine(Settings(model=<model>, precision="fp16"')):
        run_benchmark(tmp_path / "resnet50-fp16", progress=lambda _: None)
    assert cli.main(["bench", "--model", "resnet", "--out", str(tmp_path)]) == 2
    message = capsys.readouterr().err
    assert "does not exist" in message
    assert "trt-pipeline engine --model resnet --precision fp16" in message


def test_bad_batch_list_on_the_command_line(capsys) -> None:
    assert cli.main(["bench", "--batches", "1,x"]) == 2
    assert "--batches '1,x'" in capsys.readouterr().err


def test_round_spread_and_the_stability_verdict() -> None:
    spread = round_spread([[0.010, 0.011, 0.012], [0.020], [0.010, 0.012]])
    assert spread["round_p50_ms"] == pytest.approx([11.0, 20.0, 11.0])
    assert spread["spread"] == pytest.approx(9 / 11)

    def row(backend: str, spread: float) -> dict:
        return {"backend": backend, "batch": 1, "mode": "end-to-end", "status": "ok", "rounds": {"spread": spread}}

    load = {"before": [1.0, 1.0, 1.0], "after": [2.0, 1.0, 1.0]}
    policy = TimingPolicy(rounds=3, agree_within=0.1)
    calm = stability([row("a", 0.02), row("b", 0.09)], policy, load)
    assert calm["status"] == "stable" and calm["verdict"].startswith("stable: every row's 3 per-round p50s")
    busy = stability([row("a", 0.02), row("b", 0.5), {"backend": "c", "status": "failed"}], policy, load)
    assert busy["status"] == "unstable" and busy["load_average"] == load
    assert busy["verdict"].startswith("unstable: rerun on an idle machine (1 of 2 rows")
    assert busy["worst"][0] == {"backend": "b", "batch": 1, "mode": "end-to-end", "spread": 0.5}
    assert stability([row("a", 0.5)], TimingPolicy(rounds=1), load)["status"] == "not judged"


def test_inputs_follow_the_manifest_shapes_dtypes_and_integer_ranges() -> None:
    manifest = Manifest(
        inputs=(GraphTensor("ids", "int64", ("batch", "seq")), GraphTensor("image", "float32", ("batch", 3, 5))),
        axis_ranges={"seq": (1, 12, 64)},
    )
    feed = make_inputs(manifest, IntegerDraws({"ids": (3, 9)}, {}), batch=6, seed=0)
    assert feed["ids"].shape == (6, 12) and feed["ids"].dtype == np.int64
    assert feed["ids"].min() >= 3 and feed["ids"].max() <= 9
    assert feed["image"].shape == (6, 3, 5) and feed["image"].dtype == np.float32
    again = make_inputs(manifest, IntegerDraws({"ids": (3, 9)}, {}), batch=6, seed=0)
    assert np.array_equal(feed["image"], again["image"])  # every backend sees the same inputs


def test_the_bench_draws_token_ids_ending_as_every_reference_row_does(tmp_path: Path) -> None:
    """A classifier that reads each row's EOS (BART's) needs it at each row's end in the bench's inputs too."""
    from trt_pipeline.pipeline.bench.harness import integer_draws
    from trt_pipeline.pipeline.folder.artifacts import write_npz

    manifest = Manifest(inputs=(GraphTensor("ids", "int64", ("batch", "seq")),), axis_ranges={"seq": (1, 5, 8)})
    ids = np.array([[4, 9, 2], [7, 3, 2]]), np.array([[5, 6, 8, 12, 2]])
    write_npz(tmp_path / "reference.npz", {f"case{i}/in/ids": rows for i, rows in enumerate(ids)})
    draws = integer_draws(manifest, tmp_path / "reference.npz")
    assert draws == IntegerDraws({"ids": (3, 12)}, {"ids": 2})
    feed = make_inputs(manifest, draws, batch=6, seed=0)["ids"]
    assert (feed[:, -1] == 2).all() and feed[:, :-1].min() >= 3
