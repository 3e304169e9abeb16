"""What a build holds (pipeline/folder/artifacts.py): the folder's lock, one build at a time, and the temporaries of
killed runs cleared."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.folder_builds import GATED, LOCK_KINDS, feed, lock_as, settings
from tests.helpers.runner_folders import copy_folder
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.folder.artifacts import LOCK, build_lock, running_build
from trt_pipeline.pipeline.runners import load_runner
from trt_pipeline.pipeline.stages.sequence import make_engine

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def folder(built: Path, tmp_path: Path) -> Path:
    return copy_folder(built, tmp_path)


def test_a_second_build_into_the_same_folder_refuses_at_once(root, tmp_path):
    ready, go = tmp_path / "ready", tmp_path / "go"
    command = [sys.executable, "-m", "trt_pipeline", "all", "--model", GATED, "--precision", "fp32"]
    command += ["--batch", "1:2:4", "--out", str(root)]
    environment = {**os.environ, "GATE_READY": str(ready), "GATE_GO": str(go)}
    first = subprocess.Popen(command, cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for(ready, first)  # the first build holds the lock and waits in its model's factory
        folder = root / "folder_models-gated_tiny_cnn-fp32"
        builder = running_build(folder)  # the command's child, which builds (the command line watches it)
        assert builder is not None and _parent(builder) == first.pid
        second = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2, second.stderr
        assert f"error: another build is writing {folder} (process {builder} holds" in second.stderr
        assert f"kill {builder}" in second.stderr and "Traceback" not in second.stderr
    finally:
        go.touch()
        out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert running_build(folder) is None  # the pid goes with the lock
    with load_runner(folder, "onnxruntime") as runner:  # the first build finished alone
        assert runner.infer(feed())["logits"].shape == (2, 10)


def _parent(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))


def _wait_for(path: Path, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 300  # a safety net only: the first build's import of torch takes seconds
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the first build never reached its gate: {process.communicate()[1]!r}")
        time.sleep(0.05)


def test_a_killed_build_nobody_reaped_is_not_running(folder):
    """A build killed with its command (the command line's child) is reparented to the first process, which in a
    container may never reap it: as a zombie it still answers signal 0, and every load said it was building."""
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # exits at once; not waited for, it stays a zombie
    deadline = time.monotonic() + 30
    while Path(f"/proc/{zombie.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    (folder / LOCK).write_text(str(zombie.pid))
    try:
        assert running_build(folder) is None
    finally:
        zombie.wait()


def test_a_run_removes_the_temporaries_killed_runs_left(folder):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # a process that has exited: its temporaries are stale
    stale = [folder / f".model.onnx.{dead_pid}.tmp", folder / "calibration" / f".ranges.json.{dead_pid}.tmp"]
    live = folder / f".bench.json.{os.getpid()}.tmp"  # a living writer's (a benchmark writing its report)
    for path in [*stale, live]:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"half written")
    with build_lock(folder) as removed:
        assert removed == sorted(stale)
        assert (folder / LOCK).read_text() == str(os.getpid())
    assert not any(path.exists() for path in stale) and live.exists()
    assert (folder / LOCK).read_text() == ""


@pytest.mark.parametrize("kind", LOCK_KINDS)
def test_a_lock_that_is_no_plain_file_is_refused_and_nothing_is_written_through_it(kind, built, tmp_path, capsys):
    # "a+" followed a link: any file the builder could write was emptied and got the build's pid; a directory gave
    # IsADirectoryError; a FIFO would have blocked the build (and a reader) until someone wrote to it.
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    folder = tmp_path / "engines" / built.name
    folder.mkdir(parents=True)
    lock_as(kind, folder / LOCK, victim)
    refusal = re.escape(f"the build lock {folder / LOCK} is {LOCK_KINDS[kind]},")
    with pytest.raises(PipelineError, match=refusal) as caught:
        make_engine(settings(tmp_path / "engines"))
    assert "remove it (rm -r" in caught.value.fix
    assert victim.read_text() == "precious" and not (tmp_path / "created-through-the-link").exists()
    assert sorted(path.name for path in folder.iterdir()) == [LOCK]  # nothing built beside it
