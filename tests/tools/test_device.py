"""The GPU machine's measuring script (tools/device/ort_cuda.py) in its dry run on the CPU provider: a session with
a GPU lent has 15 minutes of device time, so a step that breaks there must break here first."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDER = "resnet-tiny-fp16"  # the dry run's speed folder (tests.helpers.toy_models:tiny_cnn)


def _tool(script: str, *arguments: Path | str, cwd: Path) -> None:
    environment = {**os.environ, "ORT_CUDA_DRY_RUN": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "device" / script), *map(str, arguments)],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dry run's folder built, then its graph_memory and profile steps run, then the report written."""
    work = tmp_path_factory.mktemp("device")
    engines, results = work / "engines", work / "results"
    _tool("ort_cuda.py", "build", engines, "/nonexistent", FOLDER, cwd=work)
    _tool("ort_cuda.py", "graph_memory", engines, results, FOLDER, cwd=work)
    _tool("ort_cuda.py", "profile", engines, results, FOLDER, cwd=work)
    (work / "env.txt").write_text("dry run: no GPU\n")
    earlier = ROOT / "docs" / "benchmarks" / "resnet50-h100-cuda.json"
    _tool("ort_cuda_report.py", work / "report", results, work / "env.txt", "--earlier", earlier, cwd=work)
    return work


def test_profile_times_and_traces_each_row(measured: Path) -> None:
    rows = json.loads((measured / "results" / "profile-check.json").read_text())["rows"]
    runners = {"onnxruntime-cuda", "onnxruntime-cuda-graphs", "torch-compile"}
    bare = {"ort-graph", "ort-graph-copies"}
    assert set(rows) == runners | bare | {"rt-cudnn-bias-graphs"}
    for name in ("onnxruntime-cuda", *bare):
        assert rows[name]["wall_us_per_call"] > 0, name
    for name in ("onnxruntime-cuda-graphs", "rt-cudnn-bias-graphs"):  # no CUDA graph on the CPU
        assert "need device='cuda'" in rows[name]["unavailable"]
    assert "the caller's tensors copied in and out" in rows["ort-graph-copies"]["label"]
    assert "bias-split" in rows["ort-graph"]["label"]  # the graph as the runner opens it
    assert not list((measured / "results").glob("trace-*.json"))  # each trace removed once read


def test_graph_memory_steps_through_every_batch(measured: Path) -> None:
    memory = json.loads((measured / "results" / "graph_memory-check.json").read_text())
    steps = [step["after"] for step in memory["uncaptured"]]
    assert steps == ["load", "batch 1", "batch 8", "batch 32", "batch 16", "batch 4", "batch 2"]
    assert "captured" not in memory  # a dry run captures nothing


def test_the_report_shows_where_time_and_memory_go(measured: Path) -> None:
    report = (measured / "report.md").read_text()
    section = report[report.index("## 1c. Where the time and memory go") :]
    assert "| onnxruntime-cuda | no kernels traced |" in section  # the CPU provider's calls leave no torch op
    assert "| uncaptured (MiB) | 0 | 0 | 0 | 0 | 0 | 0 | 0 |" in section  # no device memory in a dry run
    assert json.loads((measured / "report.json").read_text())["graph_memory"]["folder"] == FOLDER


def test_the_report_marks_rows_whose_outputs_disagreed() -> None:
    """A row that computed something else (an earlier run's bare CUDA-graph sessions never wrote their outputs)
    must not read as a timing: the report's speed table says so beside its name."""
    from tools.device.ort_cuda_report import p50_table

    def result(backend: str, status: str) -> dict:
        agreement = {"status": status, "rtol": 0.03, "max_rel": 1.0 if status == "mismatch" else 0.001}
        return {
            "backend": backend,
            "mode": "device-resident",
            "batch": 32,
            "latency": {"p50_ms": 3.4},
            "agreement": agreement,
        }

    bench = {"batches": [32], "results": [result("right", "ok"), result("garbage", "mismatch")]}
    lines, _ = p50_table(bench)
    assert "| right | device-resident | 3.40 |" in lines
    assert "| garbage (outputs disagreed with the reference: not a result) | device-resident | 3.40 |" in lines
