"""The runner contract on real artifacts: ONNX Runtime and PyTorch runners, validation, chunking, threads,
and the engine runner's refusals that happen before any GPU is touched."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import resource
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.concurrency import assert_each_thread_gets_its_own_result
from tests.helpers.runner_feeds import cnn_batch, text_batch
from tests.helpers.runner_folders import MODELS, copy_folder, edit_manifest
from trt_pipeline.pipeline.core.compare import compare_outputs
from trt_pipeline.pipeline.core.cpu import int8_cpu_kind
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.precision import Precision
from trt_pipeline.pipeline.core.sessions import onnxruntime_session
from trt_pipeline.pipeline.core.trt_module import gpu_present
from trt_pipeline.pipeline.folder.graph_io import load_reference
from trt_pipeline.pipeline.folder.layout import CPU_TARGETS, SERVED_CHOICE, graph_record
from trt_pipeline.pipeline.folder.manifest import Manifest
from trt_pipeline.pipeline.folder.provenance import describe_artifacts
from trt_pipeline.pipeline.runners import load_runner
from trt_pipeline.pipeline.runners.device_memory import available_layers, open_device_memory
from trt_pipeline.pipeline.runners.tensorrt import built_for, check_gpu_target

FP32_RTOL = 1e-4  # same graph, same inputs: only float reassociation between PyTorch and ONNX Runtime
BACKENDS = ("onnxruntime", "torch")


@pytest.fixture(scope="session")
def runners(folders: dict[str, Path]):
    """One ONNX Runtime and one PyTorch runner per model, shared by the read-only tests."""
    made = {(name, backend): load_runner(folder, backend) for name, folder in folders.items() for backend in BACKENDS}
    yield made
    for runner in made.values():
        runner.close()


# --------------------------------------------------------------------------- results


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_runner_matches_pytorch_reference(runners, folders, model, backend):
    runner = runners[model, backend]
    cases = load_reference(folders[model] / "reference.npz")
    assert len(cases) >= 3
    for inputs, expected in cases:
        results = compare_outputs(expected, runner.infer(inputs), rtol=FP32_RTOL)
        assert all(c.ok for c in results.values()), {n: c.as_record() for n, c in results.items()}


@pytest.mark.parametrize("model", MODELS)
def test_onnxruntime_and_torch_runners_agree(runners, model):
    feeds = [cnn_batch(5, seed=3)] if model == "tiny_cnn" else [text_batch(5, seq=3, seed=3), text_batch(7, 64)]
    for feed in feeds:
        ort_out, torch_out = runners[model, "onnxruntime"].infer(feed), runners[model, "torch"].infer(feed)
        assert set(ort_out) == {spec.name for spec in runners[model, "onnxruntime"].outputs}
        results = compare_outputs(torch_out, ort_out, rtol=FP32_RTOL)
        assert all(c.ok for c in results.values()), {n: c.as_record() for n, c in results.items()}


def test_contract_attributes(runners):
    runner = runners["text_classifier", "onnxruntime"]
    assert runner.backend == "onnxruntime"
    assert [(s.name, s.dtype, s.shape) for s in runner.inputs] == [
        ("input_ids", np.dtype("int64"), (-1, -1)),
        ("attention_mask", np.dtype("float32"), (-1, -1)),
    ]
    assert [(s.name, s.shape) for s in runner.outputs] == [("logits", (-1, 4)), ("tokens", (-1, -1, 8))]
    assert runner.max_batch == 32
    assert "CPUExecutionProvider" in runner.description
    assert runners["tiny_cnn", "torch"].backend == "torch"
    assert "cpu" in runners["tiny_cnn", "torch"].description or gpu_present()


def test_auto_picks_a_backend_and_says_why(folders, caplog):
    with caplog.at_level("INFO", logger="trt_pipeline.pipeline.runners"), load_runner(folders["tiny_cnn"]) as runner:
        assert "picked because auto:" in runner.description
        assert runner.description in caplog.text
        if not gpu_present():
            assert runner.backend == "onnxruntime"
            assert "no NVIDIA GPU" in runner.description
            # onnxruntime-gpu lists the CUDA provider as available even here; it must not be chosen.
            assert "CUDAExecutionProvider" not in runner.session.get_providers()


def test_auto_without_engine_plan_says_so(folders, tmp_path):
    folder = copy_folder(folders["tiny_cnn"], tmp_path)
    (folder / "engine.plan").unlink()
    with load_runner(folder) as runner:
        assert runner.backend == "onnxruntime"
        assert "has no engine.plan" in runner.description


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


def _truncate(graph: Path, other: Path) -> None:
    graph.write_bytes(graph.read_bytes()[:100])


def _swap(graph: Path, other: Path) -> None:
    shutil.copy(other, graph)


def _fifo(graph: Path, other: Path) -> None:
    graph.unlink()
    os.mkfifo(graph)


def _dev_zero(graph: Path, other: Path) -> None:
    graph.unlink()
    graph.symlink_to("/dev/zero")


@pytest.mark.parametrize("backend", ["onnxruntime", "onnxruntime-cuda"])
@pytest.mark.parametrize(
    ("damage", "refusal"),
    [
        (_truncate, "is not the file this folder's build wrote"),
        (_swap, "is not the file"),
        (_fifo, "is not a regular file but a FIFO"),  # "is missing": it is there
        (_dev_zero, "is not a regular file but a device file"),
    ],
    ids=["truncated", "swapped", "fifo", "dev-zero"],
)
def test_the_readers_refusal_of_a_graph_is_the_one_message(folders, tmp_path, backend, damage, refusal):
    # It was wrapped as "ONNX Runtime cannot load ...: PipelineError: ..." with a second fix saying the build wrote the
    # graph this way (its sha256 matches): the opposite of the reader's finding.
    folder = copy_folder(folders["tiny_cnn"], tmp_path)
    damage(folder / "model.onnx", folders["text_classifier"] / "model.onnx")
    options = {"device": "cpu"} if backend == "onnxruntime-cuda" else {}
    with pytest.raises(PipelineError, match=refusal) as caught:
        load_runner(folder, backend, **options)
    assert "ONNX Runtime" not in caught.value.problem and "PipelineError" not in caught.value.problem
    assert (
        caught.value.fix.startswith("rebuild the folder: make_engine(Settings(")
        and "sha256 matches" not in caught.value.fix
    )


@pytest.mark.parametrize(
    ("backend", "name"),
    [("onnxruntime", "model.onnx"), ("onnxruntime-cuda", "model.onnx"), ("auto", "reference.npz")],  # auto: its check
)
def test_a_file_of_another_size_is_refused_before_any_byte_is_copied(folders, tmp_path, backend, name):
    """A 1 GiB sparse file in place of an artifact was copied whole into the temporary folder (3.2 GB written for a
    graph) before its size was compared.  The size comes first: with writes limited to 16 MiB (RLIMIT_FSIZE), a copy
    would fail with EFBIG (Python ignores SIGXFSZ) and be blamed on the temporary folder."""
    folder = copy_folder(folders["tiny_cnn"], tmp_path)
    (folder / SERVED_CHOICE).unlink(missing_ok=True)  # auto checks afresh, reading reference.npz
    os.truncate(folder / name, 1 << 30)
    options = {"device": "cpu"} if backend == "onnxruntime-cuda" else {}
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, hard))
    try:
        with pytest.raises(PipelineError) as caught:
            load_runner(folder, backend, **options)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert f"{name} is not the file this folder's build wrote: 1073741824 bytes where the build wrote" in str(
        caught.value
    )


@pytest.mark.parametrize("backend", ["auto", "onnxruntime", "onnxruntime-cuda"])
@pytest.mark.parametrize(
    ("edit", "disagreement"),
    [
        (
            lambda m: m["inputs"][0].update(shape=["batch", 32]),
            "input 'input' is float32 [-1, 32] in the manifest, float32 [-1, 3, 16, 16] in the graph",
        ),
        (lambda m: m["inputs"][0].update(dtype="float64"), "input 'input' is float64 [-1, 3, 16, 16] in the manifest"),
        (lambda m: m["outputs"][0].update(shape=["batch", 4]), "output 'logits' is float32 [-1, 4] in the manifest"),
        (lambda m: m["outputs"][0].update(name="probs"), "outputs ['probs'] in the manifest, ['logits'] in the graph"),
    ],
    ids=["input-shape", "input-dtype", "output-shape", "output-name"],
)
def test_a_manifest_that_does_not_describe_its_graph_is_refused_at_load(folders, tmp_path, backend, edit, disagreement):
    # An edited input shape was blamed on the caller's correct input ("has shape (8, 16), expected (-1, 32)"), and
    # following the dtype fix led to ONNX Runtime's own error.
    folder = copy_folder(folders["tiny_cnn"], tmp_path)
    edit_manifest(folder, edit)
    options = {"device": "cpu"} if backend == "onnxruntime-cuda" else {}
    with pytest.raises(PipelineError, match=re.escape(disagreement)) as caught:
        load_runner(folder, backend, **options)
    assert "does not describe its graph model.onnx" in caught.value.problem
    assert caught.value.fix.startswith(
        'rebuild the folder: make_engine(Settings(model="tests.helpers.toy_models:tiny_cnn"'
    )


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


BAD_OPTIONS = {
    # Each was a raw AttributeError or TypeError from inside a runner, or (a string of providers) split into letters.
    "device-int": ("onnxruntime-cuda", {"device": 0}, "device=0 is an int; the onnxruntime-cuda runner takes a string"),
    "device-none": ("onnxruntime-cuda", {"device": None}, "device=None is None; the onnxruntime-cuda runner takes a"),
    "sessions-str": ("onnxruntime-cuda", {"device": "cpu", "sessions": "2"}, "sessions='2' is a str; the"),
    "sessions-zero": ("onnxruntime-cuda", {"device": "cpu", "sessions": 0}, "sessions=0: a number of sessions is 1"),
    "threads-str": ("onnxruntime", {"intra_op_threads": "2"}, "takes a whole number or None"),
    "threads-bool": ("onnxruntime", {"intra_op_threads": True}, "intra_op_threads=True is a bool"),
    "threads-zero": ("onnxruntime", {"intra_op_threads": 0}, "a number of intra-op threads is 1 or more"),
    "providers-str": ("onnxruntime", {"providers": "CPUExecutionProvider"}, "takes a list of strings or None"),
    "providers-empty": ("onnxruntime", {"providers": []}, "providers=[] names no provider"),
    "providers-unknown": ("onnxruntime", {"providers": ["Nosuch"]}, "['Nosuch'] are not ONNX Runtime provider names"),
    "split-str": ("auto", {"split_large_batches": "no"}, "split_large_batches='no' is a str"),
    "contexts-zero": ("tensorrt", {"contexts": 0}, "contexts=0: a number of execution contexts is 1 or more"),
    "trt-device-str": ("tensorrt", {"device": "cuda:0"}, "device='cuda:0' is a str; the tensorrt runner takes a whole"),
    "torch-device-int": ("torch", {"device": 3}, "device=3 is an int; the torch runner takes a string or None"),
    "torch-device-unknown": ("torch", {"device": "nonsense"}, "device='nonsense' is no torch device"),
}


@pytest.mark.parametrize("case", BAD_OPTIONS)
def test_load_runner_checks_every_options_type_and_count(folders, case):
    backend, options, message = BAD_OPTIONS[case]
    with pytest.raises(PipelineError, match=re.escape(message)) as caught:
        load_runner(folders["tiny_cnn"], backend, **options)
    assert caught.value.fix


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


@pytest.mark.skipif(gpu_present(), reason="on a GPU host torch may have CUDA")
def test_the_torch_runner_refuses_a_cuda_device_it_has_not_before_loading_the_model(folders):
    with pytest.raises(PipelineError, match="device='cuda': torch .* has no such CUDA device here"):
        load_runner(folders["tiny_cnn"], "torch", device="cuda")


# --------------------------------------------------------------------------- input validation


BAD_FEEDS = {
    "missing": ({"attention_mask": np.ones((2, 12), np.float32)}, r"missing \['input_ids'\]"),
    "unexpected": (
        {**text_batch(2), "extra": np.zeros(2, np.float32)},
        r"unexpected \['extra'\]",
    ),
    "dtype": (
        {**text_batch(2), "attention_mask": np.ones((2, 12), np.float64)},
        "input 'attention_mask' has dtype float64, expected float32",
    ),
    "rank": (
        {**text_batch(2), "input_ids": np.zeros((2, 12, 1), np.int64)},
        r"input 'input_ids' has shape \(2, 12, 1\), expected \(-1, -1\)",
    ),
    "batch": (
        {**text_batch(2), "attention_mask": np.ones((3, 12), np.float32)},
        "input 'attention_mask' has batch 3 but 'input_ids' has batch 2",
    ),
    "range": (text_batch(2, seq=65), r"size 65 on axis 1, outside the range \[1, 64\]"),
    "type": ({**text_batch(2), "input_ids": [[1, 2]]}, "input 'input_ids' is a list, expected a numpy array"),
    "empty": (text_batch(0), "empty batch"),
    "an array, not a dict": (text_batch(2)["input_ids"], "the inputs are a ndarray, not a dict of input name"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", BAD_FEEDS)
def test_bad_inputs_are_refused_naming_the_tensor(runners, backend, case):
    feed, message = BAD_FEEDS[case]
    with pytest.raises(PipelineError, match=message) as caught:
        runners["text_classifier", backend].infer(feed)
    assert caught.value.fix


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_closed_runner_refuses_every_call(folders, backend):
    runner = load_runner(folders["tiny_cnn"], backend)
    runner.close()
    runner.close()  # closing twice is harmless
    with pytest.raises(PipelineError, match="this runner was closed") as caught:
        runner.infer(cnn_batch(1))
    assert "load_runner" in str(caught.value.fix)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_and_inf_pass_through_as_sent(runners, backend):
    # The policy every front end shares (README, "Serving"): inputs are not scanned for NaN or inf.
    feed = cnn_batch(2)
    feed["input"][0, 0, 0, :3] = [np.nan, np.inf, -np.inf]
    logits = runners["tiny_cnn", backend].infer(feed)["logits"]
    assert np.isnan(logits[0]).all() and np.isfinite(logits[1]).all()


def test_fixed_dim_mismatch_names_expected_and_got(runners):
    feed = {"input": np.zeros((2, 3, 17, 16), np.float32)}
    with pytest.raises(PipelineError, match=r"input 'input' has shape \(2, 3, 17, 16\), expected \(-1, 3, 16, 16\)"):
        runners["tiny_cnn", "onnxruntime"].infer(feed)


# --------------------------------------------------------------------------- batches above the profile's max


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_above_max_is_chunked(runners, folders, backend):
    runner = runners["tiny_cnn", backend]
    feed = cnn_batch(2 * runner.max_batch + 6, seed=7)
    session = onnxruntime_session(folders["tiny_cnn"] / "model.onnx")
    (expected,) = session.run(["logits"], feed)  # one bare call on all 70 rows
    logits = runner.infer(feed)["logits"]
    assert logits.shape == (70, 10)
    assert compare_outputs({"logits": expected}, {"logits": logits}, rtol=FP32_RTOL)["logits"].ok


def test_batch_above_max_can_raise_instead(folders):
    with load_runner(folders["tiny_cnn"], "onnxruntime", split_large_batches=False) as runner:
        assert runner.infer(cnn_batch(32))["logits"].shape == (32, 10)
        with pytest.raises(PipelineError, match="batch of 33 rows is larger than the profile's max batch 32"):
            runner.infer(cnn_batch(33))


# --------------------------------------------------------------------------- threads


@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_calls_each_get_their_own_result(runners, backend):
    runner = runners["text_classifier", backend]
    # Different batch sizes and sequence lengths per thread, so a mix-up cannot go unnoticed.
    feeds = [text_batch(1 + t % 5, seq=4 + t, seed=t) for t in range(16)]
    assert_each_thread_gets_its_own_result(runner, feeds)


# --------------------------------------------------------------------------- load_runner refusals


def test_load_runner_refuses_a_missing_folder_and_unknown_backend(folders, tmp_path):
    with pytest.raises(PipelineError, match="does not exist") as caught:
        load_runner(tmp_path / "engines" / "nothing-fp16")
    assert "make_engine(Settings(model=" in str(caught.value)
    with pytest.raises(PipelineError, match="unknown runner backend 'tflite'"):
        load_runner(folders["tiny_cnn"], "tflite")
    with pytest.raises(PipelineError, match="not an artifact folder"):
        load_runner(tmp_path)


def test_engine_runner_refuses_a_corrupted_or_truncated_plan(folders, tmp_path):
    folder = copy_folder(folders["tiny_cnn"], tmp_path)
    plan = (folder / "engine.plan").read_bytes()
    corrupted = bytearray(plan)
    corrupted[len(plan) // 2] ^= 0xFF
    for broken in (bytes(corrupted), plan[: len(plan) // 2]):
        (folder / "engine.plan").write_bytes(broken)
        with pytest.raises(PipelineError, match="truncated, corrupted or replaced") as caught:
            load_runner(folder, "tensorrt")
        assert 'make_engine(Settings(model="tests.helpers.toy_models:tiny_cnn", precision="fp32"' in str(caught.value)
    (folder / "engine.plan").unlink()
    with pytest.raises(PipelineError, match="engine.plan is missing"):
        load_runner(folder, "tensorrt")


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


def test_device_memory_layer_refusals():
    with pytest.raises(PipelineError, match="unknown device-memory layer 'numba'"):
        open_device_memory("numba")
    missing = [layer for layer in ("pycuda", "cuda-python") if layer not in available_layers()]
    for layer in missing:
        with pytest.raises(PipelineError, match=f"device-memory layer '{layer}' is not usable here") as caught:
            open_device_memory(layer)
        assert "pip install pycuda" in str(caught.value)


def test_runner_modules_import_without_gpu_or_tensorrt():
    import importlib

    for name in ("base", "onnxruntime", "torch", "tensorrt", "device_memory"):
        importlib.import_module(f"trt_pipeline.pipeline.runners.{name}")
    import trt_pipeline

    assert trt_pipeline.load_runner is load_runner
