"""Bias correction (calibration/bias.py): a weight's int8 rounding shifts its op's output by (W_q - W) · E[x];
the INT8 stage subtracts that from the float bias where it lowers the held-out error, in the engine's graph and
in the CPU graphs (each for its own rounding)."""

from __future__ import annotations

import errno
import resource
import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from trt_pipeline.calibration import float_search, int8, qdq, qdq_cpu
from trt_pipeline.calibration.bias import BiasShifts, DequantizedWeights, correct_biases
from trt_pipeline.calibration.holdout import read_calibration
from trt_pipeline.calibration.int8 import _cpu_graph, make_int8_graph
from trt_pipeline.calibration.int8_records import CalibrationConfig
from trt_pipeline.calibration.qdq import quantize_qdq
from trt_pipeline.calibration.qdq_cpu import Uint8Rounding, int8_kernel_counts, quantize_for_cpu
from trt_pipeline.pipeline.core.cpu import VNNI
from trt_pipeline.pipeline.core.precision import Precision
from trt_pipeline.pipeline.core.sessions import onnxruntime_session
from trt_pipeline.pipeline.evaluation import layers
from trt_pipeline.pipeline.evaluation.agreement import Fp32Reference, int8_judge
from trt_pipeline.pipeline.folder.layout import CPU_TARGETS, graph_record

from ..helpers.int8_graphs import weight_kinds_graph

CHANNELS = 4


def _depthwise_graph(path) -> None:
    """x -> depthwise 3x3 Conv whose kernels round badly: one tap of 8 sets the scale (8/127), and eight taps of
    0.03 (under half a step) all round to 0, so each output channel loses 8 x 0.03 x E[x] on average."""
    kernel = np.full((CHANNELS, 1, 3, 3), 0.03, np.float32)
    kernel[:, 0, 1, 1] = 8.0
    kernel[:, 0, 0, 0] = -7.9  # a high-pass kernel: what it leaves is small beside the rounding
    conv = helper.make_node("Conv", ["x", "w", "b"], ["y"], group=CHANNELS, pads=[1, 1, 1, 1], name="dw")
    graph = helper.make_graph(
        [conv],
        "toy",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", CHANNELS, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", CHANNELS, 8, 8])],
        [numpy_helper.from_array(kernel, "w"), numpy_helper.from_array(np.zeros(CHANNELS, np.float32), "b")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def _rows(seed: int, count: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, 6, (count, CHANNELS, 8, 8)).astype(np.float32)  # E[x] = 3


def _depthwise_case(folder) -> tuple:
    """(The depthwise graph written in `folder`, make_int8_graph's arguments for it: _rows(0, 64), max ranges)."""
    fp32 = folder / "model.onnx"
    _depthwise_graph(fp32)
    np.save(folder / "calibration.npy", _rows(0, 64))
    calibration = read_calibration(folder / "calibration.npy", fp32, None, samples=64, batch=16)
    return fp32, {"calibration": calibration, "config": CalibrationConfig(("max",)),
                  "cache_folder": folder / "calibration"}  # fmt: skip


def test_bias_correction_removes_the_shift_weight_rounding_adds_and_is_kept_by_held_out_error(tmp_path):
    fp32, arguments = _depthwise_case(tmp_path)
    cpu = {"vnni": tmp_path / "model.int8.cpu.onnx", "no-vnni": tmp_path / "model.int8.cpu-novnni.onnx"}
    record = make_int8_graph(
        fp32, tmp_path / "model.int8.onnx", **arguments, cpu_out_paths=cpu, judge=int8_judge(Fp32Reference(fp32))
    )
    correction = record.calibration["bias_correction"]
    assert correction["ops"] == 1 and correction["kept"], correction
    errors = correction["held_out_error_mean"]
    assert errors["corrected"] < errors["before"] / 2, errors

    unseen = {"x": _rows(1, 32)}  # rows neither the fit nor the pick saw
    expected = onnxruntime_session(fp32).run(None, unseen)[0]
    engine = onnxruntime_session(tmp_path / "model.int8.onnx", simulate_qdq=True).run(None, unseen)[0]
    lost = 8 * 0.03 * 3  # the uncorrected mean shift per output
    assert abs(float((engine - expected)[:, :, 1:-1, 1:-1].mean())) < lost / 10
    for graph in cpu.values():  # ONNX Runtime's int8 kernels, each graph corrected for its own weights' rounding
        served = onnxruntime_session(graph).run(None, unseen)[0]
        assert abs(float((served - expected)[:, :, 1:-1, 1:-1].mean())) < lost / 10, graph.name


def test_judging_writes_the_fp32_graph_corrected_for_the_kept_candidate_alone(tmp_path):
    """Each candidate is judged by its Q/DQ graph with corrected biases; the FP32 graph with the same biases (the CPU
    graphs' source) is written once, for the candidate kept, not a copy of the weights per candidate, and it is
    the graph corrected from that candidate's own Q/DQ graph.  A graph whose bias is a Constant node is calibrated
    from the FP32 file itself (read with its Constant nodes as initializers), not from a copy of it: the corrected
    graph lies beside it, its bias corrected all the same.  The other candidates' graphs are removed once the pick
    is made."""
    (fp32, arguments), scratch = _depthwise_case(tmp_path), tmp_path / "scratch"
    _bias_as_constant_node(fp32)
    scratch.mkdir()
    config = CalibrationConfig(("max", "percentile"))
    parts, judge = arguments["calibration"], int8_judge(Fp32Reference(fp32))
    fits = int8.fit_candidates(fp32, parts, config, arguments["cache_folder"], scratch, judged=True)
    candidates = int8.build_candidates(fits, parts.fit, config, scratch)
    search = int8.judge_candidates(candidates, parts, judge, scratch)
    assert [candidate.bias_correction["kept"] for candidate in search.tried] == [True, True]
    chosen = search.chosen
    assert chosen.uncorrected == fp32 and not list(scratch.rglob("*calibrated*"))  # no copy of the FP32 graph
    corrected = sorted(tmp_path.rglob("*model.calibrated.corrected.onnx*"))
    assert corrected == [chosen.calibrated] and chosen.calibrated.parent == tmp_path  # no data file either
    assert [folder for folder in scratch.iterdir() if folder.name.isdigit()] == [chosen.qdq.parent]  # others removed

    expected = tmp_path / "expected.onnx"
    own_qdq = chosen.qdq.with_name("model.qdq.onnx")  # the candidate's Q/DQ graph before correction
    correct_biases(chosen.uncorrected, own_qdq, chosen.means, expected)
    written, wanted = onnx.load(str(chosen.calibrated)), onnx.load(str(expected))
    assert {t.name: numpy_helper.to_array(t).tolist() for t in written.graph.initializer} == {
        t.name: numpy_helper.to_array(t).tolist() for t in wanted.graph.initializer
    }
    assert [node.input for node in written.graph.node] == [node.input for node in wanted.graph.node]
    bias = numpy_helper.to_array(next(t for t in written.graph.initializer if t.name == "b"))
    assert np.abs(bias).min() > 0  # the Constant node's bias (zeros) corrected


def _bias_as_constant_node(path: Path) -> None:
    """The graph at `path` with its bias `b` made by a Constant node."""
    model = onnx.load(str(path))
    bias = next(init for init in model.graph.initializer if init.name == "b")
    model.graph.initializer.remove(bias)
    model.graph.node.insert(0, helper.make_node("Constant", [], ["b"], value=bias))
    onnx.save(model, str(path))


def test_judging_holds_two_candidates_graphs_at_a_time(tmp_path):
    """Each candidate's Q/DQ graph is made as judging asks for it, and a losing one's removed before the next is
    made: the scratch holds two at most (it held all of them, a quarter of the weights each, at the 2.4 GB MLP's
    disk peak)."""
    (fp32, arguments), scratch = _depthwise_case(tmp_path), tmp_path / "scratch"
    scratch.mkdir()
    arguments["config"] = CalibrationConfig(("max", "percentile", "entropy"))
    judge, held = int8_judge(Fp32Reference(fp32)), []

    def counting_judge(graph, rows):
        held.append(sum(folder.name.isdigit() for folder in scratch.iterdir()))  # the candidates' folders
        return judge(graph, rows)

    result = make_int8_graph(fp32, tmp_path / "model.int8.onnx", **arguments, judge=counting_judge, scratch=scratch)
    assert len(result.calibration["search"]["candidates"]) == 3 and max(held) == 2, held


def test_the_candidates_graphs_are_written_beside_the_int8_graph_and_removed_after(tmp_path):
    """The INT8 stage's scratch graphs (copies of the weights, several) go in a temporary folder beside the graphs it
    writes, on the disk the user gave them, not in the system's /tmp (memory, on some systems), and are gone after."""
    (fp32, arguments), out = _depthwise_case(tmp_path), tmp_path / "folder" / "model.int8.onnx"
    judge, judged = int8_judge(Fp32Reference(fp32)), []

    def recording_judge(graph, rows):
        judged.append(graph)
        return judge(graph, rows)

    make_int8_graph(fp32, out, **arguments, judge=recording_judge)
    assert judged and all(graph.is_relative_to(out.parent) for graph in judged), judged
    assert sorted(path.name for path in out.parent.iterdir()) == ["model.int8.onnx"]


def test_the_int8_stage_writes_nothing_in_the_systems_temporary_folder(tmp_path, monkeypatch):
    """Nothing of the stage goes through the system's temporary folder (here one that does not exist): ONNX Runtime
    wrote the optimized graph it counts a CPU graph's int8 kernels from there, with a copy of the weights, and a
    /tmp too small for them left a 0.6 GB MLP's folder without its CPU graphs (their record said why, the build
    went on, and a CPU served the slower Q/DQ graph)."""
    (fp32, arguments), out = _depthwise_case(tmp_path), tmp_path / "folder" / "model.int8.onnx"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-folder"))
    cpu = {kind: out.with_name(graph_record(Precision.INT8, target).file) for kind, target in CPU_TARGETS.items()}
    result = make_int8_graph(fp32, out, **arguments, cpu_out_paths=cpu, judge=int8_judge(Fp32Reference(fp32)))
    assert {kind: graph.failed for kind, graph in result.cpu.items()} == dict.fromkeys(CPU_TARGETS)
    assert sorted(path.name for path in out.parent.iterdir()) == sorted([out.name, *result.written_cpu_graphs.values()])


WIDE = 256


def test_a_float_search_try_that_loses_is_removed_as_it_loses(tmp_path, monkeypatch):
    """A try of the float search that is not kept is never read again: its Q/DQ graph goes at once (the 1.1B LM's,
    1.3 GB, stayed in the scratch through the CPU graphs, at the stage's disk peak).  The search is made to try the
    depthwise conv (the only one, so the try, with no INT8 left, loses)."""
    monkeypatch.setattr(float_search, "FLOAT_SEARCH_FROM", 0.0)
    monkeypatch.setattr(layers, "node_tolerance", lambda precision: 0.0)
    (fp32, arguments), scratch = _depthwise_case(tmp_path), tmp_path / "scratch"
    scratch.mkdir()
    arguments["config"] = CalibrationConfig(("max",), float_search=True)
    result = make_int8_graph(
        fp32, tmp_path / "model.int8.onnx", **arguments, judge=int8_judge(Fp32Reference(fp32)), scratch=scratch
    )
    assert [tried["kept_in_float"] for tried in result.calibration["float_search"]["tried"]] == [False]
    assert list((scratch / "float").iterdir()) == []


def test_the_kept_q_dq_graph_is_not_held_twice_while_the_cpu_graphs_are_made(tmp_path, monkeypatch):
    """Once written to the folder, the kept candidate's Q/DQ graph in the stage's own scratch goes: the CPU graphs
    are made from its FP32 graph, and the 1.1B LM's 1.3 GB graph was on disk twice while they were."""
    (fp32, arguments), out = _depthwise_case(tmp_path), tmp_path / "folder" / "model.int8.onnx"
    cpu_graph, seen = int8._cpu_graph, []

    def watched(chosen, path, *rest):
        seen.append((out.is_file(), chosen.qdq.exists()))
        return cpu_graph(chosen, path, *rest)

    monkeypatch.setattr(int8, "_cpu_graph", watched)
    cpu = {kind: out.with_name(graph_record(Precision.INT8, target).file) for kind, target in CPU_TARGETS.items()}
    make_int8_graph(fp32, out, **arguments, cpu_out_paths=cpu, judge=int8_judge(Fp32Reference(fp32)))
    assert seen == [(True, False)] * len(CPU_TARGETS)


def test_candidates_of_one_calibrated_graph_share_one_crash_probe_and_the_float_search_none(tmp_path, monkeypatch):
    """Max and percentile ranges on one graph (nothing to smooth) make two Q/DQ graphs with the same ops: the first
    one's crash probe holds for the second, and the float search's node-by-node sessions open at the levels its
    graphs were found to open at.  The search must still find where the error starts: every node is made past a zero
    tolerance."""
    from trt_pipeline.pipeline.core import sessions

    monkeypatch.setattr(float_search, "FLOAT_SEARCH_FROM", 0.0)
    monkeypatch.setattr(layers, "node_tolerance", lambda precision: 0.0)
    probed, probe = [], sessions.crash_in_child

    def counted(function, open_at, level, feed):
        probed.append(level)
        return probe(function, open_at, level, feed)

    monkeypatch.setattr(sessions, "crash_in_child", counted)
    fp32, arguments = _depthwise_case(tmp_path)
    arguments["config"] = CalibrationConfig(("max", "percentile"), float_search=True)
    result = make_int8_graph(fp32, tmp_path / "model.int8.onnx", **arguments, judge=int8_judge(Fp32Reference(fp32)))
    assert len(result.calibration["search"]["candidates"]) == 2
    assert [tried["op"] for tried in result.calibration["float_search"]["tried"]] == ["dw"]
    # The FP32 graph (calibrated as it is, and the judge's reference: one file, one probe), the first Q/DQ graph, the
    # float search's try (a float op: other ops); not the second Q/DQ graph, nor the copies of the graphs the float
    # search compares.
    assert len(probed) == 3


def test_the_gate_opens_the_kept_graph_with_no_probe_the_judge_ran_those_bytes(tmp_path, monkeypatch):
    """model.int8.onnx is the kept candidate's Q/DQ graph, copied: the judge opened it at the level its probe found and
    ran it on the held-out rows in this process, so the agreement gate opens and runs the copy with no crash probe
    of its own (a child opening ViT-L/16's graph: 5 s)."""
    from trt_pipeline.pipeline.core import sessions
    from trt_pipeline.pipeline.stages.parity import check_int8_agreement

    fp32, arguments = _depthwise_case(tmp_path)
    reference = Fp32Reference(fp32)
    out = tmp_path / "model.int8.onnx"
    make_int8_graph(fp32, out, **arguments, judge=int8_judge(reference))
    probed, probe = [], sessions.crash_in_child

    def counted(function, open_at, level, feed):
        probed.append(level)
        return probe(function, open_at, level, feed)

    monkeypatch.setattr(sessions, "crash_in_child", counted)
    parts = arguments["calibration"]
    agreement = check_int8_agreement(reference, [out], parts.fit.batches, parts.held_out.batches)
    assert agreement.graphs[out.name].held_out and probed == []


def _matmul_int8(folder, **options):
    """x [n, WIDE] -> MatMul with a WIDE x WIDE weight, made INT8 (max ranges) in `folder` from 32 random rows."""
    weight = np.random.default_rng(0).standard_normal((WIDE, WIDE)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="matmul")],
        "matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", WIDE])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", WIDE])],
        [numpy_helper.from_array(weight, "w")],
    )
    fp32, rows = folder / "model.onnx", folder / "calibration.npy"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(fp32))
    np.save(rows, np.random.default_rng(1).standard_normal((32, WIDE)).astype(np.float32))
    calibration = read_calibration(rows, fp32, None, samples=32, batch=16)
    return make_int8_graph(fp32, folder / "model.int8.onnx", calibration, config=CalibrationConfig(("max",)),
                           cache_folder=folder / "calibration", **options)  # fmt: skip


def test_the_int8_kernels_are_counted_without_a_copy_of_the_weights_on_disk(tmp_path):
    """ONNX Runtime's optimized graph, read back for its nodes alone, has its weights written to /dev/null: a file
    size limit under the graph's weights stops a copy of them (its write failed, and the CPU graph with it)."""
    graph = tmp_path / graph_record(Precision.INT8, CPU_TARGETS[VNNI]).file
    _matmul_int8(tmp_path, cpu_out_paths={VNNI: graph})
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (WIDE**2 // 2, hard))  # int8 weights: one byte each
    try:
        counts = int8_kernel_counts(graph, scratch=scratch)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert counts == {"int8_kernels": 1, "float_kernels": 0}
    assert list(scratch.iterdir()) == []


def _cnn_case(folder) -> tuple:
    """(weight_kinds_graph in `folder`, make_int8_graph's arguments for it: 32 rows, max ranges)."""
    fp32 = folder / "model.onnx"
    weight_kinds_graph(fp32, CHANNELS)
    np.save(folder / "calibration.npy", _rows(0, 32) - 2.0)
    calibration = read_calibration(folder / "calibration.npy", fp32, None, samples=32, batch=16)
    return fp32, {"calibration": calibration, "config": CalibrationConfig(("max",)),
                  "cache_folder": folder / "calibration"}  # fmt: skip


@pytest.mark.parametrize("case", [_depthwise_case, _cnn_case], ids=["depthwise", "conv-gemm-matmul"])
def test_the_uint8_rounding_is_the_cpu_graphs_to_the_bit_and_corrects_its_biases_alike(tmp_path, case):
    """The no-VNNI graph's biases are corrected for its own (uint8) rounding, computed without writing a graph
    (qdq_cpu.Uint8Rounding): each weight's values are those read back from ONNX Runtime's finished U8U8 graph, bit
    for bit, the corrected FP32 graph is byte for byte the one corrected for that graph's rounding, and the graph
    written with the weights it rounded is that graph."""
    fp32, arguments = case(tmp_path)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    chosen = make_int8_graph(fp32, tmp_path / "model.int8.onnx", **arguments, scratch=scratch).chosen
    written = tmp_path / "cpu" / "q.onnx"
    written.parent.mkdir()
    quantize_for_cpu(chosen.calibrated, written, chosen.ranges, weights="u8u8")
    from_graph = DequantizedWeights(onnx.load(str(written)), written.parent)
    computed = Uint8Rounding(chosen.calibrated, chosen.ranges)
    nodes = onnx.load(str(fp32)).graph.node
    weights = [node.input[1] for node in nodes if node.op_type in ("Conv", "Gemm", "MatMul")]
    assert weights and all(name in computed for name in weights), weights
    for name in weights:
        np.testing.assert_array_equal(computed[name], from_graph[name], err_msg=name)
    means = {name: np.linspace(-1.0, 3.0, size) for name, size in _input_channels(fp32).items()}
    corrected = {}
    for label, rounding in (("graph", written), ("computed", computed)):
        correction = correct_biases(chosen.calibrated, rounding, means, tmp_path / f"{label}.onnx")
        assert correction["ops"] >= 1, correction
        corrected[label] = onnx.load(str(tmp_path / f"{label}.onnx")).SerializeToString()
    assert corrected["graph"] == corrected["computed"]
    shared = tmp_path / "cpu" / "shared.onnx"  # written with the rounding's uint8 weights: the same graph
    quantize_for_cpu(chosen.calibrated, shared, chosen.ranges, weights="u8u8", quantized_weights=computed.weights)
    assert onnx.load(str(shared)).SerializeToString() == onnx.load(str(written)).SerializeToString()


def _input_channels(fp32) -> dict[str, int]:
    """{the activation input of each Conv/Gemm/MatMul: its channel count}, from the op's weight."""
    model = onnx.load(str(fp32))
    shapes = {init.name: list(init.dims) for init in model.graph.initializer}
    channels = {}
    for node in model.graph.node:
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        dims = shapes.get(node.input[1]) if len(node.input) > 1 else None
        if node.op_type == "Conv" and dims:
            channels[node.input[0]] = dims[1] * attributes.get("group", 1)
        elif node.op_type in ("Gemm", "MatMul") and dims:
            channels[node.input[0]] = dims[1] if attributes.get("transB") else dims[0]
    return channels


@pytest.mark.parametrize("module", [qdq, qdq_cpu], ids=["engine", "cpu"])
def test_a_quantized_graph_is_on_disk_once_as_it_is_written(tmp_path, monkeypatch, module):
    """ONNX Runtime's quantizer writes its graph with a data file; they are read and removed before the graph is
    written as the folder's rule says, so the weights are never on disk twice (the CPU graph was stored by that
    rule, then written again: the 1.1B LM's 1.3 GB twice, at its INT8 stage's disk peak)."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    chosen = _matmul_int8(tmp_path, scratch=scratch).chosen
    save, on_disk = module.save_graph, []

    def watched(model, path, **options):
        on_disk.append(sum(file.stat().st_size for file in path.parent.rglob("*") if file.is_file()))
        return save(model, path, **options)

    monkeypatch.setattr(module, "save_graph", watched)
    out = tmp_path / "out" / "model.int8.onnx"
    out.parent.mkdir()
    if module is qdq:
        quantize_qdq(chosen.calibrated, out, chosen.ranges)
    else:
        quantize_for_cpu(chosen.calibrated, out, chosen.ranges, weights="u8u8")
    assert len(on_disk) == 1 and on_disk[0] < WIDE**2 // 2, on_disk  # int8 weights: one byte each
    assert onnx.load(str(out)).graph.initializer  # written, with its weights


def test_a_cpu_graph_the_disk_has_no_room_for_stops_the_stage(tmp_path):
    """A CPU graph that fails for want of room (here: a file size limit under its weights) raises, as a full disk
    does anywhere else, where another failure is recorded and the build goes on: it went on, and a CPU served the
    slower Q/DQ graph."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    chosen = _matmul_int8(tmp_path, scratch=scratch).chosen
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (WIDE**2 // 2, hard))  # int8 weights: one byte each
    try:
        with pytest.raises(OSError) as refused:
            _cpu_graph(chosen, tmp_path / graph_record(Precision.INT8, CPU_TARGETS[VNNI]).file, VNNI, None)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert refused.value.errno == errno.EFBIG


def test_the_corrected_graphs_of_an_fp32_graph_with_a_data_file_reference_its_weights(tmp_path, monkeypatch):
    """Candidates without smoothing calibrate from the FP32 graph itself where it keeps its weights in a data file
    (past 2 GB): the graphs with corrected biases made from it (the kept candidate's, each CPU graph's, each float
    search try's) are written beside it, under temporary names, referencing its weights, and removed after.  Here
    a file size limit under the weights stops any copy of them; copies in the scratch took the weights twice over
    on a 2.4 GB MLP.  The float search is made to try the conv whatever its error (it starts past 0.05 of the
    output, at the first node past INT8's node tolerance)."""
    monkeypatch.setattr(float_search, "FLOAT_SEARCH_FROM", 0.0)
    monkeypatch.setattr(layers, "node_tolerance", lambda precision: 0.0)
    channels = 64
    rng = np.random.default_rng(0)
    kernels = [(rng.standard_normal((channels, channels, 3, 3)) / 24).astype(np.float32) for _ in range(2)]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w0", "b0"], ["h"], pads=[1, 1, 1, 1], name="conv0"),
            helper.make_node("Relu", ["h"], ["r"], name="relu"),
            helper.make_node("Conv", ["r", "w1", "b1"], ["y"], pads=[1, 1, 1, 1], name="conv1"),
        ],
        "convs",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", channels, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", channels, 4, 4])],
        [numpy_helper.from_array(kernel, f"w{index}") for index, kernel in enumerate(kernels)]
        + [numpy_helper.from_array(np.zeros(channels, np.float32), f"b{index}") for index in range(2)],
    )
    fp32, out = tmp_path / "model.onnx", tmp_path / "int8" / "model.int8.onnx"
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(fp32), save_as_external_data=True, location="model.onnx.data")
    np.save(tmp_path / "calibration.npy", rng.uniform(0, 6, (64, channels, 4, 4)).astype(np.float32))  # E[x] = 3
    before = sorted(tmp_path.iterdir())
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    # Under the weights (2 kernels), over a Q/DQ graph with one conv kept in float (1.25 kernels).
    resource.setrlimit(resource.RLIMIT_FSIZE, (kernels[0].nbytes * 8 // 5, hard))
    try:
        result = make_int8_graph(
            fp32,
            out,
            read_calibration(tmp_path / "calibration.npy", fp32, None, samples=64, batch=16),
            config=CalibrationConfig(("max",), float_search=True),
            cache_folder=tmp_path / "calibration",
            cpu_out_paths={
                kind: out.with_name(graph_record(Precision.INT8, t).file) for kind, t in CPU_TARGETS.items()
            },
            judge=int8_judge(Fp32Reference(fp32)),
        )
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    chosen = result.chosen
    assert chosen.bias_correction["kept"] and chosen.uncorrected == fp32 and chosen.calibrated.parent == tmp_path
    assert {kind: graph.failed for kind, graph in result.cpu.items()} == dict.fromkeys(CPU_TARGETS)
    assert [tried["op"] for tried in result.calibration["float_search"]["tried"]] == ["conv0"]
    assert sorted(tmp_path.iterdir()) == sorted([*before, tmp_path / "calibration", out.parent])  # nothing left


def test_a_shift_is_computed_once_for_the_same_graph_rounding_and_means(tmp_path):
    """BiasShifts: a second correction of the same FP32 graph for the same rounding and means (a candidate of the
    same smoothing alpha, the kept candidate's FP32 graph, the float search's try) takes the shifts computed by the
    first and writes the same graph, byte for byte; other means are computed anew."""
    fp32, arguments = _cnn_case(tmp_path)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    chosen = make_int8_graph(fp32, tmp_path / "model.int8.onnx", **arguments, scratch=scratch).chosen
    means = {name: np.linspace(-1.0, 3.0, size) for name, size in _input_channels(fp32).items()}
    shifts, written = BiasShifts(), {}
    for label, shared in (("alone", None), ("first", shifts), ("again", shifts)):
        correction = correct_biases(chosen.calibrated, chosen.qdq, means, tmp_path / f"{label}.onnx", shifts=shared)
        written[label] = onnx.load(str(tmp_path / f"{label}.onnx")).SerializeToString()
    assert correction["ops"] >= 3 and shifts.computed == correction["ops"], (correction, shifts.computed)
    assert written["alone"] == written["first"] == written["again"]
    other = {name: mean + 1.0 for name, mean in means.items()}
    correct_biases(chosen.calibrated, chosen.qdq, other, tmp_path / "other.onnx", shifts=shifts)
    assert shifts.computed == 2 * correction["ops"]
    assert onnx.load(str(tmp_path / "other.onnx")).SerializeToString() != written["alone"]
