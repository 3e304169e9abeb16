"""The whole pipeline end to end: make_engine, reuse, the command line and the Makefile target."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from trt_pipeline.pipeline.cli import main
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.settings import BatchProfile, Settings
from trt_pipeline.pipeline.folder.artifacts import running_build, sha256_file
from trt_pipeline.pipeline.folder.graph_io import load_reference
from trt_pipeline.pipeline.folder.layout import ARTIFACT_LAYOUT
from trt_pipeline.pipeline.runners import load_runner
from trt_pipeline.pipeline.stages.check import check_onnx
from trt_pipeline.pipeline.stages.sequence import make_engine

ROOT = Path(__file__).resolve().parents[2]
TINY = "tests.helpers.toy_models:tiny_cnn"
TEXT = "tests.helpers.toy_models:text_classifier"


def settings(tmp_path: Path, **changes) -> Settings:
    base = {"model": TINY, "precision": "fp16", "batch": BatchProfile(1, 2, 4), "out_root": tmp_path}
    return Settings(**{**base, **changes})


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_make_engine_writes_every_artifact_and_a_complete_manifest(tmp_path, precision):
    folder = make_engine(settings(tmp_path, precision=precision))
    assert folder == tmp_path / f"toy_models-tiny_cnn-{precision}"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["layout"] == ARTIFACT_LAYOUT
    assert manifest["opset"] == 17 and manifest["precision"] == precision
    assert manifest["inputs"] == [{"name": "input", "dtype": "float32", "shape": ["batch", 3, 16, 16]}]
    assert manifest["outputs"] == [{"name": "logits", "dtype": "float32", "shape": ["batch", 10]}]
    assert manifest["batch_profile"] == {"min": 1, "opt": 2, "max": 4}
    assert manifest["build"]["builder"]["module"] == "tensorrt_rtx"
    assert manifest["build"]["profile"]["input"]["max"] == [4, 3, 16, 16]
    graph = "model.onnx" if precision == "fp32" else "model.fp16.onnx"
    assert [(g["file"], g["precision"], g["target"]) for g in manifest["graphs"]][-1] == (graph, precision, "engine")
    for name, recorded in manifest["artifacts"].items():
        assert sha256_file(folder / name) == recorded["sha256"]
    assert {"model.onnx", "reference.npz", graph, "engine.plan"} <= set(manifest["artifacts"])
    assert manifest[f"parity_{precision}"]["max_rel"] < 1e-2
    assert set(manifest["timings"]) >= {"prepare", "export", "check", "simplify", "parity_fp32", "build"}
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]


def test_rerun_reuses_and_any_change_rebuilds(tmp_path, capsys):
    folder = make_engine(settings(tmp_path))
    built = (folder / "engine.plan").stat().st_mtime_ns
    capsys.readouterr()
    make_engine(settings(tmp_path))
    assert "up to date" in capsys.readouterr().out
    assert (folder / "engine.plan").stat().st_mtime_ns == built

    make_engine(settings(tmp_path, batch=BatchProfile(1, 2, 6)))  # another profile: rebuilt
    assert json.loads((folder / "manifest.json").read_text())["batch_profile"]["max"] == 6
    (folder / "engine.plan").write_bytes(b"truncated")  # damaged artifact: rebuilt
    capsys.readouterr()
    make_engine(settings(tmp_path, batch=BatchProfile(1, 2, 6)))
    assert "up to date" not in capsys.readouterr().out
    assert (folder / "engine.plan").stat().st_size > 1000


def test_multi_input_model_with_a_dynamic_sequence_builds(tmp_path):
    folder = make_engine(settings(tmp_path, model=TEXT))
    manifest = json.loads((folder / "manifest.json").read_text())
    assert [i["shape"] for i in manifest["inputs"]] == [["batch", "seq"], ["batch", "seq"]]
    assert manifest["axis_ranges"] == {"seq": [1, 12, 64]}
    assert manifest["build"]["profile"]["input_ids"] == {"min": [1, 1], "opt": [2, 12], "max": [4, 64]}


def test_resnet18_fp16_end_to_end(tmp_path):
    folder = make_engine(Settings(model="resnet18", batch=BatchProfile(1, 2, 4), out_root=tmp_path))
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["model"]["name"] == "resnet18" and any("random" in n for n in manifest["model"]["notes"])
    assert manifest["parity_fp32"]["max_rel"] < 1e-4 and manifest["parity_fp16"]["max_rel"] < 3e-2
    assert (folder / "engine.plan").stat().st_size > 1_000_000


def test_resnet50_export_check_parity(tmp_path):
    folder = make_engine(Settings(model="resnet", precision="fp32", batch=BatchProfile(1, 2, 3), out_root=tmp_path))
    assert folder.name == "resnet50-fp32"
    checked = check_onnx(folder / "model.onnx")
    assert checked["inputs"][0]["shape"] == ["batch", 3, 224, 224]
    assert [case[0]["input"].shape[0] for case in load_reference(folder / "reference.npz")] == [1, 2, 3]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trt_pipeline", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "resnet9000"], "unknown model 'resnet9000'"),
        (["--batch", "8:4:2"], "not ordered"),
        (["--batch", "eight"], "not of the form min:opt:max"),
        (["--precision", "int8"], "needs calibration data"),
        (["--weights", "/nonexistent.pth"], "does not exist"),
        (["--model", "no_such_package.module:factory"], "no_such_package"),
        (["--model", TINY, "--input-shape", "3x7"], "3x7"),
    ],
)
def test_bad_input_is_one_clear_error_and_exit_2(tmp_path, args, message):
    result = run_cli("all", "--out", str(tmp_path), *args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: ") and message in result.stderr
    assert "Traceback" not in result.stderr


def test_each_stage_runs_alone_on_what_is_on_disk(tmp_path, capsys):
    common = ["--model", TINY, "--precision", "fp16", "--batch", "1:2:4", "--out", str(tmp_path)]
    assert main(["check", *common]) == 2  # nothing exported yet
    assert "run the earlier stages first" in capsys.readouterr().err
    for stage in ("export", "check", "simplify", "parity", "precision", "build"):
        assert main([stage, *common]) == 0
    out = capsys.readouterr().out
    assert all(f"{name} " in out for name in ("export", "check", "simplify", "parity_fp32", "fp16", "build"))
    assert (tmp_path / "toy_models-tiny_cnn-fp16" / "engine.plan").is_file()


def _hide_tensorrt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hide both TensorRT modules from the import system, as on a machine where neither is installed."""
    for name in ("tensorrt", "tensorrt_rtx"):
        monkeypatch.setitem(sys.modules, name, None)


def test_a_builder_asked_for_by_name_must_be_there(tmp_path, monkeypatch):
    _hide_tensorrt(monkeypatch)
    with pytest.raises(PipelineError, match="no engine was built") as raised:
        make_engine(settings(tmp_path, builder="tensorrt_rtx"))
    assert "tensorrt-rtx" in str(raised.value) or "trt-pipeline[rtx]" in str(raised.value)
    folder = tmp_path / "toy_models-tiny_cnn-fp16"
    assert (folder / "model.fp16.onnx").is_file() and not (folder / "engine.plan").exists()
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["complete"] is False and manifest["build"]["status"] == "skipped"


def test_with_no_builder_the_folder_is_finished_without_an_engine(tmp_path, monkeypatch):
    """BUILDER=auto on a host with no TensorRT (a Hopper GPU machine): the checked graphs, a finished manifest that
    says why no engine was built, served through ONNX Runtime; an earlier build's engine goes, and once a builder
    imports the next make_engine builds the engine."""
    folder = make_engine(settings(tmp_path))
    assert (folder / "engine.plan").is_file()
    with monkeypatch.context() as hidden:
        _hide_tensorrt(hidden)
        assert make_engine(settings(tmp_path, force=True)) == folder
        manifest = json.loads((folder / "manifest.json").read_text())
        assert manifest["complete"] is True and manifest["build"]["status"] == "skipped"
        assert "tensorrt" in manifest["build"]["reason"].lower()
        assert not (folder / "engine.plan").exists() and "engine.plan" not in manifest["artifacts"]
        with load_runner(folder) as runner:
            assert runner.backend == "onnxruntime"
            assert f"no engine was built into {folder}" in runner.description
        with pytest.raises(PipelineError, match="the build was skipped"):
            load_runner(folder, "tensorrt")
        make_engine(settings(tmp_path))  # still no builder: up to date
        assert not (folder / "engine.plan").exists()
    make_engine(settings(tmp_path))  # a builder imports again: the engine is built
    manifest = json.loads((folder / "manifest.json").read_text())
    assert (folder / "engine.plan").is_file() and "status" not in manifest["build"]


def test_a_graph_tensorrt_refuses_is_finished_without_an_engine_and_served(tmp_path, capsys):
    """BUILDER=auto where TensorRT's parser refuses the gated graph (EyeLike on dynamic dims): the folder is finished
    without an engine, saying why and which builder refused, and served through ONNX Runtime; the same builder is not
    asked again; a builder asked for by name stops the build with the parser's error."""
    model = "tests.helpers.toy_models:plus_identity"
    folder = make_engine(settings(tmp_path, model=model))
    assert "no engine: TensorRT's ONNX parser rejected" in capsys.readouterr().out
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["build"]["status"] == "skipped"
    assert "EyeLike" in manifest["build"]["reason"] and manifest["build"]["builder"]["module"] == "tensorrt_rtx"
    assert not (folder / "engine.plan").exists()
    with load_runner(folder) as runner:
        x = np.random.default_rng(0).standard_normal((3, 5, 5)).astype(np.float32)
        np.testing.assert_allclose(runner.infer({"x": x})["output"], x + np.eye(5, dtype=np.float32), atol=1e-3)
    make_engine(settings(tmp_path, model=model))
    assert "up to date" in capsys.readouterr().out
    with pytest.raises(PipelineError, match="no engine was built: TensorRT's ONNX parser rejected"):
        make_engine(settings(tmp_path, model=model, builder="tensorrt_rtx", force=True))


def test_an_interrupted_build_leaves_nothing_that_loads(tmp_path):
    command = [sys.executable, "-m", "trt_pipeline", "all", "--model", "resnet18", "--precision", "fp32"]
    process = subprocess.Popen(
        [*command, "--batch", "1:2:4", "--out", str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    for line in process.stdout:  # the build starts right after this line: kill without warning
        if line.startswith("parity_fp32"):
            os.kill(process.pid, signal.SIGKILL)
            break
    process.wait(timeout=60)
    folder = tmp_path / "resnet18-fp32"
    deadline = time.monotonic() + 30  # the command's child, which builds, dies with it (it ran on, alone, before)
    while running_build(folder) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (folder / "engine.plan").exists()
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["complete"] is False
    onnx.checker.check_model(str(folder / "model.onnx"))  # what has its final name is whole
    assert load_reference(folder / "reference.npz")
    with pytest.raises(PipelineError, match="holds an unfinished build") as refused:  # and nothing of it is served
        load_runner(folder, "onnxruntime")
    rebuild = f'make_engine(Settings(model="resnet18", precision="fp32", batch="1:2:4", out_root="{tmp_path}"))'
    assert rebuild in str(refused.value.fix)
    make_engine(Settings(model="resnet18", precision="fp32", batch=BatchProfile(1, 2, 4), out_root=tmp_path))
    assert json.loads((folder / "manifest.json").read_text())["complete"] is True  # a rerun finishes the job
    assert not list(folder.rglob(".*.tmp"))  # and removes what the killed run was writing


def test_make_engine_target(tmp_path):
    make = ["make", "-s", "engine", f"MODEL={TINY}", "PRECISION=fp32", "BATCH=1:2:4", f"OUT={tmp_path}"]
    result = subprocess.run(make, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "build" in result.stdout and (tmp_path / "toy_models-tiny_cnn-fp32" / "engine.plan").is_file()
    failed = subprocess.run([*make[:3], "MODEL=nope", f"OUT={tmp_path}"], cwd=ROOT, capture_output=True, text=True)
    assert failed.returncode != 0 and "unknown model 'nope'" in failed.stderr


def _scripted_tiny_cnn(path: Path) -> None:
    from tests.helpers.toy_models import tiny_cnn

    torch.jit.save(torch.jit.script(tiny_cnn().module.eval()), str(path))


def _exported_tiny_cnn(path: Path) -> None:
    from tests.helpers.toy_models import tiny_cnn

    spec = tiny_cnn()
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(spec.module.eval(), (spec.example_inputs["input"],), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(path))


@pytest.mark.parametrize(("write", "file_name"), [(_scripted_tiny_cnn, "net.pt"), (_exported_tiny_cnn, "net.pt2")])
def test_torchscript_and_exported_program_files_build(tmp_path, write, file_name):
    write(tmp_path / file_name)
    folder = make_engine(
        settings(tmp_path, model=str(tmp_path / file_name), input_shape="3x16x16" if file_name == "net.pt" else None)
    )
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["parity_fp16"]["max_rel"] < 1e-2


def test_int8_rerun_notices_changed_calibration_data(tmp_path, capsys):
    import numpy as np

    data = tmp_path / "trt_pipeline.calibration.npy"
    np.save(data, np.random.default_rng(0).standard_normal((16, 3, 16, 16)).astype(np.float32))
    int8 = settings(tmp_path, precision="int8", calib=data, calib_samples=16, calib_batch=8)
    make_engine(int8)
    capsys.readouterr()
    make_engine(int8)
    assert "up to date" in capsys.readouterr().out
    np.save(data, np.random.default_rng(1).standard_normal((16, 3, 16, 16)).astype(np.float32))
    make_engine(int8)
    assert "up to date" not in capsys.readouterr().out


def test_a_folder_from_an_older_artifact_layout_is_rebuilt(tmp_path, capsys, monkeypatch):
    from trt_pipeline.pipeline.stages import sequence

    monkeypatch.setattr(sequence, "ARTIFACT_LAYOUT", sequence.ARTIFACT_LAYOUT - 1)  # as written by an earlier version
    make_engine(settings(tmp_path))
    monkeypatch.undo()
    capsys.readouterr()
    make_engine(settings(tmp_path))
    assert "up to date" not in capsys.readouterr().out
