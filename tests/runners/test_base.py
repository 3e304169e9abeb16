"""What every runner does alike (pipeline/runners/base.py): the manifest checked against its graph at load, inputs
checked and named before they run, batches above the profile's max split, a closed runner refused, threads each
served their own."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.helpers.concurrency import assert_each_thread_gets_its_own_result
from tests.helpers.runner_feeds import cnn_batch, text_batch
from tests.helpers.runner_folders import BACKENDS, FP32_RTOL, copy_folder, edit_manifest
from trt_pipeline.pipeline.core.compare import compare_outputs
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.sessions import onnxruntime_session
from trt_pipeline.pipeline.runners import load_runner


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


@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_calls_each_get_their_own_result(runners, backend):
    runner = runners["text_classifier", backend]
    # Different batch sizes and sequence lengths per thread, so a mix-up cannot go unnoticed.
    feeds = [text_batch(1 + t % 5, seq=4 + t, seed=t) for t in range(16)]
    assert_each_thread_gets_its_own_result(runner, feeds)
