"""backend="onnxruntime-cuda" without a GPU: its IO binding, pool and checks run here on ONNX Runtime's CPU provider
(device="cpu": the same code, the placement a parameter), a host without the CUDA provider is refused with the fix,
and auto lists CUDA candidates only where the provider runs.  On a GPU: tests/gpu/test_onnxruntime_cuda.py."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from tests.helpers.concurrency import assert_each_thread_gets_its_own_result
from tests.helpers.output_dims import column_filter_folder, column_rows
from tests.helpers.runner_feeds import assert_close, cnn_batch, text_batch
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.precision import Precision
from trt_pipeline.pipeline.core.settings import Settings
from trt_pipeline.pipeline.folder.layout import graph_record
from trt_pipeline.pipeline.folder.reader import open_folder
from trt_pipeline.pipeline.runners import load_runner
from trt_pipeline.pipeline.runners.fastest import Candidate, find_candidates, host_key, usable_providers
from trt_pipeline.pipeline.runners.onnxruntime import CPU, CUDA
from trt_pipeline.pipeline.runners.onnxruntime_cuda import OnnxRuntimeCudaRunner
from trt_pipeline.pipeline.stages.sequence import make_engine

# `folders` (fp32 tiny_cnn and text_classifier), `fp16_folder` and `int8_folder`: tests/helpers/runner_folders.py.


@pytest.fixture(scope="module")
def bound(folders):
    """The binding runner on the CPU provider, two sessions, and the plain ONNX Runtime runner beside it."""
    made = {
        name: (load_runner(folder, "onnxruntime-cuda", device="cpu"), load_runner(folder, "onnxruntime"))
        for name, folder in folders.items()
    }
    yield made
    for pair in made.values():
        for runner in pair:
            runner.close()


# The runner opens its graph with each convolution's bias split into an Add of its own (pipeline.runners.conv_bias):
# another graph than the plain session's, whose sums may round one float32 ulp apart on some CPUs (AVX2-only
# against AVX-512 kernels).  A graph without convolutions opens as it is: the same graph, the same bytes.
SPLIT_GRAPH_RTOL = 1e-5


def assert_computes_what_the_session_computes(runner, expected: dict, actual: dict) -> None:
    """Bit for bit where the runner's graph is the plain session's; within a float tolerance where it split biases."""
    assert {name: value.shape for name, value in actual.items()} == {n: v.shape for n, v in expected.items()}
    if runner.bias_adds:
        assert_close(expected, actual, rtol=SPLIT_GRAPH_RTOL)
        return
    for name in expected:
        np.testing.assert_array_equal(actual[name], expected[name])


def _feeds(model: str) -> list[dict[str, np.ndarray]]:
    if model == "tiny_cnn":
        return [cnn_batch(1), cnn_batch(32, seed=2), cnn_batch(70, seed=3)]  # 70: chunked into 32 + 32 + 6
    return [text_batch(1, seq=1), text_batch(5, seq=64, seed=4), text_batch(40, seq=7, seed=5)]


@pytest.mark.parametrize("model", ["tiny_cnn", "text_classifier"])
def test_io_binding_computes_what_the_session_computes(bound, model):
    runner, plain = bound[model]
    assert runner.backend == "onnxruntime-cuda"
    assert "on CPUExecutionProvider with IO binding to buffers pre-allocated on cpu" in runner.description
    for feed in _feeds(model):  # only the rows each call sent
        assert_computes_what_the_session_computes(runner, plain.infer(feed), runner.infer(feed))


def test_the_runner_opens_its_graph_with_each_convolutions_bias_as_an_add(bound, folders):
    """What the GPU serves (pipeline.runners.conv_bias), on the CPU placement too: the previous test's tiny_cnn
    outputs came from the split graph; a graph without convolutions opens as it is."""
    import onnx

    graph = onnx.load(str(folders["tiny_cnn"] / "model.onnx"))
    initializers = {tensor.name for tensor in graph.graph.initializer}
    convs = sum(node.op_type == "Conv" and node.input[2] in initializers for node in graph.graph.node)
    assert convs > 0
    assert bound["tiny_cnn"][0].bias_adds == convs
    assert f", {convs} convolutions' biases added by an Add of their own" in bound["tiny_cnn"][0].description
    assert bound["text_classifier"][0].bias_adds == 0
    assert "biases" not in bound["text_classifier"][0].description


def test_a_strided_input_is_copied_into_the_buffer(bound):
    runner, plain = bound["tiny_cnn"]
    strided = np.random.default_rng(6).standard_normal((4, 3, 16, 16), dtype=np.float32).transpose(0, 1, 3, 2)
    got = runner.infer({"input": strided})
    assert_computes_what_the_session_computes(runner, plain.infer({"input": np.ascontiguousarray(strided)}), got)


def test_infer_on_device_binds_the_callers_arrays_in_place(bound):
    runner, plain = bound["text_classifier"]
    feed = text_batch(6, seq=9, seed=7)
    outputs = {"logits": np.full((6, 4), np.nan, np.float32), "tokens": np.full((6, 9, 8), np.nan, np.float32)}
    returned = runner.infer_on_device(feed, outputs)
    assert returned is outputs
    assert_computes_what_the_session_computes(runner, plain.infer(feed), outputs)
    with pytest.raises(PipelineError, match=r"output tensor 'tokens' is float32 \(6, 8, 8\), this call writes"):
        runner.infer_on_device(feed, {**outputs, "tokens": np.empty((6, 8, 8), np.float32)})
    with pytest.raises(PipelineError, match="more than the profile's max batch 32"):
        runner.infer_on_device(text_batch(33, seq=2), outputs)
    # Bound in place, so a strided array would be read as if contiguous: refused (infer() copies it instead).
    with pytest.raises(PipelineError, match="tensor 'input_ids' is not contiguous"):
        runner.infer_on_device({**feed, "input_ids": np.asfortranarray(feed["input_ids"])}, outputs)


def test_each_call_reads_and_writes_its_own_arrays_though_bindings_are_kept(bound, folders):
    """A slot keeps its binding while the shapes and addresses stay the same: calls of one shape on other arrays
    (in place, as infer_on_device binds them) must still read and write those arrays, and a call back on the
    first ones too (one session, so every call goes through the same binding)."""
    plain = bound["tiny_cnn"][1]
    feeds = [cnn_batch(3, seed=8), cnn_batch(3, seed=9)]
    outputs = [{"logits": np.empty((3, 10), np.float32)} for _ in feeds]
    with load_runner(folders["tiny_cnn"], "onnxruntime-cuda", device="cpu", sessions=1) as runner:
        for feed, written in [*zip(feeds, outputs, strict=True), (feeds[0], outputs[0])]:
            written["logits"].fill(np.nan)
            runner.infer_on_device(feed, written)
            assert_computes_what_the_session_computes(runner, plain.infer(feed), written)


def test_the_pool_gives_each_thread_its_own_result(bound):
    runner, _ = bound["text_classifier"]
    feeds = [text_batch(1 + t % 7, seq=3 + t, seed=t) for t in range(8)]
    assert_each_thread_gets_its_own_result(runner, feeds, calls=10)


def test_inputs_are_checked_and_a_closed_runner_refuses(folders):
    runner = load_runner(folders["tiny_cnn"], "onnxruntime-cuda", device="cpu", sessions=1)
    with pytest.raises(PipelineError, match="input 'input' has dtype float64, expected float32"):
        runner.infer({"input": np.zeros((2, 3, 16, 16))})
    with pytest.raises(PipelineError, match="input 'input' has shape"):
        runner.infer({"input": np.zeros((2, 3, 16, 15), np.float32)})
    runner.close()
    with pytest.raises(PipelineError, match="this runner was closed"):
        runner.infer(cnn_batch(1))


def test_bad_options_are_refused(folders):
    folder = folders["tiny_cnn"]
    with pytest.raises(PipelineError, match="cuda_graph=True captures CUDA graphs, which need device='cuda'"):
        load_runner(folder, "onnxruntime-cuda", device="cpu", cuda_graph=True)
    with pytest.raises(PipelineError, match="device='tpu:0'"):
        load_runner(folder, "onnxruntime-cuda", device="tpu:0")
    with pytest.raises(PipelineError, match="sessions=0"):
        load_runner(folder, "onnxruntime-cuda", device="cpu", sessions=0)
    with pytest.raises(PipelineError, match="the onnxruntime-cuda runner takes no option intra_op_threads"):
        load_runner(folder, "onnxruntime-cuda", intra_op_threads=2)


def test_what_the_defaults_were_measured_against_is_an_option(bound, folders):
    """The bias split off (split_conv_bias=False) opens the graph as it is, computing what the split one does;
    provider_options may not set what the runner's own keywords set, and maps strings to strings."""
    folder = folders["tiny_cnn"]
    with load_runner(folder, "onnxruntime-cuda", device="cpu", split_conv_bias=False) as whole:
        assert whole.bias_adds == 0 and "biases" not in whole.description
        feed = cnn_batch(4, seed=6)
        np.testing.assert_allclose(whole.infer(feed)["logits"], bound["tiny_cnn"][0].infer(feed)["logits"], rtol=1e-5)
    with pytest.raises(PipelineError, match="enable_cuda_graph, which the runner sets") as refused:
        load_runner(folder, "onnxruntime-cuda", device="cpu", provider_options={"enable_cuda_graph": "1"})
    assert refused.value.fix == "give cuda_graph= instead"
    with pytest.raises(PipelineError, match="takes a dict of strings to strings or None"):
        load_runner(folder, "onnxruntime-cuda", device="cpu", provider_options={"prefer_nhwc": 0})


@pytest.mark.skipif(CUDA in ort.get_available_providers(), reason="this onnxruntime has the CUDA provider")
def test_a_host_without_the_cuda_provider_is_refused_with_the_fix(folders):
    with pytest.raises(PipelineError) as caught:
        load_runner(folders["tiny_cnn"], "onnxruntime-cuda")
    assert f"returned {ort.get_available_providers()}" in caught.value.problem
    assert "'trt-pipeline[gpu]'" in caught.value.fix and "onnxruntime-gpu" in caught.value.fix


def test_auto_lists_cuda_candidates_only_where_the_provider_runs(fp16_folder, int8_folder):
    here = usable_providers()
    for path in (fp16_folder, int8_folder):
        folder = open_folder(path)
        candidates, _ = find_candidates(folder, here)
        assert any(c.on_cuda for c in candidates) == (CUDA in here)
    # With what onnxruntime-gpu and a GPU give: the TensorRT-shaped graphs on CUDA, served by the binding runner,
    # besides the CPU's; never the INT8 graphs shaped for the CPU's kernels.
    folder = open_folder(int8_folder)
    candidates, _ = find_candidates(folder, [CUDA, CPU])
    on_cuda = [c.graph for c in candidates if c.on_cuda]
    assert on_cuda == ["model.onnx", "model.int8.onnx"] * 2
    assert [c.label for c in candidates if c.on_cuda] == [
        "model.onnx on CUDA",
        "model.int8.onnx on CUDA",
        "model.onnx on CUDA untuned",
        "model.int8.onnx on CUDA untuned",
    ]
    assert {c.graph for c in candidates if not c.on_cuda} == {c.graph for c in find_candidates(folder, [CPU])[0]}


def test_a_check_cached_for_cuda_candidates_holds_only_while_the_runner_computes_as_it_did(fp16_folder, monkeypatch):
    """served.json's key (auto's timing and its host check) names how the CUDA runner opens a graph: a cached check
    of the runner with cuDNN adding the biases is not one of the runner that splits them.  CPU-only keys (this
    host's) do not change."""
    from trt_pipeline.pipeline.runners import onnxruntime_cuda

    folder = open_folder(fp16_folder)
    on_gpu, _ = find_candidates(folder, [CUDA, CPU])
    on_cpu, _ = find_candidates(folder, [CPU])
    split, cpu_key = host_key(folder, on_gpu, None), host_key(folder, on_cpu, None)
    assert split["onnxruntime_cuda"]["split_conv_bias"] is True and cpu_key["onnxruntime_cuda"] is None
    monkeypatch.setattr(onnxruntime_cuda, "SPLIT_CONV_BIAS", False)
    assert host_key(folder, on_gpu, None) != split
    assert host_key(folder, on_cpu, None) == cpu_key


def test_a_cuda_candidate_opens_the_binding_runner(folders):
    """What auto opens for a CUDA candidate is the onnxruntime-cuda runner; here its CUDA check refuses it, naming
    the gpu extra, where the provider is missing."""
    candidate = Candidate(graph_record(Precision.FP32), (CUDA, CPU))
    folder = open_folder(folders["tiny_cnn"])
    if CUDA in usable_providers():
        with candidate.open(folder, {"intra_op_threads": 2}) as runner:
            assert isinstance(runner, OnnxRuntimeCudaRunner)
    else:
        with pytest.raises(PipelineError, match="backend='onnxruntime-cuda'"):
            candidate.open(folder, {"intra_op_threads": 2})


# ---------------------------------------------------------------- outputs the inputs do not size by name


def test_outputs_named_by_an_expression_of_input_dims_are_served_from_buffers_sized_ahead(tmp_path):
    """tests.helpers.toy_models:computed_dims: a strided convolution's height and a doubled sequence, named by their
    expressions at check (tests/stages/test_output_dims.py); their buffers are sized by the expressions at the top
    of the ranges, and each call binds the sizes its inputs give, the largest included."""
    folder = make_engine(Settings(model="tests.helpers.toy_models:computed_dims", precision="fp32", out_root=tmp_path))
    rng = np.random.default_rng(0)
    with load_runner(folder, "onnxruntime-cuda", device="cpu") as runner, load_runner(folder, "onnxruntime") as plain:
        assert "allocated by ONNX Runtime" not in runner.description
        for rows, size in ((1, 9), (3, 30), (runner.max_batch, 32), (2, 8)):
            feed = {
                "image": rng.standard_normal((rows, 3, size, 16), dtype=np.float32),
                "tokens": rng.standard_normal((rows, size, 4), dtype=np.float32),
            }
            got, want = runner.infer(feed), plain.infer(feed)
            assert got["features"].shape == (rows, 4, (size - 1) // 2 + 1, 8)
            assert got["doubled"].shape == (rows, 2 * size, 4)
            for name in want:
                np.testing.assert_array_equal(got[name], want[name])


@pytest.fixture(scope="module")
def column_filter(tmp_path_factory: pytest.TempPathFactory):
    return column_filter_folder(tmp_path_factory.mktemp("column_filter"))


def test_an_output_only_the_data_sizes_is_allocated_by_onnx_runtime_at_each_run(column_filter):
    """The output is bound to the device and allocated by ONNX Runtime at each run; the other keeps its buffer.  One
    session, so calls of other sizes go through the same binding, and a call of the same shape after another (which
    binds nothing anew) still gets its own size."""
    feeds = [column_rows(4, seed=1), column_rows(1, seed=2), column_rows(3, seed=3), column_rows(3, seed=4)]
    with (
        load_runner(column_filter, "onnxruntime-cuda", device="cpu", sessions=1) as runner,
        load_runner(column_filter, "onnxruntime") as plain,
    ):
        assert "outputs ['kept'] allocated by ONNX Runtime at each run" in runner.description
        widths = set()
        for feed in feeds:
            got, want = runner.infer(feed), plain.infer(feed)
            assert list(got) == ["kept", "total"]
            for name in want:
                np.testing.assert_array_equal(got[name], want[name])
            widths.add(got["kept"].shape[1])
        assert len(widths) > 1  # the sizes really changed between calls

        feed = feeds[2]
        want = plain.infer(feed)
        written = {name: np.full(value.shape, np.nan, value.dtype) for name, value in want.items()}
        assert runner.infer_on_device(feed, written) is written
        for name in want:
            np.testing.assert_array_equal(written[name], want[name])
        wrong = {**written, "kept": np.empty((3, want["kept"].shape[1] + 1), np.float32)}
        with pytest.raises(PipelineError, match=r"output 'kept' of this call is \(3, \d+\) \(a size its data"):
            runner.infer_on_device(feed, wrong)
