"""Accuracy of every precision, measured: the trained digits CNN on its labelled held-out split.

Accuracy is a property of the graphs, so it is asserted: INT8 (best calibration method) within
1.0 point of FP32's top-1, FP16 no more than 0.1 points below it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trt_pipeline.calibration.int8 import CACHE_FOLDER
from trt_pipeline.models.digits import load_split
from trt_pipeline.pipeline import cli
from trt_pipeline.pipeline.core.cpu import NO_VNNI, VNNI, cpu_instruction_sets, int8_cpu_kind
from trt_pipeline.pipeline.core.settings import Settings
from trt_pipeline.pipeline.quality.accuracy import cpu_graph_path, measure_accuracy


@pytest.fixture(scope="module")
def digits_report(tmp_path_factory) -> tuple[Path, dict]:
    folder = measure_accuracy(
        Settings(model="digits", precision="fp32", out_root=tmp_path_factory.mktemp("engines")),
        ["max", "percentile", "entropy"],
    )
    return folder, json.loads((folder / "accuracy.json").read_text())


def test_digits_meets_the_accuracy_targets(digits_report):
    _, report = digits_report
    results = report["results"]
    int8 = {f"int8-{method}{shape}" for method in ("max", "percentile", "entropy") for shape in ("", "-ort")}
    assert report["labelled"] and set(results) == {"fp32", "fp16", *int8}
    fp32 = results["fp32"]["top1"]
    assert fp32 >= 97.0  # the trained model is worth measuring
    assert fp32 - results["fp16"]["top1"] <= 0.1
    best = report["best_int8"]
    assert best["metric"] == "top1" and best["points_below_fp32"] <= 1.0
    assert best["points_below_fp32"] == round(fp32 - results[best["graph"]]["top1"], 3)
    for label, row in results.items():
        assert row["cosine_mean"] > 0.99, label
        assert row["top1_agreement"] >= 98.0, label
    assert results["fp32"]["max_abs_diff"] == 0 and results["int8-max"]["max_abs_diff"] > 0


def test_digits_report_files_and_graphs(digits_report):
    folder, report = digits_report
    for graph in report["graphs"].values():
        assert (folder / graph).is_file()
    assert report["calibration_data"].startswith("sklearn digits training split")
    assert {c["method"] for c in report["calibration"].values()} == {"max", "percentile", "entropy"}
    assert all(c["source"].startswith("callable") for c in report["calibration"].values())
    markdown = (folder / "accuracy.md").read_text()
    for label, row in report["results"].items():
        assert f"| {label} | {row['top1']:.2f} |" in markdown
    assert list((folder / CACHE_FOLDER).glob("*.json"))


def test_held_out_split_is_fixed_and_disjoint_from_calibration():
    first, second = load_split(), load_split()
    np.testing.assert_array_equal(first.held_out_labels, second.held_out_labels)
    assert len(first.held_out_labels) == 360 and len(first.train_labels) == 1437
    train = {row.tobytes() for row in first.train_inputs}
    assert sum(row.tobytes() in train for row in first.held_out_inputs) <= 2  # sklearn's digits has a few duplicates


def test_unlabelled_model_is_compared_with_fp32_on_calib(tmp_path, capsys):
    """A model with no labelled set: agreement and cosine vs FP32 on CALIB, through the command line."""
    calib = tmp_path / "calib.npy"
    np.save(calib, np.random.default_rng(0).standard_normal((48, 3, 16, 16), dtype=np.float32))
    # CALIB_METHOD=auto's two methods
    argv = ["accuracy", "--model", "tests.helpers.toy_models:tiny_cnn", "--calib", str(calib)]
    assert cli.main([*argv, "--out", str(tmp_path / "engines")]) == 0
    report = json.loads((tmp_path / "engines" / "toy_models-tiny_cnn-fp32" / "accuracy.json").read_text())
    int8 = {"int8-max", "int8-percentile", "int8-max-ort", "int8-percentile-ort"}
    assert not report["labelled"] and set(report["results"]) == {"fp32", "fp16", *int8}
    assert all("top1" not in row for row in report["results"].values())
    assert report["best_int8"]["metric"] == "top1_agreement_beyond_ties"
    assert (
        "(the calibration data itself, no labelled set: INT8 fit on 38 of its rows, 10 held out)"
        in (report["evaluation"])
    )
    # Each INT8 graph on the rows its ranges were fit on and on the rows held out from them, side by side.
    held_out = report["held_out"]
    assert (held_out["split"]["fit_rows"], held_out["split"]["held_out_rows"]) == (38, 10)
    assert set(held_out["graphs"]) == int8
    for sides in held_out["graphs"].values():
        assert (sides["in_sample"]["rows"], sides["held_out"]["rows"]) == (38, 10)
        assert 0 < sides["held_out"]["cosine_min"] <= sides["held_out"]["cosine_mean"] <= 1 + 1e-6
    for label, row in report["results"].items():  # a near-tie is a change, never a real flip
        ties, changed = len(row["near_tie_flips"]), 48 * (100 - row["top1_agreement"]) / 100
        assert row["real_flips"] + ties == pytest.approx(changed), label
        assert row["top1_agreement_beyond_ties"] == pytest.approx(100 * (48 - row["real_flips"]) / 48, abs=1e-3)
    out = capsys.readouterr().out
    assert "top-1 agreement with FP32 % | agreement beyond near-ties % | near-tie flips" in out
    assert "## In-sample vs held out" in out and "| top-1 agreement % in-sample | held out |" in out


def test_unlabelled_model_without_calib_is_a_clear_error(tmp_path, capsys):
    argv = ["accuracy", "--model", "tests.helpers.toy_models:tiny_cnn", "--out", str(tmp_path)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "has no labelled held-out set" in err and "--calib" in err  # the command line's terms (make's under make)


def test_unknown_method_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["accuracy", "--calib-method", "kl"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "argument --calib-method: invalid choice: 'kl'" in err and "Traceback" not in err


def test_one_calibration_method_is_named_as_make_engine_names_it(tmp_path):
    """accuracy reads CALIB_METHOD as the build does (no second spelling of it): one method, and given with the
    default PRECISION it is not refused as an INT8-only setting, since accuracy makes every precision."""
    calib = tmp_path / "calib.npy"
    np.save(calib, np.random.default_rng(0).standard_normal((24, 3, 16, 16), dtype=np.float32))
    argv = ["accuracy", "--model", "tests.toy_models:tiny_cnn", "--calib", str(calib), "--calib-method", "entropy"]
    assert cli.main([*argv, "--out", str(tmp_path / "engines")]) == 0
    report = json.loads((tmp_path / "engines" / "toy_models-tiny_cnn-fp32" / "accuracy.json").read_text())
    assert set(report["results"]) == {"fp32", "fp16", "int8-entropy", "int8-entropy-ort"}


# QEMU's model of an AVX2 CPU without AVX-512 or VNNI: qemu-user (TCG) executes its instructions, and
# ONNX Runtime, asking CPUID, takes the AVX2 int8 kernels it would take on such a CPU.
AVX2_CPU = "Haswell-v4"
RUN_GRAPHS = """
import sys, numpy as np, onnxruntime as ort
inputs, out, *graphs = sys.argv[1:]
x = np.load(inputs)
results = {}
for index, graph in enumerate(graphs):
    session = ort.InferenceSession(graph, providers=["CPUExecutionProvider"])
    results[str(index)] = session.run(None, {session.get_inputs()[0].name: x})[0]
np.savez(out, **results)
"""


def _on_avx2_kernels() -> list[str] | str:
    """The command prefix under which ONNX Runtime runs its AVX2 int8 kernels here, or why there is none."""
    isa = cpu_instruction_sets()
    if isa is None or not isa["avx2"]:
        return "not an x86 CPU with AVX2"
    if int8_cpu_kind(isa) == NO_VNNI:
        return []  # this CPU's own kernels are the AVX2 ones
    qemu = shutil.which("qemu-x86_64")
    if qemu is None:
        return "this CPU has VNNI; running ONNX Runtime's AVX2 kernels takes qemu-user (apt-get install qemu-user)"
    return [qemu, "-cpu", AVX2_CPU]


def test_each_cpu_graph_on_the_avx2_kernels(digits_report, tmp_path):
    """The graph for CPUs without VNNI keeps its accuracy where ONNX Runtime runs AVX2's int8 kernels (natively
    on such a CPU, else under qemu-user), while the U8S8 graph for VNNI loses some there: the proof that the
    saturating AVX2 kernels really ran."""
    prefix = _on_avx2_kernels()
    if isinstance(prefix, str):
        pytest.skip(prefix)
    folder, _ = digits_report
    split = load_split()
    np.save(tmp_path / "held_out.npy", split.held_out_inputs)
    methods = ("max", "percentile", "entropy")
    graphs = {(method, kind): cpu_graph_path(folder, method, kind) for method in methods for kind in (NO_VNNI, VNNI)}
    paths = [folder / "model.onnx", *graphs.values()]
    command = [*prefix, sys.executable, "-c", RUN_GRAPHS, str(tmp_path / "held_out.npy"), str(tmp_path / "out.npz")]
    subprocess.run([*command, *map(str, paths)], check=True, capture_output=True, timeout=600)
    with np.load(tmp_path / "out.npz") as saved:
        fp32 = saved["0"]
        logits = {key: saved[str(index)] for index, key in enumerate(graphs, start=1)}
    fp32_top1 = np.mean(fp32.argmax(1) == split.held_out_labels) * 100
    top1 = {key: np.mean(out.argmax(1) == split.held_out_labels) * 100 for key, out in logits.items()}
    cosine = {key: _cosine_mean(fp32, out) for key, out in logits.items()}
    for method in methods:
        assert top1[method, NO_VNNI] >= fp32_top1 - 1.0, (fp32_top1, top1, cosine)
        assert cosine[method, NO_VNNI] > 0.998, cosine
        assert cosine[method, VNNI] < cosine[method, NO_VNNI] - 0.005, cosine  # U8S8 saturates on AVX2


def _cosine_mean(reference: np.ndarray, actual: np.ndarray) -> float:
    dot = np.sum(reference * actual, axis=1)
    return float(np.mean(dot / (np.linalg.norm(reference, axis=1) * np.linalg.norm(actual, axis=1))))
