"""The Triton model repository, checked by parsing config.pbtxt with Triton's own ModelConfig protobuf."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as pb

from trt_pipeline.pipeline.cli import main
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.settings import BatchProfile, Settings
from trt_pipeline.pipeline.folder.artifacts import sha256_file
from trt_pipeline.pipeline.folder.manifest import Manifest, read_manifest, update_manifest
from trt_pipeline.pipeline.folder.reader import open_folder
from trt_pipeline.pipeline.folder.records import ModelRecord
from trt_pipeline.pipeline.stages.sequence import make_engine
from trt_pipeline.pipeline.triton.repository import engine_io, model_config, model_name, write_repository


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="module")
def tiny(engines: Path) -> Path:
    return make_engine(Settings(model="tests.helpers.toy_models:tiny_cnn", precision="fp32", out_root=engines))


@pytest.fixture(scope="module")
def text(engines: Path) -> Path:
    batch = BatchProfile(1, 4, 16)
    return make_engine(
        Settings(model="tests.helpers.toy_models:text_classifier", precision="fp16", batch=batch, out_root=engines)
    )


def parse(text: str) -> pb.ModelConfig:
    """Triton's own parse of a config.pbtxt: unknown fields, bad enums or types raise ParseError."""
    return text_format.Parse(text, pb.ModelConfig())


def test_rtx_engine_is_served_through_the_onnx_backend_by_default(tiny: Path, tmp_path: Path) -> None:
    assert open_folder(tiny).manifest.builder().module == "tensorrt_rtx"
    model_dir, why = write_repository(tiny, tmp_path)
    assert "TensorRT-RTX" in why
    config = parse((model_dir / "config.pbtxt").read_text())
    # The name `python -m trt_pipeline serve` gives the model too: <model>-<precision>.
    assert model_dir.name == config.name == model_name(open_folder(tiny).manifest) == "toy_models-tiny_cnn-fp32"
    assert (config.platform, config.backend) == ("onnxruntime_onnx", "onnxruntime")
    assert config.max_batch_size == 32  # the profile's max (1:8:32)
    [given] = config.input
    assert (given.name, pb.DataType.Name(given.data_type), list(given.dims)) == ("input", "TYPE_FP32", [3, 16, 16])
    [logits] = config.output
    assert (logits.name, pb.DataType.Name(logits.data_type), list(logits.dims)) == ("logits", "TYPE_FP32", [10])
    assert config.dynamic_batching.max_queue_delay_microseconds == 2000
    [group] = config.instance_group
    assert (group.count, pb.ModelInstanceGroup.Kind.Name(group.kind)) == (1, "KIND_GPU")
    assert sha256_file(model_dir / "1" / "model.onnx") == sha256_file(tiny / "model.onnx")


def test_asking_for_the_plan_of_an_rtx_engine_is_refused(tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(PipelineError, match="built by TensorRT-RTX, which Triton's TensorRT backend cannot load"):
        write_repository(tiny, tmp_path, backend="tensorrt_plan")
    assert not list(tmp_path.iterdir())


def test_plan_config_from_the_engines_recorded_io(tiny: Path) -> None:
    """The tensorrt_plan config built from the real engine's I/O (as the build stage recorded it)."""
    io = engine_io(open_folder(tiny).manifest)
    text = text_format.MessageToString(model_config("tiny", "tensorrt_plan", io, max_batch=32, instances=2))
    config = parse(text)
    assert (config.platform, config.backend, config.default_model_filename) == (
        "tensorrt_plan",
        "tensorrt",
        "model.plan",
    )
    assert [list(t.dims) for t in config.input] == [[3, 16, 16]] and config.instance_group[0].count == 2


def test_two_inputs_dynamic_dims_and_the_command_line(text: Path, tmp_path: Path, capsys) -> None:
    assert main(["triton", str(text), "--repo", str(tmp_path), "--name", "text", "--instance-kind", "cpu"]) == 0
    assert "tritonserver --model-repository=" in capsys.readouterr().out
    config = parse((tmp_path / "text" / "config.pbtxt").read_text())
    assert config.max_batch_size == 16
    inputs = {t.name: (pb.DataType.Name(t.data_type), list(t.dims)) for t in config.input}
    # The fp16 graph keeps float32 inputs and outputs; "seq" is dynamic (-1).
    assert inputs == {"input_ids": ("TYPE_INT64", [-1]), "attention_mask": ("TYPE_FP32", [-1])}
    outputs = {t.name: (pb.DataType.Name(t.data_type), list(t.dims)) for t in config.output}
    assert outputs == {"logits": ("TYPE_FP32", [4]), "tokens": ("TYPE_FP32", [-1, 8])}
    assert pb.ModelInstanceGroup.Kind.Name(config.instance_group[0].kind) == "KIND_CPU"
    assert sha256_file(tmp_path / "text" / "1" / "model.onnx") == sha256_file(text / "model.fp16.onnx")


def test_the_name_comes_from_the_manifest_not_the_folder(tiny: Path, tmp_path: Path) -> None:
    renamed = tmp_path / "my-copy"
    shutil.copytree(tiny, renamed)
    model_dir, _ = write_repository(renamed, tmp_path / "repo")
    assert model_dir.name == "toy_models-tiny_cnn-fp32"
    with pytest.raises(PipelineError, match="records no model name or precision"):
        model_name(Manifest(model=ModelRecord("tiny", "tiny", "")))


@pytest.mark.parametrize("name", ["../escaped", "a/b", ".hidden", "x" * 129])
def test_a_name_that_leaves_the_repository_is_refused(tiny: Path, tmp_path: Path, name: str) -> None:
    repo = tmp_path / "repo"
    with pytest.raises(PipelineError, match="cannot be a folder of the repository"):
        write_repository(tiny, repo, name=name)
    assert not any(tmp_path.rglob("config.pbtxt"))


def test_the_onnxruntime_level_the_build_fell_back_to_reaches_the_config(tiny: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(tiny, tmp_path / tiny.name)
    assert (
        parse((write_repository(folder, tmp_path / "full")[0] / "config.pbtxt").read_text()).optimization.graph.level
        == 0
    )
    update_manifest(folder, onnxruntime_levels={"model.onnx": "ORT_ENABLE_BASIC"})  # as a crash at the build records
    model_dir, _ = write_repository(folder, tmp_path / "basic")
    assert parse((model_dir / "config.pbtxt").read_text()).optimization.graph.level == -1  # Triton's BASIC


def test_a_swapped_graph_is_refused(tiny: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(tiny, tmp_path / tiny.name)
    graph = folder / open_folder(folder).graph
    graph.write_bytes(graph.read_bytes() + b"\0")
    with pytest.raises(PipelineError, match="is not the file this folder's build wrote"):
        write_repository(folder, tmp_path / "repo")


def test_the_python_form_runs_our_runner_inside_triton(tiny: Path, tmp_path: Path) -> None:
    """What `--backend python` writes; tests/triton/test_server.py serves it with a real tritonserver."""
    model_dir, why = write_repository(tiny, tmp_path, backend="python", runner_backend="onnxruntime")
    assert "Python backend" in why
    config = parse((model_dir / "config.pbtxt").read_text())
    assert (config.backend, config.platform, config.default_model_filename) == ("python", "", "model.py")
    assert pb.ModelInstanceGroup.Kind.Name(config.instance_group[0].kind) == "KIND_CPU"  # the runner picks the GPU
    assert config.parameters["runner_backend"].string_value == "onnxruntime"
    assert Path(config.parameters["trt_pipeline_path"].string_value, "trt_pipeline", "pipeline", "runners").is_dir()
    assert [list(t.dims) for t in config.input] == [[3, 16, 16]] and config.max_batch_size == 32
    artifacts = model_dir / "1" / "artifacts"
    for name in ("model.onnx", "engine.plan"):
        assert sha256_file(artifacts / name) == sha256_file(tiny / name)
    assert read_manifest(artifacts) == read_manifest(tiny)
    source = Path(__file__).resolve().parents[2] / "pipeline" / "triton" / "python_model.py"
    assert (model_dir / "1" / "model.py").read_bytes() == source.read_bytes()


def test_the_python_form_refuses_an_unknown_runner_backend(tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(PipelineError, match="unknown runner backend 'torch'"):
        write_repository(tiny, tmp_path, backend="python", runner_backend="torch")
    assert not list(tmp_path.iterdir())
