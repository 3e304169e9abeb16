"""benchmarks/gpu_models.py in its dry run on the CPU: a session with a GPU lent has minutes of device time, so the
sweep must run end to end here first (two tiny models built through make_engine and served through load_runner)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from benchmarks.gpu_models import BATCHES, ROWS, main, merged
from trt_pipeline.pipeline.core.errors import PipelineError


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("sweep")
    assert main(["--dry-run", "--group", "dry", "--out", str(work / "dry"), "--engines", str(work / "engines")]) == 0
    return work


def test_the_report_has_the_issues_shape_and_served_agrees_with_pytorch(swept: Path) -> None:
    report = json.loads((swept / "dry.json").read_text())
    assert set(report) == {"device", "versions", "models"} and "CPU" in report["device"]
    assert {"torch", "onnxruntime", "transformers"} <= set(report["versions"])
    assert set(report["models"]) == {"tiny-cnn", "tiny-bert", "tiny-detector"}
    for name, record in report["models"].items():
        assert record["error"] is None, name
        assert "picked because auto" in record["description"]  # what load_runner(folder) served, and why
        assert set(record["batches"]) == {str(batch) for batch in BATCHES}
        for row in record["batches"].values():
            assert set(row) == {*ROWS, "served_cosine", "served_max_abs", "served_detections"}
            assert row["served"] > 0
            if name == "tiny-detector":  # its detections, through the NMS the folder appends, against PyTorch's
                assert row["served_detections"] >= 0.99 and row["served_cosine"] is None
            else:
                assert row["served_cosine"] > 0.9999 and row["served_max_abs"] < 1e-2
                assert row["served_detections"] is None
            assert row["torch-amp"] is row["torch-compile-reduce-overhead"] is row["torch-compile"] is None
        assert "CUDA" in record["skipped"]["torch-amp"] and "CUDA" in record["skipped"]["torch-compile-reduce-overhead"]
        assert "dry run" in record["skipped"]["torch-compile"]
    bench = json.loads((swept / "dry-logs" / "tiny-cnn-bench.json").read_text())  # the harness's whole report
    served = next(backend for backend in bench["backends"] if backend["name"] == "served")
    assert served["description"] == report["models"]["tiny-cnn"]["description"]


def test_the_markdown_gives_each_batch_and_what_auto_served(swept: Path) -> None:
    text = (swept / "dry.md").read_text()
    assert all(f"## Batch {batch}" in text for batch in BATCHES)
    assert "| tiny-bert | " in text and "Goal: not judged" in text
    assert " | 1.000 of detections found |  |" in text  # the tiny detector's, at each batch
    assert "torch-amp not run: needs a CUDA GPU" in text


def test_a_model_that_fails_records_its_error_and_the_sweep_goes_on(tmp_path: Path) -> None:
    out = tmp_path / "timed-out"
    main(["--dry-run", "--models", "tiny-cnn", "--out", str(out), "--engines", str(tmp_path / "engines")]
         + ["--model-timeout-s", "0.5"])  # fmt: skip
    record = json.loads(out.with_suffix(".json").read_text())["models"]["tiny-cnn"]
    assert "ran past --model-timeout-s 0.5" in record["error"] and record["batches"] == {}
    assert "tiny-cnn | error |" in out.with_suffix(".md").read_text()


def test_a_model_whose_process_crashes_records_its_python_stack(tmp_path: Path) -> None:
    """A child killed by SIGSEGV (as the ConvNeXt's was on an H200, inside ONNX Runtime) leaves the Python stack it
    was at in the model's error, not just its exit status: the signal is sent here, once the child runs."""
    out = tmp_path / "crashed"
    sweep = threading.Thread(
        target=main,
        args=(["--dry-run", "--models", "tiny-cnn", "--out", str(out), "--engines", str(tmp_path / "engines")],),
    )
    sweep.start()
    child = _child_of(os.getpid(), "tiny-cnn")
    time.sleep(1.0)  # past the interpreter's start, into the child's imports
    os.kill(child, signal.SIGSEGV)
    sweep.join()
    error = json.loads(out.with_suffix(".json").read_text())["models"]["tiny-cnn"]["error"]
    assert "exit -11" in error and "Fatal Python error: Segmentation fault" in error
    text = out.with_suffix(".md").read_text()  # the dump under the model's item, as printed
    assert "\n  ```\n  Fatal Python error: Segmentation fault\n" in text and text.count("  ```\n") == 2


def _child_of(parent: int, model: str, timeout_s: float = 30.0) -> int:
    """The pid of the sweep's child process for `model` (found in /proc by its parent and command line)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                status = (entry / "status").read_text()
                command = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:  # the process ended meanwhile
                continue
            if f"PPid:\t{parent}\n" in status and b"--child" in command and model.encode() in command:
                return int(entry.name)
        time.sleep(0.02)
    raise AssertionError(f"no child process for {model} within {timeout_s} s")


def test_runs_of_the_same_gpu_merge_into_one_report_and_others_are_refused(swept: Path, tmp_path: Path) -> None:
    dry = json.loads((swept / "dry.json").read_text())
    later = {**dry, "models": {"tiny-cnn": {**dry["models"]["tiny-cnn"], "description": "measured again"}}}
    (tmp_path / "later.json").write_text(json.dumps({**later, "notes": ["tiny-cnn measured again"]}))
    main(["--merge", str(swept / "dry.json"), str(tmp_path / "later.json"), "--out", str(tmp_path / "merged")]
         + ["--note", "tiny-bert: the first run"])  # fmt: skip
    report = json.loads((tmp_path / "merged.json").read_text())
    models = report["models"]
    assert set(models) == {"tiny-cnn", "tiny-bert", "tiny-detector"}
    assert models["tiny-cnn"]["description"] == "measured again"
    assert report["notes"] == ["tiny-cnn measured again", "tiny-bert: the first run"]  # a later merge keeps them
    text = (tmp_path / "merged.md").read_text()
    assert "| tiny-bert | " in text and "## Notes\n\n- tiny-cnn measured again\n- tiny-bert: the first run" in text
    assert "--out " + str(tmp_path / "merged") + " --note ...` (" in text  # the notes' text only under Notes
    with pytest.raises(PipelineError, match="measured on another device"):
        merged([dry, {**dry, "device": "NVIDIA H200"}])
