"""A catalogue of bad inputs through the command line and `make`: each one is one `error:` line with the fix,
exit status 2, no traceback, and nothing it names is executed.  Add a case whenever a new one is found.

Security cases first: a pickled model file runs code only with TRUST_MODEL_FILE=1, and make variables
reach Python as data, never as shell or make code.
"""

from __future__ import annotations

import inspect
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.bad_inputs.cases import BAD_SETTINGS, BadSetting, build_argv
from tests.helpers import bad_factories, toy_models
from trt_pipeline.pipeline import cli
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.runners import load_runner

ROOT = Path(__file__).resolve().parents[2]


class _RunsCode:
    """Unpickling this runs `touch <path>`: what a crafted model file can do."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _cli_error(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and "\n  fix: " in err, err
    return err


def test_a_pickled_model_file_runs_no_code_unless_trusted(tmp_path, capsys):
    crafted, marker = tmp_path / "model.pt", tmp_path / "EXECUTED"
    torch.save(_RunsCode(marker), crafted)
    err = _cli_error(["all", "--model", str(crafted), "--out", str(tmp_path / "engines")], capsys)
    assert "loading it runs code the file contains" in err and "--trust-model-file" in err
    assert not marker.exists()


def test_a_trusted_pickled_module_loads_and_its_torch_runner_asks_again(tmp_path, capsys):
    module = tmp_path / "plain.pt"
    torch.save(toy_models.plain_module(), module)
    argv = ["all", "--model", str(module), "--input-shape", "3x16x16", "--precision", "fp32"]
    assert cli.main([*argv, "--out", str(tmp_path / "engines"), "--trust-model-file"]) == 0
    folder = tmp_path / "engines" / "plain-fp32"
    # The folder may come from someone else: the torch runner does not take the build's trust from it.
    with pytest.raises(PipelineError, match="loading it runs code the file contains"):
        load_runner(folder, "torch")
    with load_runner(folder, "torch", trust_model_file=True) as runner:
        assert runner.infer({"input": np.zeros((2, 3, 16, 16), np.float32)})["output"].shape[0] == 2


@pytest.mark.parametrize("setting", BAD_SETTINGS, ids=lambda setting: setting.id)
def test_bad_settings(setting: BadSetting, tmp_path, capsys):
    err = _cli_error(build_argv(list(setting.options), str(tmp_path / "engines")), capsys)
    assert all(name in err for name in setting.names), err


@pytest.mark.parametrize(
    ("factory", "names"),
    [("killed", ["SIGKILL", "out-of-memory killer", "--batch"]), ("crashes", ["SIGSEGV", "PYTHONFAULTHANDLER=1"])],
)
def test_a_command_killed_or_crashed_in_native_code_ends_in_one_error(factory, names, tmp_path):
    """Killed for memory, the build ended with exit 137 and not a word; a native crash with exit 139."""
    argv = ["engine", "--model", f"tests.helpers.bad_factories:{factory}", "--out", str(tmp_path / "engines")]
    done = subprocess.run(
        [sys.executable, "-m", "trt_pipeline", *argv], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert done.stderr.startswith("error: the command stopped: ") and "\n  fix: " in done.stderr, done.stderr
    assert all(name in done.stderr for name in names) and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("option", ["--out", "--weights", "--calib"])
def test_an_empty_path_is_refused_not_read_as_the_current_directory(option, capsys):
    # OUT= with nothing after it wrote the artifact folder into the current directory.
    with pytest.raises(SystemExit) as exited:
        cli.main(["all", "--model", "tests.helpers.toy_models:tiny_cnn", option, ""])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and f"argument {option}: an empty path" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "refused"),
    [
        (["engine", "--precision", "int8", "--precision", "fp32"], "--precision is given twice ('int8', then 'fp32')"),
        (["engine", "--prec", "int8", "--precision=fp32"], "--precision is given twice ('int8', then 'fp32')"),
        (["engine", "--force", "--force"], "--force is given twice: give it once"),
        (["serve", "f", "--port", "8000", "--port", "8001"], "--port is given twice ('8000', then '8001')"),
        (["bench", "--folder", "a", "--folder", "b"], "--folder is given twice ('a', then 'b')"),
        (["triton", "f", "--repo", "a", "--repo", "b"], "--repo is given twice ('a', then 'b')"),
        (["accuracy", "--out", "a", "--out", "b"], "--out is given twice ('a', then 'b')"),
        (["calibration-images", "--out", "a", "--out=b"], "--out is given twice ('a', then 'b')"),
    ],
    ids=["engine", "engine-abbreviated", "engine-switch", "serve", "bench", "triton", "accuracy", "calibration-images"],
)
def test_an_option_given_twice_is_refused_naming_both_values(argv, refused, tmp_path, monkeypatch, capsys):
    # argparse kept the last value without a word: --precision int8 --precision fp32 built FP32.
    monkeypatch.chdir(tmp_path)  # the relative paths given, were the command to run
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and f"error: {refused}" in err and "Traceback" not in err, err


def test_weights_that_are_not_a_torch_file(tmp_path, capsys):
    text = tmp_path / "notes.pth"
    text.write_text("hello\n")
    err = _cli_error(["all", "--model", "resnet18", "--weights", str(text), "--out", str(tmp_path)], capsys)
    assert "is not a file torch.load can read" in err


@pytest.mark.parametrize(
    ("factory", "raised"),
    [("raises", "ValueError: no weights here"), ("exits", "SystemExit: 0")],
    ids=["raises", "exits-0"],  # sys.exit(0) ended the run with status 0 and no word
)
def test_a_factory_that_raises_is_named_with_its_message(factory, raised, tmp_path, capsys):
    model = f"tests.helpers.bad_factories:{factory}"
    err = _cli_error(["all", "--model", model, "--out", str(tmp_path / "engines")], capsys)
    line = inspect.getsourcelines(getattr(bad_factories, factory))[1] + 1  # the raise, on the function's first line
    assert f"the factory raised {raised} (at " in err and f"bad_factories.py:{line})" in err


def test_a_model_whose_output_is_nan_is_not_called_random(tmp_path, capsys):
    # NaN != NaN: the determinism check read it as an output that changed between two calls.
    model = "tests.helpers.bad_factories:nan_model"
    err = _cli_error(["all", "--model", model, "--out", str(tmp_path / "engines")], capsys)
    assert "output 0 holds NaN for the example inputs" in err and "randomness" not in err


def test_an_out_folder_under_a_file(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    argv = [
        "all",
        "--model",
        "tests.helpers.toy_models:tiny_cnn",
        "--precision",
        "fp32",
        "--out",
        str(tmp_path / "file" / "x"),
    ]
    assert "a part of the path is a file, not a folder" in _cli_error(argv, capsys)


def test_a_file_size_limit_is_named_with_its_fix(tmp_path, capsys):
    # Python ignores SIGXFSZ, so a write past RLIMIT_FSIZE fails with EFBIG: it got the generic "check the disk".
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    argv = ["all", "--model", "tests.helpers.toy_models:tiny_cnn", "--precision", "fp32", "--out", str(tmp_path)]
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        err = _cli_error(argv, capsys)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert "File too large" in err and "ulimit -f" in err


def _make(*assignments: str) -> subprocess.CompletedProcess:
    # -o: the venv running these tests is taken as set up (a fresh worktree's pyproject.toml is newer than its stamp)
    command = ["make", "-s", "-o", ".venv/.installed", "engine", *assignments]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize(
    "model",
    # the shell, then make, would run the touch; a line break split the recipe and broke the shell's quoting
    ["x'; touch {marker}; echo '", "$(shell touch {marker})", "x\ntouch {marker}"],
    ids=["shell", "make", "line-break"],
)
def test_make_variables_run_no_code(model, tmp_path):
    marker = tmp_path / "INJECTED"
    result = _make(f"MODEL={model.format(marker=marker)}", f"OUT={tmp_path}/engines")
    assert result.returncode != 0 and "error: " in result.stderr and "Traceback" not in result.stderr
    assert not marker.exists()


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_passes_a_quote_in_a_path_intact(tmp_path):
    out = tmp_path / "it's"
    result = _make("MODEL=tests.helpers.toy_models:tiny_cnn", "PRECISION=fp32", f"OUT={out}")
    assert result.returncode == 0, result.stderr
    assert (out / "toy_models-tiny_cnn-fp32" / "manifest.json").is_file()


def _make_with_trust(word: str, tmp_path) -> tuple[subprocess.CompletedProcess, Path]:
    """`make engine` on a pickle whose loading writes a marker file, with TRUST_MODEL_FILE=`word`: (the result, the
    marker's path), the engines under tmp_path/engines."""
    crafted, marker = tmp_path / "model.pt", tmp_path / "EXECUTED"
    torch.save(_RunsCode(marker), crafted)
    result = _make(f"MODEL={crafted}", f"TRUST_MODEL_FILE={word}", "PRECISION=fp32", f"OUT={tmp_path}/engines")
    return result, marker


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize("word", ["0", "no", "False", ""])
def test_a_switch_given_as_off_is_off(word, tmp_path):
    # make passed --trust-model-file for any word but nothing: TRUST_MODEL_FILE=0 ran the pickle's code.
    result, marker = _make_with_trust(word, tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "loading it runs code the file contains" in result.stderr and "TRUST_MODEL_FILE=1" in result.stderr
    assert not marker.exists()


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_a_switch_given_as_yes_is_on(tmp_path):
    _, marker = _make_with_trust("yes", tmp_path)
    assert marker.exists()  # trusted: its code ran (what it unpickles to is no model, so the run fails after)


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize("word", ["maybe", "2", "on", "y"])
def test_a_switch_given_another_word_is_refused_before_anything_runs(word, tmp_path):
    result, marker = _make_with_trust(word, tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"error: TRUST_MODEL_FILE is a switch, on or off, and {word!r} is neither" in result.stderr
    assert "fix: give TRUST_MODEL_FILE=1 (or yes, true) to switch it on; 0, no, false or nothing" in result.stderr
    assert not marker.exists() and not (tmp_path / "engines").exists()


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_force_0_reuses_the_folder_and_force_true_rebuilds_it(tmp_path):
    build = ["MODEL=tests.helpers.toy_models:tiny_cnn", "PRECISION=fp32", f"OUT={tmp_path}"]
    assert _make(*build).returncode == 0
    manifest = tmp_path / "toy_models-tiny_cnn-fp32" / "manifest.json"
    written = manifest.read_bytes()
    kept = _make(*build, "FORCE=0")
    assert kept.returncode == 0 and "up to date" in kept.stdout, kept.stderr
    assert manifest.read_bytes() == written
    rebuilt = _make(*build, "FORCE=TRUE")
    assert rebuilt.returncode == 0 and "up to date" not in rebuilt.stdout, rebuilt.stderr


@pytest.mark.parametrize("text", ["[1, 2]", '"a string"', "\xff\xfe"], ids=["list", "string", "not-utf8"])
def test_a_manifest_that_is_not_a_json_object(text, tmp_path):
    (tmp_path / "manifest.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(PipelineError, match="manifest.json (holds a JSON|is not valid JSON)") as caught:
        load_runner(tmp_path)
    assert "rebuild the folder: make_engine(Settings(" in caught.value.fix


def _built(tmp_path_factory: pytest.TempPathFactory, model: str) -> Path:
    from trt_pipeline.pipeline.core.settings import Settings
    from trt_pipeline.pipeline.stages.sequence import make_engine

    out = tmp_path_factory.mktemp("engines")
    return make_engine(Settings(model=f"tests.helpers.toy_models:{model}", precision="fp32", out_root=out))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _built(tmp_path_factory, "tiny_cnn")


def _edited(folder: Path, tmp_path: Path, **changes: object) -> Path:
    from trt_pipeline.pipeline.folder.manifest import update_manifest

    copy = tmp_path / folder.name
    shutil.copytree(folder, copy)
    update_manifest(copy, **changes)
    return copy


@pytest.mark.parametrize("profile", [{"min": 1, "opt": 1, "max": 0}, {"min": 1}, {"max": "many"}])
def test_a_damaged_batch_profile(profile, tiny_folder, tmp_path):
    with pytest.raises(PipelineError, match="batch_profile .* has no max of 1 row or more"):
        load_runner(_edited(tiny_folder, tmp_path, batch_profile=profile), "onnxruntime")


@pytest.mark.parametrize(
    "inputs",
    ["input", [{"name": "input", "dtype": "nosuch", "shape": ["batch", 3, 16, 16]}], [{"name": "input"}]],
    ids=["a-string", "unknown-dtype", "no-shape"],
)
def test_damaged_input_records_in_the_manifest(inputs, tiny_folder, tmp_path):
    with pytest.raises(PipelineError, match=r"manifest\.json is damaged: its inputs") as caught:
        load_runner(_edited(tiny_folder, tmp_path, inputs=inputs), "onnxruntime")
    assert "rebuild the folder" in caught.value.fix


def test_an_unknown_runner_option_is_named_with_the_known_ones(tiny_folder):
    with pytest.raises(PipelineError, match="the onnxruntime runner takes no option threads") as caught:
        load_runner(tiny_folder, "onnxruntime", threads=2)
    assert "intra_op_threads" in caught.value.fix


def test_values_onnx_runtime_refuses_are_a_pipeline_error(tmp_path_factory):
    # A token id beyond the embedding: names, dtypes and shapes are right, ONNX Runtime's Gather refuses it.
    with load_runner(_built(tmp_path_factory, "text_classifier"), "onnxruntime") as runner:
        feed = {"input_ids": np.array([[1, 10**6, 3]], np.int64), "attention_mask": np.ones((1, 3), np.float32)}
        with pytest.raises(PipelineError, match="ONNX Runtime could not run .* on these inputs") as caught:
            runner.infer(feed)
    assert "token ids must lie within" in caught.value.fix


def test_an_empty_triton_model_name_is_refused_not_defaulted(tiny_folder, tmp_path, capsys):
    argv = ["triton", str(tiny_folder), "--repo", str(tmp_path / "repo"), "--name", ""]
    assert "model name '' cannot be a folder of the repository" in _cli_error(argv, capsys)
    assert not (tmp_path / "repo").exists()


def test_a_serve_host_that_is_no_address_is_refused_before_loading(tiny_folder, capsys):
    # uvicorn logged it and exited 3 after the model had loaded
    argv = ["serve", str(tiny_folder), "--host", "not a host", "--port", "8000", "--grpc-port", "0"]
    assert "--host 'not a host' is not an address" in _cli_error(argv, capsys)
