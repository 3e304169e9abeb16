"""backend="onnxruntime-cuda" on a real GPU: FP32 and FP16 folders against the CPU provider within each graph's own
gate tolerance, torch CUDA tensors in and out, CUDA graphs on and off, threads, and auto listing CUDA candidates.
Skipped with the reason (tests/conftest.py) where no GPU is present, or where onnxruntime has no CUDA provider."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort
import pytest

from tests.helpers.concurrency import assert_each_thread_gets_its_own_result
from tests.helpers.runner_feeds import assert_close, cnn_batch, text_batch
from trt_pipeline.pipeline.core.settings import Settings
from trt_pipeline.pipeline.folder.graph_io import load_reference
from trt_pipeline.pipeline.folder.reader import open_folder
from trt_pipeline.pipeline.runners import load_runner, onnxruntime_cuda
from trt_pipeline.pipeline.runners.onnxruntime import CPU, CUDA
from trt_pipeline.pipeline.stages.sequence import make_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        CUDA not in ort.get_available_providers(),
        reason=f"onnxruntime {ort.__version__} has no {CUDA} (install the gpu extra: onnxruntime-gpu)",
    ),
]

MODELS = {
    "tiny_cnn": "tests.helpers.toy_models:tiny_cnn",
    "text_classifier": "tests.helpers.toy_models:text_classifier",
}
CASES = [(model, precision) for model in MODELS for precision in ("fp32", "fp16")]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("ort-cuda")
    # A Hopper machine has no TensorRT: make_engine finishes the folders with their graphs alone.
    return {
        (model, precision): make_engine(Settings(model=MODELS[model], precision=precision, out_root=root))
        for model, precision in CASES
    }


@pytest.mark.parametrize(("model", "precision"), CASES)
def test_cuda_matches_the_cpu_provider_within_the_graphs_gate(folders, model, precision):
    folder = folders[model, precision]
    with load_runner(folder, "onnxruntime-cuda") as runner:
        # ORT falls back to the CPU silently when the CUDA provider fails to load; the description says what it uses.
        assert f"on {CUDA}, {CPU} with IO binding" in runner.description
        assert runner.graph == ("model.fp16.onnx" if precision == "fp16" else "model.onnx")
        assert "TF32 off" in runner.description
        with load_runner(folder, "onnxruntime", providers=[CPU], graph=runner.graph) as cpu:
            opened = open_folder(folder)
            record = opened.manifest.parity(opened.record(runner.graph).gate)
            assert record is not None
            for inputs, _ in load_reference(folder / "reference.npz"):
                assert_close(cpu.infer(inputs), runner.infer(inputs), rtol=record.rtol)


def test_device_resident_inference_writes_the_callers_tensors(folders):
    import torch

    with load_runner(folders["text_classifier", "fp16"], "onnxruntime-cuda") as runner:
        feed = text_batch(8, seq=12, seed=1)
        expected = runner.infer(feed)
        inputs = {name: torch.from_numpy(value).cuda() for name, value in feed.items()}
        outputs = {
            name: torch.empty(value.shape, dtype=torch.float32, device="cuda") for name, value in expected.items()
        }
        assert runner.infer_on_device(inputs, outputs) is outputs
        assert_close(expected, {name: tensor.cpu().numpy() for name, tensor in outputs.items()}, rtol=1e-6)
        # torch CUDA inputs through infer(): bound in place, host arrays out.
        assert_close(expected, runner.infer(inputs), rtol=1e-6)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_cuda_graphs_on_and_off_give_the_same_outputs(folders, precision):
    import torch

    folder = folders["tiny_cnn", precision]
    with (
        load_runner(folder, "onnxruntime-cuda") as plain,
        load_runner(folder, "onnxruntime-cuda", cuda_graph=True) as graphs,
    ):
        assert "a CUDA graph captured per input shape" in graphs.description
        for rows in (1, 8, 1, 8, 32, 8):  # repeated shapes replay their captured graph
            feed = cnn_batch(rows, seed=rows)
            assert_close(plain.infer(feed), graphs.infer(feed), rtol=1e-5)
        feed = cnn_batch(4, seed=9)
        outputs = {"logits": torch.empty((4, 10), dtype=torch.float32, device="cuda")}
        graphs.infer_on_device({"input": torch.from_numpy(feed["input"]).cuda()}, outputs)
        assert_close(plain.infer(feed), {"logits": outputs["logits"].cpu().numpy()}, rtol=1e-5)


def test_the_runners_options_change_how_it_runs_not_what_it_computes(folders):
    """What the defaults were measured against (NCHW convolutions, cuDNN adding each bias, inputs and
    outputs through a page-locked copy), as options of the runner: the same FP32 outputs (TF32 off either way)."""
    folder = folders["tiny_cnn", "fp32"]
    varied = {"provider_options": {"prefer_nhwc": "0"}, "split_conv_bias": False, "pinned_copies": True}
    with load_runner(folder, "onnxruntime-cuda") as default, load_runner(folder, "onnxruntime-cuda", **varied) as other:
        assert "provider options {'prefer_nhwc': '0'}" in other.description and "page-locked" in other.description
        assert other.bias_adds == 0 < default.bias_adds
        for rows in (1, 8, 32):
            feed = cnn_batch(rows, seed=rows)
            assert_close(default.infer(feed), other.infer(feed), rtol=1e-4)


def test_shapes_past_max_graphs_run_uncaptured_with_the_same_outputs(folders, monkeypatch):
    """A slot captures its first MAX_GRAPHS shapes (each captured graph keeps its memory); the rest run uncaptured
    (gpu_graph_id -1), replayed shapes and new ones alike giving the outputs of a runner without CUDA graphs.
    Inputs go to the GPU straight from the caller's array, or through the page-locked copy where not contiguous."""
    monkeypatch.setattr(onnxruntime_cuda, "MAX_GRAPHS", 2)
    folder = folders["tiny_cnn", "fp16"]
    with (
        load_runner(folder, "onnxruntime-cuda") as plain,
        load_runner(folder, "onnxruntime-cuda", cuda_graph=True, sessions=1) as graphs,
    ):
        for rows in (1, 8, 3, 5, 1, 3, 8, 5):
            feed = cnn_batch(rows, seed=rows)
            assert_close(plain.infer(feed), graphs.infer(feed), rtol=1e-5)
        assert list(graphs._slots[0].graph_ids) == [((1, 3, 16, 16),), ((8, 3, 16, 16),)]
        strided = {"input": cnn_batch(6, seed=2)["input"][::2]}
        assert not strided["input"].flags.c_contiguous
        assert_close(plain.infer({"input": strided["input"].copy()}), graphs.infer(strided), rtol=1e-5)


def test_concurrent_calls_from_other_threads(folders):
    with load_runner(folders["text_classifier", "fp32"], "onnxruntime-cuda", sessions=3) as runner:
        feeds = [text_batch(1 + t % 7, seq=3 + t, seed=t) for t in range(12)]
        assert_each_thread_gets_its_own_result(runner, feeds)


def test_auto_times_the_cuda_candidates_where_no_engine_runs(folders):
    folder = folders["tiny_cnn", "fp16"]
    with load_runner(folder) as runner:
        if runner.backend == "tensorrt":
            pytest.skip("the engine runs on this GPU, so auto serves it without timing ONNX Runtime")
        assert "model.fp16.onnx on CUDA" in runner.description and "model.onnx on CUDA" in runner.description


@pytest.mark.parametrize("model", list(MODELS))
def test_auto_checks_on_the_gpu_what_it_serves_and_caches_the_check(folders, model):
    """Part A on a GPU: the candidate auto serves ran the folder's cases on the CUDA provider (real float16 for an
    FP16 graph) within its gate, at every measured batch, and the check is cached with the times."""
    import json

    from trt_pipeline.pipeline.folder.layout import SERVED_CHOICE
    from trt_pipeline.pipeline.runners.fastest import profile_batches

    folder = folders[model, "fp16"]
    (folder / SERVED_CHOICE).unlink(missing_ok=True)
    with load_runner(folder) as runner:
        if runner.backend == "tensorrt":
            pytest.skip("the engine runs on this GPU: auto checks it at every load, without served.json")
        served = json.loads((folder / SERVED_CHOICE).read_text())
        assert served["checks"][served["served"]]["passed"] is True
        assert f"{served['served']} checked on this host" in runner.description
        # A GPU times the profile's opt, max and min batches within the budget (a CPU may stop after the first).
        assert [int(batch) for batch in served["ms"]] == profile_batches(open_folder(folder))
    with load_runner(folder) as again:
        assert "measured earlier" in again.description
        assert f"{served['served']} checked on this host" in again.description


def test_an_output_the_data_sizes_is_served_from_onnx_runtimes_device_allocation(tmp_path):
    """The column filter (tests/helpers/output_dims.py) on the CUDA provider: no CUDA graph (refused with the reason
    auto falls back on), host arrays and torch CUDA tensors out at the size each call's data gives."""
    import numpy as np
    import torch

    from tests.helpers.output_dims import column_filter_folder, column_rows

    folder = column_filter_folder(tmp_path)  # without an engine where no TensorRT imports (a Hopper machine)
    with pytest.raises(onnxruntime_cuda.CaptureRefused, match=r"outputs \['kept'\] .* have sizes the inputs' dims"):
        load_runner(folder, "onnxruntime-cuda", cuda_graph=True)
    with (
        load_runner(folder, "onnxruntime-cuda", sessions=1) as runner,
        load_runner(folder, "onnxruntime", providers=[CPU]) as cpu,
    ):
        assert "outputs ['kept'] allocated by ONNX Runtime at each run" in runner.description
        for feed in (column_rows(4, seed=1), column_rows(1, seed=2), column_rows(3, seed=3)):
            expected = cpu.infer(feed)
            got = runner.infer(feed)
            np.testing.assert_array_equal(got["kept"], expected["kept"])  # a slice of the input: exact
            assert_close(expected, got, rtol=1e-5)
            inputs = {"x": torch.from_numpy(feed["x"]).cuda()}
            outputs = {name: torch.empty(value.shape, device="cuda") for name, value in expected.items()}
            assert runner.infer_on_device(inputs, outputs) is outputs
            np.testing.assert_array_equal(outputs["kept"].cpu().numpy(), expected["kept"])


def test_a_distilbert_folder_is_captured_with_its_padding_masks_length_made_on_the_device(tmp_path):
    """transformers 5's padding mask reads the sequence length (a Gather of a Shape, on the host) as data: ONNX
    Runtime added a Memcpy node for it and refused the capture on an H200 (pipeline.runners.shape_values)."""
    import numpy as np

    from tests.helpers.output_dims import PROFILE

    transformers = pytest.importorskip("transformers")
    config = transformers.DistilBertConfig(vocab_size=30, dim=32, n_layers=2, n_heads=2, hidden_dim=64)
    transformers.DistilBertModel(config).save_pretrained(tmp_path / "distilbert")
    settings = Settings(model=str(tmp_path / "distilbert"), precision="fp16", batch=PROFILE, out_root=tmp_path)
    folder = make_engine(settings)
    rng = np.random.default_rng(0)
    with (
        load_runner(folder, "onnxruntime-cuda") as plain,
        load_runner(folder, "onnxruntime-cuda", cuda_graph=True) as graphs,
    ):
        assert "a CUDA graph captured per input shape" in graphs.description
        assert "1 one-element shape value(s) made on the device" in graphs.description
        for rows, length in ((1, 5), (3, 17), (1, 5), (3, 17)):  # the repeats replay their captured graph
            mask = np.ones((rows, length), dtype=np.int64)
            mask[-1, length // 2 :] = 0
            feed = {"input_ids": rng.integers(1, 30, (rows, length)), "attention_mask": mask}
            got, want = graphs.infer(feed), plain.infer(feed)
            np.testing.assert_array_equal(got["last_hidden_state"], want["last_hidden_state"])
