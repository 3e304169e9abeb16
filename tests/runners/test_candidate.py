"""auto's candidates on CUDA (pipeline/runners/candidate.py): each graph tuned (the onnxruntime-cuda runner's
defaults) and untuned (onnxruntime_cuda.UNTUNED: NCHW, each bias in cuDNN, attention as exported), so that a model the
tuning does not suit, or whose rewritten graph fails on a GPU, is still served on CUDA.  Opened here on the runner's
CPU placement, which rewrites the graph as it does on a GPU."""

from __future__ import annotations

import numpy as np

from tests.helpers.runner_feeds import cnn_batch
from trt_pipeline.pipeline.folder.reader import open_folder
from trt_pipeline.pipeline.runners.fastest import find_candidates
from trt_pipeline.pipeline.runners.onnxruntime import CPU, CUDA
from trt_pipeline.pipeline.runners.onnxruntime_cuda import OnnxRuntimeCudaRunner


def test_each_cuda_graph_is_timed_tuned_and_untuned_and_untuned_opens_the_graph_as_exported(fp16_folder):
    folder = open_folder(fp16_folder)
    candidates, _ = find_candidates(folder, [CUDA, CPU])
    tuned, untuned = (c for c in candidates if c.on_cuda and c.graph == "model.fp16.onnx")
    assert (tuned.label, untuned.label) == ("model.fp16.onnx on CUDA", "model.fp16.onnx on CUDA untuned")
    with (
        OnnxRuntimeCudaRunner(folder, device="cpu", **tuned.cuda_options({})) as rewritten,
        OnnxRuntimeCudaRunner(folder, device="cpu", **untuned.cuda_options({})) as exported,
    ):
        assert rewritten.bias_adds > 0 and rewritten.provider_options["prefer_nhwc"] == "1"
        assert exported.bias_adds == 0 and exported.provider_options["prefer_nhwc"] == "0"
        assert exported.fused == {} and "biases added by an Add" not in exported.description
        feed = cnn_batch(4, seed=3)
        for got, want in zip(exported.infer(feed).values(), rewritten.infer(feed).values(), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
