"""INT8 calibration for real: the trained digits CNN calibrated on its own data with ONNX Runtime,
the Q/DQ graph checked structurally, run by ONNX Runtime and built by TensorRT-RTX; the cache; and
every kind of bad calibration input.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from PIL import Image

from tests.helpers import toy_models
from trt_pipeline.calibration.cache import load_ranges
from trt_pipeline.calibration.holdout import read_calibration
from trt_pipeline.calibration.int8 import CACHE_FOLDER, calibration_sample, make_int8_graph
from trt_pipeline.calibration.int8_records import CalibrationConfig, Int8Result
from trt_pipeline.calibration.photos import PHOTOS, export_calibration_images
from trt_pipeline.calibration.qdq import qdq_problems
from trt_pipeline.calibration.qdq_cpu import (
    as_tensors_data,
    asymmetric_ranges,
    int8_kernel_counts,
    nodes_without_ranges,
)
from trt_pipeline.calibration.ranges import collect_statistics
from trt_pipeline.calibration.readers import graph_inputs, read_calibration_data
from trt_pipeline.models.digits import PREPROCESS, load_split
from trt_pipeline.models.preprocess import load_image
from trt_pipeline.models.spec import ImagePreprocess
from trt_pipeline.pipeline import cli
from trt_pipeline.pipeline.core.cpu import NO_VNNI, VNNI, int8_cpu_kind
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.precision import Precision
from trt_pipeline.pipeline.core.sessions import onnxruntime_session
from trt_pipeline.pipeline.core.settings import BatchProfile, Settings
from trt_pipeline.pipeline.folder.artifacts import write_npz
from trt_pipeline.pipeline.folder.layout import CPU_TARGETS, folder_graphs, graph_record
from trt_pipeline.pipeline.quality.diagnose import diagnose_folder
from trt_pipeline.pipeline.stages.parity import check_int8_agreement, check_parity
from trt_pipeline.pipeline.stages.sequence import make_engine, run_stage

SAMPLES, BATCH = 128, 32


def cpu_graph(kind: str) -> str:
    """The file of the INT8 graph for ONNX Runtime's kernels on this kind of CPU."""
    return graph_record(Precision.INT8, CPU_TARGETS[kind]).file


@pytest.fixture(scope="module")
def split():
    return load_split()


@pytest.fixture(scope="module")
def fp32(tmp_path_factory) -> Path:
    """The digits model's checked, simplified FP32 graph (the pipeline's own stages)."""
    out = tmp_path_factory.mktemp("engines")
    return make_engine(Settings(model="digits", precision="fp32", out_root=out)) / "model.onnx"


@pytest.fixture(scope="module")
def train_npy(split, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.npy"
    np.save(path, split.train_inputs)
    return path


@pytest.fixture(scope="module")
def int8(fp32, train_npy, tmp_path_factory) -> tuple[Path, Int8Result]:
    """model.int8.onnx (and the two CPU graphs beside it) calibrated (max) on the training split; its stage record."""
    folder = tmp_path_factory.mktemp("int8")
    record = make_int8_graph(
        fp32,
        folder / "model.int8.onnx",
        read_calibration(train_npy, fp32, PREPROCESS, samples=SAMPLES, batch=BATCH),
        config=CalibrationConfig(("max",)),
        cache_folder=folder / CACHE_FOLDER,
        cpu_out_paths={kind: folder / cpu_graph(kind) for kind in CPU_TARGETS},
    )
    return folder / "model.int8.onnx", record


def _digit_pngs(split, folder: Path, count: int) -> Path:
    """Training digits written as 8-bit grayscale PNGs, as a user's image folder would hold them."""
    folder.mkdir(parents=True, exist_ok=True)
    pixels = np.round((split.train_inputs[:count, 0] * 0.5 + 0.5) * 255).astype(np.uint8)
    for index, image in enumerate(pixels):
        sub = folder / f"class{index % 3}"  # nested: the reader searches recursively
        sub.mkdir(exist_ok=True)
        Image.fromarray(image, mode="L").save(sub / f"{index:03d}.png")
    return folder


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


def test_cpu_ranges_from_symmetric_ones():
    """ResNet's shape in miniature: conv-relu-maxpool-conv, a residual Add-Relu, pooling and a classifier.
    Calibration ranged the Conv/Gemm inputs and outputs (symmetric, as TensorRT wants them)."""
    from onnx import helper
    from onnxruntime.quantization import CalibrationMethod
    from onnxruntime.quantization.calibrate import TensorData, TensorsData

    weights = [
        numpy_helper.from_array(np.ones(shape, np.float32), name)
        for name, shape in (("w", (4, 4, 1, 1)), ("w2", (3, 4)))
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c1"], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["m1"], name="pool", kernel_shape=[1, 1]),
        helper.make_node("Conv", ["m1", "w"], ["c2"], name="conv2"),
        helper.make_node("Add", ["c2", "m1"], ["a"], name="add"),
        helper.make_node("Relu", ["a"], ["r2"], name="relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "w2"], ["y"], name="fc"),
    ]
    graph = helper.make_graph(nodes, "g", [], [], weights)
    # Symmetric (-T, T), except f: percentile's T is clamped to the observed minimum (all f > 0.2).
    bounds = {"x": (-2, 2), "c1": (-5, 5), "m1": (-3, 3), "c2": (-4, 4), "f": (0.2, 1.5), "y": (-9, 9)}
    symmetric = TensorsData(
        CalibrationMethod.Percentile,
        {n: TensorData(lowest=np.float32(lo), highest=np.float32(hi)) for n, (lo, hi) in bounds.items()},
    )
    ranges = asymmetric_ranges(graph, symmetric)
    assert ranges == {
        "x": (-2.0, 2.0),  # the input: signed
        "c1": (0.0, 5.0),  # only a Relu reads it: the Relu folded into its QuantizeLinear clips at 0
        "r1": (0.0, 3.0),  # MaxPool keeps values: its output's range is its input's
        "m1": (0.0, 3.0),
        "c2": (-4.0, 4.0),  # a conv output before the residual Add: its true min and max are unknown
        "g": (0.0, 1.5),  # Flatten keeps values; average of a Relu output: non-negative
        "f": (0.0, 1.5),
        "y": (-9.0, 9.0),
    }
    # Nothing ranged the residual sum or the last Relu: those nodes stay in float.
    assert nodes_without_ranges(graph, ranges) == ["add", "relu2", "gap"]
    assert as_tensors_data(ranges, symmetric.calibration_method)["c1"].range_value == (0.0, 5.0)


def test_cpu_ranges_of_a_relu6_are_non_negative():
    """EfficientNet-Lite's ReLU6 (Clip 0..6): its output, and its input where only it reads that, get [0, high] as
    a Relu's do; max calibration's symmetric (-6, 6) there gave that model's CPU graphs cosine 0.04 to FP32."""
    from onnx import helper
    from onnxruntime.quantization import CalibrationMethod
    from onnxruntime.quantization.calibrate import TensorData, TensorsData

    weights = [
        numpy_helper.from_array(np.ones((4, 4, 1, 1), np.float32), "w"),
        numpy_helper.from_array(np.array(0, np.float32), "low"),
        numpy_helper.from_array(np.array(6, np.float32), "high"),
        numpy_helper.from_array(np.array(-1, np.float32), "minus_one"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c1"], name="conv1"),
        helper.make_node("Clip", ["c1", "low", "high"], ["r1"], name="relu6"),
        helper.make_node("Conv", ["r1", "w"], ["c2"], name="conv2"),
        helper.make_node("Clip", ["c2", "minus_one", "high"], ["r2"], name="not_a_relu"),
        helper.make_node("Conv", ["r2", "w"], ["y"], name="conv3"),
    ]
    graph = helper.make_graph(nodes, "g", [], [], weights)
    bounds = {"x": (-2, 2), "c1": (-80, 80), "r1": (-6, 6), "c2": (-7, 7), "r2": (-6, 6), "y": (-9, 9)}
    symmetric = TensorsData(
        CalibrationMethod.MinMax,
        {n: TensorData(lowest=np.float32(lo), highest=np.float32(hi)) for n, (lo, hi) in bounds.items()},
    )
    ranges = asymmetric_ranges(graph, symmetric)
    assert ranges["r1"] == (0.0, 6.0) and ranges["c1"] == (0.0, 80.0)
    assert ranges["r2"] == (-6.0, 6.0) and ranges["c2"] == (-7.0, 7.0)  # a Clip from -1 is no Relu


def test_tensorrt_rtx_builds_the_int8_graph(int8, tmp_path):
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed: pip install tensorrt-rtx-cu13")
    from trt_pipeline.pipeline.core.settings import BatchProfile
    from trt_pipeline.pipeline.stages.build import build_engine

    record = build_engine(int8[0], tmp_path / "engine.plan", batch=BatchProfile(1, 8, 32), builder="tensorrt_rtx")
    assert record["builder"]["module"] == "tensorrt_rtx"
    assert (tmp_path / "engine.plan").stat().st_size == record["engine_bytes"] > 0


def test_make_engine_int8_from_an_image_folder(split, tmp_path):
    """`make engine MODEL=digits PRECISION=int8 CALIB=<pngs>`: calibrate, parity, build, manifest."""
    images = _digit_pngs(split, tmp_path / "pngs", 64)
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


def test_image_preprocessing_matches_the_arrays_inference_sees(split, tmp_path):
    """A digit saved as a PNG and read back by calibration equals the model-ready array (to 8-bit rounding)."""
    _digit_pngs(split, tmp_path, 4)
    for index in range(4):
        image = load_image(tmp_path / f"class{index % 3}" / f"{index:03d}.png", PREPROCESS)
        assert image.shape == (1, 8, 8) and image.dtype == np.float32
        np.testing.assert_allclose(image, split.train_inputs[index], atol=2 / 255 / 0.5)


def test_percentile_and_entropy_clip_what_max_keeps(fp32, train_npy):
    data = read_calibration_data(train_npy, graph_inputs(fp32), PREPROCESS, samples=SAMPLES, batch=BATCH)
    ranges = collect_statistics(fp32, data, ("max", "percentile", "entropy")).ranges
    assert set(ranges["max"].keys()) == set(ranges["percentile"].keys()) == set(ranges["entropy"].keys())
    for name in ranges["max"]:
        low, high = ranges["max"][name].range_value
        assert np.isclose(-low, high)  # symmetric
        for method in ("percentile", "entropy"):
            assert 0 < ranges[method][name].range_value[1] <= high * (1 + 1e-6)
    assert any(ranges["percentile"][n].range_value[1] < ranges["max"][n].range_value[1] for n in ranges["max"])


def test_readers_agree_on_npy_npz_and_callable(fp32, split, tmp_path):
    inputs = graph_inputs(fp32)
    arrays = split.train_inputs[:SAMPLES]
    np.savez(tmp_path / "named.npz", input=arrays)
    sources = [tmp_path / "named.npz", lambda: (arrays[i : i + 10] for i in range(0, SAMPLES, 10))]
    np.save(tmp_path / "plain.npy", arrays)
    sources.append(tmp_path / "plain.npy")
    digests = set()
    for source in sources:
        data = read_calibration_data(source, inputs, PREPROCESS, samples=SAMPLES, batch=BATCH)
        assert data.samples == SAMPLES and len(data.batches) == SAMPLES // BATCH
        digests.add(data.digest)
    assert len(digests) == 1


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


def test_int8_without_calibration_data_is_refused():
    with pytest.raises(PipelineError, match="needs calibration data") as error:
        Settings(model="digits", precision="int8").check()
    assert "Settings(calib=" in str(error.value)


@pytest.mark.parametrize(
    ("make_source", "preprocess", "message"),
    [
        (lambda d, s: d.mkdir() or d, PREPROCESS, "contains no .jpg/.jpeg/.png images"),
        (lambda d, s: _broken_png(d), PREPROCESS, "cannot be read"),
        (lambda d, s: _save(d / "x.npy", s.train_inputs[:64, :, :4]), PREPROCESS, r"has shape \[64, 1, 4, 8\]"),
        (lambda d, s: _save(d / "x.npy", s.train_inputs[:64].astype(np.float64)), PREPROCESS, "is float64"),
        (lambda d, s: _save(d / "x.npy", s.train_inputs[:64, 0]), PREPROCESS, r"has shape \[64, 8, 8\]"),
        (lambda d, s: _save(d / "x.npy", s.train_inputs[: BATCH - 1]), PREPROCESS, "fewer than one batch of 32"),
        (lambda d, s: _digit_pngs(s, d, 4), None, "declares no image preprocessing"),
        (lambda d, s: _digit_pngs(s, d, 4), ImagePreprocess(), r"preprocess to \[3, 224, 224\]"),
        (lambda d, s: _savez_unnamed_pair(d / "x.npz", s.train_inputs), PREPROCESS, "missing"),
        (lambda d, s: d / "absent", PREPROCESS, "does not exist"),
        (lambda d, s: _save(d / "x.npy", np.full((64, 1, 8, 8), np.nan, np.float32)), PREPROCESS, "NaN"),
    ],
    ids=[
        "empty-folder",
        "unreadable-image",
        "wrong-shape",
        "wrong-dtype",
        "wrong-rank",
        "fewer-than-a-batch",
        "folder-without-preprocess",
        "preprocess-not-matching-input",
        "npz-missing-input",
        "missing-path",
        "nan",
    ],
)
def test_bad_calibration_data_is_a_clear_error(fp32, split, tmp_path, make_source, preprocess, message):
    source = make_source(tmp_path / "calib", split)
    with pytest.raises(PipelineError, match=message) as error:
        read_calibration_data(source, graph_inputs(fp32), preprocess, samples=SAMPLES, batch=BATCH)
    assert error.value.fix


def test_bad_calibration_folder_fails_the_command_and_leaves_no_int8_graph(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    argv = ["all", "--model", "digits", "--precision", "int8", "--calib", str(tmp_path / "empty")]
    assert cli.main([*argv, "--out", str(tmp_path / "engines")]) == 2
    err = capsys.readouterr().err
    assert "error: calibration folder" in err and "contains no .jpg/.jpeg/.png images" in err and "fix:" in err
    folder = tmp_path / "engines" / "digits-int8"
    assert (folder / "model.onnx").is_file() and not (folder / "model.int8.onnx").exists()
    assert not list(folder.glob(".*.tmp"))


def _broken_png(folder: Path) -> Path:
    folder.mkdir()
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    return folder


def _save(path: Path, array: np.ndarray) -> Path:
    path.parent.mkdir(exist_ok=True)
    np.save(path, array)
    return path


def _savez_unnamed_pair(path: Path, array: np.ndarray) -> Path:
    """A .npz of two arrays named "a" and "b": neither is the model's input name."""
    path.parent.mkdir(exist_ok=True)
    np.savez(path, a=array, b=array)
    return path


# --------------------------------------------------------------------------- the photographs


def test_calibration_photographs_export_and_preprocess_for_resnet(tmp_path):
    written = export_calibration_images(tmp_path)
    assert len(written) == 4 * len(PHOTOS) == 40
    image = load_image(written[0], ImagePreprocess())
    assert image.shape == (3, 224, 224) and image.dtype == np.float32
    assert -2.2 < image.min() < image.max() < 2.7  # ImageNet-normalised 0..255 pixels


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


def test_int8_gate_passes_the_calibrated_graph_and_fails_a_wrong_scale(int8, fp32, split, tmp_path):
    batches = [{"input": split.train_inputs[:128]}]
    record = check_int8_agreement(fp32, [int8[0]], batches)
    assert record.graphs["model.int8.onnx"].in_sample["logits"].error_mean < 0.05
    assert record.split.rows == 128
    model = onnx.load(str(int8[0]))
    initializers = {init.name: init for init in model.graph.initializer}
    first_weight = next(
        node for node in model.graph.node if node.op_type == "DequantizeLinear" and node.input[0] in initializers
    )
    scale = initializers[first_weight.input[1]]
    scale.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(scale) * 10, scale.name))
    onnx.save(model, str(tmp_path / "model.int8.onnx"))
    with pytest.raises(PipelineError, match="departs from FP32 on the calibration data") as caught:
        check_int8_agreement(fp32, [int8[0], tmp_path / "model.int8.onnx"], batches)
    assert "the first node past it is" in str(caught.value) and "diagnose" in caught.value.fix
    # An optional graph (a CPU-shaped one) past the gate is left out, not an error: the engine's graph stands in.
    shaped = graph_record(Precision.INT8, CPU_TARGETS[NO_VNNI])
    shutil.copy(tmp_path / "model.int8.onnx", tmp_path / shaped.file)
    record = check_int8_agreement(fp32, [int8[0]], batches, optional={tmp_path / shaped.file: shaped})
    assert record.graphs["model.int8.onnx"].left_out is None
    assert "departs from FP32 on the calibration data" in str(record.graphs[shaped.file].left_out)


def test_calibration_data_onnx_runtime_cannot_run_is_a_clear_error(tmp_path):
    """Ids that reach their lookup through a Cast (the reader's id check cannot see it) and lie outside the table:
    ONNX Runtime refuses the calibration batch; the error names the batch and the fix, not ORT's traceback."""
    from onnx import TensorProto, helper, numpy_helper

    table = numpy_helper.from_array(np.ones((10, 3), np.float32), "table")
    weight = numpy_helper.from_array(np.ones((3, 2), np.float32), "weight")
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["x"], ["ids"], to=TensorProto.INT64),
            helper.make_node("Gather", ["table", "ids"], ["rows"]),
            helper.make_node("MatMul", ["rows", "weight"], ["y"]),
        ],
        "cast_lookup",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, 2])],
        [table, weight],
    )
    fp32 = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(fp32))
    np.savez(tmp_path / "calib.npz", x=np.full((8, 4), 50.0, np.float32))
    data = read_calibration_data(tmp_path / "calib.npz", graph_inputs(fp32), None, samples=8, batch=4)
    with pytest.raises(PipelineError, match="could not run model.onnx on calibration batch 0") as caught:
        collect_statistics(fp32, data, ("max",))
    assert "within the range the model looks them up in" in str(caught.value.fix)


def test_int8_smoke_parity_on_random_inputs_fails_only_on_inf_or_nan(tmp_path):
    """y = 10 x - 9 (x @ I): equal to x in float; in INT8 the MatMul's input is clipped to the calibrated +-0.01,
    so on reference.npz's N(0, 1) noise the error is ~9 of the output's scale: the noise's doing, not the graph's
    (the agreement gate judges it on the calibration data).  Refused before; recorded now.  Non-finite still fails."""
    from onnx import TensorProto, helper, numpy_helper

    def graph(extra: list, output: str) -> Path:
        nodes = [
            # The MatMul reads a copy of x: a QuantizeLinear on x itself would be shared with the Mul below.
            helper.make_node("Mul", ["x", "one"], ["copy"]),
            helper.make_node("MatMul", ["copy", "identity"], ["through"]),
            helper.make_node("Mul", ["x", "ten"], ["tenfold"]),
            helper.make_node("Mul", ["through", "nine"], ["ninefold"]),
            helper.make_node("Sub", ["tenfold", "ninefold"], ["y"]),
            *extra,
        ]
        constants = [
            numpy_helper.from_array(np.eye(4, dtype=np.float32), "identity"),
            numpy_helper.from_array(np.float32(1), "one"),
            numpy_helper.from_array(np.float32(10), "ten"),
            numpy_helper.from_array(np.float32(9), "nine"),
        ]
        inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])]
        outputs = [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["batch", 4])]
        model = helper.make_model(
            helper.make_graph(nodes, "smoke", inputs, outputs, constants), opset_imports=[helper.make_opsetid("", 17)]
        )
        folder = tmp_path / output
        folder.mkdir()
        onnx.save(model, str(folder / "model.onnx"))
        np.savez(folder / "calib.npz", x=np.random.default_rng(0).uniform(-0.01, 0.01, (32, 4)).astype(np.float32))
        calibration = read_calibration(folder / "calib.npz", folder / "model.onnx", None, samples=32, batch=16)
        make_int8_graph(
            folder / "model.onnx",
            folder / "model.int8.onnx",
            calibration,
            config=CalibrationConfig(("max",)),
            cache_folder=folder / CACHE_FOLDER,
        )
        return folder

    noise = np.random.default_rng(1).standard_normal((8, 4)).astype(np.float32)
    folder = graph([], "y")
    write_npz(folder / "reference.npz", {"case0/in/x": noise, "case0/out/y": noise})
    record = check_parity(folder / "model.int8.onnx", folder / "reference.npz", graph=graph_record(Precision.INT8))
    assert record["max_rel"] > 5 and "smoke: fails on inf/NaN only" in record["summary"]

    folder = graph([helper.make_node("Div", ["y", "ninefold"], ["ratio"])], "ratio")  # 0 / 0 where x is 0
    zero = np.zeros((1, 4), np.float32)
    write_npz(folder / "reference.npz", {"case0/in/x": zero, "case0/out/ratio": np.ones((1, 4), np.float32)})
    with pytest.raises(PipelineError, match="disagrees with PyTorch"):
        check_parity(folder / "model.int8.onnx", folder / "reference.npz", graph=graph_record(Precision.INT8))


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
