"""INT8 to an accuracy budget, on the trained digits CNN (real graphs, real ONNX Runtime runs), and the rule that
tells a real top-1 flip from a near-tie (pipeline.quality.accuracy.top1_changes), on logits built to sit either side of
it.

The budget's loss here is 100 x (1 - mean cosine to FP32) on the training split, because the digits CNN loses no
top-1 on it when fully quantized: only a loss above the budget makes the search leave layers in float.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from trt_pipeline.calibration.budget import fit_budget, quantized_layers
from trt_pipeline.calibration.cache import read_cache
from trt_pipeline.calibration.holdout import read_calibration
from trt_pipeline.calibration.int8 import CACHE_FOLDER, make_int8_graph
from trt_pipeline.calibration.int8_records import CalibrationConfig
from trt_pipeline.calibration.qdq import quantize_qdq
from trt_pipeline.models.digits import PREPROCESS, load_split
from trt_pipeline.pipeline import cli
from trt_pipeline.pipeline.core.sessions import onnxruntime_session
from trt_pipeline.pipeline.core.settings import Settings
from trt_pipeline.pipeline.quality.accuracy import budget_loss, top1_changes
from trt_pipeline.pipeline.stages.sequence import make_engine


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> tuple[Path, object, np.ndarray]:
    """The digits FP32 graph, its max-calibrated ranges (training split) and 256 training inputs."""
    out = tmp_path_factory.mktemp("budget")
    fp32 = make_engine(Settings(model="digits", precision="fp32", out_root=out / "engines")) / "model.onnx"
    train = load_split().train_inputs[:256]
    np.save(out / "train.npy", train)
    record = make_int8_graph(
        fp32,
        out / "model.int8.onnx",
        read_calibration(out / "train.npy", fp32, PREPROCESS, samples=256, batch=64),
        config=CalibrationConfig(("max",)),
        cache_folder=out / CACHE_FOLDER,
    )
    return fp32, read_cache(Path(record.calibration["cache_file"])).ranges, train


def _cosine_loss(fp32: Path, inputs: np.ndarray):
    reference = onnxruntime_session(fp32).run(None, {"input": inputs})[0]

    def loss(graph: Path) -> dict:
        actual = onnxruntime_session(graph).run(None, {"input": inputs})[0]
        cosine = np.sum(actual * reference, 1) / (np.linalg.norm(actual, axis=1) * np.linalg.norm(reference, axis=1))
        return {"loss": float(100 * (1 - cosine.mean())), "cosine_mean": float(cosine.mean())}

    return loss


def test_budget_keeps_the_most_sensitive_layers_in_float_until_it_holds(digits, tmp_path):
    fp32, ranges, train = digits
    loss = _cosine_loss(fp32, train)
    full = fit_budget(fp32, tmp_path / "full.onnx", ranges, 1e9, loss)
    assert full["kept_float"] == [] and len(full["steps"]) == 1  # a loose budget quantizes everything
    budget = full["steps"][0]["loss"] / 3
    record = fit_budget(fp32, tmp_path / "budget.onnx", ranges, budget, loss)
    assert record["within_budget"] and 0 < len(record["kept_float"]) < record["layers"]
    assert record["steps"][-1]["loss"] <= budget < record["steps"][0]["loss"]
    # the first layer left in float is the one whose exclusion alone helped most
    sensitivity = record["sensitivity"]
    assert record["kept_float"][0] == max(sensitivity, key=sensitivity.get)
    # the written graph is the last step's: those layers read float inputs, the others Q/DQ
    graph = onnx.load(str(tmp_path / "budget.onnx")).graph
    producers = {out: node.op_type for node in graph.node for out in node.output}
    for node in graph.node:
        if node.name in quantized_layers(fp32):
            dequantized = producers.get(node.input[0]) == "DequantizeLinear"
            assert dequantized == (node.name not in record["kept_float"]), node.name
    assert loss(tmp_path / "budget.onnx")["loss"] == pytest.approx(record["steps"][-1]["loss"], abs=1e-6)
    assert all("cosine_mean" in step for step in record["steps"])  # the loss's record lands in each step


def test_accuracy_budget_from_the_command_line(tmp_path, capsys):
    code = cli.main(
        ["accuracy", "--model", "digits", "--calib-method", "max", "--accuracy-budget", "0.5", "--out", str(tmp_path)]
    )
    assert code == 0
    report = json.loads((tmp_path / "digits-fp32" / "accuracy.json").read_text())
    budget = report["calibration"]["max"]["budget"]
    assert budget["budget"] == 0.5 and budget["within_budget"]
    assert "int8-max-budget" in report["results"]
    assert report["results"]["fp32"]["top1"] - report["results"]["int8-max-budget"]["top1"] <= 1.0
    markdown = (tmp_path / "digits-fp32" / "accuracy.md").read_text()
    assert "accuracy budget of 0.5" in markdown and "| step | layers in float |" in markdown


def test_a_negative_budget_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["accuracy", "--model", "digits", "--accuracy-budget", "-1", "--out", str(tmp_path)]) == 2
    assert "--accuracy-budget -1" in capsys.readouterr().err


# FP32 logits and lower-precision ones built around the rule: (FP32 row, lower row, what the change is).
FLIPS = [
    ([5.00, 4.98, 0.0], [4.95, 5.03, 0.0], "near-tie"),  # margin 0.02 <= the sample's worst error 0.05
    ([5.00, 3.00, 0.0], [4.90, 5.20, 0.0], "real"),  # margin 2.0 within its own error 2.2, not within the median's
    ([5.00, 4.85, 0.0], [4.92, 4.93, 0.0], "real"),  # margin 0.15 > 0.08: both logits had to move, apart
    ([1.00, 0.00, 0.0], [1.05, 0.02, 0.0], "kept"),
    ([0.00, 2.00, 1.0], [0.03, 1.96, 1.0], "kept"),
]


def test_a_flip_is_a_near_tie_only_within_the_error_the_graph_makes():
    reference = np.array([row[0] for row in FLIPS], dtype=np.float32)
    outputs = np.array([row[1] for row in FLIPS], dtype=np.float32)
    changes = top1_changes(outputs, reference)
    kinds = [
        "near-tie" if tie else "real" if real else "kept"
        for tie, real in zip(changes.near_tie, changes.real, strict=True)
    ]
    assert kinds == [row[2] for row in FLIPS]
    np.testing.assert_allclose(changes.margin[:3], [0.02, 2.0, 0.15], atol=1e-5)
    # the tolerance is each sample's worst error, capped by the median worst error (0.05 here)
    np.testing.assert_allclose(changes.tolerance, [0.05, 0.05, 0.05, 0.05, 0.04], atol=1e-5)
    assert not changes.changed[3:].any()


def test_the_unlabelled_budget_loss_charges_real_flips(digits, tmp_path):
    """Ranges shrunk tenfold: the graph clips everything and changes most answers; its flips are real, not
    excused as near-ties, and they (207 of 256 when measured), not the cosine (0.27), set the loss."""
    from onnxruntime.quantization.calibrate import TensorData

    fp32, ranges, train = digits
    shrunk = copy.deepcopy(ranges)
    for name in list(shrunk.keys()):
        low, high = shrunk[name].range_value
        shrunk[name] = TensorData(lowest=np.float32(low / 10), highest=np.float32(high / 10))
    quantize_qdq(fp32, tmp_path / "clipped.onnx", shrunk)
    record = budget_loss(fp32, [{"input": train}], None)(tmp_path / "clipped.onnx")
    flipped = 100 * record["real_flips"] / len(train)
    assert record["real_flips"] > 3 * record["near_tie_flips"]
    assert record["loss"] == pytest.approx(max(100 * (1 - record["cosine_mean"]), flipped))
    assert flipped > 100 * (1 - record["cosine_mean"])
