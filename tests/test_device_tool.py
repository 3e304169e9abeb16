"""The GPU machine's measuring script (tools/device/ort_cuda.py) in its dry run on the CPU provider: a session with
a GPU lent has 15 minutes of device time, so a step that breaks there must break here first."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDER = "resnet-tiny-fp16"  # the dry run's speed folder (tests.toy_models:tiny_cnn)


def _tool(script: str, *arguments: Path | str, cwd: Path, rows: str = "") -> None:
    environment = {**os.environ, "ORT_CUDA_DRY_RUN": "1", "PYTHONPATH": str(ROOT), "ROWS": rows}
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
    """The dry run's folder built, then its profile (with the next GPU run's leads, ROWS=leads) and graph_memory
    steps run, then the report written."""
    work = tmp_path_factory.mktemp("device")
    engines, results = work / "engines", work / "results"
    _tool("ort_cuda.py", "build", engines, "/nonexistent", FOLDER, cwd=work)
    _tool("ort_cuda.py", "graph_memory", engines, results, FOLDER, cwd=work)
    _tool("ort_cuda.py", "profile", engines, results, FOLDER, cwd=work, rows="leads")
    (work / "env.txt").write_text("dry run: no GPU\n")
    earlier = ROOT / "docs" / "benchmarks" / "resnet50-h100-cuda.json"
    _tool("ort_cuda_report.py", work / "report", results, work / "env.txt", "--earlier", earlier, cwd=work)
    return work


def test_profile_times_and_traces_each_row(measured: Path) -> None:
    rows = json.loads((measured / "results" / "profile-check.json").read_text())["rows"]
    runners = {"onnxruntime-cuda", "onnxruntime-cuda-graphs", "torch-compile"}
    assert set(rows) == runners | {"rt-biasadd", "rt-biasadd-graphs", "ort-graph", "ort-fp16-io-nhwc-graph"}
    for name in ("onnxruntime-cuda", "rt-biasadd", "ort-graph", "ort-fp16-io-nhwc-graph"):
        assert rows[name]["wall_us_per_call"] > 0, name
    for name in ("onnxruntime-cuda-graphs", "rt-biasadd-graphs"):  # no CUDA graph on the CPU
        assert "need device='cuda'" in rows[name]["unavailable"]
    assert "each convolution's bias an Add" in rows["rt-biasadd"]["label"]
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


def test_the_bias_split_lead_computes_the_same_and_onnx_runtime_keeps_its_adds(tmp_path: Path) -> None:
    """The next GPU run's lead (tools/device/ort_cuda.py lead_rows): each Conv's bias as an Add of its own. It must
    compute what the graph did, and it measures something only while ONNX Runtime does not fold the Adds back into
    the Convs (ConvAddFusion), which KEEP_BIAS_ADD turns off."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from tools.device.ort_cuda import KEEP_BIAS_ADD, conv_bias_split

    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w"),
        numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b"),
    ]
    conv = helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1])
    relu = helper.make_node("Relu", ["y"], ["out"])
    graph = helper.make_graph(
        [conv, relu],
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 16, 16])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n", 8, 16, 16])],
        weights,
    )
    source, split = tmp_path / "conv.onnx", tmp_path / "split.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(source))
    conv_bias_split(source, split)
    x = {"x": rng.standard_normal((2, 3, 16, 16)).astype(np.float32)}
    expected = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"]).run(None, x)[0]

    def optimized_ops(disabled: list[str]) -> list[str]:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC  # no CPU-only layouts
        options.optimized_model_filepath = str(tmp_path / f"optimized-{len(disabled)}.onnx")
        session = ort.InferenceSession(str(split), options, ["CPUExecutionProvider"], disabled_optimizers=disabled)
        np.testing.assert_allclose(session.run(None, x)[0], expected, rtol=1e-5, atol=1e-5)
        return [node.op_type for node in onnx.load(options.optimized_model_filepath).graph.node]

    assert [node.op_type for node in onnx.load(str(split)).graph.node] == ["Conv", "Add", "Relu"]
    assert "Add" not in optimized_ops([])  # folded back into the Conv's bias
    assert "Add" in optimized_ops(KEEP_BIAS_ADD)


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
