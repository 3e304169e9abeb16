"""Folders whose graphs keep their weights in external data, end to end: FP16 and INT8 built with every graph's
weights in `<graph>.data` (graph_files.EXTERNAL_DATA_BYTES lowered, so a small model takes the paths a model past
2 GB takes), each data file an artifact with its sha256, the reader refusing one tampered with, missing or outside
the folder, the runners, the service and the Triton writer carrying it; and one model past 2 GB for real (slow)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import httpx
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from tests.helpers.serve_fixtures import served
from trt_pipeline.models.spec import ModelSpec
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.settings import BatchProfile, Settings
from trt_pipeline.pipeline.folder import graph_files, onnx_wire
from trt_pipeline.pipeline.folder.graph_files import graph_without_weights, write_graph
from trt_pipeline.pipeline.folder.graph_io import load_reference
from trt_pipeline.pipeline.folder.provenance import describe_artifacts
from trt_pipeline.pipeline.folder.reader import open_folder
from trt_pipeline.pipeline.runners import load_runner
from trt_pipeline.pipeline.stages.fp16 import convert_fp16
from trt_pipeline.pipeline.stages.sequence import make_engine
from trt_pipeline.pipeline.triton.repository import write_repository

WIDTH = 256  # 256 x 256 FP32 weights: 256 KiB a layer, far past INLINE_TENSOR_BYTES
PROFILE = BatchProfile(1, 4, 8)


def mlp() -> ModelSpec:
    """Linear-GELU-Linear on one [batch, 256] input."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(), torch.nn.Linear(WIDTH, 8))
    return ModelSpec(name="mlp", module=module, example_inputs={"input": torch.randn(2, WIDTH)})


@pytest.fixture
def external(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every graph with more than a few bytes of weights keeps them in external data, as one past 2 GB does."""
    monkeypatch.setattr(graph_files, "EXTERNAL_DATA_BYTES", 0)


def build(out: Path, precision: str, **more) -> Path:
    return make_engine(Settings(model=f"{__name__}:mlp", precision=precision, batch=PROFILE, out_root=out, **more))


def calibration_file(folder: Path) -> Path:
    path = folder / "calibration.npz"
    np.savez(path, input=np.random.default_rng(1).standard_normal((64, WIDTH)).astype(np.float32))
    return path


def assert_serves_the_reference(folder: Path, backend: str = "onnxruntime", atol: float = 2e-2) -> None:
    inputs, outputs = load_reference(folder / "reference.npz")[-1]
    with load_runner(folder, backend=backend) as runner:
        result = runner.infer(inputs)
    for name, expected in outputs.items():
        np.testing.assert_allclose(result[name], expected, atol=atol)


# --------------------------------------------------------------------------- writing a graph tensor by tensor


@pytest.mark.parametrize("threshold", [graph_files.EXTERNAL_DATA_BYTES, 0], ids=["one file", "external data"])
def test_a_graph_written_tensor_by_tensor_is_the_graph_with_its_weights_converted(tmp_path, monkeypatch, threshold):
    """write_graph streams each weight from where it lies (here: inside a graph of one file), converting the ones
    named a block at a time; the graph it writes holds exactly the converted weights, as one file or, past the
    threshold, with its data file."""
    monkeypatch.setattr(onnx_wire, "_BLOCK", 1000)  # blocks smaller than a tensor: conversion block by block
    weights = np.random.default_rng(0).standard_normal((WIDTH, WIDTH)).astype(np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", WIDTH])
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [x], [y], [numpy_helper.from_array(weights, "w")]
    )
    source = tmp_path / "source.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(source))
    model = graph_without_weights(source)
    assert model.graph.initializer[0].external_data[0].value == "source.onnx"  # a reference into the file itself
    model.graph.initializer[0].data_type = TensorProto.FLOAT16
    monkeypatch.setattr(graph_files, "EXTERNAL_DATA_BYTES", threshold)
    written = tmp_path / "written.onnx"
    write_graph(
        model,
        tmp_path,
        written,
        convert={"w": lambda raw, start: np.frombuffer(raw, np.float32).astype(np.float16).tobytes()},
    )
    assert (tmp_path / "written.onnx.data").is_file() == (threshold == 0)
    loaded = onnx.load(str(written))
    np.testing.assert_array_equal(numpy_helper.to_array(loaded.graph.initializer[0]), weights.astype(np.float16))


def test_the_float16_graph_from_weights_on_disk_is_the_converters_graph(external, tmp_path):
    """FP16 converts each weight as it writes it (the graph read without its weights): the weights are what ONNX
    Runtime's converter makes of them, in model.fp16.onnx.data past the threshold."""
    from onnxruntime.transformers.float16 import convert_np_to_float16

    folder = build(tmp_path, "fp32")
    source = folder / "model.onnx"
    convert_fp16(source, tmp_path / "model.fp16.onnx")
    assert (tmp_path / "model.fp16.onnx.data").is_file()
    fp32 = {t.name: numpy_helper.to_array(t, str(folder)) for t in onnx.load(str(source)).graph.initializer}
    fp16 = onnx.load(str(tmp_path / "model.fp16.onnx"))
    converted = [t for t in fp16.graph.initializer if t.data_type == TensorProto.FLOAT16]
    assert len(converted) == 4  # two weights, two biases
    for tensor in converted:
        np.testing.assert_array_equal(numpy_helper.to_array(tensor), convert_np_to_float16(fp32[tensor.name]))


# --------------------------------------------------------------------------- folders with data files


def test_an_fp16_folder_lists_every_data_file_and_serves_from_them(external, tmp_path):
    folder = build(tmp_path, "fp16")
    opened = open_folder(folder)
    assert {"model.onnx.data", "model.fp16.onnx.data"} <= set(opened.artifacts)
    assert opened.graph_files("model.fp16.onnx") == ["model.fp16.onnx", "model.fp16.onnx.data"]
    assert_serves_the_reference(folder)
    assert_serves_the_reference(folder, backend="auto")  # every candidate opened, the choice cached


def test_an_int8_folder_writes_every_graph_with_its_data_file(external, tmp_path):
    folder = build(tmp_path, "int8", calib=str(calibration_file(tmp_path)))
    opened = open_folder(folder)
    graphs = [graph.file for graph in opened.graphs]
    assert "model.int8.onnx" in graphs and len(graphs) >= 3  # FP32, the engine's and the CPU graphs
    for graph in graphs:
        assert opened.graph_files(graph) == [graph, f"{graph}.data"], graph
        assert (folder / f"{graph}.data").is_file()
    assert_serves_the_reference(folder, atol=0.1)


@pytest.fixture
def fp16_folder(external, tmp_path) -> Path:
    return build(tmp_path / "engines", "fp16")


def test_a_data_file_changed_after_the_build_is_refused_and_rebuilt(fp16_folder):
    data = fp16_folder / "model.fp16.onnx.data"
    with open(data, "r+b") as handle:  # one weight changed in place: same size, same name
        handle.seek(100)
        byte = handle.read(1)
        handle.seek(100)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(PipelineError, match="model.fp16.onnx.data is not the file this folder's build wrote"):
        load_runner(fp16_folder, backend="onnxruntime")
    rebuilt = build(fp16_folder.parent, "fp16")  # the preflight sees it: not up to date, built again
    assert_serves_the_reference(rebuilt)


def test_a_missing_data_file_is_refused(fp16_folder):
    (fp16_folder / "model.fp16.onnx.data").unlink()
    with pytest.raises(PipelineError, match="model.fp16.onnx.data is missing"):
        load_runner(fp16_folder, backend="onnxruntime")


def test_a_graph_keeping_weights_outside_the_folder_is_refused_though_the_manifest_agrees(fp16_folder):
    """The graph rewritten to name a file outside the folder, and its sha256 recorded as if the build wrote it:
    refused by name, before ONNX Runtime is given anything."""
    outside = fp16_folder.parent / "outside.bin"
    shutil.copyfile(fp16_folder / "model.fp16.onnx.data", outside)
    graph = fp16_folder / "model.fp16.onnx"
    model = onnx.load(str(graph), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../outside.bin"
    onnx.save(model, str(graph))
    manifest = json.loads((fp16_folder / "manifest.json").read_text())
    recorded = describe_artifacts(fp16_folder, ["model.fp16.onnx"])["model.fp16.onnx"]
    manifest["artifacts"]["model.fp16.onnx"] = dataclasses.asdict(recorded)
    (fp16_folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PipelineError, match=r"keeps weights in '\.\./outside\.bin', not in its own data file"):
        load_runner(fp16_folder, backend="onnxruntime", graph="model.fp16.onnx")


def test_the_runner_computes_with_the_bytes_it_checked_whatever_the_folder_holds_later(fp16_folder):
    """The runner opens a private copy: a data file written over in place after it loaded (zeros, same size)
    changes nothing it computes.  The FP32 graph: ONNX Runtime maps the weights it does not pack (the biases here),
    where it casts the float16 graph's weights to float32 copies."""
    inputs, outputs = load_reference(fp16_folder / "reference.npz")[-1]
    with load_runner(fp16_folder, backend="onnxruntime", graph="model.onnx") as runner:
        before = runner.infer(inputs)
        data = fp16_folder / "model.onnx.data"
        size = data.stat().st_size
        with open(data, "r+b") as handle:
            handle.write(b"\0" * size)
        after = runner.infer(inputs)
    for name in outputs:
        np.testing.assert_array_equal(after[name], before[name])


def test_the_triton_repository_carries_the_data_file_beside_the_graph(fp16_folder, tmp_path):
    import onnxruntime as ort

    model_dir, _ = write_repository(fp16_folder, tmp_path / "repo", backend="onnxruntime")
    version = model_dir / "1"
    assert sorted(path.name for path in version.iterdir()) == ["model.fp16.onnx.data", "model.onnx"]
    inputs, outputs = load_reference(fp16_folder / "reference.npz")[-1]
    session = ort.InferenceSession(str(version / "model.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, inputs)[0], next(iter(outputs.values())), atol=2e-2)
    assert not list((tmp_path / "repo").glob(".*"))  # no staging folder left

    python_dir, _ = write_repository(fp16_folder, tmp_path / "python", backend="python")
    artifacts = python_dir / "1" / "artifacts"
    assert {"model.onnx.data", "model.fp16.onnx.data"} <= {path.name for path in artifacts.iterdir()}
    assert_serves_the_reference(artifacts)  # load_runner on the copied folder: every file checked again


def test_the_service_serves_a_folder_with_data_files(fp16_folder):
    inputs, outputs = load_reference(fp16_folder / "reference.npz")[-1]
    array = inputs["input"]
    body = {
        "inputs": [{"name": "input", "shape": list(array.shape), "datatype": "FP32", "data": array.ravel().tolist()}]
    }
    with served(fp16_folder, "--backend", "onnxruntime") as server:
        response = httpx.post(f"{server.url}/v2/models/{fp16_folder.name}/infer", json=body, timeout=60)
    assert response.status_code == 200, response.text
    (output,) = response.json()["outputs"]
    expected = next(iter(outputs.values()))
    np.testing.assert_allclose(np.array(output["data"]).reshape(output["shape"]), expected, atol=2e-2)


def test_make_accuracy_and_the_bench_read_graphs_with_data_files(external, tmp_path):
    from trt_pipeline.pipeline.bench.harness import run_benchmark
    from trt_pipeline.pipeline.bench.timing import TimingPolicy
    from trt_pipeline.pipeline.quality.accuracy import SUBFOLDER, measure_accuracy

    settings = Settings(
        model=f"{__name__}:mlp", precision="fp32", calib=str(calibration_file(tmp_path)), out_root=tmp_path
    )
    folder = measure_accuracy(settings, ["max"])
    report = json.loads((folder / "accuracy.json").read_text())
    assert {"fp32", "fp16", "int8-max"} <= set(report["results"])
    assert (folder / SUBFOLDER / "model.fp16.onnx.data").is_file() and (folder / "model.onnx.data").is_file()
    quick = TimingPolicy(warmup=1, iterations=10, budget_s=0.2, rounds=2)
    bench = run_benchmark(folder, backends=["served", "onnxruntime-session"], batches=[1], policy=quick, progress=print)
    assert {row["backend"] for row in bench["results"] if row["status"] == "ok"} >= {"served", "onnxruntime-session"}


# --------------------------------------------------------------------------- past 2 GB for real

PAST_2GB = "tests.end_to_end.test_external_data_folders:mlp_past_2gb"
NEEDED_MEMORY = 12 << 30  # measured peak of make engine at 2.4 GB: 5.1 GB; the runner's 3.8 GB (docs/benchmarks)
NEEDED_DISK = 12 << 30  # model.onnx.data 2.4 GB, model.fp16.onnx 1.2 GB, engine.plan 1.2 GB, the runner's copy


def mlp_past_2gb() -> ModelSpec:
    """9 x (Linear(8192, 8192) + GELU): 604M parameters, 2.42 GB of FP32 weights (benchmarks/scale_models.py)."""
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(8192, 8192), torch.nn.GELU()) for _ in range(9)]
    return ModelSpec(
        name="mlp_2400mb", module=torch.nn.Sequential(*blocks), example_inputs={"input": torch.randn(1, 8192)}
    )


def _short_of_room(folder: Path) -> str | None:
    available = next(
        (
            int(line.split()[1]) * 1024
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemAvailable:")
        ),
        0,
    )
    if available < NEEDED_MEMORY:
        return f"needs {NEEDED_MEMORY >> 30} GiB of available memory, {available / 2**30:.1f} GiB here"
    free = shutil.disk_usage(folder).free
    if free < NEEDED_DISK:
        return f"needs {NEEDED_DISK >> 30} GiB of free disk, {free / 2**30:.1f} GiB here"
    return None


@pytest.mark.slow
def test_a_model_past_2gb_builds_fp16_and_serves(tmp_path):
    reason = _short_of_room(tmp_path)
    if reason:
        pytest.skip(f"the 2.4 GB model {reason}")
    folder = make_engine(Settings(model=PAST_2GB, precision="fp16", batch=BatchProfile(1, 2, 4), out_root=tmp_path))
    files = {path.name: path.stat().st_size for path in folder.iterdir()}
    assert files["model.onnx"] < 1 << 20 < 2 << 30 < files["model.onnx.data"]  # past protobuf's limit
    assert files["model.fp16.onnx"] > 1 << 30  # 1.2 GB of float16 weights: one file, as below the limit
    assert "model.onnx.data" in open_folder(folder).artifacts
    assert json.loads((folder / "manifest.json").read_text())["exporter"] == "dynamo"  # dynamo first past 1 GiB
    assert_serves_the_reference(folder)
    for path in folder.iterdir():
        os.remove(path)
