"""The ONNX Runtime runner (pipeline/runners/onnxruntime.py): the graph the manifest lists, or the one asked for, on the
providers asked for, with its session options; a graph it cannot load is a clear error."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import numpy as np
import pytest

from tests.helpers.runner_feeds import cnn_batch
from tests.helpers.runner_folders import FP32_RTOL, copy_folder, edit_manifest
from trt_pipeline.pipeline.core.compare import compare_outputs
from trt_pipeline.pipeline.core.cpu import int8_cpu_kind
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.precision import Precision
from trt_pipeline.pipeline.core.sessions import onnxruntime_session
from trt_pipeline.pipeline.core.trt_module import gpu_present
from trt_pipeline.pipeline.folder.layout import CPU_TARGETS, graph_record
from trt_pipeline.pipeline.folder.provenance import describe_artifacts
from trt_pipeline.pipeline.runners import load_runner


def test_onnxruntime_runner_runs_the_manifest_graph(folders, tmp_path):
    folder = copy_folder(folders["tiny_cnn"], tmp_path)
    shutil.copy(folder / "model.onnx", folder / "renamed.onnx")
    (folder / "model.onnx").unlink()
    renamed = describe_artifacts(folder, ["renamed.onnx"])
    renamed = {name: dataclasses.asdict(artifact) for name, artifact in renamed.items()}
    graphs = [
        {**record, "file": "renamed.onnx"} for record in json.loads((folder / "manifest.json").read_text())["graphs"]
    ]
    edit_manifest(folder, lambda m: m.update(graphs=graphs, artifacts={**m["artifacts"], **renamed}))
    with load_runner(folder, "onnxruntime") as runner:
        assert "renamed.onnx" in runner.description
        assert runner.infer(cnn_batch(2))["logits"].shape == (2, 10)
    (folder / "renamed.onnx").unlink()
    with pytest.raises(PipelineError, match="renamed.onnx is missing") as caught:
        load_runner(folder, "onnxruntime")
    assert 'make_engine(Settings(model="tests.helpers.toy_models:tiny_cnn", precision="fp32"' in str(caught.value.fix)
    edit_manifest(folder, lambda m: m.update(graphs=[{**graph, "file": "gone.onnx"} for graph in graphs]))
    with pytest.raises(PipelineError, match="names gone.onnx as its graph but records no sha256"):
        load_runner(folder, "onnxruntime")


def test_a_graph_onnxruntime_refuses_is_a_clear_error(folders, tmp_path):
    # Bytes that match the recorded sha256 (so the folder layer passes them) but are no ONNX model.
    folder = copy_folder(folders["tiny_cnn"], tmp_path)
    (folder / "model.onnx").write_bytes(b"not an onnx graph")
    recorded = {name: dataclasses.asdict(a) for name, a in describe_artifacts(folder, ["model.onnx"]).items()}
    edit_manifest(folder, lambda m: m.update(artifacts={**m["artifacts"], **recorded}))
    with pytest.raises(PipelineError, match="ONNX Runtime cannot load .*model.onnx: InvalidProtobuf") as caught:
        load_runner(folder, "onnxruntime")
    assert 'make_engine(Settings(model="tests.helpers.toy_models:tiny_cnn"' in str(caught.value.fix)


def test_int8_folder_on_the_cpu_runs_the_graph_shaped_for_it(int8_folder):
    feed = cnn_batch(4, seed=5)
    with load_runner(int8_folder, "onnxruntime", providers=["CPUExecutionProvider"]) as runner:
        graph = graph_record(
            Precision.INT8, CPU_TARGETS[int8_cpu_kind()]
        ).file  # the one for this kind of CPU: with VNNI, or without
        assert runner.graph == graph
        assert f"running {graph} (the int8 graph for ONNX Runtime's CPU kernels, for " in runner.description
        cpu_logits = runner.infer(feed)["logits"]
    with load_runner(int8_folder, "onnxruntime", graph="model.int8.onnx") as runner:
        assert runner.graph == "model.int8.onnx"
        assert "(asked for, its Q/DQ simulated in float as TensorRT computes them" in runner.description
        tensorrt_shaped = runner.infer(feed)["logits"]
    (reference,) = onnxruntime_session(int8_folder / graph).run(["logits"], feed)
    np.testing.assert_array_equal(cpu_logits, reference)
    # The TensorRT-shaped graph on the CPU computes what the gates judged, not ORT's fused int8 kernels.
    (simulated,) = onnxruntime_session(int8_folder / "model.int8.onnx", simulate_qdq=True).run(["logits"], feed)
    np.testing.assert_array_equal(tensorrt_shaped, simulated)
    # Two quantizations of one model from the same ranges: close, not equal (uint8 vs int8 weights, fused kernels).
    assert compare_outputs({"logits": tensorrt_shaped}, {"logits": cpu_logits}, rtol=0.2)["logits"].ok


def test_graph_option_picks_a_file_of_the_folder_and_refuses_others(folders):
    with load_runner(folders["tiny_cnn"], "onnxruntime", graph="model.onnx") as runner:
        assert runner.graph == "model.onnx"
        assert runner.infer(cnn_batch(2))["logits"].shape == (2, 10)
    for other in ("../model.onnx", "model.fp16.onnx", "reference.npz"):
        with pytest.raises(PipelineError, match=f"graph='{re.escape(other)}' is not one of the graphs") as caught:
            load_runner(folders["tiny_cnn"], "onnxruntime", graph=other)
        assert "(model.onnx)" in str(caught.value.fix)


def test_thread_and_spinning_options_reach_the_session(folders, runners):
    feed = cnn_batch(3, seed=9)
    with load_runner(folders["tiny_cnn"], "onnxruntime", intra_op_threads=1, allow_spinning=False) as runner:
        options = runner.session.get_session_options()
        assert options.intra_op_num_threads == 1
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
        assert "1 intra-op threads, no spinning" in runner.description
        results = compare_outputs(runners["tiny_cnn", "onnxruntime"].infer(feed), runner.infer(feed), rtol=FP32_RTOL)
        assert all(c.ok for c in results.values())
    default = runners["tiny_cnn", "onnxruntime"].session.get_session_options()
    assert default.get_session_config_entry("session.intra_op.allow_spinning") == "1"


@pytest.mark.skipif(gpu_present(), reason="on a GPU host the CUDA provider can run")
def test_providers_that_cannot_run_here_are_refused_or_named_never_taken_as_requested(folders):
    # ["CUDAExecutionProvider"] on a CPU host ran on the CPU while the description said "providers as requested".
    with pytest.raises(PipelineError, match=r"providers=\['CUDAExecutionProvider'\]: none can run here") as caught:
        load_runner(folders["tiny_cnn"], "onnxruntime", providers=["CUDAExecutionProvider"])
    assert "add 'CPUExecutionProvider' to fall back to the CPU" in caught.value.fix
    with load_runner(
        folders["tiny_cnn"], "onnxruntime", providers=["CUDAExecutionProvider", "CPUExecutionProvider"]
    ) as runner:
        assert runner.session.get_providers() == ["CPUExecutionProvider"]
        assert "on CPUExecutionProvider (as requested, less CUDAExecutionProvider: " in runner.description
    with load_runner(folders["tiny_cnn"], "onnxruntime", providers=["CPUExecutionProvider"]) as runner:
        assert "on CPUExecutionProvider (as requested)" in runner.description
