"""INT8 calibration for real (calibration/int8.py): the trained digits CNN calibrated on its own data with ONNX
Runtime, the Q/DQ graph checked structurally, run by ONNX Runtime and built by TensorRT-RTX; the graphs for ONNX
Runtime's CPU kernels; the cache; a bad calibration folder on the command line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from tests.helpers import toy_models
from tests.helpers.digits_int8 import BATCH, SAMPLES, cpu_graph, digit_pngs
from trt_pipeline.calibration.cache import load_ranges
from trt_pipeline.calibration.holdout import read_calibration
from trt_pipeline.calibration.int8 import CACHE_FOLDER, calibration_sample, make_int8_graph
from trt_pipeline.calibration.int8_records import CalibrationConfig
from trt_pipeline.calibration.qdq import qdq_problems
from trt_pipeline.calibration.qdq_cpu import (
    int8_kernel_counts,
)
from trt_pipeline.models.digits import PREPROCESS
from trt_pipeline.pipeline import cli
from trt_pipeline.pipeline.core.cpu import NO_VNNI, VNNI, int8_cpu_kind
from trt_pipeline.pipeline.core.precision import Precision
from trt_pipeline.pipeline.core.sessions import onnxruntime_session
from trt_pipeline.pipeline.core.settings import BatchProfile, Settings
from trt_pipeline.pipeline.folder.layout import folder_graphs
from trt_pipeline.pipeline.quality.diagnose import diagnose_folder
from trt_pipeline.pipeline.stages.sequence import make_engine, run_stage

# --------------------------------------------------------------------------- the Q/DQ graph


def test_qdq_graph_is_what_tensorrt_accepts(int8):
    path, record = int8
    model = onnx.load(str(path))
    initializers = {i.name: i for i in model.graph.initializer}
    nodes = model.graph.node
    assert qdq_problems(model) == []
    dequantize = [n for n in nodes if n.op_type == "DequantizeLinear"]
    quantize = [n for n in nodes if n.op_type == "QuantizeLinear"]
    assert dequantize and quantize
    # No int32 DequantizeLinear: biases stay float (QuantizeBias=False).
    assert all(
        initializers[n.input[0]].data_type != onnx.TensorProto.INT32 for n in dequantize if n.input[0] in initializers
    )
    # Symmetric INT8 everywhere: every zero point is an int8 zero.
    for node in quantize + dequantize:
        zero_point = initializers[node.input[2]]
        assert zero_point.data_type == onnx.TensorProto.INT8
        assert not numpy_helper.to_array(zero_point).any()
    # Per-channel weights on the output-channel axis; per-tensor activations.
    producers = {n.output[0]: n for n in dequantize}
    for conv in (n for n in nodes if n.op_type in ("Conv", "Gemm")):
        weight_dq = producers[conv.input[1]]
        weight = numpy_helper.to_array(initializers[weight_dq.input[0]])
        scale = numpy_helper.to_array(initializers[weight_dq.input[1]])
        axis = next(a.i for a in weight_dq.attribute if a.name == "axis")
        assert weight.dtype == np.int8 and axis == 0 and scale.shape == (weight.shape[0],)
        # The bias (BatchNorm folded in) stays a float initializer, with no DequantizeLinear.
        assert initializers[conv.input[2]].data_type == onnx.TensorProto.FLOAT
        activation_dq = producers[conv.input[0]]
        assert numpy_helper.to_array(initializers[activation_dq.input[1]]).size == 1
    # Q/DQ on weighted ops' inputs only: every conv's output stays float (TensorRT fuses it).
    assert not any(n.input[0] in {c.output[0] for c in nodes if c.op_type == "Conv"} for n in quantize)
    assert record.qdq == {
        "quantized_ops": 5,
        "quantized_activations": 5,
        "quantized_weights": 5,
        "per_channel_weights": 5,
        "opset": 17,
    }


def test_qdq_graph_runs_in_onnxruntime_and_keeps_the_answers(int8, fp32, split):
    held_out = {"input": split.held_out_inputs}
    reference = onnxruntime_session(fp32).run(None, held_out)[0]
    quantized = onnxruntime_session(int8[0]).run(None, held_out)[0]
    assert quantized.dtype == np.float32 and quantized.shape == reference.shape
    assert np.mean(quantized.argmax(1) == reference.argmax(1)) >= 0.98


# --------------------------------------------------------------------------- the graph for ONNX Runtime's CPU


@pytest.mark.parametrize(("kind", "weights"), [(VNNI, onnx.TensorProto.INT8), (NO_VNNI, onnx.TensorProto.UINT8)])
def test_cpu_graph_runs_every_conv_and_gemm_as_an_int8_kernel(int8, tmp_path, kind, weights):
    """After ORT's own graph optimizations (the optimized model it saves), no Conv/Gemm is left in float."""
    import onnxruntime as ort

    graph = int8[0].parent / cpu_graph(kind)
    options = ort.SessionOptions()
    options.log_severity_level = 3  # ORT warns that an optimized model may be specific to this CPU
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
    optimized = [node.op_type for node in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]
    assert optimized.count("QLinearConv") == 4 and optimized.count("QGemm") == 1
    assert not {"Conv", "FusedConv", "Gemm", "FusedGemm", "Relu"} & set(optimized)
    record = int8[1].cpu[kind]
    assert (record.graph, record.details["int8_kernels"], record.details["float_kernels"]) == (cpu_graph(kind), 5, 0)
    # The TensorRT-shaped graph from the same ranges runs none of them in int8 (why the CPU graphs exist).
    assert int8_kernel_counts(int8[0], scratch=tmp_path) == {"int8_kernels": 0, "float_kernels": 5}
    model = onnx.load(str(graph))
    initializers = {i.name: i for i in model.graph.initializer}
    dequantize = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in initializers]
    biases = [n for n in dequantize if initializers[n.input[0]].data_type == onnx.TensorProto.INT32]
    assert len(biases) == 5  # one int32 bias per Conv/Gemm, as QLinearConv/QGemm take them
    assert sum(initializers[n.input[0]].data_type == weights for n in dequantize) == 5  # the weights' form
    activations = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    assert all(initializers[n.input[2]].data_type == onnx.TensorProto.UINT8 for n in activations)


def test_cpu_graph_keeps_the_answers(int8, fp32, split):
    held_out = {"input": split.held_out_inputs}
    reference = onnxruntime_session(fp32).run(None, held_out)[0]
    quantized = onnxruntime_session(int8[0].parent / cpu_graph(int8_cpu_kind())).run(None, held_out)[0]
    assert quantized.dtype == np.float32 and quantized.shape == reference.shape
    assert np.mean(quantized.argmax(1) == reference.argmax(1)) >= 0.98
    assert np.mean(quantized.argmax(1) == split.held_out_labels) >= 0.9


def test_tensorrt_rtx_builds_the_int8_graph(int8, tmp_path):
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed: pip install tensorrt-rtx-cu13")
    from trt_pipeline.pipeline.core.settings import BatchProfile
    from trt_pipeline.pipeline.stages.build import build_engine

    record = build_engine(int8[0], tmp_path / "engine.plan", batch=BatchProfile(1, 8, 32), builder="tensorrt_rtx")
    assert record["builder"]["module"] == "tensorrt_rtx"
    assert (tmp_path / "engine.plan").stat().st_size == record["engine_bytes"] > 0


def test_make_engine_int8_from_an_image_folder(split, tmp_path):
    """`make engine MODEL=digits PRECISION=int8 CALIB=<pngs>`: calibrate, parity, build, manifest."""
    images = digit_pngs(split, tmp_path / "pngs", 64)
    argv = ["all", "--model", "digits", "--precision", "int8", "--calib", str(images), "--calib-batch", "16"]
    assert cli.main([*argv, "--out", str(tmp_path / "engines")]) == 0
    folder = tmp_path / "engines" / "digits-int8"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["complete"]
    assert [graph["file"] for graph in manifest["graphs"]] == [graph.file for graph in folder_graphs(Precision.INT8)]
    assert manifest["graphs"][1] == {
        "file": "model.int8.onnx",
        "precision": "int8",
        "target": "engine",
        "evaluation": "qdq-simulated",
        "gate": "parity_int8",
        "postprocess": "none",
    }
    assert {graph["file"] for graph in manifest["graphs"]} <= set(manifest["artifacts"])
    assert manifest["parity_int8_onnxruntime_vnni"]["max_rel"] < 1.0
    assert manifest["parity_int8_onnxruntime_no_vnni"]["max_rel"] < 1.0
    assert {r["int8_kernels"] for r in manifest["int8"]["qdq_onnxruntime_cpu"].values()} == {5}
    calibration = manifest["calibration"]
    assert calibration["method"] == calibration["search"]["kept"]["method"]  # CALIB_METHOD=auto's pick
    assert calibration.get("percentile") == (99.99 if calibration["method"] == "percentile" else None)
    assert (calibration["samples"], calibration["batch"], calibration["cache"]) == (64, 16, "miss")
    assert calibration["source"] == f"image folder {images}"
    assert manifest["parity_int8"]["max_rel"] < 1.0
    assert manifest["build"]["builder"]["module"] == "tensorrt_rtx"
    assert Path(calibration["cache_file"]).parent == folder / CACHE_FOLDER
    # The diagnosis of an INT8 folder compares on the calibration rows it kept, not on reference.npz's noise.
    report = diagnose_folder(folder)
    assert report["data"].startswith("the first calibration rows the INT8 gate judged") and report["batch"] == 8
    sample = calibration_sample(folder)
    assert sample is not None and sample["input"].shape == (8, 1, 8, 8) and sample["input"].min() >= -1.0


# --------------------------------------------------------------------------- the cache


def test_cache_hit_miss_recalibrate_and_corruption(fp32, train_npy, tmp_path, capsys):
    calibration = read_calibration(train_npy, fp32, PREPROCESS, samples=SAMPLES, batch=BATCH)

    def build(method: str = "max", recalibrate: bool = False) -> dict:
        config = CalibrationConfig((method,), recalibrate=recalibrate)
        args = (fp32, tmp_path / "model.int8.onnx", calibration)
        result = make_int8_graph(*args, config=config, cache_folder=tmp_path / CACHE_FOLDER)
        return result.as_json()

    first = build()["calibration"]
    assert first["cache"] == "miss" and first["collect_seconds"] > 0
    graph = (tmp_path / "model.int8.onnx").read_bytes()
    second = build()["calibration"]
    assert second["cache"] == "hit" and second["collect_seconds"] == 0
    assert second["cache_file"] == first["cache_file"]
    assert (tmp_path / "model.int8.onnx").read_bytes() == graph  # same ranges, same graph
    assert build(recalibrate=True)["calibration"]["cache"] == "recalibrate"
    assert build("percentile")["calibration"]["cache_file"] != first["cache_file"]

    cache_file = Path(first["cache_file"])
    stored = json.loads(cache_file.read_text())
    # Edit one range value (still valid JSON): the sha256 check must catch it.
    tampered = re.sub(r'"data": \[(-?[0-9.]+)', lambda m: f'"data": [{float(m[1]) * 2}', stored["ranges"], count=1)
    assert tampered != stored["ranges"]
    cache_file.write_text(json.dumps({**stored, "ranges": tampered}))
    recomputed = build()["calibration"]
    assert recomputed["cache"] == "corrupted: the ranges do not match their sha256"
    assert "recalibrating" in capsys.readouterr().out
    assert (tmp_path / "model.int8.onnx").read_bytes() == graph  # recomputed, not the tampered ranges
    assert load_ranges(cache_file, stored["key"]).status == "hit"  # rewritten whole

    cache_file.write_text(cache_file.read_text()[:100])  # truncated
    assert build()["calibration"]["cache"].startswith("corrupted: JSONDecodeError")


# --------------------------------------------------------------------------- bad input


def test_bad_calibration_folder_fails_the_command_and_leaves_no_int8_graph(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    argv = ["all", "--model", "digits", "--precision", "int8", "--calib", str(tmp_path / "empty")]
    assert cli.main([*argv, "--out", str(tmp_path / "engines")]) == 2
    err = capsys.readouterr().err
    assert "error: calibration folder" in err and "contains no .jpg/.jpeg/.png images" in err and "fix:" in err
    folder = tmp_path / "engines" / "digits-int8"
    assert (folder / "model.onnx").is_file() and not (folder / "model.int8.onnx").exists()
    assert not list(folder.glob(".*.tmp"))


# --------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
def test_int8_engine_on_the_gpu_agrees_with_onnxruntime(split, train_npy, tmp_path):
    from trt_pipeline.pipeline.runners import load_runner

    settings = Settings(model="digits", precision="int8", calib=train_npy, out_root=tmp_path)
    folder = make_engine(settings)
    feed = {"input": split.held_out_inputs[:32]}  # the profile's max batch
    with load_runner(folder, backend="tensorrt") as runner:
        engine = runner.infer(feed)["logits"]
    reference = onnxruntime_session(folder / "model.int8.onnx").run(None, feed)[0]
    assert np.mean(engine.argmax(1) == reference.argmax(1)) >= 0.97
    assert np.mean(engine.argmax(1) == split.held_out_labels[:32]) >= 0.9


# The times the factory below built its model (tests.calibration.test_int8:counted_cnn).
MODEL_LOADS: list[str] = []


def counted_cnn():
    MODEL_LOADS.append("tiny_cnn")
    return toy_models.tiny_cnn()


def test_the_int8_stage_on_model_ready_rows_does_not_load_the_model(tmp_path: Path):
    """Only a folder of images needs the model's declared preprocessing: on model-ready rows the precision stage
    (its own process on the command line) reads the graphs alone, and does not hold a model of gigabytes beside
    the copies of the weights it works on."""
    np.save(tmp_path / "rows.npy", np.random.default_rng(0).normal(size=(16, 3, 16, 16)).astype(np.float32))
    settings = Settings(
        model="tests.calibration.test_int8:counted_cnn",
        precision="int8",
        calib=str(tmp_path / "rows.npy"),
        batch=BatchProfile(1, 2, 4),
        out_root=tmp_path,
    )
    for stage in ("export", "check", "simplify", "parity"):
        run_stage(settings, stage)
    MODEL_LOADS.clear()
    folder = run_stage(settings, "precision")
    assert MODEL_LOADS == []
    assert json.loads((folder / "manifest.json").read_text())["agreement_int8"]
