"""pipeline/evaluation/tensors.py: a graph's intermediate tensors, whole or part by part."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.helpers.live_sessions import alive, record_sessions
from trt_pipeline.pipeline.core.sessions import OPTIMIZATION_LEVELS, UNOPTIMIZED
from trt_pipeline.pipeline.evaluation.tensors import channel_maxima, tensor_values, tensor_values_in_parts
from trt_pipeline.pipeline.folder.graph_files import graph_without_weights

WIDTH = 64


def _residual_graph(path, opset=17):
    """x -> MatMul -> Relu -> MatMul -> Add(x) -> MatMul: the Add reads the graph's input past two nodes, the
    pattern of a transformer's residual stream; written with its weights in the file, read without them."""
    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32), f"w{i}") for i in range(3)
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w0"], ["h0"]),
        helper.make_node("Relu", ["h0"], ["r0"]),
        helper.make_node("MatMul", ["r0", "w1"], ["h1"]),
        helper.make_node("Add", ["h1", "x"], ["s"]),
        helper.make_node("MatMul", ["s", "w2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "residual",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", WIDTH])],
        weights,
    )
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), str(path))
    return graph_without_weights(path)


def test_a_graph_run_in_parts_gives_the_whole_graphs_values_bit_for_bit_one_part_at_a_time(tmp_path):
    """Cut so that each part exposes one tensor's bytes (8 rows x 64 floats), the graph runs in a part per node and
    feeds the residual's input on to the part that reads it: every tensor equal to the whole graph's unoptimized
    run, each part holding its own node's values alone (and the input, given with the first)."""
    model = _residual_graph(tmp_path / "model.onnx")
    names = ["x", "h0", "r0", "h1", "s", "y"]
    feeds = [{"x": np.random.default_rng(row).standard_normal((8, WIDTH)).astype(np.float32)} for row in range(2)]
    whole = list(tensor_values(model, names, feeds, weights=tmp_path, level=UNOPTIMIZED))
    batches = tensor_values_in_parts(model, names, feeds, weights=tmp_path, part_bytes=8 * WIDTH * 4)
    for expected, parts in zip(whole, batches, strict=True):
        parts = list(parts)
        assert [sorted(part) for part in parts] == [["h0", "x"], ["r0"], ["h1"], ["s"], ["y"]]
        for name, value in [item for part in parts for item in part.items()]:
            assert np.array_equal(value, expected[name]), name


def test_a_graph_within_the_bytes_runs_whole(tmp_path):
    """Parts as large as every tensor together: one part, one run a batch."""
    model = _residual_graph(tmp_path / "model.onnx")
    names = ["h0", "s", "y"]
    feeds = [{"x": np.ones((8, WIDTH), np.float32)}]
    (parts,) = tensor_values_in_parts(model, names, feeds, weights=tmp_path, part_bytes=3 * 8 * WIDTH * 4)
    assert [sorted(part) for part in parts] == [["h0", "s", "y"]]


def test_a_graph_in_parts_holds_one_parts_session_at_a_time(tmp_path, monkeypatch):
    """ONNX Runtime maps a session's weights while it lives: each part's session goes before the next part runs
    (none is left when a part's values come), while a graph in one part opens one session for every feed."""
    sessions = record_sessions(monkeypatch)
    model = _residual_graph(tmp_path / "model.onnx")
    names = ["h0", "r0", "h1", "s", "y"]
    feeds = [{"x": np.full((8, WIDTH), row, np.float32)} for row in range(2)]
    for parts in tensor_values_in_parts(model, names, feeds, weights=tmp_path, part_bytes=8 * WIDTH * 4):
        for _ in parts:
            assert not alive(sessions)
    assert len(sessions) == 2 * 5
    sessions.clear()
    for parts in tensor_values_in_parts(model, names, feeds, weights=tmp_path, part_bytes=5 * 8 * WIDTH * 4):
        assert len(list(parts)) == 1
    assert len(sessions) == 1


@pytest.mark.parametrize("opset", [17, 18])
def test_channel_maxima_computed_in_the_graph_are_those_of_the_exposed_tensors(tmp_path, opset):
    """Each tensor's max |x| over every axis but the last, reduced in the graph (ReduceMax's axes an attribute
    before opset 18, an input from it): a vector a tensor where the exposed run holds the tensor, and the same
    values, at the highest level as at the lowest; a graph input comes whole, as fed.  The graph's own outputs come
    beside them, those of a session on the graph itself bit for bit."""
    model = _residual_graph(tmp_path / "model.onnx", opset)
    names = ["x", "h0", "r0", "s"]
    produced = [output.name for output in model.graph.output]
    feeds = [{"x": np.random.default_rng(row).standard_normal((8, WIDTH)).astype(np.float32)} for row in range(2)]
    for level in (OPTIMIZATION_LEVELS[0], UNOPTIMIZED):
        exposed = tensor_values(model, names, feeds, weights=tmp_path, level=level)
        alone = tensor_values(model, produced, feeds, weights=tmp_path, level=level)  # the graph as it is
        reduced = channel_maxima(model, names, feeds, weights=tmp_path, level=level)
        for whole, outputs, (maxima, beside) in zip(exposed, alone, reduced, strict=True):
            assert list(beside) == produced and all(np.array_equal(beside[n], outputs[n]) for n in produced), level
            assert list(maxima) == names and maxima["x"] is whole["x"]
            for name in names[1:]:
                assert maxima[name].shape == (WIDTH,)
                assert np.array_equal(maxima[name], np.abs(whole[name]).max(axis=0)), (level, name)


def test_rows_per_run_cuts_only_runs_whose_rows_compute_much(tmp_path):
    """The tensors a row computes, as shape inference sizes them at one row: the residual graph's 5 tensors of 64
    floats a row run RUN_BYTES // 1280 rows at a time (any batch whole); a graph whose row expands to 512 MB runs 5
    rows at a time."""
    from trt_pipeline.pipeline.evaluation.tensors import RUN_BYTES, rows_per_run

    feed = {"x": np.zeros((8, WIDTH), np.float32)}
    assert rows_per_run(_residual_graph(tmp_path / "model.onnx"), feed) == RUN_BYTES // (5 * WIDTH * 4)
    wide = 2_000_000  # 512 MB a row
    shape = numpy_helper.from_array(np.array([1, WIDTH, wide], np.int64), "shape")
    axes = numpy_helper.from_array(np.array([2], np.int64), "axes")
    graph = helper.make_graph(
        [
            helper.make_node("Unsqueeze", ["x", "axes"], ["column"]),
            helper.make_node("Expand", ["column", "shape"], ["wide"]),
            helper.make_node("ReduceMax", ["wide", "axes"], ["y"], keepdims=0),
        ],
        "expanding",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", WIDTH])],
        [shape, axes],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    per_row = WIDTH * wide * 4 + 2 * WIDTH * 4
    assert rows_per_run(model, feed) == RUN_BYTES // per_row == 5
