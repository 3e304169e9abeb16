"""auto never lets one candidate take the load down (pipeline/runners/fastest.py, candidate.py, proving.py): a
candidate that fails to open, to be timed or its host check is skipped with its reason, in runner.description and
served.json, and the next one serves; a candidate proved in a child process that dies there is skipped the same way;
only where none can serve is the load refused, with every reason.  Faults are real: graphs ONNX Runtime refuses or
fails to run, recorded in the manifest as if the build had written them, and children that really die."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from tests.helpers.graph_faults import fails_when_run, unopenable
from tests.helpers.proof_faults import FAULTS, STARTS
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.settings import Settings
from trt_pipeline.pipeline.folder.layout import SERVED_CHOICE
from trt_pipeline.pipeline.folder.reader import open_folder
from trt_pipeline.pipeline.runners import load_runner
from trt_pipeline.pipeline.runners.fastest import fastest_onnxruntime_runner
from trt_pipeline.pipeline.runners.proving import DIED_FIX, Isolation
from trt_pipeline.pipeline.stages.sequence import make_engine

FP16, FP32 = "model.fp16.onnx on CPU", "model.onnx on CPU"
TEST_ENTRY = "tests.helpers.proof_faults"


@pytest.fixture(scope="module")
def fp16_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_cnn in FP16: two CPU candidates here, model.fp16.onnx and model.onnx."""
    settings = Settings(
        model="tests.helpers.toy_models:tiny_cnn",
        precision="fp16",
        batch="1:4:8",
        out_root=tmp_path_factory.mktemp("fp16"),
        builder="tensorrt_rtx",
    )
    return make_engine(settings.check())


@pytest.fixture
def folder(fp16_folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(fp16_folder, tmp_path / fp16_folder.name))


def _served(folder: Path) -> dict:
    return json.loads((folder / SERVED_CHOICE).read_text())


def test_a_candidate_that_fails_to_open_is_skipped_and_the_next_one_serves(folder: Path):
    unopenable(folder, "model.fp16.onnx")
    with load_runner(folder) as runner:
        assert runner.graph == "model.onnx"
        assert f"skipped: {FP16}: opening it: ONNX Runtime cannot load" in runner.description
        assert "NoSuchOperator" in runner.description
    record = _served(folder)
    assert record["served"] == FP32 and list(record["skipped"]) == [FP16]
    assert "NoSuchOperator" in record["skipped"][FP16]["reason"]
    assert "rebuild the folder" in record["skipped"][FP16]["fix"]  # the file is refused: ONNX Runtime's error says so
    with load_runner(folder) as again:  # the cache keeps why it was skipped
        assert "measured earlier with this host's key" in again.description
        assert f"skipped: {FP16}: opening it: ONNX Runtime cannot load" in again.description


def test_a_candidate_that_fails_while_it_is_timed_is_skipped_and_the_next_one_serves(folder: Path):
    fails_when_run(folder, "model.fp16.onnx")
    with load_runner(folder) as runner:
        assert runner.graph == "model.onnx"
        assert f"skipped: {FP16}: timing it at batch 4: ONNX Runtime could not run model.fp16.onnx" in (
            runner.description
        )
    record = _served(folder)
    assert all(list(medians) == [FP32] for medians in record["ms"].values())  # none of its times are kept
    # A float input, an error of ONNX Runtime's Reshape: the fix names no cause it cannot know.
    fix = record["skipped"][FP16]["fix"]
    assert "token ids" not in fix and "ONNX Runtime's message is all that is known" in fix


def test_where_no_candidate_can_serve_the_load_is_refused_with_every_reason(folder: Path):
    unopenable(folder, "model.fp16.onnx")
    fails_when_run(folder, "model.onnx")
    with pytest.raises(PipelineError, match="no candidate can serve .* on this host") as refused:
        load_runner(folder)
    assert f"{FP16}: opening it: ONNX Runtime cannot load" in refused.value.problem
    assert f"{FP32}: timing it at batch 4: ONNX Runtime could not run model.onnx" in refused.value.problem
    fix = str(refused.value.fix)
    assert "rebuild the folder" in fix and "ONNX Runtime's message is all that is known" in fix
    assert not (folder / SERVED_CHOICE).exists()


def _isolating(**changes) -> Isolation:
    """Every candidate proved in a child process (on a GPU host only the CUDA ones are), the tests' entry."""
    return dataclasses.replace(Isolation(isolate=lambda candidate: True, entry=TEST_ENTRY), **changes)


def _starts(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def test_a_candidate_proved_in_a_child_process_serves_and_its_verdict_is_cached(folder: Path, tmp_path, monkeypatch):
    starts = tmp_path / "starts"
    monkeypatch.setenv(STARTS, str(starts))
    runner, why = fastest_onnxruntime_runner(open_folder(folder), {}, isolation=_isolating())
    with runner:
        assert "checked on this host" in why and ": in a child process: 3 reference cases within" in why
    assert sorted(_starts(starts)) == ["model.fp16.onnx", "model.onnx"]
    checks = _served(folder)["checks"]
    assert set(checks) == {FP16, FP32}
    assert all(check["passed"] and check["verdict"].startswith("in a child process: ") for check in checks.values())
    again, why = fastest_onnxruntime_runner(open_folder(folder), {}, isolation=_isolating())
    with again:  # the verdicts stand under the same host key: no child is started
        assert "measured earlier with this host's key" in why and "in a child process" in why
    assert len(_starts(starts)) == 2


def test_a_candidate_whose_process_dies_is_skipped_and_the_next_one_serves(folder: Path, tmp_path, monkeypatch):
    starts = tmp_path / "starts"
    monkeypatch.setenv(STARTS, str(starts))
    monkeypatch.setenv(FAULTS, json.dumps({"model.fp16.onnx": "segfault"}))
    runner, why = fastest_onnxruntime_runner(open_folder(folder), {}, isolation=_isolating())
    with runner:
        assert runner.graph == "model.onnx"
        died = f"skipped: {FP16}: the candidate's process died with signal 11 (SIGSEGV) while starting Python"
        assert died in why
    record = _served(folder)
    assert record["skipped"][FP16]["reason"].startswith("the candidate's process died with signal 11 (SIGSEGV)")
    assert record["skipped"][FP16]["fix"] == DIED_FIX and FP16 not in record["checks"]
    again, why = fastest_onnxruntime_runner(open_folder(folder), {}, isolation=_isolating())
    with again:  # its verdict is cached: no child is started again, and the description still says why
        assert died in why
    assert sorted(_starts(starts)) == ["model.fp16.onnx", "model.onnx"]


def test_unchecked_a_candidate_whose_process_dies_is_skipped_too(folder: Path, monkeypatch):
    """verify=False serves unchecked, not unsafely: a risky candidate still proves in a child that it runs."""
    monkeypatch.setenv(FAULTS, json.dumps({"model.fp16.onnx": "segfault"}))
    runner, why = fastest_onnxruntime_runner(open_folder(folder), {}, verify=False, isolation=_isolating())
    with runner:
        assert runner.graph == "model.onnx" and "not checked on this host" in why
        assert f"skipped: {FP16}: the candidate's process died with signal 11 (SIGSEGV)" in why
    assert _served(folder)["checks"] == {}


def test_a_child_that_does_not_finish_in_time_is_killed_and_its_candidate_skipped(folder: Path, monkeypatch):
    monkeypatch.setenv(FAULTS, json.dumps({"model.fp16.onnx": "hang"}))
    fp16_alone = _isolating(isolate=lambda candidate: candidate.graph == "model.fp16.onnx", timeout_s=5.0)
    runner, why = fastest_onnxruntime_runner(open_folder(folder), {}, isolation=fp16_alone)
    with runner:
        assert f"skipped: {FP16}: its proof in a child process did not finish within 5 s (killed while " in why


def test_a_candidate_its_child_cannot_open_is_skipped_with_the_childs_reason(folder: Path):
    """Through the real entry point (python -m trt_pipeline.pipeline.runners.proving)."""
    unopenable(folder, "model.fp16.onnx")
    isolation = Isolation(isolate=lambda candidate: candidate.graph == "model.fp16.onnx")
    runner, why = fastest_onnxruntime_runner(open_folder(folder), {}, isolation=isolation)
    with runner:
        assert f"skipped: {FP16}: in a child process, opening it: ONNX Runtime cannot load" in why
    assert "NoSuchOperator" in _served(folder)["skipped"][FP16]["reason"]


def test_where_every_child_dies_the_load_is_refused_with_each_reason(folder: Path, monkeypatch):
    monkeypatch.setenv(FAULTS, json.dumps({"model.fp16.onnx": "segfault", "model.onnx": "segfault"}))
    with pytest.raises(PipelineError, match="no candidate can serve") as refused:
        fastest_onnxruntime_runner(open_folder(folder), {}, isolation=_isolating())
    for label in (FP16, FP32):
        assert f"{label}: the candidate's process died with signal 11 (SIGSEGV)" in refused.value.problem
    assert refused.value.fix == DIED_FIX


@pytest.mark.gpu
def test_on_a_gpu_each_cuda_candidate_proves_itself_in_a_child_process_once(folder: Path):
    """The default isolation: the onnxruntime-cuda runner's candidates, tuned and untuned, are proved in a child
    process (their checks say so, or they are skipped with why), the CPU's in this one; a second load starts no
    child."""
    with load_runner(folder) as runner:
        if runner.backend == "tensorrt":
            pytest.skip("the engine runs on this GPU, so auto serves it without trying ONNX Runtime's candidates")
    record = _served(folder)
    on_cuda = [label for label in record["key"]["candidates"] if " on CUDA" in label]
    assert any(label.endswith(" untuned") for label in on_cuda), record["key"]["candidates"]
    for label in on_cuda:
        assert label in record["skipped"] or record["checks"][label]["verdict"].startswith("in a child process: ")
    for label, check in record["checks"].items():
        assert check["verdict"].startswith("in a child process: ") == (" on CUDA" in label)
    with load_runner(folder) as again:
        assert "measured earlier with this host's key" in again.description
