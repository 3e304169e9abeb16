"""INT8's gate on calibration rows its ranges never saw (issue 25): the split, the held-out gate, STRICT_CALIB.

The digits CNN (trained, 8x8 inputs: a build takes a few seconds) calibrated on .npy files built from its own
training digits: a broad set (varied digits), and narrow ones (near-copies of one to three digits, with a few
varied digits at the end) of the kind a user makes from a few photos and many crops of them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from trt_pipeline.calibration import readers
from trt_pipeline.calibration.holdout import split_rows
from trt_pipeline.calibration.int8 import calibration_sample
from trt_pipeline.models.digits import load_split
from trt_pipeline.pipeline import cli
from trt_pipeline.pipeline.evaluation import INT8_MAX_ERROR
from trt_pipeline.pipeline.folder.manifest import Manifest, read_manifest
from trt_pipeline.pipeline.stages.parity import MUCH_WORSE_RATIO

ROOT = Path(__file__).resolve().parents[2]
ROWS, TAIL = 40, 4


@pytest.fixture(scope="module")
def digits() -> np.ndarray:
    return load_split().train_inputs


def _narrow(digits: np.ndarray, kinds: int, path: Path) -> Path:
    """ROWS rows: near-copies (noise of 0.02 on pixels in [-1, 1]) of the first `kinds` training digits, then TAIL
    other digits.  The split holds out rows 16-19 (near-copies) and 36-39 (the varied tail): the fit rows are
    narrow, the held-out ones are not."""
    noise = np.random.default_rng(0).normal(0, 0.02, (ROWS - TAIL, *digits.shape[1:]))
    copies = np.clip(digits[np.arange(ROWS - TAIL) % kinds] + noise, -1, 1)
    np.save(path, np.concatenate([copies, digits[100 : 100 + TAIL]]).astype(np.float32))
    return path


def _build(calib: Path, out: Path, *options: str) -> list[str]:
    return ["engine", "--model", "digits", "--precision", "int8", "--calib", str(calib), *options, "--out", str(out)]


def test_an_int8_build_reads_its_calibration_data_once(digits, tmp_path, monkeypatch):
    """The INT8 stage and its agreement gate take the one record the run read and split (sequence.Run.calibration),
    so the rows a graph was fit on and the rows its gate holds out cannot differ (the FP16 scan and the NMS gate
    take it too).  Every read of a .npy goes through readers._arrays_from_numpy_file: counted on its way through."""
    reads: list[Path] = []
    read = readers._arrays_from_numpy_file

    def counted(path: Path, inputs: list) -> dict:
        reads.append(path)
        return read(path, inputs)

    monkeypatch.setattr(readers, "_arrays_from_numpy_file", counted)
    np.save(tmp_path / "broad.npy", digits[:ROWS])
    assert cli.main(_build(tmp_path / "broad.npy", tmp_path / "engines", "--calib-batch", "8")) == 0
    assert reads == [tmp_path / "broad.npy"]


def test_split_is_deterministic_spread_and_recorded(digits, tmp_path):
    split = split_rows(ROWS)
    again = split_rows(ROWS)
    assert np.array_equal(split.fit, again.fit) and np.array_equal(split.held_out, again.held_out)
    assert sorted([*split.fit, *split.held_out]) == list(range(ROWS))
    # Whole runs of consecutive rows, spread over the set (not its last fifth): calibration/samples' 4 views of a
    # photo are held out together.
    assert list(split.held_out) == [16, 17, 18, 19, 36, 37, 38, 39]
    assert len(split_rows(256).held_out) == 52 and len(split_rows(16).held_out) == 8
    assert len(split_rows(15).held_out) == 0 and "judged in-sample" in split_rows(15).rule

    np.save(tmp_path / "broad.npy", digits[:ROWS])
    assert cli.main(_build(tmp_path / "broad.npy", tmp_path / "engines", "--calib-batch", "8")) == 0
    folder = tmp_path / "engines" / "digits-int8"
    manifest = read_manifest(folder)
    assert manifest is not None and manifest.agreement_int8 is not None
    assert Manifest.from_json(manifest.as_json()) == manifest  # the typed record reads back what it wrote
    agreement = manifest.agreement_int8
    assert agreement.split.held_out == tuple(split.held_out) and agreement.split.rows == ROWS
    graph = agreement.graphs["model.int8.onnx"]
    assert graph.judged_on == "held_out"
    assert graph.in_sample["logits"].rows == 32 and graph.held_out["logits"].rows == 8
    assert graph.held_out["logits"].error_mean <= INT8_MAX_ERROR and agreement.warning is None
    raw = json.loads((folder / "manifest.json").read_text())
    assert raw["agreement_int8"]["split"]["held_out"] == [16, 17, 18, 19, 36, 37, 38, 39]
    # The ranges were fit on the 32 fit rows only, and the cache is keyed on those rows.
    calibration = raw["calibration"]
    assert calibration["split"] == raw["agreement_int8"]["split"]
    assert calibration["fit_sha256"] != calibration["data_sha256"]
    cache = json.loads(Path(calibration["cache_file"]).read_text())
    assert cache["record"]["samples"] == 32
    # `trt-pipeline diagnose` compares on the rows the gate judged.
    sample = calibration_sample(folder)
    assert sample is not None and np.array_equal(sample["input"], digits[split.held_out])


def test_gate_passes_in_sample_and_fails_held_out_on_a_narrow_set(digits, tmp_path, capsys):
    """Near-copies of one digit and four other digits, percentile ranges, the classifier's input smoothed
    (SMOOTH=0.9) and every op INT8 (NO_FLOAT_SEARCH=1): the ranges and scales fit on the copies clip the other
    digits.  On the rows it was fit on the graph is within 0.01 of FP32; on the held-out rows it is past the gate,
    and says why.  The defaults (CALIB_METHOD=auto, SMOOTH=auto, the float search) judge the unsmoothed graphs on
    the same held-out rows too, keep one, and pass: the held-out rows chose."""
    calib = _narrow(digits, 1, tmp_path / "narrow.npy")
    pinned = ("--calib-batch", "8", "--calib-method", "percentile", "--smooth", "0.9", "--no-float-search")
    assert cli.main(_build(calib, tmp_path / "engines", *pinned)) == 2
    err = capsys.readouterr().err
    assert "model.int8.onnx departs from FP32 on the held-out calibration rows" in err
    in_sample = float(err.split("rows its ranges were fit on: ")[1].split(";")[0])
    assert in_sample < INT8_MAX_ERROR / 10  # the gate on the fit rows would have passed it
    assert "too small or too narrow to stand for the served inputs" in err
    assert "fix: calibrate on at least 256 rows (now 40" in err
    assert not (tmp_path / "engines" / "digits-int8" / "engine.plan").exists()

    assert cli.main(_build(calib, tmp_path / "auto", "--calib-batch", "8")) == 0
    search = json.loads((tmp_path / "auto" / "digits-int8" / "manifest.json").read_text())["calibration"]
    errors = {(c["method"], c["smooth_alpha"]): c["held_out_error_mean"] for c in search["search"]["candidates"]}
    assert search["smooth_alpha"] is None and errors[search["method"], None] < INT8_MAX_ERROR
    assert errors["percentile", 0.9] > INT8_MAX_ERROR


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_strict_calib_refuses_what_the_build_warns_about(digits, tmp_path, capsys):
    """Near-copies of one digit and a varied tail (percentile ranges, not smoothed: CALIB_METHOD=percentile SMOOTH=off;
    every op INT8, NO_FLOAT_SEARCH=1): within the gate held out, but many times worse than in-sample.  The build
    warns with the fix; STRICT_CALIB=1 refuses it (exit 2, the reason and the fix); and a set too small to hold any
    rows out is refused under it too."""
    calib = _narrow(digits, 1, tmp_path / "narrow.npy")
    command = ["make", "-s", "-o", ".venv/.installed", "engine", "MODEL=digits", "PRECISION=int8", f"CALIB={calib}"]
    command += ["CALIB_METHOD=percentile", "SMOOTH=off", "NO_FLOAT_SEARCH=1"]
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's code, as `make` runs it

    def make(*assignments: str) -> subprocess.CompletedProcess:
        return subprocess.run([*command, *assignments], cwd=ROOT, env=environment, capture_output=True, text=True)

    warned = make(f"OUT={tmp_path}/lenient")
    assert warned.returncode == 0, warned.stderr
    manifest = read_manifest(tmp_path / "lenient" / "digits-int8")
    assert manifest is not None and manifest.agreement_int8 is not None
    ratio = manifest.agreement_int8.graphs["model.int8.onnx"].held_out_ratio()
    assert ratio is not None and ratio > MUCH_WORSE_RATIO
    assert "warning: INT8 is" in warned.stdout and "(STRICT_CALIB=1 refuses such a build)" in warned.stdout
    assert (
        manifest.agreement_int8.warning is not None
        and "calibrate on at least 256 rows" in manifest.agreement_int8.warning
    )

    refused = make(f"OUT={tmp_path}/strict", "STRICT_CALIB=1")
    assert refused.returncode == 2
    assert "worse on the 8 held-out calibration rows than on the 32 its ranges were fit on" in refused.stderr
    assert "fix: calibrate on at least 256 rows (now 40" in refused.stderr and "Traceback" not in refused.stderr
    strict = read_manifest(tmp_path / "strict" / "digits-int8")
    assert strict is not None and not strict.complete and strict.settings["strict_calib"] is True

    np.save(tmp_path / "tiny.npy", digits[:12])  # no make variable sets the calibration batch: the command line
    tiny = _build(tmp_path / "tiny.npy", tmp_path / "tiny", "--calib-batch", "4", "--strict-calib")
    assert cli.main(tiny) == 2
    assert "judged only the rows calibration was fit on" in capsys.readouterr().err
