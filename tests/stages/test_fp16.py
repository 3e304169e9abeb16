"""FP16 as the engine computes it: the faithful check, the automatic FP32 fallback, --keep-fp32, the diagnosis.

tests.helpers.toy_models:overflow_ffn has a feed-forward block whose hidden values reach ~1e5 (beyond float16's
65504); ONNX Runtime's CPU provider runs its float16 graph in float32 and sees nothing wrong.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from trt_pipeline.calibration.readers import CalibrationData
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.sessions import onnxruntime_session
from trt_pipeline.pipeline.core.settings import BatchProfile, Settings
from trt_pipeline.pipeline.evaluation.float16 import faithful_session
from trt_pipeline.pipeline.folder.graph_io import load_reference
from trt_pipeline.pipeline.quality.diagnose import diagnose_folder
from trt_pipeline.pipeline.stages.fp16 import calibration_cases, convert_fp16
from trt_pipeline.pipeline.stages.fp16_overflow import Case, TensorStats
from trt_pipeline.pipeline.stages.sequence import make_engine

OVERFLOW = "tests.helpers.toy_models:overflow_ffn"
BLOCK = ["/up/Gemm", "/Relu", "/down/Gemm"]  # the nodes that hold the large values


def _fp16(tmp_path: Path, **options) -> Path:
    return make_engine(Settings(model=OVERFLOW, precision="fp16", out_root=tmp_path, builder="tensorrt_rtx", **options))


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def test_overflow_is_caught_without_the_fallback_and_names_the_node(tmp_path):
    with pytest.raises(PipelineError) as caught:
        _fp16(tmp_path, auto_fp32=False)
    message = str(caught.value)
    assert "max abs error nan" in message and "the first node past it is '/up/Gemm' (Gemm)" in message
    assert "Settings(keep_fp32=<node or op type>)" in caught.value.fix and "trt-pipeline diagnose" in caught.value.fix
    # What the old gate saw: the same float16 graph through ONNX Runtime's CPU provider is fine.
    folder = next(tmp_path.glob("*-fp16"))
    inputs, outputs = load_reference(folder / "reference.npz")[0]
    (logits,) = onnxruntime_session(folder / "model.fp16.onnx").run(None, inputs)
    assert np.allclose(logits, outputs["logits"], rtol=0, atol=0.03 * np.abs(outputs["logits"]).max())


def test_the_fallback_keeps_only_the_overflowing_nodes_in_fp32(tmp_path):
    folder = _fp16(tmp_path)
    manifest = _manifest(folder)
    record = manifest["fp16"]
    assert [kept["node"] for kept in record["kept_fp32"]] == BLOCK
    assert all(kept["max_abs"] > 65504 / 4 for kept in record["kept_fp32"])
    assert 0 < record["fp32_compute_share"] < 0.25
    assert manifest["parity_fp16"]["max_rel"] < 0.03 and "as the engine stores it" in manifest["parity_fp16"]["summary"]
    graph = onnx.load(str(folder / "model.fp16.onnx")).graph
    sizes = {TensorProto.FLOAT16: 0, TensorProto.FLOAT: 0}
    for initializer in graph.initializer:
        sizes[initializer.data_type] += int(np.prod(initializer.dims))
    assert sizes[TensorProto.FLOAT16] > 3 * sizes[TensorProto.FLOAT]  # most weights stay float16
    # Kept nodes read each other's FP32 values: no float16 round trip between them.
    producers = {out: node for node in graph.node for out in node.output}
    for node in graph.node:
        if node.name in BLOCK[1:]:
            assert producers[node.input[0]].name in BLOCK


def test_the_float16_graph_is_topologically_sorted(tmp_path):
    graph = onnx.load(str(_fp16(tmp_path) / "model.fp16.onnx")).graph
    available = {value.name for value in graph.input} | {init.name for init in graph.initializer} | {""}
    for node in graph.node:
        assert all(name in available for name in node.input), node.name
        available.update(node.output)


def test_keep_fp32_by_op_type_and_by_name(tmp_path):
    record = _manifest(_fp16(tmp_path / "a", keep_fp32="Tanh, /head/Gemm"))["fp16"]
    asked = {kept["node"] for kept in record["kept_fp32"] if kept["reason"] == "asked for (--keep-fp32)"}
    assert asked == {"/layers/layers.1/Tanh", "/layers/layers.3/Tanh", "/head/Gemm"}
    with pytest.raises(PipelineError, match=r"Settings.keep_fp32 names \['TopKk'\], which is neither") as caught:
        _fp16(tmp_path / "b", keep_fp32="TopKk")
    assert "Gemm" in caught.value.fix


def test_diagnosis_names_the_one_broken_node_first(tmp_path):
    folder = shutil.copytree(_fp16(tmp_path / "built"), tmp_path / "broken")
    model = onnx.load(str(folder / "model.fp16.onnx"))
    weight = next(init for init in model.graph.initializer if init.name == "layers.2.weight")
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * np.float16(1.5), weight.name))
    onnx.save(model, str(folder / "model.fp16.onnx"))
    report = diagnose_folder(folder)
    assert report["first_past_tolerance"]["node"] == "/layers/layers.2/Gemm"
    assert report["worst"][0]["rel"] > 0.03
    markdown = (folder / "diagnosis.md").read_text()
    assert "First node past the tolerance: **/layers/layers.2/Gemm** (Gemm)" in markdown


def test_diagnose_refuses_an_fp32_folder(tmp_path):
    folder = make_engine(Settings(model=OVERFLOW, precision="fp32", out_root=tmp_path, builder="tensorrt_rtx"))
    with pytest.raises(PipelineError, match="holds a fp32 graph: there is no lower precision"):
        diagnose_folder(folder)


# --------------------------------------------------------------------------- the scan sees the calibration data

LARGE_ROWS = slice(40, 48)  # the calibration rows whose inputs are 30x the reference inputs' size
SCALED_BLOCK = ["up", "relu", "down"]


def _scaled_ffn(folder: Path) -> tuple[Path, Path]:
    """An ONNX graph y = relu(x @ up) @ down + x @ skip whose hidden values are about 1000 |x|, and its calibration
    .npz.  The reference inputs (standard normal) reach a few thousand there, fine in float16; calibration rows
    40-47 are 30x larger and reach about 1e5, beyond float16's 65504, as real inputs can where random ones do not."""
    rng = np.random.default_rng(0)
    weights = {
        "up_w": rng.standard_normal((16, 64)) * 250,
        "down_w": rng.standard_normal((64, 4)) / 8000,
        "skip_w": rng.standard_normal((16, 4)) / 4,
    }
    nodes = [
        helper.make_node("MatMul", ["x", "up_w"], ["hidden"], name="up"),
        helper.make_node("Relu", ["hidden"], ["active"], name="relu"),
        helper.make_node("MatMul", ["active", "down_w"], ["block"], name="down"),
        helper.make_node("MatMul", ["x", "skip_w"], ["direct"], name="skip"),
        helper.make_node("Add", ["block", "direct"], ["y"], name="add"),
    ]
    graph = helper.make_graph(
        nodes,
        "scaled_ffn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        initializer=[numpy_helper.from_array(value.astype(np.float32), name) for name, value in weights.items()],
    )
    model_path, data_path = folder / "scaled_ffn.onnx", folder / "calibration.npz"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), model_path)
    x = rng.standard_normal((64, 16)).astype(np.float32)
    x[LARGE_ROWS] *= 30
    np.savez(data_path, x=x)
    return model_path, data_path


def _scaled_fp16(model: Path, out: Path, **options) -> Path:
    settings = Settings(model=str(model), precision="fp16", out_root=out, builder="tensorrt_rtx", **options)
    return make_engine(settings)


def test_the_fallback_scan_sees_an_overflow_only_the_calibration_data_shows(tmp_path):
    model, data = _scaled_ffn(tmp_path)
    large = {"x": np.load(data)["x"][LARGE_ROWS]}
    # Without CALIB the reference inputs are all the scan sees: nothing is kept, and the graph overflows on the
    # calibration data as the engine would compute it.
    plain = _scaled_fp16(model, tmp_path / "plain")
    assert _manifest(plain)["fp16"]["kept_fp32"] == []
    (y,) = faithful_session(plain / "model.fp16.onnx").run(None, large)
    assert not np.isfinite(y).all()
    # With it the block is kept, each node with the magnitude and the rows that showed it.
    folder = _scaled_fp16(model, tmp_path / "calibrated", calib=data, calib_samples=64, calib_batch=16)
    manifest = _manifest(folder)
    kept = manifest["fp16"]["kept_fp32"]
    assert [node["node"] for node in kept] == SCALED_BLOCK
    assert all(node["max_abs"] > 65504 and node["seen_in"] == "calibration rows 40-47" for node in kept)
    scanned = manifest["fp16"]["scanned"]
    assert scanned["reference"]["cases"] >= 2 and scanned["calibration"]["samples"] == 64
    assert manifest["calibration"]["data_sha256"] == scanned["calibration"]["data_sha256"]
    (y,) = faithful_session(folder / "model.fp16.onnx").run(None, large)
    assert np.isfinite(y).all()
    # The faithful gate judged the rows with the largest activations too, against the FP32 graph.
    judged = {case["data"]: case for case in manifest["parity_fp16"]["cases"]}
    assert "calibration rows 40-47" in judged and judged["calibration rows 40-47"]["outputs"]["y"]["max_rel"] < 0.03
    # New calibration data is a new graph: the folder is not reused.
    np.savez(data, x=np.load(data)["x"] * 0.5)
    _scaled_fp16(model, tmp_path / "calibrated", calib=data, calib_samples=64, calib_batch=16)
    assert _manifest(folder)["calibration"]["data_sha256"] != scanned["calibration"]["data_sha256"]


def test_the_faithful_gate_judges_the_calibration_rows_with_the_largest_activations(tmp_path):
    model, data = _scaled_ffn(tmp_path)
    with pytest.raises(PipelineError) as caught:
        _scaled_fp16(model, tmp_path, calib=data, calib_samples=64, calib_batch=16, auto_fp32=False)
    message = str(caught.value)
    assert "disagrees with the FP32 graph on calibration rows 40-47" in message and "max abs error nan" in message
    assert "the first node past it is 'up' (MatMul)" in message


def test_the_scan_names_where_each_maximum_was_seen_and_ranks_the_runs_by_their_activations():
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["y"], name="scale"), helper.make_node("Shape", ["x"], ["s"])],
        "scale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])],
        initializer=[numpy_helper.from_array(np.array([3.0, -3.0], np.float32), "k")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    sizes = {"rows 0-1": 1.0, "rows 2-3": 5.0, "rows 4-5": 2.0, "rows 6-7": -7.0}
    cases = [Case("calibration", label, {"x": np.full((2, 2), size, np.float32)}) for label, size in sizes.items()]
    stats = TensorStats.of_runs(model, cases)
    assert stats.max_abs == {"x": 7.0, "y": 21.0} and stats.seen == {"x": "rows 6-7", "y": "rows 6-7"}
    assert stats.largest_cases(list(sizes), 2) == ["rows 6-7", "rows 2-3"]


def test_the_scan_runs_a_large_case_in_slices_of_rows_with_the_same_maxima(monkeypatch):
    """Every tensor of a run is exposed at once (ViT-L/16: 7 GB at batch 8), so a case runs in slices of rows whose
    tensors fit EXPOSED_BYTES; each tensor's maximum, and the case that reached it, are the whole batch's."""
    from trt_pipeline.pipeline.evaluation.tensors import ExposingSession
    from trt_pipeline.pipeline.stages import fp16_overflow

    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["y"], name="scale"), helper.make_node("Relu", ["y"], ["z"])],
        "scale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 256])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 256])],
        initializer=[numpy_helper.from_array(np.full(256, -2.0, np.float32), "k")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    rows = np.random.default_rng(0).normal(size=(32, 256)).astype(np.float32)
    rows[21, 7], rows[5, 3] = 90.0, -400.0  # z's largest row, then x's and y's
    cases = [Case("reference", "case 0 (batch 1)", {"x": rows[:1]}), Case("reference", "case 1", {"x": rows})]
    whole = TensorStats.of_runs(model, cases)
    ran: list[int] = []
    run = ExposingSession.run
    monkeypatch.setattr(ExposingSession, "run", lambda self, feeds: ran.append(len(feeds["x"])) or run(self, feeds))
    monkeypatch.setattr(fp16_overflow, "EXPOSED_BYTES", 4 * 3 * 256 * 4)  # 4 rows of x, y and z in float32
    sliced = TensorStats.of_runs(model, cases)
    assert max(ran) <= 4 and sum(ran) == 33
    assert sliced.max_abs == whole.max_abs == {"x": 400.0, "y": 800.0, "z": 800.0}
    assert sliced.seen == whole.seen == {"x": "case 1", "y": "case 1", "z": "case 1"}


def test_the_scan_cuts_calibration_batches_to_the_rows_a_run_may_hold():
    rows = np.arange(40, dtype=np.float32).reshape(20, 2)
    data = CalibrationData([{"x": rows[:16]}, {"x": rows[16:]}], 20, "sha", "test")
    labels = [case.label for case in calibration_cases(data, Settings())]
    assert labels == ["calibration rows 0-7", "calibration rows 8-15", "calibration rows 16-19"]
    small = calibration_cases(data, Settings(batch=BatchProfile(1, 2, 4)))  # no run beyond the profile's max
    assert [len(case.feeds["x"]) for case in small] == [4, 4, 4, 4, 4]
    assert small[-1].label == "calibration rows 16-19" and np.array_equal(small[-1].feeds["x"], rows[16:])


def test_weights_convert_to_float16_bit_for_bit_as_onnxruntimes_converter_converts_them():
    """The FP16 stage converts each weight itself as it writes it: the same bits as the converter's
    convert_np_to_float16 on values around zero, past float16's range, at its bounds, infinite and NaN."""
    from onnxruntime.transformers.float16 import convert_np_to_float16

    from trt_pipeline.pipeline.stages.fp16 import to_float16

    rng = np.random.default_rng(0)
    edges = [0.0, -0.0, 1e-45, 1e-9, 2.98e-8, 2.99e-8, 3e-8, 5.96e-8, 6e-8, 6.1e-5, 1.0, 65504, 65505, 65519, 65520]
    edges += [1e6, np.inf, np.nan]
    values = np.array(edges + [-value for value in edges], np.float32)
    spread = rng.standard_normal(99_964) * 10 ** rng.uniform(-12, 8, 99_964)  # every magnitude float32 holds
    values = np.concatenate([values, spread.astype(np.float32)]).reshape(-1, 5)
    np.testing.assert_array_equal(to_float16(values).view(np.uint16), convert_np_to_float16(values).view(np.uint16))


def test_a_mask_cast_to_float_for_a_kernel_kept_in_fp32_stays_a_float(tmp_path):
    """A bool mask cast to float for CumSum, which ONNX Runtime's converter keeps in FP32 (no float16 kernel): the
    converter's Cast to float16 and its Cast back are a round trip from a bool, not from a float32 value, so the
    CumSum must not read the bool (a DETR's position embedding: the FP16 graph was invalid, and every gate failed)."""
    nodes = [
        helper.make_node("Greater", ["x", "zero"], ["mask"]),
        helper.make_node("Cast", ["mask"], ["mask_float"], to=TensorProto.FLOAT),
        helper.make_node("CumSum", ["mask_float", "axis"], ["positions"]),
        helper.make_node("Mul", ["positions", "x"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "masked_positions",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 6])],
        [
            helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0]),
            helper.make_tensor("axis", TensorProto.INT64, [], [1]),
        ],
    )
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    onnx.save(model, str(tmp_path / "model.onnx"))
    convert_fp16(tmp_path / "model.onnx", tmp_path / "model.fp16.onnx")
    onnx.checker.check_model(str(tmp_path / "model.fp16.onnx"), full_check=True)
    x = np.array([[1.0, -2.0, 3.0, 0.5, -1.0, 2.0]], dtype=np.float32)
    (y,) = onnxruntime_session(tmp_path / "model.fp16.onnx").run(None, {"x": x})
    np.testing.assert_allclose(y, np.cumsum(x > 0, axis=1) * x, rtol=1e-3)


def test_an_output_a_kept_node_computes_leaves_the_graph_in_float32(tmp_path):
    """A graph output computed by a node kept in FP32 went out through the converter's Cast to float16 and its Cast
    back: past float16's range it was inf (a random MobileOne's logits, 1e15, through its kept Gemm), and below it,
    rounded to float16."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "scale"], ["y"], name="scale_up")],
        "large_output",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor("scale", TensorProto.FLOAT, [], [1e6])],
    )
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    onnx.save(model, str(tmp_path / "model.onnx"))
    record = convert_fp16(tmp_path / "model.onnx", tmp_path / "model.fp16.onnx", keep_fp32=["scale_up"])
    assert [kept["node"] for kept in record["kept_fp32"]] == ["scale_up"]
    x = np.array([[1.0, -0.123456, 3.0]], dtype=np.float32)
    (y,) = onnxruntime_session(tmp_path / "model.fp16.onnx").run(None, {"x": x})
    np.testing.assert_array_equal(y, x * np.float32(1e6))  # the kept node's float32 product, bit for bit
