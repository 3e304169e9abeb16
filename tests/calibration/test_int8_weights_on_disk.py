"""The INT8 stage's graph rewrites leave the weights on disk: smoothing (calibration/smooth.py, through
calibration.int8.calibrated_graph) scales each weight as it is written, and bias correction (calibration/bias.py)
reads one weight at a time and copies the rest, so neither holds the model's weights in memory (a 2.4 GB model's
stage peaked at 4.5x its weights while they did).  What they write is what the same rewrite makes of the graph
held in memory.  And the graph ONNX Runtime's quantizer is given keeps its weights in a data file."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from trt_pipeline.calibration.bias import correct_biases
from trt_pipeline.calibration.int8 import calibrated_graph
from trt_pipeline.calibration.qdq import quantize_qdq
from trt_pipeline.calibration.ranges import collect_statistics
from trt_pipeline.calibration.readers import CalibrationData
from trt_pipeline.calibration.smooth import smooth_graph
from trt_pipeline.pipeline.core.precision import Precision
from trt_pipeline.pipeline.evaluation import layers
from trt_pipeline.pipeline.evaluation.layers import compare_layers
from trt_pipeline.pipeline.evaluation.tensors import run_exposing_tensors
from trt_pipeline.pipeline.folder import graph_files, onnx_wire
from trt_pipeline.pipeline.folder.graph_files import data_files, gather_weights, graph_without_weights
from trt_pipeline.pipeline.folder.layout import graph_record

WIDTH, LAYERS = 256, 32  # 256 KiB a weight, 31 of them (7.75 MiB)


def _mlp(path: Path, layers: int = LAYERS) -> Path:
    """`layers` x (MatMul + bias Add + Relu) on [batch, WIDTH], the first two MatMuls sharing one weight."""
    rng = np.random.default_rng(0)
    nodes, weights, x = [], [], "x"
    for layer in range(layers):
        weight = "w0" if layer == 1 else f"w{layer}"
        nodes += [
            helper.make_node("MatMul", [x, weight], [f"m{layer}"], name=f"matmul{layer}"),
            helper.make_node("Add", [f"m{layer}", f"b{layer}"], [f"a{layer}"], name=f"add{layer}"),
            helper.make_node("Relu", [f"a{layer}"], [f"r{layer}"], name=f"relu{layer}"),
        ]
        if layer != 1:
            weights.append(numpy_helper.from_array(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32) / 16, weight))
        weights.append(numpy_helper.from_array(rng.standard_normal(WIDTH).astype(np.float32), f"b{layer}"))
        x = f"r{layer}"
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", WIDTH])],
        weights,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _scales(layers: int = LAYERS) -> dict[str, np.ndarray]:
    """A smoothing scale per MatMul input (x and each Relu's output but the last)."""
    rng = np.random.default_rng(1)
    inputs = ["x", *(f"r{layer}" for layer in range(layers - 1))]
    return {name: rng.uniform(0.25, 4.0, WIDTH).astype(np.float32) for name in inputs}


def _constants(path: Path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t, str(path.parent)) for t in onnx.load(str(path)).graph.initializer}


def _nodes(path: Path) -> list[tuple]:
    return [(n.op_type, n.name, list(n.input), list(n.output)) for n in onnx.load(str(path)).graph.node]


def test_a_graph_smoothed_with_its_weights_on_disk_is_the_graph_smoothed_in_memory(tmp_path, monkeypatch):
    """smooth_graph on the graph read without its weights names the weights to scale as they are written (the shared
    one's copy among them) instead of reading them; written a block at a time (blocks that end inside a row),
    the graph is node for node and constant for constant the one smoothing the whole graph in memory makes."""
    monkeypatch.setattr(onnx_wire, "_BLOCK", 1000)  # 250 elements: a row of a weight is 256
    source = _mlp(tmp_path / "model.onnx")
    scales = _scales()
    _, on_disk = smooth_graph(graph_without_weights(source), scales)
    assert set(on_disk) == {f"w{layer}" for layer in range(LAYERS) if layer != 1} | {"w0_smoothed"}
    in_memory, none_on_disk = smooth_graph(onnx.load(str(source)), scales)
    assert none_on_disk == {}
    onnx.save(in_memory, str(tmp_path / "in_memory.onnx"))
    written = calibrated_graph(source, scales, tmp_path / "calibrated.onnx")
    assert (tmp_path / "calibrated.onnx.data").is_file()  # a scratch graph: its weights in its data file
    assert _nodes(written) == _nodes(tmp_path / "in_memory.onnx")
    expected, actual = _constants(tmp_path / "in_memory.onnx"), _constants(written)
    assert actual.keys() == expected.keys() and len(actual) == 3 * LAYERS  # weights (and the copy), biases, 1/s
    for name, value in expected.items():
        np.testing.assert_array_equal(actual[name], value, err_msg=name)


def test_a_graph_with_nothing_to_change_is_calibrated_from_its_own_file(tmp_path, monkeypatch):
    """A graph with no Constant node and nothing to smooth is calibrated from its own file, with its data file or
    of one file (its weights read where they lie in it), not from a copy."""
    source = _mlp(tmp_path / "model.onnx")  # no Constant node, nothing to smooth
    assert data_files(source) == []
    assert calibrated_graph(source, {}, tmp_path / "scratch" / "calibrated.onnx") == source
    assert not (tmp_path / "scratch").exists()
    monkeypatch.setattr(graph_files, "EXTERNAL_DATA_BYTES", 0)  # the rule for a graph past 2 GB
    gather_weights(source)
    assert calibrated_graph(source, {}, tmp_path / "again.onnx") == source


def _traced_peak(function) -> int:
    """The most bytes Python and numpy held at once while `function` ran (tracemalloc: counted, not timed)."""
    tracemalloc.start()
    try:
        function()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.fixture
def calibrated(tmp_path) -> tuple[Path, Path, dict]:
    """(the graph, its Q/DQ graph, its weights' input means), every constant past a few bytes on disk."""
    source = _mlp(tmp_path / "model.onnx")
    rows = np.random.default_rng(2).standard_normal((32, WIDTH)).astype(np.float32)
    data = CalibrationData([{"x": rows}], samples=32, digest="", description="32 random rows")
    statistics = collect_statistics(source, data, ("max",), means=True)
    quantize_qdq(source, tmp_path / "model.qdq.onnx", statistics.ranges["max"])
    return source, tmp_path / "model.qdq.onnx", statistics.means


def test_smoothing_and_bias_correction_hold_a_weight_at_a_time_not_the_model(calibrated, tmp_path, monkeypatch):
    """Smoothing 7.75 MiB of weights and correcting their biases each hold less than a quarter of them at once (one
    weight: 256 KiB, in float64 and its rounding error), where reading the graph whole holds all of them; the biases
    read from disk (past INLINE_TENSOR_BYTES, as here) are corrected as those held in the graph are."""
    source, qdq, means = calibrated
    weights = (LAYERS - 1) * WIDTH * WIDTH * 4  # the second layer reads the first one's
    smoothing = _traced_peak(lambda: calibrated_graph(source, _scales(), tmp_path / "smoothed.onnx"))
    correcting = _traced_peak(lambda: correct_biases(source, qdq, means, tmp_path / "on_disk.onnx"))
    whole = _traced_peak(lambda: onnx.load(str(source)))
    assert whole > weights  # what the measure sees of a graph read whole: a check that it can fail
    assert smoothing < weights / 4, f"smoothing held {smoothing} bytes of {weights}"
    assert correcting < weights / 4, f"bias correction held {correcting} bytes of {weights}"
    monkeypatch.setattr(graph_files, "INLINE_TENSOR_BYTES", 2**31)  # nothing referenced: every tensor read whole
    assert correct_biases(source, qdq, means, tmp_path / "held.onnx")["ops"] == LAYERS
    on_disk, held, original = (_constants(tmp_path / n) for n in ("on_disk.onnx", "held.onnx", "model.onnx"))
    assert on_disk.keys() == held.keys()
    for name, value in held.items():
        np.testing.assert_array_equal(on_disk[name], value, err_msg=name)
    assert all(not np.array_equal(on_disk[f"b{layer}"], original[f"b{layer}"]) for layer in range(LAYERS))


def test_a_graph_with_corrected_biases_written_beside_its_source_references_the_weights_there(calibrated, tmp_path):
    """A scratch graph that changes only the biases, written in the folder of the graph it changes, writes none of the
    weights it keeps: it reads them from that graph's files (the INT8 stage writes its candidates' corrected Q/DQ
    graphs so, where a copy each took a quarter of the FP32 weights' bytes).  Written elsewhere, it carries a copy.
    Both hold the same constants."""
    source, qdq, means = calibrated
    beside, corrected_qdq = tmp_path / "model.corrected.onnx", tmp_path / "model.qdq.corrected.onnx"
    correct_biases(source, qdq, means, beside, quantized_out=corrected_qdq)
    assert data_files(beside) == [source] and data_files(corrected_qdq) == [qdq]
    assert beside.stat().st_size + corrected_qdq.stat().st_size < source.stat().st_size / 16  # the graphs alone
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    correct_biases(source, qdq, means, elsewhere / "model.corrected.onnx")
    assert data_files(elsewhere / "model.corrected.onnx") == [elsewhere / "model.corrected.onnx.data"]
    copied, referenced = _constants(elsewhere / "model.corrected.onnx"), _constants(beside)
    assert copied.keys() == referenced.keys()
    for name, value in copied.items():
        np.testing.assert_array_equal(referenced[name], value, err_msg=name)


def test_comparing_layers_holds_the_tensors_both_graphs_compute_not_the_int8_graphs_weights(calibrated, monkeypatch):
    """The float search's node-by-node comparison (compare_layers, also `diagnose`'s) holds only the tensors it
    compares: the Q/DQ graph's own, its DequantizeLinear outputs, are its weights in float (a 1.1B LM's comparison
    held 13.6 GB with them, 6.4 without).  Its errors are those of the same tensors with every tensor exposed."""
    source, qdq, _ = calibrated
    weights = (LAYERS - 1) * WIDTH * WIDTH * 4
    inputs = {"x": np.random.default_rng(3).standard_normal((4, WIDTH)).astype(np.float32)}
    held: list[int] = []  # the bytes of each graph's run (ONNX Runtime's arrays, which tracemalloc does not see)

    def measured(*arguments, **options):
        values = run_exposing_tensors(*arguments, **options)
        held.append(sum(value.nbytes for value in values.values()))
        return values

    monkeypatch.setattr(layers, "run_exposing_tensors", measured)
    errors = compare_layers(source, qdq, inputs, graph_record(Precision.INT8))
    assert len(held) == 2 and sum(held) < weights / 4, f"the two runs held {held} bytes, the weights are {weights}"
    everything = run_exposing_tensors(graph_without_weights(qdq), inputs, simulate_qdq=True, weights=qdq.parent)
    assert sum(value.nbytes for value in everything.values()) > weights  # exposing every tensor holds them
    reference = run_exposing_tensors(graph_without_weights(source), inputs, weights=source.parent)
    assert [error.tensor for error in errors] == [f"{kind}{layer}" for layer in range(LAYERS) for kind in "mar"]
    for error in errors:
        expected = np.abs(everything[error.tensor].astype(np.float64) - reference[error.tensor]).max()
        assert error.max_abs == expected, error.tensor
