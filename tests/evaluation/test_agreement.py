"""The FP32 graph's outputs in the int8 precision stage (pipeline/evaluation/agreement.py Fp32Reference): computed
once per list of calibration rows and shared by calibration's judge and the agreement gate, counted on the real ONNX
Runtime sessions the stage opens."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from trt_pipeline.pipeline.core.settings import BatchProfile, Settings
from trt_pipeline.pipeline.folder.layout import FP32_GRAPH
from trt_pipeline.pipeline.stages.sequence import run_stage

ROWS, BATCH = 24, 4  # 8 rows held out for the gate (2 batches), 16 fit on (4 batches): calibration/holdout.py


def _fp32_runs(monkeypatch, fp32: onnx.ModelProto) -> list[dict]:
    """The feeds of every run of a session on the FP32 graph as it is (its nodes and outputs: not a quantized graph,
    not one with tensors exposed for calibration), recorded as ONNX Runtime runs them."""
    structure = _structure(fp32)
    runs: list[dict] = []  # the feeds themselves: a count by id alone could meet a freed dict's id again
    opened, ran = ort.InferenceSession.__init__, ort.InferenceSession.run

    def open_and_tag(self, model, *args, **kwargs):
        opened(self, model, *args, **kwargs)
        graph = onnx.load_from_string(model) if isinstance(model, bytes) else onnx.load(model, load_external_data=False)
        self.is_fp32 = _structure(graph) == structure

    def run_and_count(self, names, feeds, *args, **kwargs):
        if getattr(self, "is_fp32", False):
            runs.append(feeds)
        return ran(self, names, feeds, *args, **kwargs)

    monkeypatch.setattr(ort.InferenceSession, "__init__", open_and_tag)
    monkeypatch.setattr(ort.InferenceSession, "run", run_and_count)
    return runs


def _structure(model: onnx.ModelProto) -> tuple[list[str], list[str]]:
    return [node.op_type for node in model.graph.node], [output.name for output in model.graph.output]


def test_the_int8_stage_runs_the_fp32_graph_once_on_each_calibration_batch(tmp_path: Path, monkeypatch):
    """The judge picks among candidates on the held-out rows and the gate then judges the kept graph on the same
    rows: FP32's outputs on them are the same, so they are computed once (the gate used to run FP32 on them again)."""
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
    runs = _fp32_runs(monkeypatch, onnx.load(folder / FP32_GRAPH, load_external_data=False))
    run_stage(settings, "precision")
    times_run = Counter(id(feeds) for feeds in runs)
    assert sorted(times_run.values()) == [1] * (ROWS // BATCH), times_run  # every batch, held out and fit, once
