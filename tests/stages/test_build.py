"""The build stage, for real: tiny ONNX graphs built into engines with TensorRT-RTX (no GPU needed).

Whole file: about 5 s of tests (9 s wall with pytest start-up and imports) on a 2-core CPU machine.
Running the engines needs a GPU and belongs to the runner's tests.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from trt_pipeline.pipeline.core import trt_module
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.settings import BatchProfile
from trt_pipeline.pipeline.stages.build import build_engine

rtx = pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed: pip install tensorrt-rtx-cu13")

BATCH = BatchProfile(1, 2, 4)


def _full_tensorrt_usable() -> bool:
    module, _ = trt_module._try_import("tensorrt")
    return module is not None and trt_module.gpu_present()


class TinyConvNet(torch.nn.Module):
    """conv -> relu -> global mean -> linear; 2-D (image) or 1-D (sequence) input."""

    def __init__(self, dims: int):
        super().__init__()
        conv = torch.nn.Conv2d if dims == 2 else torch.nn.Conv1d
        self.conv = conv(3, 4, 3, padding=1)
        self.head = torch.nn.Linear(4, 2)
        self.spatial = tuple(range(2, 2 + dims))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).mean(self.spatial))


def _export(model: torch.nn.Module, example: torch.Tensor, path: Path, input_axes: dict[int, str]) -> Path:
    # dynamo=False on purpose (the pipeline's exporter); torch warns that it is the legacy path.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "You are using the legacy TorchScript-based ONNX export")
        _export_quietly(model, example, path, input_axes)
    return path


def _export_quietly(model: torch.nn.Module, example: torch.Tensor, path: Path, input_axes: dict[int, str]) -> None:
    torch.onnx.export(
        model.eval(),
        (example,),
        str(path),
        dynamo=False,
        opset_version=17,
        input_names=["x"],
        output_names=["y"],
        dynamic_axes={"x": input_axes, "y": {0: "batch"}},
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    folder = tmp_path_factory.mktemp("onnx")
    torch.manual_seed(0)
    fp32 = _export(TinyConvNet(2), torch.randn(2, 3, 8, 8), folder / "model.fp32.onnx", {0: "batch"})
    fp16 = folder / "model.fp16.onnx"
    onnx.save(convert_float_to_float16(onnx.load(str(fp32)), keep_io_types=True), str(fp16))
    seq = _export(TinyConvNet(1), torch.randn(2, 3, 8), folder / "seq.onnx", {0: "batch", 2: "length"})
    return {"fp32": fp32, "fp16": fp16, "seq": seq}


def _custom_op_model(path: Path) -> Path:
    """Relu between two nodes of an unknown custom domain: the parser must name both."""
    nodes = [
        helper.make_node("Frobnicate", ["x"], ["a"], name="custom_first", domain="com.example"),
        helper.make_node("Relu", ["a"], ["b"], name="fine_relu"),
        helper.make_node("Frobnicate", ["b"], ["y"], name="custom_second", domain="com.example"),
    ]
    graph = helper.make_graph(
        nodes,
        "custom",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)]
    onnx.save(helper.make_model(graph, opset_imports=opsets), str(path))
    return path


def _fixed_reshape_model(path: Path) -> Path:
    """Parses fine, but Reshape to a constant [2, 4] only fits a batch of 2: the build itself fails."""
    shape = numpy_helper.from_array(np.array([2, 4], dtype=np.int64), "shape")
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"], name="fixed_reshape")],
        "reshape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        initializer=[shape],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


# --------------------------------------------------------------------------- builds


def test_build_for_named_gpus_records_them(models: dict[str, Path], tmp_path: Path) -> None:
    from trt_pipeline.pipeline.runners.tensorrt import built_for

    record = build_engine(
        models["fp32"], tmp_path / "engine.plan", batch=BATCH, builder="tensorrt_rtx", target="sm86,sm89"
    )
    assert record["target"]["compute_capabilities"] == ["SM86", "SM89"]
    assert built_for(record["target"]) == ["8.6", "8.9"]


def test_build_targets_it_cannot_honour(models: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(PipelineError, match="cannot build for SM90") as caught:
        build_engine(models["fp32"], tmp_path / "engine.plan", batch=BATCH, builder="tensorrt_rtx", target="sm90")
    assert "SM89" in caught.value.fix
    if not trt_module.gpu_present():
        no_gpu = r'Settings\(target="current"\) builds for the GPU of this machine, and none'
        with pytest.raises(PipelineError, match=no_gpu):
            build_engine(
                models["fp32"], tmp_path / "engine.plan", batch=BATCH, builder="tensorrt_rtx", target="current"
            )
    assert not (tmp_path / "engine.plan").exists()


def test_fp32_engine_and_its_record(models: dict[str, Path], tmp_path: Path) -> None:
    engine = tmp_path / "engine.plan"
    record = build_engine(models["fp32"], engine, batch=BATCH, workspace_mib=64, builder="tensorrt_rtx")

    assert engine.stat().st_size == record["engine_bytes"] > 0
    assert record["builder"] == {"module": "tensorrt_rtx", "version": rtx.__version__}
    assert record["profile"] == {"x": {"min": [1, 3, 8, 8], "opt": [2, 3, 8, 8], "max": [4, 3, 8, 8]}}
    assert record["io"] == [
        {"name": "x", "mode": "input", "dtype": "float32", "shape": [-1, 3, 8, 8]},
        {"name": "y", "mode": "output", "dtype": "float32", "shape": [-1, 2]},
    ]
    assert record["workspace_mib"] == 64
    assert record["target"]["kind"] == "ahead-of-time"
    assert record["target"]["compute_capabilities"] == "default"  # nothing set on the config
    assert record["timing_cache"]["status"] == "not requested"
    assert record["build_seconds"] > 0
    json.dumps(record)  # the manifest must be able to hold it as it is
    assert [p.name for p in tmp_path.iterdir()] == ["engine.plan"]


def test_fp16_graph_builds_with_float32_io(models: dict[str, Path], tmp_path: Path) -> None:
    weights = onnx.load(str(models["fp16"])).graph.initializer
    assert {w.data_type for w in weights} == {TensorProto.FLOAT16}  # precision lives in the graph

    record = build_engine(models["fp16"], tmp_path / "engine.plan", batch=BATCH, builder="tensorrt_rtx")

    assert [(t["name"], t["dtype"]) for t in record["io"]] == [("x", "float32"), ("y", "float32")]
    fp32_plan = tmp_path / "fp32.plan"
    build_engine(models["fp32"], fp32_plan, batch=BATCH, builder="tensorrt_rtx")
    assert (tmp_path / "engine.plan").read_bytes() != fp32_plan.read_bytes()


def test_second_dynamic_axis_needs_a_range(models: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(PipelineError) as caught:
        build_engine(models["seq"], tmp_path / "engine.plan", batch=BATCH, builder="tensorrt_rtx")
    message = str(caught.value)
    assert "'x'" in message and "axis 2" in message and "'length'" in message and "axis_ranges" in message
    assert not any(tmp_path.iterdir())

    record = build_engine(
        models["seq"], tmp_path / "engine.plan", batch=BATCH, axis_ranges={"length": (4, 8, 16)}, builder="tensorrt_rtx"
    )
    assert record["profile"]["x"] == {"min": [1, 3, 4], "opt": [2, 3, 8], "max": [4, 3, 16]}
    assert record["io"][0]["shape"] == [-1, 3, -1]


def test_axis_range_for_a_name_no_axis_has(models: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(PipelineError, match=r"\['lenght'\].*\n.*'length'"):
        build_engine(
            models["seq"], tmp_path / "e.plan", batch=BATCH, axis_ranges={"lenght": (4, 8, 16)}, builder="tensorrt_rtx"
        )


# --------------------------------------------------------------------------- failures


def test_parser_errors_name_every_bad_node(tmp_path: Path) -> None:
    model = _custom_op_model(tmp_path / "custom.onnx")
    with pytest.raises(PipelineError) as caught:
        build_engine(model, tmp_path / "engine.plan", batch=BATCH, builder="tensorrt_rtx")
    message = str(caught.value)
    assert "2 error(s)" in message
    assert "node 0 'custom_first' (Frobnicate)" in message
    assert "node 2 'custom_second' (Frobnicate)" in message
    assert "fine_relu" not in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["custom.onnx"]


def test_failed_build_quotes_tensorrt_and_leaves_no_files(tmp_path: Path) -> None:
    model = _fixed_reshape_model(tmp_path / "reshape.onnx")
    out = tmp_path / "out"
    out.mkdir()
    # opt = 3 cannot be reshaped to [2, 4]: build_serialized_network returns None.
    with pytest.raises(PipelineError, match=r"could not build(.|\n)*fixed_reshape"):
        build_engine(model, out / "engine.plan", batch=BatchProfile(1, 3, 4), builder="tensorrt_rtx")
    assert list(out.iterdir()) == []  # neither engine.plan nor a temporary file


def test_failure_is_quoted_while_another_tensorrt_object_lives(tmp_path: Path) -> None:
    # TensorRT keeps one logger per process: a Runtime alive here would swallow the messages of a
    # builder made with a different logger; build_engine shares the process's logger instead.
    runtime = rtx.Runtime(trt_module.RecordingLogger.for_module(rtx).trt_logger)
    model = _fixed_reshape_model(tmp_path / "reshape.onnx")
    with pytest.raises(PipelineError, match="fixed_reshape"):
        build_engine(model, tmp_path / "engine.plan", batch=BatchProfile(1, 3, 4), builder="tensorrt_rtx")
    del runtime


def test_fixed_batch_model_rejects_a_batch_range(tmp_path: Path) -> None:
    model = _fixed_reshape_model(tmp_path / "reshape.onnx")
    graph = onnx.load(str(model))
    graph.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 2  # now a fixed batch of 2
    onnx.save(graph, str(model))
    with pytest.raises(PipelineError, match="fixed batch of 2"):
        build_engine(model, tmp_path / "engine.plan", batch=BATCH, builder="tensorrt_rtx")
    record = build_engine(model, tmp_path / "engine.plan", batch=BatchProfile(2, 2, 2), builder="tensorrt_rtx")
    assert record["profile"]["x"] == {"min": [2, 4], "opt": [2, 4], "max": [2, 4]}


def test_missing_onnx_file(tmp_path: Path) -> None:
    with pytest.raises(PipelineError, match="does not exist"):
        build_engine(tmp_path / "absent.onnx", tmp_path / "engine.plan", batch=BATCH, builder="tensorrt_rtx")


# --------------------------------------------------------------------------- timing cache


def test_rtx_records_timing_cache_as_unsupported(models: dict[str, Path], tmp_path: Path) -> None:
    cache = tmp_path / "timing.cache"
    record = build_engine(
        models["fp32"], tmp_path / "engine.plan", batch=BATCH, builder="tensorrt_rtx", timing_cache=cache
    )
    # TensorRT-RTX's timing-cache calls are no-ops that would force a GPU query, so none are made.
    assert record["timing_cache"]["status"] == "unsupported"
    assert record["timing_cache"]["path"] == str(cache)
    assert not cache.exists()


@pytest.mark.gpu
@pytest.mark.skipif(not _full_tensorrt_usable(), reason="needs the full TensorRT and an NVIDIA GPU")
def test_full_tensorrt_writes_and_reuses_timing_cache(models: dict[str, Path], tmp_path: Path) -> None:
    cache = tmp_path / "timing.cache"
    first = build_engine(models["fp32"], tmp_path / "a.plan", batch=BATCH, builder="tensorrt", timing_cache=cache)
    assert first["timing_cache"] == {"status": "created", "path": str(cache), "written": True}
    assert cache.stat().st_size > 0
    second = build_engine(models["fp32"], tmp_path / "b.plan", batch=BATCH, builder="tensorrt", timing_cache=cache)
    assert second["timing_cache"]["status"] == "loaded"
    assert second["target"]["kind"] == "gpu" and second["target"]["gpu"]["compute_capability"]


# --------------------------------------------------------------------------- picking the module


@pytest.mark.skipif(_full_tensorrt_usable(), reason="the full TensorRT and a GPU are here, so auto takes them")
def test_auto_picks_tensorrt_rtx_here() -> None:
    assert trt_module.import_trt("auto") is rtx


def test_empty_namespace_package_is_not_tensorrt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What tensorrt-stubs installs: a folder with only __init__.pyi, imported as an empty namespace.
    stub = tmp_path / "tensorrt_stub_probe"
    stub.mkdir()
    (stub / "__init__.pyi").write_text("class Builder: ...\n__version__: str\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    module, why = trt_module._try_import("tensorrt_stub_probe")

    assert module is None and "not TensorRT" in why
    assert trt_module.is_real_tensorrt(rtx)


@pytest.mark.skipif(_full_tensorrt_usable(), reason="the full TensorRT and a GPU are here")
def test_explicit_tensorrt_without_it_says_what_to_install() -> None:
    with pytest.raises(PipelineError, match=r"builder 'tensorrt' was asked for(.|\n)*fix: .*pypi\.nvidia\.com"):
        trt_module.import_trt("tensorrt")


def test_unknown_builder_choice() -> None:
    with pytest.raises(PipelineError, match="unknown builder 'tensorrt12'"):
        trt_module.import_trt("tensorrt12")


def test_gpu_probe_agrees_with_device_description() -> None:
    assert trt_module.gpu_present() == (trt_module.describe_gpu(0) is not None)


def test_settings_refuse_an_unknown_target() -> None:
    from trt_pipeline.pipeline.core.settings import Settings

    for target in ("default", "current", "sm86", "sm86,sm120"):
        Settings(target=target).check()
    with pytest.raises(PipelineError, match="unknown build target 'h100'") as caught:
        Settings(target="h100").check()
    assert 'Settings(target="current")' in caught.value.fix
