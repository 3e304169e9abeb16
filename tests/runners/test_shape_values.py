"""pipeline.runners.shape_values: the host values ONNX Runtime's CUDA provider would copy to the device (its placement
rule, read from the graph), and the rewrite that makes them there with a Range.  The outputs must stay the same bit
for bit, and no read may be left that the rewrite can make."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from trt_pipeline.pipeline.runners.shape_values import HostRead, host_reads, make_on_device

RNG = np.random.default_rng(0)


def _save(path: Path, nodes: list, elem: int) -> Path:
    """A graph of `nodes` from input x / ids [batch, sequence] to out, of element type `elem`, index [1] its one
    initializer."""
    index = numpy_helper.from_array(np.array([1], np.int64), "index")
    source = nodes[0].input[0]
    graph = helper.make_graph(
        nodes,
        "shapes",
        [helper.make_tensor_value_info(source, elem, ["batch", "sequence"])],
        [helper.make_tensor_value_info("out", elem, ["batch", "sequence"])],
        [index],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _sequence_graph(path: Path, add: str) -> Path:
    """ids [batch, sequence] -> Neg (on the device) + the sequence length (Gather of a Shape: on the host) ->
    Reshape to the ids' shape (its shape a host input of the kernel: no copy) -> out; the Add named `add`."""
    nodes = [
        helper.make_node("Shape", ["ids"], ["shape"]),
        helper.make_node("Gather", ["shape", "index"], ["length"], axis=0),
        helper.make_node("Neg", ["ids"], ["negated"]),
        helper.make_node("Add", ["negated", "length"], ["shifted"], name=add),
        helper.make_node("Reshape", ["shifted", "shape"], ["out"], name="reshape"),
    ]
    return _save(path, nodes, TensorProto.INT64)


def _outputs(path: Path, feeds: list[dict[str, np.ndarray]]) -> list[list[np.ndarray]]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return [session.run(None, feed) for feed in feeds]


@pytest.mark.parametrize("add", ["add", ""], ids=["named", "unnamed"])
def test_a_shape_value_read_as_data_is_found_and_made_on_the_device_with_the_same_outputs(
    tmp_path: Path, add: str
) -> None:
    """Unnamed too (an exporter may leave node names empty): the read is the Add's, no other unnamed node's."""
    graph = _sequence_graph(tmp_path / "model.onnx", add)
    before = shutil.copy(graph, tmp_path / "before.onnx")
    # The Add reads the length as data (a copy); the Reshape reads the shape where its kernel takes it (no copy).
    assert host_reads(onnx.load(str(graph))) == [HostRead("length", add, 1)]
    assert make_on_device(graph) == 1
    assert host_reads(onnx.load(str(graph))) == []
    onnx.checker.check_model(onnx.load(str(graph)), full_check=True)
    feeds = [{"ids": RNG.integers(-50, 50, shape)} for shape in ((1, 1), (3, 7), (2, 40))]
    for got, want in zip(_outputs(graph, feeds), _outputs(before, feeds), strict=True):
        np.testing.assert_array_equal(got[0], want[0])


def test_a_read_the_rewrite_cannot_make_is_left_to_onnx_runtimes_copy_and_the_file_untouched(tmp_path: Path) -> None:
    """The length cast to float16 on the host (a Cast's input decides where it runs) and squared: a node with a
    float16 input stays on the device, though no type is declared for it (its type inferred), so the Mul reads the
    host value twice.  Range makes integers only: those reads stay copies, and a file with nothing to make is not
    rewritten."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "index"], ["length"], axis=0),
        helper.make_node("Cast", ["length"], ["half_length"], to=TensorProto.FLOAT16),
        helper.make_node("Mul", ["half_length", "half_length"], ["squared"], name="square"),
        helper.make_node("Add", ["x", "squared"], ["out"], name="add"),
    ]
    path = _save(tmp_path / "model.onnx", nodes, TensorProto.FLOAT16)
    written = path.read_bytes()
    expected = [HostRead("half_length", "square", 0), HostRead("half_length", "square", 1)]
    assert host_reads(onnx.load(str(path))) == expected
    assert make_on_device(path) == 0
    assert path.read_bytes() == written


def test_a_distilbert_folders_padding_mask_reads_the_sequence_length_and_serves_the_same_after(tmp_path: Path):
    """transformers 5's padding mask gathers the attention mask at batch * sequence + position: the sequence length,
    a Gather of a Shape, is the one read that kept ONNX Runtime from capturing a BERT or DistilBERT on an H200.  The
    CUDA runner (here on the CPU placement) opens the graph with it made on the device, and serves what the plain
    runner serves, bit for bit."""
    transformers = pytest.importorskip("transformers")
    from tests.helpers.output_dims import PROFILE
    from trt_pipeline.pipeline.core.settings import Settings
    from trt_pipeline.pipeline.runners import load_runner
    from trt_pipeline.pipeline.stages.sequence import make_engine

    config = transformers.DistilBertConfig(vocab_size=30, dim=32, n_layers=2, n_heads=2, hidden_dim=64)
    transformers.DistilBertModel(config).save_pretrained(tmp_path / "distilbert")
    settings = Settings(model=str(tmp_path / "distilbert"), precision="fp16", batch=PROFILE, out_root=tmp_path)
    folder = make_engine(settings)
    reads = host_reads(onnx.load(str(folder / "model.fp16.onnx"), load_external_data=False))
    assert [(read.node, read.index) for read in reads] == [("/model/Mul", 1)]
    with load_runner(folder, "onnxruntime-cuda", device="cpu") as runner, load_runner(folder, "onnxruntime") as plain:
        assert "1 one-element shape value(s) made on the device by a Range" in runner.description
        for rows, length in ((1, 5), (3, 17)):
            mask = np.ones((rows, length), dtype=np.int64)
            mask[-1, length // 2 :] = 0  # padding: the gathered mask matters
            feed = {"input_ids": RNG.integers(1, 30, (rows, length)), "attention_mask": mask}
            got, want = runner.infer(feed), plain.infer(feed)
            np.testing.assert_array_equal(got["last_hidden_state"], want["last_hidden_state"])
