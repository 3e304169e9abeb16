"""Output dims named after the input dims they follow (pipeline/stages/output_dims.py, run by the check stage), in the
graph and the manifest, through simplify and the FP16 graph; a dim only the data decides stays so, and the binding
runner (backend="onnxruntime-cuda", here on the CPU provider) serves a graph with such an output."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.settings import BatchProfile, Settings
from trt_pipeline.pipeline.folder.manifest import MANIFEST
from trt_pipeline.pipeline.runners import load_runner
from trt_pipeline.pipeline.stages.sequence import make_engine

PROFILE = BatchProfile(1, 2, 4)


def _output_dims(graph: Path) -> dict[str, list]:
    model = onnx.load(str(graph), load_external_data=False)
    return {
        output.name: [d.dim_param or d.dim_value for d in output.type.tensor_type.shape.dim]
        for output in model.graph.output
    }


# ---------------------------------------------------------------- a size only the data decides


def _column_filter(path: Path) -> Path:
    """x [batch, 16] -> kept [batch, columns]: the leading columns, as many as there are columns whose largest value
    passes 0.5 (a count only the values decide: NonZero's kind, in ops TensorRT-RTX builds, which NonZero is not),
    and total [batch, 1], each row's sum, an output the inputs size."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    nodes = [
        helper.make_node("ReduceMax", ["x"], ["column_max"], axes=[0], keepdims=0),
        helper.make_node("Greater", ["column_max", "threshold"], ["passes"]),
        helper.make_node("Cast", ["passes"], ["passes_int"], to=i64),
        helper.make_node("ReduceSum", ["passes_int", "zero"], ["count"], keepdims=1),
        helper.make_node("Slice", ["x", "zero", "count", "one"], ["kept"]),
        helper.make_node("ReduceSum", ["x", "one"], ["total"], keepdims=1),
    ]
    graph = helper.make_graph(
        nodes,
        "column_filter",
        [helper.make_tensor_value_info("x", f, ["batch", 16])],
        [
            helper.make_tensor_value_info("kept", f, ["batch", "columns"]),
            helper.make_tensor_value_info("total", f, ["batch", 1]),
        ],
        initializer=[
            helper.make_tensor("threshold", f, [], [0.5]),
            helper.make_tensor("zero", i64, [1], [0]),
            helper.make_tensor("one", i64, [1], [1]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def column_filter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("column_filter")
    source = _column_filter(root / "column_filter.onnx")
    settings = Settings(model=str(source), precision="fp32", batch=PROFILE, out_root=root / "engines")
    return make_engine(settings)


def _rows(rows: int, seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((rows, 16)).astype(np.float32)}


def test_a_data_dependent_dim_keeps_its_name_and_the_binding_runner_serves_it(column_filter: Path):
    """The dim stays the file's own (no input dim gives it) in the graph and the manifest.  The output is bound to
    the device and allocated by ONNX Runtime at each run; the other keeps its buffer.  One session, so calls of other
    sizes go through the same binding, and a call of the same shape after another (which binds nothing anew) still
    gets its own size."""
    assert _output_dims(column_filter / "model.onnx") == {"kept": ["batch", "columns"], "total": ["batch", 1]}
    outputs = json.loads((column_filter / MANIFEST).read_text())["outputs"]
    assert [output["shape"] for output in outputs] == [["batch", "columns"], ["batch", 1]]
    feeds = [_rows(4, seed=1), _rows(1, seed=2), _rows(3, seed=3), _rows(3, seed=4)]
    with (
        load_runner(column_filter, "onnxruntime-cuda", device="cpu", sessions=1) as runner,
        load_runner(column_filter, "onnxruntime") as plain,
    ):
        assert "outputs ['kept'] allocated by ONNX Runtime at each run" in runner.description
        counts = set()
        for feed in feeds:
            got, want = runner.infer(feed), plain.infer(feed)
            assert list(got) == ["kept", "total"]
            for name in want:
                np.testing.assert_array_equal(got[name], want[name])
            counts.add(got["kept"].shape[1])
        assert len(counts) > 1  # the sizes really changed between calls

        feed = feeds[2]
        want = plain.infer(feed)
        written = {name: np.full(value.shape, np.nan, value.dtype) for name, value in want.items()}
        assert runner.infer_on_device(feed, written) is written
        for name in want:
            np.testing.assert_array_equal(written[name], want[name])
        wrong = {**written, "kept": np.empty((3, want["kept"].shape[1] + 1), np.float32)}
        with pytest.raises(PipelineError, match=r"output 'kept' of this call is \(3, \d+\) \(a size its data"):
            runner.infer_on_device(feed, wrong)
