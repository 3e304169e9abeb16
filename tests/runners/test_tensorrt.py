"""The engine runner's refusals that happen before any GPU is touched (pipeline/runners/tensorrt.py): an engine of
another TensorRT, a skipped build, a plan for another GPU, unknown execution options, no GPU."""

from __future__ import annotations

import json

import pytest

from tests.helpers.runner_folders import copy_folder, edit_manifest
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.trt_module import gpu_present
from trt_pipeline.pipeline.folder.manifest import Manifest
from trt_pipeline.pipeline.runners import load_runner
from trt_pipeline.pipeline.runners.tensorrt import built_for, check_gpu_target


def test_engine_runner_refuses_an_engine_from_another_tensorrt(folders, tmp_path):
    folder = copy_folder(folders["tiny_cnn"], tmp_path)
    edit_manifest(folder, lambda m: m["build"]["builder"].update(version="1.0.0.1"))
    with pytest.raises(
        PipelineError, match=r"built with tensorrt_rtx 1\.0\.0\.1, but this machine runs tensorrt_rtx"
    ) as e:
        load_runner(folder, "tensorrt")
    # the hint rebuilds the copy where it lies, not the folder it was copied from
    rebuild = (
        'make_engine(Settings(model="tests.helpers.toy_models:tiny_cnn", precision="fp32", builder="tensorrt_rtx", '
        f'out_root="{folder.parent}", force=True))'
    )
    assert rebuild in str(e.value)


def test_engine_runner_refuses_a_skipped_build(folders, tmp_path):
    folder = copy_folder(folders["tiny_cnn"], tmp_path)
    edit_manifest(folder, lambda m: m.update(build={"status": "skipped", "reason": "no TensorRT builder"}))
    with pytest.raises(PipelineError, match="the build was skipped \\(no TensorRT builder\\)") as caught:
        load_runner(folder, "tensorrt")
    assert "backend='onnxruntime'" in str(caught.value)


def test_target_check_refuses_another_gpu_architecture(folders):
    manifest = json.loads((folders["tiny_cnn"] / "manifest.json").read_text())
    # As built here: TensorRT-RTX's documented default targets, "8.0, 8.6, 8.9, 12.0, and later".
    assert built_for(manifest["build"]["target"]) == ["8.0", "8.6", "8.9", "12.0"]
    check_gpu_target(Manifest.from_json(manifest), {"name": "RTX 4090", "compute_capability": "8.9"})
    check_gpu_target(Manifest.from_json(manifest), {"name": "RTX PRO 6000", "compute_capability": "12.1"})
    # Measured on an H100: TensorRT-RTX's runtime refuses SM 9.0 whatever the plan was built for.
    with pytest.raises(PipelineError, match=r"NVIDIA H100 \(compute capability 9\.0\), does not run TensorRT-RTX") as e:
        check_gpu_target(Manifest.from_json(manifest), {"name": "NVIDIA H100", "compute_capability": "9.0"})
    assert "backend='onnxruntime'" in str(e.value)
    with pytest.raises(PipelineError, match="built for compute capability 8.0, 8.6, 8.9, 12.0") as caught:
        check_gpu_target(Manifest.from_json(manifest), {"name": "Tesla T4", "compute_capability": "7.5"})
    assert "check_target=False" in str(caught.value)
    manifest["build"]["target"].update(compute_capabilities=["SM86"], documented_default=None)
    check_gpu_target(Manifest.from_json(manifest), {"name": "A40", "compute_capability": "8.6"})
    with pytest.raises(PipelineError, match="built for compute capability 8.6 .* this GPU is L4 .* 8.9"):
        check_gpu_target(Manifest.from_json(manifest), {"name": "L4", "compute_capability": "8.9"})
    manifest["build"]["builder"]["module"] = "tensorrt"  # the full TensorRT builds for the GPU at hand
    manifest["build"]["target"] = {"kind": "gpu", "gpu": {"name": "A100", "compute_capability": "8.0"}}
    with pytest.raises(PipelineError, match="built for compute capability 8.0 \\(gpu\\)"):
        check_gpu_target(Manifest.from_json(manifest), {"name": "NVIDIA H100", "compute_capability": "9.0"})


def test_a_plan_for_the_gpu_of_its_build_runs_only_there(folders):
    manifest = json.loads((folders["tiny_cnn"] / "manifest.json").read_text())
    gpu = {"ordinal": 0, "name": "RTX 4090", "compute_capability": "8.9"}
    manifest["build"]["target"].update(compute_capabilities=["CURRENT"], documented_default=None, gpu=gpu)
    assert built_for(manifest["build"]["target"]) == ["8.9"]
    check_gpu_target(Manifest.from_json(manifest), gpu)
    with pytest.raises(PipelineError, match="built for compute capability 8.9"):
        check_gpu_target(Manifest.from_json(manifest), {"name": "A40", "compute_capability": "8.6"})


def test_engine_runner_refuses_unknown_execution_options(folders):
    with pytest.raises(PipelineError, match="unknown execution 'v4'"):
        load_runner(folders["tiny_cnn"], "tensorrt", execution="v4")
    with pytest.raises(PipelineError, match="CUDA graphs capture execute_async_v3, not execute_v2"):
        load_runner(folders["tiny_cnn"], "tensorrt", execution="v2", cuda_graphs=True)


@pytest.mark.skipif(gpu_present(), reason="checks the refusal on a machine without a GPU")
def test_engine_runner_without_gpu_says_so_after_the_checks(folders):
    with pytest.raises(PipelineError, match="no NVIDIA GPU 0 is usable here") as caught:
        load_runner(folders["tiny_cnn"], "tensorrt")
    assert "backend='onnxruntime'" in str(caught.value)
