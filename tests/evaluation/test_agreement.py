"""The FP32 graph's outputs in the int8 precision stage (pipeline/evaluation/agreement.py Fp32Reference): computed
once per list of calibration rows and shared by calibration's judge and the agreement gate, counted on the real ONNX
Runtime sessions the stage opens."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from tests.helpers.live_sessions import alive, record_sessions
from trt_pipeline.pipeline.core.settings import BatchProfile, Settings
from trt_pipeline.pipeline.folder.layout import FP32_GRAPH
from trt_pipeline.pipeline.stages.sequence import run_stage

ROWS, BATCH = 24, 4  # 8 rows held out for the gate (2 batches), 16 fit on (4 batches): calibration/holdout.py


def _fp32_runs(monkeypatch, fp32: onnx.ModelProto) -> list[dict]:
    """The feeds of every run that computes the FP32 graph's outputs at the level it runs at (a session on the graph
    as it is, or on it with nodes added after its own, as the maxima pass's reductions; not a quantized graph, not
    calibration's unoptimized passes), recorded as ONNX Runtime runs them."""
    ops, outputs = _structure(fp32)
    runs: list[dict] = []  # the feeds themselves: a count by id alone could meet a freed dict's id again
    opened, ran = ort.InferenceSession.__init__, ort.InferenceSession.run

    def open_and_tag(self, model, *args, **kwargs):
        opened(self, model, *args, **kwargs)
        graph = onnx.load_from_string(model) if isinstance(model, bytes) else onnx.load(model, load_external_data=False)
        level = self.get_session_options().graph_optimization_level
        self.is_fp32 = _structure(graph)[0][: len(ops)] == ops and level != ort.GraphOptimizationLevel.ORT_DISABLE_ALL

    def run_and_count(self, names, feeds, *args, **kwargs):
        if getattr(self, "is_fp32", False) and set(outputs) <= set(names or outputs):
            runs.append(feeds)
        return ran(self, names, feeds, *args, **kwargs)

    monkeypatch.setattr(ort.InferenceSession, "__init__", open_and_tag)
    monkeypatch.setattr(ort.InferenceSession, "run", run_and_count)
    return runs


def _structure(model: onnx.ModelProto) -> tuple[list[str], list[str]]:
    return [node.op_type for node in model.graph.node], [output.name for output in model.graph.output]


def _int8_settings_at_parity(tmp_path: Path) -> tuple[Settings, Path]:
    """A tiny CNN's INT8 settings (ROWS random calibration rows) and its folder built up to the precision stage."""
    rows = np.random.default_rng(0).normal(size=(ROWS, 3, 16, 16)).astype(np.float32)
    np.save(tmp_path / "rows.npy", rows)
    settings = Settings(
        model="tests.helpers.toy_models:tiny_cnn",
        precision="int8",
        calib=str(tmp_path / "rows.npy"),
        calib_batch=BATCH,
        batch=BatchProfile(1, 2, 4),
        out_root=tmp_path,
    )
    for stage in ("export", "check", "simplify", "parity"):
        folder = run_stage(settings, stage)
    return settings, folder


def test_the_int8_stage_runs_the_fp32_graph_once_on_each_calibration_batch(tmp_path: Path, monkeypatch):
    """The judge picks among candidates on the held-out rows and the gate then judges the kept graph on the same
    rows: FP32's outputs on them are the same, so they are computed once (the gate used to run FP32 on them again).
    The fit rows' are the maxima pass's (smoothing's, at the level the graph runs at), which the gate's in-sample
    numbers compare with (the gate used to run FP32 on those rows again too)."""
    settings, folder = _int8_settings_at_parity(tmp_path)
    runs = _fp32_runs(monkeypatch, onnx.load(folder / FP32_GRAPH, load_external_data=False))
    run_stage(settings, "precision")
    # Each run's rows by where they lie (a run takes a batch's rows a few at a time: agreement.run_in_rows): held
    # alive by `runs`, no two runs' rows lie in the same place unless they are the same rows.
    times_run = Counter(
        (array.__array_interface__["data"][0], len(array)) for feeds in runs for array in feeds.values()
    )
    assert set(times_run.values()) == {1}, times_run  # no rows twice
    assert sum(rows for _, rows in times_run) == ROWS  # every row, held out and fit, once


def test_the_fp32_reference_closes_its_session_once_it_has_a_lists_outputs(tmp_path: Path, monkeypatch):
    """A session on the FP32 graph lives while its outputs on a list of batches are computed, not through the
    judging after (where its mapped weights would count beside each INT8 graph's): once a list's outputs are had, no
    session on the graph is left; the same list again opens none."""
    from onnx import TensorProto, helper, numpy_helper

    from trt_pipeline.pipeline.evaluation.agreement import Fp32Reference

    weight = numpy_helper.from_array(np.random.default_rng(1).normal(size=(16, 4)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "fp32",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [weight],
    )
    path = tmp_path / FP32_GRAPH
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    sessions = record_sessions(monkeypatch)
    batches = [{"x": np.ones((2, 16), np.float32)}, {"x": np.full((3, 16), 2, np.float32)}]
    reference = Fp32Reference(path)
    outputs = reference.outputs(batches)
    assert len(sessions) == 1 and not alive(sessions)
    np.testing.assert_allclose(outputs[1]["y"], 2 * outputs[0]["y"][:1].repeat(3, axis=0), rtol=1e-6)
    assert reference.outputs(batches) is outputs and len(sessions) == 1


def test_a_graph_run_a_few_rows_at_a_time_gives_one_runs_outputs(tmp_path: Path):
    """run_in_rows: 7 rows run 2 at a time (the last run shorter), each output put back together in order, equal to
    one run of the 7 to float rounding (each row computes alone)."""
    from onnx import TensorProto, helper, numpy_helper

    from trt_pipeline.pipeline.evaluation.agreement import run_in_rows

    rng = np.random.default_rng(2)
    weight = numpy_helper.from_array(rng.normal(size=(16, 8)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Softmax", ["h"], ["y"], axis=-1)],
        "rows",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [
            helper.make_tensor_value_info("h", TensorProto.FLOAT, ["batch", 8]),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8]),
        ],  # fmt: skip
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"x": rng.normal(size=(7, 16)).astype(np.float32)}
    for whole, in_rows in zip(session.run(["y", "h"], feeds), run_in_rows(session, ["y", "h"], feeds, 2), strict=True):
        assert in_rows.shape == whole.shape
        np.testing.assert_allclose(in_rows, whole, rtol=1e-6, atol=0)


def test_the_fp32_graph_is_never_open_beside_an_int8_graph(tmp_path: Path, monkeypatch):
    """Each session keeps its graph's weights (mapped, or folded from int8) while it lives: the judge and the gate
    have FP32's outputs on their rows before they open the INT8 graph they compare (the FP32 graph's session gone),
    so the two graphs' weights never count together, on the held-out rows or the in-sample ones."""
    settings, folder = _int8_settings_at_parity(tmp_path)
    fp32 = _structure(onnx.load(folder / FP32_GRAPH, load_external_data=False))
    together: list[set[str]] = []  # as each session opens, the kinds of graph of those alive

    def kind_and_company(session, model) -> None:
        graph = onnx.load_from_string(model) if isinstance(model, bytes) else onnx.load(model, load_external_data=False)
        ops = {node.op_type for node in graph.graph.node}
        session.kind = "fp32" if _structure(graph) == fp32 else "int8" if "DequantizeLinear" in ops else "other"
        together.append({other.kind for other in alive(sessions)})

    sessions = record_sessions(monkeypatch, kind_and_company)
    run_stage(settings, "precision")
    assert any("int8" in kinds for kinds in together) and any("fp32" in kinds for kinds in together)
    assert not [kinds for kinds in together if {"fp32", "int8"} <= kinds]
