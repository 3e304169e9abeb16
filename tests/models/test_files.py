"""Models given as files (pickled module, TorchScript, ExportedProgram, ONNX), their named inputs,
and graphs that crash ONNX Runtime."""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import toy_models
from trt_pipeline.models import load_model
from trt_pipeline.pipeline.core.errors import PipelineError


def test_pickled_whole_module_needs_input_shape(tmp_path: Path):
    path = tmp_path / "plain.pt"
    module = toy_models.plain_module()
    torch.save(module, path)
    with pytest.raises(PipelineError, match="(?s)is a pickled nn.Module.*Settings.input_shape"):
        load_model(str(path), trust_model_file=True)
    spec = load_model(str(path), input_shape="3x16x16", trust_model_file=True)
    assert spec.name == "plain"
    x = spec.example_inputs["input"]
    with torch.no_grad():
        assert torch.equal(spec.module(x), module(x))


def test_state_dict_as_model_is_refused_with_the_fix(tmp_path: Path):
    path = tmp_path / "weights_only.pth"
    torch.save(toy_models.tiny_cnn().module.state_dict(), path)
    with pytest.raises(PipelineError, match="is a state_dict") as caught:
        load_model(str(path))
    assert f'Settings(model=<registry name or package.module:factory>, weights="{path}")' in str(caught.value)


def test_file_that_is_not_a_model_is_refused(tmp_path: Path):
    path = tmp_path / "numbers.pt"
    torch.save([1, 2, 3], path)
    with pytest.raises(PipelineError, match="holds a list, not an nn.Module"):
        load_model(str(path))
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x00not a torch file")
    with pytest.raises(PipelineError, match="is not a file torch.load can read"):
        load_model(str(garbage))


def test_torchscript_file(tmp_path: Path):
    module = toy_models.plain_module()
    path = tmp_path / "scripted.ts"
    torch.jit.save(torch.jit.script(module), str(path))
    with pytest.raises(PipelineError, match="(?s)is a TorchScript file.*Settings.input_shape"):
        load_model(str(path))
    spec = load_model(str(path), input_shape="3x16x16")
    assert spec.name == "scripted" and spec.output_names == ["output"]
    x = spec.example_inputs["input"]
    with torch.no_grad():
        assert torch.allclose(spec.module(x), module(x))
    with pytest.raises(PipelineError, match=re.escape('Settings(input_shape="5x16x16")')):
        load_model(str(path), input_shape="5x16x16")


def test_exported_program_derives_its_inputs_with_batch_two(tmp_path: Path):
    spec = toy_models.tiny_cnn()
    module = spec.module.eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(module, (torch.randn(4, 3, 16, 16),), dynamic_shapes=({0: batch},))
    path = tmp_path / "tiny.pt2"
    torch.export.save(program, str(path))

    loaded = load_model(str(path))
    assert loaded.name == "tiny"
    assert list(loaded.example_inputs) == ["x"]  # the forward argument's name
    assert loaded.example_inputs["x"].shape == (2, 3, 16, 16)
    assert loaded.notes == []
    x = loaded.example_inputs["x"]
    loaded.module.eval()  # torch.export's own module raises here; the prepare stage calls it on every model
    assert not loaded.module.training
    with torch.no_grad():
        assert torch.allclose(loaded.module(x), module(x), atol=1e-6)
        assert loaded.module(torch.randn(5, 3, 16, 16)).shape == (5, 10)  # the batch stayed dynamic


def test_exported_program_with_a_static_batch_says_so(tmp_path: Path):
    module, example = toy_models.dropout_mlp()
    program = torch.export.export(module.eval(), (torch.randn(1, 16),))
    path = tmp_path / "static.pt2"
    torch.export.save(program, str(path))
    loaded = load_model(str(path))
    assert loaded.example_inputs["input"].shape == (1, 16)
    assert loaded.notes == ["static.pt2 was exported with a static batch of 1 on input: only that batch size will run"]
    with pytest.raises(PipelineError, match=re.escape('Settings(input_shape="17")')):
        load_model(str(path), input_shape="17")


def test_model_file_fingerprint_covers_the_file(tmp_path: Path):
    path = tmp_path / "plain.pt"
    torch.save(toy_models.plain_module(), path)
    first = load_model(str(path), input_shape="3x16x16", trust_model_file=True).fingerprint
    changed = toy_models.plain_module()
    with torch.no_grad():
        changed.fc.bias.add_(1)
    torch.save(changed, path)
    assert load_model(str(path), input_shape="3x16x16", trust_model_file=True).fingerprint != first


# ---------------------------------------------------------------- inputs bound to forward() by name


class _OptionalInputs(torch.nn.Module):
    """forward(x, mask=None, scale=None): an input bound by position to the wrong parameter changes the result."""

    def forward(self, x, mask=None, scale=None):
        y = x * 2
        if mask is not None:
            y = y + mask * 100
        return y * scale if scale is not None else y


def optional_inputs_dict():
    return _OptionalInputs(), {"scale": torch.full((2, 3), 3.0), "x": torch.ones(2, 3)}


def optional_inputs_tuple():
    return _OptionalInputs(), (torch.ones(2, 3), torch.zeros(2, 3))


def optional_inputs_unnamed():
    return _OptionalInputs(), {"a": torch.ones(2, 3), "b": torch.ones(2, 3)}


def test_dict_inputs_are_bound_by_name_through_export_and_parity(tmp_path: Path):
    """{"x", "scale"} for forward(x, mask=None, scale=None): scale must not feed mask, in PyTorch or in ONNX."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    from trt_pipeline.pipeline.core.settings import Settings
    from trt_pipeline.pipeline.stages.sequence import make_engine

    folder = make_engine(Settings(model=f"{__name__}:optional_inputs_dict", precision="fp32", out_root=tmp_path))
    graph = folder / "model.onnx"
    assert [value.name for value in onnx.load(str(graph)).graph.input] == ["x", "scale"]  # forward()'s order
    session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    x, scale = np.ones((4, 3), np.float32), np.full((4, 3), 3.0, np.float32)
    np.testing.assert_allclose(session.run(None, {"x": x, "scale": scale})[0], x * 2 * scale)
    from trt_pipeline.pipeline.runners import load_runner

    with load_runner(folder, "torch") as runner:  # the torch runner binds them by name too
        np.testing.assert_allclose(runner.infer({"x": x, "scale": scale})["output"], x * 2 * scale)


def test_tuple_inputs_take_forward_parameter_names():
    spec = load_model(f"{__name__}:optional_inputs_tuple")
    assert list(spec.example_inputs) == ["x", "mask"]


def one_input_tuple():
    return _OptionalInputs(), (torch.ones(2, 3),)


def test_a_one_input_tuple_takes_the_forward_parameter_name_too():
    """One rule for tuples of any length: (x,) is `x`, so DYNAMIC names it as forward() does (it was input_0)."""
    spec = load_model(f"{__name__}:one_input_tuple", dynamic="x:1=1:3:6")
    assert list(spec.example_inputs) == ["x"] and spec.dynamic_axes["x"][1].max == 6


def test_several_inputs_not_named_after_forward_are_refused():
    with pytest.raises(PipelineError, match=r"example inputs \['a', 'b'\] are not parameters of forward\(x, mask"):
        load_model(f"{__name__}:optional_inputs_unnamed")


# ---------------------------------------------------------------- MODEL=<file>.onnx


def _export_text_classifier(path: Path, *, opset: int = 17, sequence: str | None = "seq") -> Path:
    """The toy text classifier as a user would export it: batch named, the sequence named or left fixed."""
    spec = toy_models.text_classifier()
    axes = {name: {0: "batch", **({1: sequence} if sequence else {})} for name in spec.example_inputs}
    torch.onnx.export(
        spec.module.eval(),
        tuple(spec.example_inputs.values()),
        str(path),
        input_names=list(spec.example_inputs),
        output_names=["logits", "tokens"],
        dynamic_axes={**axes, "logits": {0: "batch"}, "tokens": {0: "batch", **({1: sequence} if sequence else {})}},
        opset_version=opset,
        dynamo=False,
    )
    return path


def _onnx_settings(model: Path, tmp_path: Path, **overrides):
    from trt_pipeline.pipeline.core.settings import BatchProfile, Settings

    defaults = {"precision": "fp16", "batch": BatchProfile(1, 2, 4), "out_root": tmp_path / "engines"}
    return Settings(model=str(model), **{**defaults, "builder": "tensorrt_rtx", **overrides})


def test_an_onnx_file_starts_at_check_with_its_own_fp32_outputs_as_the_reference(tmp_path: Path):
    from trt_pipeline.pipeline.folder.layout import MANIFEST
    from trt_pipeline.pipeline.stages.onnx_model import REFERENCE_SOURCE
    from trt_pipeline.pipeline.stages.sequence import make_engine

    graph = _export_text_classifier(tmp_path / "classifier.onnx", opset=13)  # converted to 17 on the way in
    folder = make_engine(_onnx_settings(graph, tmp_path, dynamic="input_ids:1=1:12:24,attention_mask:1=1:12:24"))
    manifest = json.loads((folder / MANIFEST).read_text())  # as written on disk
    assert manifest["reference_source"] == REFERENCE_SOURCE
    assert manifest["import"]["source_opset"] == 13
    assert manifest["axis_ranges"] == {"seq": [1, 12, 24]}  # the file's dim_param is the profile's axis
    assert [i["shape"] for i in manifest["inputs"]] == [["batch", "seq"], ["batch", "seq"]]
    assert "prepare" not in manifest and "export" not in manifest  # no PyTorch model was loaded
    assert manifest["parity_fp16"]["max_rel"] < 3e-2
    assert manifest["build"]["engine_bytes"] > 0


def test_an_onnx_files_symbolic_dims_need_a_range_or_a_size(tmp_path: Path):
    import onnx

    from trt_pipeline.pipeline.stages.sequence import make_engine

    graph = _export_text_classifier(tmp_path / "classifier.onnx")
    with pytest.raises(PipelineError) as error:
        make_engine(_onnx_settings(graph, tmp_path))
    assert "input_ids axis 1 ('seq')" in error.value.problem
    assert 'Settings(dynamic="input_ids:1=' in (error.value.fix or "")
    # INPUT_SHAPE fixes the sequence at 10 instead.
    shape = "input_ids=10:int64,attention_mask=10:float32"
    folder = make_engine(_onnx_settings(graph, tmp_path, precision="fp32", input_shape=shape))
    dims = [
        [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in onnx.load(str(folder / "model.onnx")).graph.input
    ]
    assert dims == [["batch", 10], ["batch", 10]]


def test_an_onnx_file_with_a_fixed_batch_is_refused(tmp_path: Path):
    from trt_pipeline.pipeline.stages.sequence import make_engine

    spec = toy_models.tiny_cnn()
    graph = tmp_path / "fixed.onnx"
    torch.onnx.export(spec.module.eval(), tuple(spec.example_inputs.values()), str(graph), dynamo=False)
    with pytest.raises(PipelineError) as error:
        make_engine(_onnx_settings(graph, tmp_path))
    assert "dim 0 2" in error.value.problem and "dynamic_axes=" in (error.value.fix or "")


# ---------------------------------------------------------------- an ONNX Runtime crash is contained


def _segfault() -> None:
    """A real SIGSEGV (reading address 0 through ctypes), standing in for a crash inside ONNX Runtime's C++."""
    import ctypes

    ctypes.string_at(0)


def _crash_at_full_optimization(path: Path, level: str):
    from trt_pipeline.pipeline.core.sessions import OPTIMIZATION_LEVELS, _open

    if level == OPTIMIZATION_LEVELS[0]:
        _segfault()
    return _open(path, None, level)


class _CrashingRun:
    """A real session on the graph whose run segfaults, standing in for an ONNX Runtime kernel crash (none known
    in ORT 1.31/1.32) at the levels in `crashing`."""

    def __init__(self, path: Path, level: str, crashing: tuple[str, ...]):
        from trt_pipeline.pipeline.core.sessions import _open

        self.session, self.crashes = _open(path, None, level), level in crashing

    def run(self, names, feed):
        if self.crashes:
            _segfault()
        return self.session.run(names, feed)


def test_a_native_crash_kills_only_the_child():
    from trt_pipeline.pipeline.core.sessions import crash_in_child

    assert crash_in_child(_segfault) == "SIGSEGV"
    assert crash_in_child(len, "exits normally") is None
    assert crash_in_child(int, "not a number") is None  # a Python error is not a crash


def test_a_probe_child_that_hangs_is_stopped_and_counts_as_no_crash(monkeypatch, capsys):
    """A forked child can wait forever on a lock another thread of the parent held at the fork: the parent stops
    it after PROBE_TIMEOUT_S instead of waiting with it."""
    import time

    from trt_pipeline.pipeline.core import sessions

    monkeypatch.setattr(sessions, "PROBE_TIMEOUT_S", 0.5)
    started = time.monotonic()
    assert sessions.crash_in_child(time.sleep, 60) is None
    assert time.monotonic() - started < 30
    assert "hung for 0.5 s; stopped it" in capsys.readouterr().out


def test_a_graph_that_crashes_at_full_optimization_opens_one_level_lower(tmp_path: Path, capsys):
    from trt_pipeline.pipeline.core.sessions import OPTIMIZATION_LEVELS, level_that_opens

    graph = _export_text_classifier(tmp_path / "classifier.onnx")
    assert level_that_opens(graph, lambda level: _crash_at_full_optimization(graph, level)) == OPTIMIZATION_LEVELS[1]
    assert "crashed on classifier.onnx (SIGSEGV at ORT_ENABLE_ALL)" in capsys.readouterr().out


def test_a_graph_whose_first_run_crashes_is_probed_with_the_feed_and_opens_lower(tmp_path: Path, capsys):
    from trt_pipeline.pipeline.core.sessions import OPTIMIZATION_LEVELS, level_that_opens

    graph = _export_text_classifier(tmp_path / "classifier.onnx")
    feed = {"input_ids": np.ones((1, 12), np.int64), "attention_mask": np.ones((1, 12), np.int64)}
    crashing = OPTIMIZATION_LEVELS[:2]
    # Opening alone does not crash, so a probe without the feed keeps the highest level...
    assert level_that_opens(graph, lambda level: _CrashingRun(graph, level, crashing)) == OPTIMIZATION_LEVELS[0]
    # ...and the run on the feed is what finds the level that works.
    level = level_that_opens(graph, lambda level: _CrashingRun(graph, level, crashing), feed)
    assert level == OPTIMIZATION_LEVELS[2]
    assert "SIGSEGV at ORT_ENABLE_ALL; SIGSEGV at ORT_ENABLE_EXTENDED" in capsys.readouterr().out


def test_a_graph_that_crashes_at_every_level_is_a_clear_error_through_the_command_line(tmp_path: Path):
    """The check stage's session on a graph whose every opening segfaults: exit 2, the graph named, no traceback."""
    import subprocess
    import sys

    graph = _export_text_classifier(tmp_path / "classifier.onnx")
    script = textwrap.dedent(
        f"""
        import sys
        from trt_pipeline.pipeline import cli
        from trt_pipeline.pipeline.core import sessions
        from tests.models.test_files import _segfault
        real = sessions.level_that_opens
        sessions.level_that_opens = lambda path, open_at, feed=None: real(path, lambda level: _segfault(), feed)
        sys.exit(cli.main(["check", "--model", {str(graph)!r}, "--out", {str(tmp_path / "engines")!r},
                           "--dynamic", "input_ids:1=1:12:24,attention_mask:1=1:12:24"]))
        """
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "trt_pipeline",
            "export",
            "--model",
            str(graph),
            "--out",
            str(tmp_path / "engines"),
            "--dynamic",
            "input_ids:1=1:12:24,attention_mask:1=1:12:24",
        ],
        check=True,
        capture_output=True,
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert "ONNX Runtime crashed opening" in done.stderr and "model.onnx at every optimization level" in done.stderr
    assert "SIGSEGV at ORT_DISABLE_ALL" in done.stderr and "Traceback" not in done.stderr


def _crash_before(open_at, level: str):
    from trt_pipeline.pipeline.core.sessions import OPTIMIZATION_LEVELS

    if level == OPTIMIZATION_LEVELS[0]:
        _segfault()
    return open_at(level)


def test_the_level_a_build_fell_back_to_is_recorded_and_the_runner_opens_at_it(tmp_path: Path):
    """A build whose graphs crash ONNX Runtime at full optimization (the stand-in as above): the manifest records
    the level that worked for each graph the folder serves, and the runner opens the graph's bytes at it."""
    import subprocess

    import onnxruntime

    from trt_pipeline import load_runner
    from trt_pipeline.pipeline.folder.manifest import read_manifest

    out = tmp_path / "engines"
    script = textwrap.dedent(
        f"""
        import sys
        from trt_pipeline.pipeline import cli
        from trt_pipeline.pipeline.core import sessions
        from tests.models.test_files import _crash_before
        real = sessions.level_that_opens
        sessions.level_that_opens = lambda path, open_at, feed=None: real(
            path, lambda level: _crash_before(open_at, level), feed
        )
        sys.exit(cli.main(["engine", "--model", "tests.helpers.toy_models:tiny_cnn", "--precision", "fp32",
                           "--out", {str(out)!r}, "--batch", "1:2:4"]))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "opened it at ORT_ENABLE_EXTENDED instead" in done.stdout
    folder = out / "toy_models-tiny_cnn-fp32"
    manifest = read_manifest(folder)
    assert manifest is not None and manifest.onnxruntime_levels == {"model.onnx": "ORT_ENABLE_EXTENDED"}
    with load_runner(folder, "onnxruntime", providers=["CPUExecutionProvider"]) as runner:
        level = runner.session.get_session_options().graph_optimization_level
        assert level == onnxruntime.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        assert runner.infer({"input": np.zeros((2, 3, 16, 16), np.float32)})["logits"].shape == (2, 10)


# ---------------------------------------------------------------- a static token sequence is worth a warning


def test_a_static_token_sequence_is_warned_about_with_the_dynamic_that_fixes_it(tmp_path: Path, capsys):
    from trt_pipeline.pipeline.stages.export import export_onnx, static_token_sequences

    dynamic = load_model("tests.helpers.toy_models:text_classifier")
    assert static_token_sequences(dynamic) is None  # its sequence axis is declared
    static = load_model("tests.helpers.toy_models:text_classifier", dynamic="none")
    record = export_onnx(static, tmp_path / "model.onnx")
    printed = capsys.readouterr().out
    # input_ids is an integer token input; the float attention_mask is not
    assert "integer token input(s) input_ids (12) have a static sequence axis" in printed
    assert 'Settings(dynamic="input_ids:1=1:12:512") makes it dynamic' in printed
    assert record["warnings"] == [printed.strip().removeprefix("warning: ")]
