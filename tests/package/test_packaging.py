"""What gets installed and how it is met: the version, the help, the extras and their errors, the API."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib

import trt_pipeline
from trt_pipeline.pipeline.cli import main
from trt_pipeline.pipeline.core.extras import EXTRA_OF_MODULE, missing_module_error, requirements

ROOT = Path(__file__).resolve().parents[2]


def test_version_is_the_installed_distribution(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"trt-pipeline {trt_pipeline.__version__}"
    assert trt_pipeline.__version__ != "0+unknown"


def test_help_shows_defaults_and_the_command_name(capsys):
    with pytest.raises(SystemExit):
        main(["engine", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines at the terminal's width
    assert text.startswith("usage: trt-pipeline engine")
    assert "(default: 1:8:32)" in text and "(default: fp16)" in text
    assert "(default: None)" not in text and "(default: False)" not in text


def test_errors_speak_make_under_make_and_options_otherwise(tmp_path):
    command = [sys.executable, "-m", "trt_pipeline", "engine", "--precision", "int8", "--out", str(tmp_path)]
    plain = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)
    under_make = subprocess.run(
        command, capture_output=True, text=True, cwd=ROOT, timeout=120, env={**_env(), "TRT_PIPELINE_FRONT_END": "make"}
    )
    assert plain.returncode == under_make.returncode == 2
    assert "--calib" in plain.stderr and "CALIB=" not in plain.stderr
    assert "CALIB=" in under_make.stderr


def test_every_extra_named_for_a_module_exists_in_pyproject():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(EXTRA_OF_MODULE.values()) <= set(declared)
    assert requirements("rtx") == declared["rtx"], "the installed metadata is stale: pip install -e '.[all,dev]'"


def test_a_missing_extra_is_one_error_naming_its_install():
    # The import system's own refusal (a None entry in sys.modules), in a fresh interpreter.
    script = textwrap.dedent(
        """
        import sys
        sys.modules["skimage"] = None
        from trt_pipeline.pipeline.cli import main
        sys.exit(main(["calibration-images", "--out", sys.argv[1]]))
        """
    )
    out = ROOT / "build" / "never-written"
    result = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "skimage is not installed" in result.stderr and "`demo` extra" in result.stderr
    assert "scikit-image" in result.stderr  # the requirement itself, read from the installed metadata


def test_a_module_of_no_extra_is_left_a_bug():
    with pytest.raises(ModuleNotFoundError) as raised:
        import no_such_module_anywhere  # noqa: F401
    assert missing_module_error(raised.value) is None
    assert "`build` extra" in str(missing_module_error(ModuleNotFoundError(name="torch.nn")))


def test_onnxruntime_broken_by_its_two_wheels_is_named(tmp_path):
    # What removing one of onnxruntime / onnxruntime-gpu leaves: the shared folder without its __init__.py.
    (tmp_path / "onnxruntime" / "capi").mkdir(parents=True)
    script = textwrap.dedent(
        """
        import sys
        from trt_pipeline.pipeline.core.errors import PipelineError
        from trt_pipeline.pipeline.core.extras import import_onnxruntime
        try:
            import_onnxruntime()
        except PipelineError as error:
            print(error)
        """
    )
    # -S: no site-packages, so the real onnxruntime cannot win over the broken folder.
    result = subprocess.run(
        [sys.executable, "-S", "-c", script],
        capture_output=True,
        text=True,
        env={**_env(), "PYTHONPATH": f"{tmp_path}:{ROOT}"},
    )
    assert "cannot be imported whole" in result.stdout, result.stdout + result.stderr
    assert "pip uninstall -y onnxruntime onnxruntime-gpu" in result.stdout


def test_the_api_names_functions_and_help_lists_them():
    from trt_pipeline import compare, load_runner, prepare

    assert callable(compare) and callable(prepare) and callable(load_runner)
    assert type(compare).__name__ == "function" and type(prepare).__name__ == "function"
    assert {"load_runner", "make_engine", "Settings", "__version__"} <= set(dir(trt_pipeline))


def _env() -> dict[str, str]:
    import os

    return {key: value for key, value in os.environ.items() if key != "TRT_PIPELINE_FRONT_END"}


def test_a_command_imports_only_its_own_module():
    # `serve` must start without the build: the command line imports a command's module only when it runs.
    script = textwrap.dedent(
        """
        import sys
        from trt_pipeline.pipeline.cli import build_parser
        build_parser("serve").parse_args(["serve", "engines/x"])
        build_parser("triton").parse_args(["triton", "engines/x", "--repo", "r"])
        assert "torch" not in sys.modules, sorted(name for name in sys.modules if name.startswith("torch"))[:5]
        assert "trt_pipeline.pipeline.bench" not in sys.modules
        assert "trt_pipeline.pipeline.quality.accuracy" not in sys.modules
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_a_project_with_its_own_models_pipeline_and_calibration_keeps_them(tmp_path):
    # A user's project whose package names are ours too: trt_pipeline imports none of them, and
    # MODEL=models.my_net:build finds the project's own.
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("")
    (tmp_path / "models" / "my_net.py").write_text(
        "import torch\n\n\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear(4, 3)), (torch.zeros(2, 4),)\n"
    )
    (tmp_path / "pipeline.py").write_text("OWN = 'the project'\n")
    (tmp_path / "calibration").mkdir()
    (tmp_path / "calibration" / "__init__.py").write_text("OWN = 'the project'\n")
    env = {key: value for key, value in _env().items() if key != "PYTHONPATH"}  # the installed trt_pipeline only
    command = [sys.executable, "-m", "trt_pipeline", "engine", "--model", "models.my_net:build", "--precision", "fp32"]
    built = subprocess.run(
        [*command, "--batch", "1:2:4", "--out", "out"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert built.returncode == 0, built.stderr
    (folder,) = (tmp_path / "out").iterdir()
    script = textwrap.dedent(
        f"""
        import numpy as np
        import calibration, pipeline
        from trt_pipeline import load_runner
        assert pipeline.OWN == calibration.OWN == "the project"
        with load_runner({str(folder)!r}) as runner:
            (output,) = runner.infer({{spec.name: np.ones((2, 4), np.float32) for spec in runner.inputs}}).values()
            print(output.shape)
        """
    )
    used = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert used.returncode == 0, used.stderr
    assert used.stdout.strip() == "(2, 3)"
