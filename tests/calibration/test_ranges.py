"""INT8 calibration runs each graph over the fit rows twice at most, whatever the candidates (calibration/ranges.py):
the ranges of every method from one pass, ONNX Runtime's calibrators' own bit for bit, for max, percentile and
entropy, on a graph unsmoothed and smoothed; the stage takes two passes per graph for all its candidates and none on
a cache hit; and a candidate's bias-corrected Q/DQ graph, written without quantizing its weights again, is the one
the quantizer makes of the corrected graph, and opens at the level its original was probed at.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.helpers.digits_int8 import SAMPLES
from trt_pipeline.calibration.bias import ChannelMeans, correct_biases
from trt_pipeline.calibration.holdout import read_calibration
from trt_pipeline.calibration.int8 import calibrated_graph, make_int8_graph
from trt_pipeline.calibration.int8_records import CalibrationConfig
from trt_pipeline.calibration.qdq import quantize_qdq
from trt_pipeline.calibration.ranges import (
    HISTOGRAM_BINS,
    QUANTIZED_OPS,
    AbsoluteHistograms,
    Alike,
    ChangedPart,
    KeptValues,
    MethodRanges,
    _histogram_collector,
    collect_statistics,
    method_options,
)
from trt_pipeline.calibration.readers import CalibrationData, graph_inputs, read_calibration_data
from trt_pipeline.calibration.smooth import (
    ChannelMaxima,
    smoothable,
    smoothed_tensors,
    smoothing_boundary,
    smoothing_scales,
)
from trt_pipeline.models.digits import PREPROCESS
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.sessions import OPTIMIZATION_LEVELS, onnxruntime_session, opens_like, probed_level
from trt_pipeline.pipeline.evaluation.agreement import Fp32Reference, int8_judge
from trt_pipeline.pipeline.folder.graph_files import graph_without_weights

ROWS, BATCH = 40, 16
METHODS = ("max", "percentile", "entropy")


def _graph(path: Path) -> Path:
    """x -> Conv -> Relu -> Conv (sharing the first one's bias) -> Relu -> Conv (no bias) -> GlobalAveragePool ->
    Flatten -> Mul (two channels 30x and 20x the rest: something to smooth) -> MatMul + Add -> Relu -> Gemm (transB):
    every kind of op the ranges, the smoothing and the bias correction treat."""
    rng = np.random.default_rng(0)

    def constant(name: str, *shape: int, scale: float = 0.3) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    gain = numpy_helper.from_array(np.array([30, 1, 1, 20, 1, 1, 1, 1], np.float32), "gain")
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b1"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Conv", ["r2", "w3"], ["c3"], name="conv3"),
        helper.make_node("GlobalAveragePool", ["c3"], ["pooled"], name="pool"),
        helper.make_node("Flatten", ["pooled"], ["flat"], name="flatten"),
        helper.make_node("Mul", ["flat", "gain"], ["loud"], name="loud"),
        helper.make_node("MatMul", ["loud", "w4"], ["mm"], name="matmul"),
        helper.make_node("Add", ["mm", "b4"], ["biased"], name="bias_add"),
        helper.make_node("Relu", ["biased"], ["hidden"], name="relu3"),
        helper.make_node("Gemm", ["hidden", "w5", "b5"], ["y"], transB=1, name="gemm"),
    ]
    weights = [
        constant("w1", 8, 4, 3, 3),
        constant("b1", 8),
        constant("w2", 8, 8, 3, 3, scale=0.15),
        constant("w3", 8, 8, 1, 1),
        gain,
        constant("w4", 8, 16),
        constant("b4", 16),
        constant("w5", 4, 16),
        constant("b5", 4),
    ]
    graph = helper.make_graph(
        nodes,
        "collection",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        weights,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


@pytest.fixture
def model(tmp_path) -> tuple[Path, Path]:
    """(the graph, its calibration rows as .npz): later rows larger, so the histograms grow bins as batches come."""
    rows = np.random.default_rng(1).standard_normal((ROWS, 4, 6, 6)) * np.linspace(0.5, 2.0, ROWS)[:, None, None, None]
    np.savez(tmp_path / "rows.npz", x=rows.astype(np.float32))
    return _graph(tmp_path / "model.onnx"), tmp_path / "rows.npz"


def _data(graph: Path, rows: Path) -> CalibrationData:
    return read_calibration_data(rows, graph_inputs(graph), None, samples=ROWS, batch=BATCH)  # 16, 16 and 8 rows


class _OneBatch:
    """ONNX Runtime's CalibrationDataReader protocol over one batch."""

    def __init__(self, feed: dict) -> None:
        self.feed: dict | None = feed

    def get_next(self) -> dict | None:
        feed, self.feed = self.feed, None
        return feed


def _calibrator_ranges(graph: Path, data: CalibrationData, method: str, scratch: Path):
    """ONNX Runtime's own calibrator for `method`, run as the stage ran it before its pass was shared: symmetric,
    our options, one batch per collect_data."""
    from onnxruntime.quantization import CalibrationMethod
    from onnxruntime.quantization.calibrate import create_calibrator

    kind = {"max": CalibrationMethod.MinMax, "percentile": CalibrationMethod.Percentile}.get(
        method, CalibrationMethod.Entropy
    )
    options = {key: value for key, value in method_options(method).items() if key not in ("method", "op_types")}
    calibrator = create_calibrator(
        graph,
        list(QUANTIZED_OPS),
        augmented_model_path=str(scratch / f"augmented-{method}.onnx"),
        calibrate_method=kind,
        providers=["CPUExecutionProvider"],
        extra_options={"symmetric": True, **options},
    )
    with contextlib.redirect_stdout(io.StringIO()):
        for feed in data.batches:
            calibrator.collect_data(_OneBatch(feed))
        return calibrator.compute_data()


def _as_cached(ranges) -> str:
    """The ranges as the calibration cache stores them (every value, shape and dtype)."""
    from onnxruntime.quantization.calibrate import CalibrationCacheEncoder

    return json.dumps(ranges.to_dict(), cls=CalibrationCacheEncoder, sort_keys=True)


@pytest.mark.parametrize("run_bytes", [None, 1], ids=["batches-whole", "a-row-a-run"])
def test_the_maxima_pass_gives_the_fp32_references_outputs_on_every_batch(model, monkeypatch, run_bytes):
    """The maxima pass runs the graph at the level it runs at elsewhere: its outputs there, put back together batch
    by batch (from runs of one row each too), are the FP32 reference's bit for bit, for the agreement gate to
    compare with rather than run the rows again; past KEPT_BYTES none are kept (the gate runs them)."""
    from trt_pipeline.calibration import ranges
    from trt_pipeline.pipeline.evaluation import tensors

    graph, rows = model
    data, groups = _data(graph, rows), list(smoothable(onnx.load(str(graph))))
    if run_bytes is not None:
        monkeypatch.setattr(tensors, "RUN_BYTES", run_bytes)
    outputs = collect_statistics(graph, data, (), maxima_of=groups).outputs
    expected = Fp32Reference(graph).outputs(data.batches)
    assert outputs is not None and len(outputs) == len(expected) == 3
    for batch, (got, wanted) in enumerate(zip(outputs, expected, strict=True)):
        assert list(got) == list(wanted) and all(np.array_equal(got[n], wanted[n]) for n in wanted), batch
    monkeypatch.setattr(ranges, "KEPT_BYTES", 0)
    assert collect_statistics(graph, data, (), maxima_of=groups).outputs is None


@pytest.mark.parametrize("smoothed", [False, True], ids=["unsmoothed", "smoothed"])
def test_one_pass_gives_every_method_the_calibrators_own_ranges(model, tmp_path, smoothed):
    """The smoothed graph as the stage measures it: the tensors before the smoothed ops' outputs are the unsmoothed
    graph's, their ranges taken from its pass; the rest measured."""
    graph, rows = model
    data = _data(graph, rows)
    alike = None
    if smoothed:
        unsmoothed = onnx.load(str(graph))
        groups = smoothable(unsmoothed)
        first = collect_statistics(graph, data, METHODS, maxima_of=list(groups))
        scales = smoothing_scales(unsmoothed, groups, first.maxima, 0.5)
        assert set(scales) == {"loud", "hidden"} and scales["loud"].max() / scales["loud"].min() > 3
        alike = Alike(first.ranges, smoothed_tensors(unsmoothed, scales) or set())
        assert alike.changed == {"mm", "biased", "hidden", "y"}
        graph = calibrated_graph(graph, scales, tmp_path / "smoothed.onnx")
    collected = collect_statistics(graph, data, METHODS, alike=alike)
    assert collected.passes == 1 and len(data.batches) == 3  # one pass for the three methods
    for method in METHODS:
        expected = _calibrator_ranges(graph, data, method, tmp_path)
        assert len(expected.keys()) >= 8
        assert _as_cached(collected.ranges[method]) == _as_cached(expected), method
    peaks = {method: collected.ranges[method]["c2"].range_value[1] for method in METHODS}
    assert peaks["percentile"] < peaks["max"]  # the methods do differ on these rows: a comparison that can fail
    if alike is not None:  # six of the smoothed graph's ten calibrated tensors were not measured again
        assert set(alike.reused("max", list(collected.ranges["max"].keys()))) == {"x", "c1", "r1", "c2", "r2", "c3"}


def test_a_smoothed_graph_runs_only_what_smoothing_changes_from_the_values_the_unsmoothed_passes_kept(model, tmp_path):
    """The unsmoothed graph's pass keeps the smoothed part's boundary (the first smoothed activation, "loud"); the
    smoothed graph's pass then runs that part alone (6 of its 13 nodes, the Convs not at all), fed those values,
    and takes the unchanged weight inputs' means from the unsmoothed pass: every range and mean the same, bit for
    bit, as when the whole smoothed graph runs."""
    graph, rows = model
    data = _data(graph, rows)
    unsmoothed = onnx.load(str(graph))
    groups = smoothable(unsmoothed)
    keep = smoothing_boundary(unsmoothed, groups)
    assert keep == ["loud"]  # "hidden" is smoothed too, but computed from the first smoothed MatMul
    first = collect_statistics(graph, data, METHODS, maxima_of=list(groups), means=True, keep=keep)
    assert first.shared is not None and first.shared.kept == {"loud"}
    scales = smoothing_scales(unsmoothed, groups, first.maxima, 0.5)
    smoothed = calibrated_graph(graph, scales, tmp_path / "smoothed.onnx")
    changed = smoothed_tensors(unsmoothed, scales) or set()
    alike = Alike(first.ranges, changed, first.shared)
    part = ChangedPart.of(graph_without_weights(smoothed), alike)
    assert part is not None and part.boundary == ["loud"]
    assert [node.op_type for node in part.model.graph.node] == ["Mul", "MatMul", "Add", "Relu", "Mul", "Gemm"]
    whole = collect_statistics(smoothed, data, METHODS, means=True, alike=Alike(first.ranges, changed))
    from_part = collect_statistics(smoothed, data, METHODS, means=True, alike=alike)
    assert from_part.passes == whole.passes == 1  # the ranges and the means in one pass
    for method in METHODS:
        assert _as_cached(from_part.ranges[method]) == _as_cached(whole.ranges[method]), method
    assert list(from_part.means) == list(whole.means) == ["x", "r1", "r2", "loud_smoothed", "hidden_smoothed"]
    for name, mean in whole.means.items():
        np.testing.assert_array_equal(from_part.means[name], mean, err_msg=name)


def test_the_percentile_histograms_are_onnx_runtimes_collectors_bin_for_bin():
    """AbsoluteHistograms against HistogramCollector.collect_absolute_value on batches that grow past the first
    one's bins, a tensor of one value (numpy's [-0.5, 0.5] edges), float16 and a batch of nothing but outliers."""
    rng = np.random.default_rng(3)
    batches = [
        {
            "wide": (rng.standard_normal((rows, 64, 9)) * scale).astype(np.float32),
            "constant": np.full((rows, 5), 0.25, np.float32),
            "half": (rng.standard_normal((rows, 33)) * scale).astype(np.float16),
        }
        for rows, scale in ((16, 1.0), (16, 3.5), (8, 0.2), (4, 40.0))
    ]
    ours, theirs = AbsoluteHistograms(HISTOGRAM_BINS), _histogram_collector("percentile")
    for batch in batches:
        ours.collect(batch)
        with contextlib.redirect_stdout(io.StringIO()):
            theirs.collect(batch)
    expected = theirs.get_histogram_dict()
    assert set(ours.histograms) == set(expected)
    for name, (counts, edges, low, high) in expected.items():
        got = ours.histograms[name]
        np.testing.assert_array_equal(got[0], counts, err_msg=name)
        assert got[1].dtype == edges.dtype and np.array_equal(got[1], edges), name
        assert (got[2], got[3]) == (low, high), name
    assert len(expected["wide"][1]) > HISTOGRAM_BINS + 1  # the later batches did add bins


def test_the_stage_runs_each_graph_once_over_the_fit_rows_and_not_at_all_on_a_cache_hit(model, tmp_path):
    """Percentile and max, smoothed and not: four candidates from three passes, one per graph for both methods'
    ranges and its means, and one more on the unsmoothed graph for the maxima the smoothing scales come from (at
    the level it runs at); the same four from the cache with no pass, the same graph again; without smoothing, one
    pass for both methods."""
    graph, rows = model
    calibration = read_calibration(rows, graph, None, samples=ROWS, batch=BATCH)

    def build(alphas: tuple[float | None, ...], out: Path) -> dict:
        config = CalibrationConfig(("percentile", "max"), smooth_alphas=alphas)
        int8, judge = out / "model.int8.onnx", int8_judge(Fp32Reference(graph))
        record = make_int8_graph(graph, int8, calibration, config=config, cache_folder=out, judge=judge)
        return record.calibration

    first = build((0.5, None), tmp_path / "both")
    assert len(first["search"]["candidates"]) == 4
    assert (first["cache"], first["collect_passes"]) == ("miss", 3)
    written = (tmp_path / "both" / "model.int8.onnx").read_bytes()
    again = build((0.5, None), tmp_path / "both")
    assert (again["cache"], again["collect_passes"], again["collect_seconds"]) == ("hit", 0, 0)
    assert (tmp_path / "both" / "model.int8.onnx").read_bytes() == written  # the cached ranges, scales and means
    assert again["search"] == first["search"]
    unsmoothed = build((None,), tmp_path / "unsmoothed")
    assert len(unsmoothed["search"]["candidates"]) == 2 and unsmoothed["collect_passes"] == 1


def test_a_corrected_qdq_graph_is_the_one_the_quantizer_makes_of_the_corrected_graph(model, tmp_path):
    """correct_biases with quantized_out: the Q/DQ graph with the corrected biases, node for node and constant for
    constant what quantize_qdq makes of the corrected FP32 graph: a bias shared by two Convs (the quantizer gave each
    a copy), a Conv with none, a MatMul's bias Add and a Gemm's bias."""
    graph, rows = model
    data = _data(graph, rows)
    collected = collect_statistics(graph, data, ("max",), means=True)
    quantize_qdq(graph, tmp_path / "qdq.onnx", collected.ranges["max"])
    correction = correct_biases(
        graph,
        tmp_path / "qdq.onnx",
        collected.means,
        tmp_path / "corrected.onnx",
        quantized_out=tmp_path / "corrected.qdq.onnx",
    )
    assert correction["ops"] == 5 and correction["largest"] > 0
    quantize_qdq(tmp_path / "corrected.onnx", tmp_path / "requantized.onnx", collected.ranges["max"])
    patched = onnx.load(str(tmp_path / "corrected.qdq.onnx")).graph
    requantized = onnx.load(str(tmp_path / "requantized.onnx")).graph
    assert [_node(node) for node in patched.node] == [_node(node) for node in requantized.node]
    constants = {init.name: numpy_helper.to_array(init) for init in requantized.initializer}
    assert {init.name for init in patched.initializer} == set(constants)
    for init in patched.initializer:
        value = numpy_helper.to_array(init)
        assert value.dtype == constants[init.name].dtype and np.array_equal(value, constants[init.name]), init.name


def _node(node: onnx.NodeProto) -> tuple:
    return node.op_type, node.name, list(node.input), list(node.output), [a.SerializeToString() for a in node.attribute]


def test_a_graph_that_differs_in_constants_alone_takes_the_level_its_original_was_probed_at(model, tmp_path):
    """The judge probes each candidate's Q/DQ graph; the same graph with corrected biases takes its level (opens_like)
    instead of a probe of its own, and a file never probed has none."""
    graph, _ = model
    corrected = tmp_path / "corrected.onnx"
    corrected.write_bytes(graph.read_bytes())
    assert probed_level(graph) is None and probed_level(corrected) is None
    onnxruntime_session(graph)  # probed in a child, as any graph file is
    assert probed_level(graph) == OPTIMIZATION_LEVELS[0] and probed_level(corrected) is None
    opens_like(corrected, graph)
    assert probed_level(corrected) == OPTIMIZATION_LEVELS[0]


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


def test_calibration_data_onnx_runtime_cannot_run_is_a_clear_error(tmp_path):
    """Ids that reach their lookup through a Cast (the reader's id check cannot see it) and lie outside the table:
    ONNX Runtime refuses the calibration batch; the error names its rows and the fix, not ORT's traceback."""
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
    with pytest.raises(PipelineError, match="could not run model.onnx on calibration rows 0-3 ") as caught:
        collect_statistics(fp32, data, ("max",))
    assert "within the range the model looks them up in" in str(caught.value.fix)


@pytest.mark.parametrize(
    "exported", ["tests.helpers.toy_models:tiny_cnn", "tests.helpers.toy_models:transformer_encoder"]
)
def test_the_calibrated_tensors_are_the_calibrators_own_found_without_the_weights(model, exported, tmp_path):
    """calibrated_tensors selects what ORT's calibrators select (CalibraterBase, which loads the graph with its weights
    and infers its shapes), from the graph's structure alone: its data file emptied, the selection is the same."""
    from onnxruntime.quantization.calibrate import CalibraterBase

    from trt_pipeline.calibration.ranges import calibrated_tensors
    from trt_pipeline.pipeline.core.settings import Settings
    from trt_pipeline.pipeline.stages.sequence import make_engine

    folder = make_engine(Settings(model=exported, precision="fp32", out_root=tmp_path / "engines"))
    apart = tmp_path / "apart.onnx"  # the exported graph with its weights in a data file
    onnx.save_model(onnx.load(str(folder / "model.onnx")), str(apart), save_as_external_data=True, location="w.data")
    for graph in (model[0], calibrated_graph(folder / "model.onnx", {}, tmp_path / "calibrated.onnx"), apart):
        calibrater = CalibraterBase(graph, list(QUANTIZED_OPS))
        expected = sorted(calibrater.select_tensors_to_calibrate(calibrater.model)[0])
        assert expected and calibrated_tensors(graph_without_weights(graph)) == expected, graph
    (tmp_path / "w.data").write_bytes(b"")  # no weight read: none there to read
    assert calibrated_tensors(graph_without_weights(apart)) == expected


def test_every_statistic_of_a_pass_takes_a_batch_in_parts_as_it_takes_it_whole():
    """A pass gives each batch's tensors part by part where the graph runs in parts (tensor_values_in_parts): every
    statistic (each method's ranges, the means, the maxima, the values kept for another graph) gives the same from
    the batches in two parts as from the batches whole."""
    rng = np.random.default_rng(5)
    batches = [
        {name: (rng.standard_normal((rows, 6, 4)) * scale).astype(np.float32) for name in ("a", "b", "c")}
        for rows, scale in ((8, 1.0), (4, 3.0), (8, 0.5))
    ]
    names = ["a", "b", "c"]

    def statistics():
        return [
            *(MethodRanges(method, names) for method in METHODS),
            ChannelMeans({name: 1 for name in names}),
            ChannelMaxima(names),
            KeptValues(["a", "c"], names),
        ]

    whole, in_parts = statistics(), statistics()
    for batch in batches:
        rows = len(batch["a"])
        for statistic in whole:
            statistic.add(batch, rows)
        for part in ({"a": batch["a"]}, {"b": batch["b"], "c": batch["c"]}):
            for statistic in in_parts:
                statistic.add(part, rows)
    for left, right in zip(whole[: len(METHODS)], in_parts[: len(METHODS)], strict=True):
        assert _as_cached(left.ranges()) == _as_cached(right.ranges()), left.method
    (means, maxima, kept), (part_means, part_maxima, part_kept) = whole[len(METHODS) :], in_parts[len(METHODS) :]
    for name in names:
        np.testing.assert_array_equal(part_means.means()[name], means.means()[name])
        np.testing.assert_array_equal(part_maxima.maxima[name], maxima.maxima[name])
    assert kept.batches is not None and part_kept.batches is not None and len(part_kept.batches) == len(batches)
    for left, right in zip(kept.batches, part_kept.batches, strict=True):
        assert list(left) == list(right) == ["a", "c"]
        assert all(np.array_equal(left[name], right[name]) for name in left)
