"""The gates of pipeline/stages/parity.py: a graph against PyTorch's reference, and an INT8 graph's agreement with FP32
on the calibration data."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from tests.helpers import toy_models
from tests.helpers.exported import exported
from trt_pipeline.calibration.holdout import read_calibration
from trt_pipeline.calibration.int8 import CACHE_FOLDER, make_int8_graph
from trt_pipeline.calibration.int8_records import CalibrationConfig
from trt_pipeline.pipeline.core.cpu import NO_VNNI
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.precision import Precision
from trt_pipeline.pipeline.evaluation.agreement import Fp32Reference, int8_judge
from trt_pipeline.pipeline.folder.artifacts import write_npz
from trt_pipeline.pipeline.folder.layout import CPU_TARGETS, graph_record
from trt_pipeline.pipeline.stages.parity import check_int8_agreement, check_parity


def test_parity_fails_with_a_clear_message_past_tolerance(tmp_path):
    graph, reference = exported(toy_models.tiny_cnn(), tmp_path)
    model = onnx.load(str(graph))
    bias = next(i for i in model.graph.initializer if i.name.endswith("fc.bias"))
    values = onnx.numpy_helper.to_array(bias) + 1.0  # a wrong graph: every logit shifted by 1
    bias.CopyFrom(onnx.numpy_helper.from_array(values, bias.name))
    onnx.save(model, str(graph))
    with pytest.raises(PipelineError, match="disagrees with PyTorch at batch 1 on output 'logits'"):
        check_parity(graph, reference, graph=graph_record(Precision.FP32))


def test_int8_gate_passes_the_calibrated_graph_and_fails_a_wrong_scale(int8, fp32, split, tmp_path):
    batches = [{"input": split.train_inputs[:128]}]
    record = check_int8_agreement(Fp32Reference(fp32), [int8[0]], batches)
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
        check_int8_agreement(Fp32Reference(fp32), [int8[0], tmp_path / "model.int8.onnx"], batches)
    assert "the first node past it is" in str(caught.value) and "diagnose" in caught.value.fix
    # An optional graph (a CPU-shaped one) past the gate is left out, not an error: the engine's graph stands in.
    shaped = graph_record(Precision.INT8, CPU_TARGETS[NO_VNNI])
    shutil.copy(tmp_path / "model.int8.onnx", tmp_path / shaped.file)
    record = check_int8_agreement(Fp32Reference(fp32), [int8[0]], batches, optional={tmp_path / shaped.file: shaped})
    assert record.graphs["model.int8.onnx"].left_out is None
    assert "departs from FP32 on the calibration data" in str(record.graphs[shaped.file].left_out)


def test_the_int8_gate_takes_the_held_out_numbers_the_stage_judged_and_runs_the_in_sample_rows(int8, fp32, split):
    """The INT8 stage's judge computed the kept graph's outputs' agreement on the held-out rows already: the gate's
    own evaluation of the same bytes gives the same numbers, so it takes them as given (here halved, to tell them
    from numbers computed again) and runs the graph on the in-sample rows alone."""
    fit, held_out = [{"input": split.train_inputs[:64]}], [{"input": split.train_inputs[64:96]}]
    reference = Fp32Reference(fp32)
    judged = int8_judge(reference)(int8[0], held_out)
    afresh = check_int8_agreement(reference, [int8[0]], fit, held_out).graphs["model.int8.onnx"]
    assert afresh.held_out == judged and afresh.held_out["logits"].rows == 32
    given = {name: replace(rows, error_mean=rows.error_mean / 2) for name, rows in judged.items()}
    taken = check_int8_agreement(reference, [int8[0]], fit, held_out, judged={int8[0]: given})
    graph = taken.graphs["model.int8.onnx"]
    assert graph.held_out == given and graph.in_sample == afresh.in_sample


def test_int8_smoke_parity_on_random_inputs_fails_only_on_inf_or_nan(tmp_path):
    """y = 10 x - 9 (x @ I): equal to x in float; in INT8 the MatMul's input is clipped to the calibrated +-0.01,
    so on reference.npz's N(0, 1) noise the error is ~9 of the output's scale: the noise's doing, not the graph's
    (the agreement gate judges it on the calibration data).  Refused before; recorded now.  Non-finite still fails."""
    from onnx import TensorProto, helper

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
