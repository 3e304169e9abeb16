"""Verified on the host before it serves: `auto` runs what it would serve on the folder's own cases, holds it to the
folder's gate for its precision, and serves only what passes (pipeline/runners/host_check.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.settings import Settings
from trt_pipeline.pipeline.evaluation.host import HostCheck
from trt_pipeline.pipeline.folder.layout import CALIBRATION_SAMPLE, SERVED_CHOICE
from trt_pipeline.pipeline.folder.provenance import describe_artifacts
from trt_pipeline.pipeline.folder.reader import open_folder
from trt_pipeline.pipeline.runners import load_runner
from trt_pipeline.pipeline.runners.fastest import Trials, _first_served, find_candidates
from trt_pipeline.pipeline.runners.host_check import check_runner
from trt_pipeline.pipeline.runners.onnxruntime import CPU
from trt_pipeline.pipeline.stages.sequence import make_engine

TINY = "tests.helpers.toy_models:tiny_cnn"


def _build(root: Path, model: str = TINY, **settings) -> Path:
    return make_engine(Settings(model=model, batch="1:4:8", out_root=root, builder="tensorrt_rtx", **settings).check())


@pytest.fixture(scope="module")
def fp16_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory.mktemp("fp16"), precision="fp16")


@pytest.fixture(scope="module")
def int8_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("int8")
    np.save(root / "calib.npy", np.random.default_rng(1).standard_normal((40, 3, 16, 16), dtype=np.float32))
    return _build(root, precision="int8", calib=root / "calib.npy", calib_batch=8)


def _copy(folder: Path, tmp_path: Path) -> Path:
    copy = Path(shutil.copytree(folder, tmp_path / folder.name))
    (copy / SERVED_CHOICE).unlink(missing_ok=True)
    return copy


def _off_its_gate(folder: Path, graph: str) -> None:
    """The graph with its first weight scaled by 1.5, recorded in the manifest as if the build had written it: a
    graph that computes something other than what its gate verified (as an engine or a host's kernels may)."""
    model = onnx.load(str(folder / graph))
    weight = next(t for t in model.graph.initializer if numpy_helper.to_array(t).dtype.kind == "f" and t.dims)
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * 1.5, weight.name))
    onnx.save(model, str(folder / graph))
    _record(folder, graph)


def _record(folder: Path, artifact: str) -> None:
    """The artifact's sha256 and size in the manifest, as if the build had written the file as it is now."""
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["artifacts"][artifact] = dataclasses.asdict(describe_artifacts(folder, [artifact])[artifact])
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _checks(folder: Path) -> dict[str, dict]:
    return json.loads((folder / SERVED_CHOICE).read_text())["checks"]


def test_what_auto_serves_is_checked_once_per_host_and_cached(fp16_folder: Path, tmp_path: Path):
    folder = _copy(fp16_folder, tmp_path)
    with load_runner(folder) as runner:
        served = runner.graph
        assert "checked on this host" in runner.description and "rows alone as in a batch of 8" in runner.description
    checks = _checks(folder)
    assert checks[f"{served} on CPU"]["passed"] is True
    assert "3 reference cases within" in checks[f"{served} on CPU"]["verdict"]
    with load_runner(folder) as again:  # the cache stands for the check under the same host key
        assert again.graph == served and "measured earlier with this host's key" in again.description
        assert "checked on this host" in again.description


def test_a_graph_that_departs_from_its_gate_here_is_not_served(fp16_folder: Path, tmp_path: Path):
    folder = _copy(fp16_folder, tmp_path)
    _off_its_gate(folder, "model.onnx")
    with load_runner(folder) as runner:
        assert runner.graph == "model.fp16.onnx"  # whichever was faster, the FP32 graph fails its gate here
    checks = _checks(folder)
    assert checks["model.fp16.onnx on CPU"]["passed"] is True
    if "model.onnx on CPU" in checks:  # it was the faster one: checked, refused, recorded
        assert checks["model.onnx on CPU"]["passed"] is False
        assert "off PyTorch's reference" in checks["model.onnx on CPU"]["verdict"]


def test_the_next_fastest_serves_when_the_fastest_fails_its_gate_here(fp16_folder: Path, tmp_path: Path):
    folder = _copy(fp16_folder, tmp_path)
    _off_its_gate(folder, "model.fp16.onnx")
    opened = open_folder(folder)
    candidates, _ = find_candidates(opened, [CPU])
    fp32, fp16 = (next(c for c in candidates if c.precision == precision) for precision in ("fp32", "fp16"))
    runners = {candidate: candidate.open(opened, {}) for candidate in candidates}
    try:
        trials = Trials()
        served = _first_served(opened, runners, [fp16, fp32], trials, verify=True)  # as if fp16 were the faster
        checks = trials.checks
    finally:
        for runner in runners.values():
            runner.close()
    assert served == fp32 and [check.passed for check in checks.values()] == [False, True]
    assert "(the fp16 gate: 0.03 of the output's scale)" in checks[fp16.label].verdict


def test_no_graph_that_passes_here_refuses_the_load_and_caches_nothing(fp16_folder: Path, tmp_path: Path):
    folder = _copy(fp16_folder, tmp_path)
    for graph in ("model.onnx", "model.fp16.onnx"):
        _off_its_gate(folder, graph)
    with pytest.raises(PipelineError, match="no graph of .* computes on this host what its build verified") as refused:
        load_runner(folder)
    assert (
        "model.onnx on CPU: at batch 1, off PyTorch's reference: output 'logits'" in refused.value.problem
        and "verify=False" in str(refused.value.fix)
    )
    assert not (folder / SERVED_CHOICE).exists()
    with load_runner(folder, verify=False) as unchecked:  # the user's call: served as the folder holds it
        assert "not checked on this host (load_runner(..., verify=False))" in unchecked.description


def _row_mixing_graph(path: Path) -> Path:
    """An ONNX graph whose rows each lose the batch's mean: its own outputs are its reference (MODEL=<file>.onnx has
    no PyTorch model to prove), so every build gate passes, while a service batching requests would change them."""
    helper, float32 = onnx.helper, onnx.TensorProto.FLOAT
    mean = helper.make_node("ReduceMean", ["input"], ["mean"], axes=[0], keepdims=1)
    graph = helper.make_graph(
        [mean, helper.make_node("Sub", ["input", "mean"], ["output"])],
        "row_mixing",
        [helper.make_tensor_value_info("input", float32, ["batch", 4])],
        [helper.make_tensor_value_info("output", float32, ["batch", 4])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _rows_by_rows_graph(path: Path) -> Path:
    """Each row's scores against every row of the batch, [batch, batch], as CLIP's logits_per_image scores each image
    against the batch's texts: a row alone has one score, in a batch of 8 eight."""
    helper, float32 = onnx.helper, onnx.TensorProto.FLOAT
    nodes = [helper.make_node("Transpose", ["input"], ["rows"], perm=[1, 0])]
    nodes.append(helper.make_node("MatMul", ["input", "rows"], ["output"]))
    graph = helper.make_graph(
        nodes,
        "rows_by_rows",
        [helper.make_tensor_value_info("input", float32, ["batch", 4])],
        [helper.make_tensor_value_info("output", float32, ["batch", "batch"])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


@pytest.mark.parametrize(
    ("graph", "verdict"),
    [
        (_row_mixing_graph, "row 0 run alone differs from the same row run in a batch of 8"),
        (_rows_by_rows_graph, "row 0 run alone gives output 'output' of shape (1, 1), the same row in a batch of 8"),
    ],
    ids=["values", "shape"],
)
def test_a_graph_that_mixes_rows_across_the_batch_is_refused_though_every_build_gate_passed(tmp_path, graph, verdict):
    folder = _build(tmp_path, model=str(graph(tmp_path / "mixing.onnx")), precision="fp32")
    with pytest.raises(PipelineError, match="the graph mixes rows across the batch") as refused:
        load_runner(folder)
    assert verdict in refused.value.problem
    assert "every output is one row's own" in str(refused.value.fix) and "verify=False" in str(refused.value.fix)


def test_an_int8_graph_is_held_to_the_int8_gate_on_the_held_out_rows_against_fp32_here(
    int8_folder: Path, tmp_path: Path
):
    folder = _copy(int8_folder, tmp_path)
    opened = open_folder(folder)
    candidates, _ = find_candidates(opened, [CPU])
    int8 = next(candidate for candidate in candidates if candidate.precision == "int8")
    fp32 = next(candidate for candidate in candidates if candidate.precision == "fp32")
    runners = {candidate: candidate.open(opened, {}) for candidate in (int8, fp32)}
    try:
        trials = Trials()
        served = _first_served(opened, runners, [int8, fp32], trials, verify=True)
        checks = trials.checks
        assert served == int8 and "INT8 off FP32 by" in checks[int8.label].verdict
        # Rows far outside the calibrated ranges: the input's Q/DQ clips them, and INT8 departs from FP32 there
        # (recorded in the manifest as if the build had kept them: the sample is an artifact with its sha256).
        with np.load(folder / CALIBRATION_SAMPLE) as sample:
            np.savez(folder / CALIBRATION_SAMPLE, **{name: sample[name] * 100 for name in sample.files})
        _record(folder, CALIBRATION_SAMPLE)
        trials = Trials()
        served = _first_served(open_folder(folder), runners, [int8, fp32], trials, verify=True)
        checks = trials.checks
    finally:
        for runner in runners.values():
            runner.close()
    assert served == fp32 and "(the INT8 gate: 0.2)" in checks[int8.label].verdict


def test_a_cached_choice_that_was_never_checked_here_is_measured_and_checked_again(fp16_folder: Path, tmp_path: Path):
    folder = _copy(fp16_folder, tmp_path)
    with load_runner(folder, verify=False):
        pass
    assert _checks(folder) == {}  # served unchecked: the cache says so
    with load_runner(folder) as runner:
        assert "measured now" in runner.description and "checked on this host" in runner.description
    assert all(check["passed"] for check in _checks(folder).values())


def test_a_check_that_raises_skips_its_candidate_with_the_reason_and_the_next_serves(int8_folder: Path, tmp_path: Path):
    """A check that fails for a reason of its own (the INT8 check reads the held-out rows: here bytes np.load
    refuses) is no reason to give up the load: the candidate is skipped, saying why, and the next one is checked."""
    folder = _copy(int8_folder, tmp_path)
    (folder / CALIBRATION_SAMPLE).write_bytes(b"not a numpy file")
    opened = open_folder(folder)
    candidates, _ = find_candidates(opened, [CPU])
    int8, fp32 = (next(c for c in candidates if c.precision == precision) for precision in ("int8", "fp32"))
    runners = {candidate: candidate.open(opened, {}) for candidate in (int8, fp32)}
    trials = Trials()
    try:
        served = _first_served(opened, runners, [int8, fp32], trials, verify=True)
    finally:
        for runner in runners.values():
            runner.close()
    assert served == fp32 and list(trials.checks) == [fp32.label] and trials.checks[fp32.label].passed
    assert trials.skipped[int8.label].reason.startswith("running its host check: ")


def _int8_check(folder: Path) -> HostCheck:
    """The host check of the folder's INT8 graph for this CPU, whatever would be measured fastest."""
    opened = open_folder(folder)
    candidates, _ = find_candidates(opened, [CPU])
    candidate = next(candidate for candidate in candidates if candidate.precision == "int8")
    with candidate.open(opened, {}) as runner:
        return check_runner(opened, candidate.record, runner)


def test_the_held_out_rows_are_an_artifact_checked_like_the_graphs(int8_folder: Path, tmp_path: Path):
    assert CALIBRATION_SAMPLE in open_folder(int8_folder).artifacts
    folder = _copy(int8_folder, tmp_path)
    (folder / CALIBRATION_SAMPLE).write_bytes(b"not a numpy file")  # a raw ValueError from np.load
    with pytest.raises(PipelineError, match=f"{CALIBRATION_SAMPLE} is not the file this folder's build wrote"):
        _int8_check(folder)


def test_held_out_rows_saved_under_another_input_name_blame_the_file_not_the_caller(int8_folder: Path, tmp_path):
    folder = _copy(int8_folder, tmp_path)
    with np.load(folder / CALIBRATION_SAMPLE) as sample:
        np.savez(folder / CALIBRATION_SAMPLE, images=sample["input"])  # "pass exactly ['input']" blamed the caller
    with pytest.raises(PipelineError, match=f"{CALIBRATION_SAMPLE} is not the file this folder's build wrote") as error:
        _int8_check(folder)
    assert "rebuild the folder" in str(error.value) and "pass exactly" not in str(error.value)


def test_deleted_held_out_rows_are_said_to_be_unchecked(int8_folder: Path, tmp_path: Path):
    folder = _copy(int8_folder, tmp_path)
    (folder / CALIBRATION_SAMPLE).unlink()
    check = _int8_check(folder)
    assert check.passed and "INT8 off FP32" not in check.verdict  # nothing was run on them: never "checked"
    assert f"the held-out calibration rows not checked: {folder / CALIBRATION_SAMPLE} is missing" in check.verdict


def test_held_out_rows_that_are_no_regular_file_are_named_as_such(int8_folder: Path, tmp_path: Path):
    folder = _copy(int8_folder, tmp_path)
    (folder / CALIBRATION_SAMPLE).unlink()
    os.mkfifo(folder / CALIBRATION_SAMPLE)  # it was called missing
    with pytest.raises(PipelineError, match=f"{CALIBRATION_SAMPLE} is not a regular file but a FIFO"):
        _int8_check(folder)
