"""pipeline.runners.attention: a transformer's layers as ONNX Runtime's fused kernels (what the onnxruntime-cuda
runner opens).  On a DistilBERT folder as the build writes it, both graphs fuse every attention, and the fused graph
computes what the graph did on masks padded on either side and with holes; the Cast moved above a Where computes the
same bit for bit; a graph with no attention is left untouched."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.helpers.output_dims import PROFILE
from trt_pipeline.pipeline.core.settings import Settings
from trt_pipeline.pipeline.runners import load_runner
from trt_pipeline.pipeline.runners.attention import (
    GraphLookup,
    _cast_before_where,
    _scale_as_division,
    _softmax_in_float16,
    attention_heads,
    attention_scale,
    fuse_attention,
    mask_fill,
    query_scale,
)
from trt_pipeline.pipeline.stages.sequence import make_engine

RNG = np.random.default_rng(0)
LAYERS, HEADS, WIDTH = 2, 2, 32
# How far the fused graph's outputs may be from the graph's: float rounding apart in each graph's own precision.
ATOL = {"model.onnx": 1e-5, "model.fp16.onnx": 2e-2}


@pytest.fixture(scope="module")
def distilbert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DistilBERT folder (FP16, so model.onnx and model.fp16.onnx) with biases drawn as training leaves them: with
    transformers' zero biases the exporter drops the bias Adds, and no rule matches."""
    transformers = pytest.importorskip("transformers")
    work = tmp_path_factory.mktemp("attention")
    config = transformers.DistilBertConfig(vocab_size=30, dim=WIDTH, n_layers=LAYERS, n_heads=HEADS, hidden_dim=64)
    model = transformers.DistilBertModel(config)
    with __import__("torch").no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.1)
    model.save_pretrained(work / "distilbert")
    return make_engine(Settings(model=str(work / "distilbert"), precision="fp16", batch=PROFILE, out_root=work))


def tiny_whisper_encoder():  # noqa: ANN201 - a factory: (module, example inputs)
    """Whisper's encoder at a tiny size, its biases drawn (q and v have them, k none), 8 mel bins x 32 frames."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    torch = __import__("torch")
    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        d_model=WIDTH, encoder_layers=LAYERS, encoder_attention_heads=HEADS, encoder_ffn_dim=64, num_mel_bins=8,
        max_source_positions=16,
    )  # fmt: skip
    model = WhisperEncoder(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.1)
    return model.eval(), {"input_features": torch.randn(1, 8, 32)}


@pytest.fixture(scope="module")
def whisper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("whisper")
    model = "tests.runners.test_attention:tiny_whisper_encoder"
    return make_engine(Settings(model=model, precision="fp16", batch=PROFILE, out_root=work))


def _masked_feeds() -> list[dict[str, np.ndarray]]:
    """Masks padded on the right, on the left, with a hole, wholly, and not at all: ONNX Runtime's default mask index
    (each row's count of ones) reads the left padding and the hole as padding on the right, and its default fill
    (-10000) lets a wholly masked row attend as if unmasked."""
    mask = np.ones((5, 12), dtype=np.int64)
    mask[1, 9:] = 0
    mask[2, :4] = 0
    mask[3, 5:7] = 0
    mask[4] = 0
    return [
        {"input_ids": RNG.integers(1, 30, (5, 12)), "attention_mask": mask},
        {"input_ids": RNG.integers(1, 30, (1, 3)), "attention_mask": np.ones((1, 3), dtype=np.int64)},
    ]


def _run(graph: Path, feeds: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
    session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    return [session.run(None, feed)[0] for feed in feeds]


@pytest.mark.parametrize("graph", ATOL)
def test_every_attention_is_fused_and_the_graph_computes_what_it_did_on_any_padding(
    distilbert: Path, tmp_path: Path, graph: str
) -> None:
    """The float16 graph keeps its mask's Where in float32 with a Cast after it: fused only after the Cast moves."""
    fused = shutil.copy(distilbert / graph, tmp_path / graph)
    counts = fuse_attention(Path(fused))
    assert counts["Attention"] == LAYERS
    attentions = [node for node in onnx.load(str(fused)).graph.node if node.op_type == "Attention"]
    assert {helper.get_node_attr_value(node, "scale") for node in attentions} == {(WIDTH // HEADS) ** -0.5}
    assert counts["SkipLayerNormalization"] == 2 * LAYERS
    ops = {node.op_type for node in onnx.load(str(fused)).graph.node}
    assert "Softmax" not in ops  # no attention left unfused
    feeds = _masked_feeds()
    for got, want in zip(_run(Path(fused), feeds), _run(distilbert / graph, feeds), strict=True):
        np.testing.assert_allclose(got, want, atol=ATOL[graph], rtol=0)


@pytest.mark.parametrize("graph", ATOL)
def test_an_attention_scaled_on_its_query_is_fused_by_barts_rules(whisper: Path, tmp_path: Path, graph: str) -> None:
    """Whisper's encoder scales the query (q_proj's output times 1/sqrt(head size)) and its Softmax reads Q·K itself,
    which BERT's rules never match; BART's do, and drop the Mul: the Attention scales by the graph's factor."""
    fused = shutil.copy(whisper / graph, tmp_path / graph)
    counts = fuse_attention(Path(fused))
    assert counts["Attention"] == LAYERS
    model = onnx.load(str(fused))
    attentions = [node for node in model.graph.node if node.op_type == "Attention"]
    assert {helper.get_node_attr_value(node, "scale") for node in attentions} == {(WIDTH // HEADS) ** -0.5}
    assert "Softmax" not in {node.op_type for node in model.graph.node}
    feeds = [{"input_features": RNG.standard_normal((rows, 8, 32)).astype(np.float32)} for rows in (1, 3)]
    for got, want in zip(_run(Path(fused), feeds), _run(whisper / graph, feeds), strict=True):
        np.testing.assert_allclose(got, want, atol=ATOL[graph], rtol=0)


def test_a_float16_graph_fused_in_part_is_left_untouched(distilbert: Path, tmp_path: Path) -> None:
    """The float16 graph's attentions are written in float16 for the rules (their Add and Softmax are kept in
    float32): only a fused Attention may stand in for one, so where a layer is left unfused (here a Mul by 1 between
    its Softmax and the MatMul by V, which no rule matches) the file stays as it was."""
    model = onnx.load(str(distilbert / "model.fp16.onnx"))
    lookup = GraphLookup.of(model)
    cast = lookup.only_reader(lookup.of_type("Softmax")[-1].output[0])
    matmul = lookup.only_reader(cast.output[0])
    one = numpy_helper.from_array(np.ones((), dtype=np.float16), "one")
    model.graph.initializer.append(one)
    matmul.input[0] = "probabilities_times_one"
    position = list(model.graph.node).index(matmul)
    model.graph.node.insert(position, helper.make_node("Mul", [cast.output[0], "one"], ["probabilities_times_one"]))
    path = tmp_path / "model.fp16.onnx"
    onnx.save(model, str(path))
    before = path.read_bytes()
    assert fuse_attention(path) == {}
    assert path.read_bytes() == before


def test_the_heads_and_the_mask_fill_are_read_from_the_graph(distilbert: Path) -> None:
    """transformers 5 splits the heads with view(..., -1, head_size), where ONNX Runtime's own detection fails; its
    eager mask fills with float32's lowest, which the float16 graph keeps in float32 behind a Cast.  The float16 graph
    keeps each attention's mask Add and Softmax in float32 too (on the padded reference the masked scores reach
    float32's lowest): the scale is read once they are written in float16, as the rules expect them."""
    assert attention_heads(GraphLookup.of(onnx.load(str(distilbert / "model.onnx")))) == (HEADS, WIDTH)
    for graph in ATOL:
        model = onnx.load(str(distilbert / graph))
        assert _softmax_in_float16(model) == (LAYERS if graph == "model.fp16.onnx" else 0)
        lookup = GraphLookup.of(model)
        assert mask_fill(lookup) == float(np.finfo(np.float32).min)
        assert attention_scale(lookup) == (WIDTH // HEADS) ** -0.5
        assert query_scale(lookup) is None  # the scores are scaled, under a mask: BART's rules would read it as causal


def test_a_softmax_that_reads_its_matmul_directly_has_no_scale_to_give_the_attention(tmp_path: Path) -> None:
    """ONNX Runtime's Attention scales by 1/sqrt(head size) unless told: where the graph's scale is not found (a
    Softmax reading its MatMul directly, as Whisper's encoder does once onnxsim folds the query's scale into its
    weights) there is none to tell it, and fuse_attention leaves the graph as it is."""
    f32 = TensorProto.FLOAT
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["q", "k"], ["scores"]), helper.make_node("Softmax", ["scores"], ["out"])],
        "unscaled",
        [helper.make_tensor_value_info("q", f32, [2, 4, 8]), helper.make_tensor_value_info("k", f32, [2, 8, 4])],
        [helper.make_tensor_value_info("out", f32, [2, 4, 4])],
    )
    assert (
        attention_scale(GraphLookup.of(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))) is None
    )


def test_a_cast_moved_above_a_where_computes_the_same_bit_for_bit(tmp_path: Path) -> None:
    """float32's lowest casts to float16's -inf either way; a Where read twice stays as it is."""
    f32, f16 = TensorProto.FLOAT, TensorProto.FLOAT16
    lowest = numpy_helper.from_array(np.array(np.finfo(np.float32).min, np.float32), "lowest")
    nodes = [
        helper.make_node("Where", ["keep", "x", "lowest"], ["masked"]),
        helper.make_node("Cast", ["masked"], ["half"], to=f16),
        helper.make_node("Where", ["keep", "x", "lowest"], ["twice"]),
        helper.make_node("Cast", ["twice"], ["half_twice"], to=f16),
        helper.make_node("Neg", ["twice"], ["negated"]),
    ]
    graph = helper.make_graph(
        nodes,
        "where",
        [helper.make_tensor_value_info("keep", TensorProto.BOOL, [2, 5]), helper.make_tensor_value_info("x", f32, [5])],
        [
            helper.make_tensor_value_info("half", f16, [2, 5]),
            helper.make_tensor_value_info("half_twice", f16, [2, 5]),
            helper.make_tensor_value_info("negated", f32, [2, 5]),
        ],
        [lowest],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(tmp_path / "before.onnx"))
    _cast_before_where(model)
    onnx.checker.check_model(model, full_check=True)
    assert [node.op_type for node in model.graph.node] == ["Cast", "Cast", "Where", "Where", "Cast", "Neg"]
    onnx.save(model, str(tmp_path / "after.onnx"))
    feed = {"keep": RNG.random((2, 5)) > 0.5, "x": RNG.standard_normal(5).astype(np.float32) * 1e5}
    before, after = (
        ort.InferenceSession(str(tmp_path / name), providers=["CPUExecutionProvider"]).run(None, feed)
        for name in ("before.onnx", "after.onnx")
    )
    for got, want in zip(after, before, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(("scale", "divides"), [(0.125, True), (64**-0.5 * 1.1, False)])
def test_a_scale_by_a_power_of_two_becomes_a_division_with_the_same_outputs(
    tmp_path: Path, scale: float, divides: bool
) -> None:
    """ViT's unmasked scores: Softmax(MatMul * 0.125) as Softmax(MatMul / 8), bit for bit; another scale stays."""
    f32 = TensorProto.FLOAT
    nodes = [
        helper.make_node("MatMul", ["q", "k"], ["scores"]),
        helper.make_node("Mul", ["scores", "scale"], ["scaled"]),
        helper.make_node("Softmax", ["scaled"], ["out"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "scores",
        [helper.make_tensor_value_info("q", f32, [2, 4, 8]), helper.make_tensor_value_info("k", f32, [2, 8, 4])],
        [helper.make_tensor_value_info("out", f32, [2, 4, 4])],
        [numpy_helper.from_array(np.array(scale, np.float32), "scale")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(tmp_path / "before.onnx"))
    _scale_as_division(model, GraphLookup.of(model))
    assert [node.op_type for node in model.graph.node] == ["MatMul", "Div" if divides else "Mul", "Softmax"]
    onnx.save(model, str(tmp_path / "after.onnx"))
    feed = {
        "q": RNG.standard_normal((2, 4, 8)).astype(np.float32) * 30,
        "k": RNG.standard_normal((2, 8, 4)).astype(np.float32),
    }
    before, after = (
        ort.InferenceSession(str(tmp_path / name), providers=["CPUExecutionProvider"]).run(None, feed)[0]
        for name in ("before.onnx", "after.onnx")
    )
    np.testing.assert_array_equal(after, before)


def test_a_graph_with_no_attention_is_left_untouched(tmp_path: Path) -> None:
    """A classifier's Softmax is no attention: nothing fused, the file's bytes as they were."""
    weight = numpy_helper.from_array(RNG.standard_normal((8, 4)).astype(np.float32), "weight")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "weight"], ["logits"]), helper.make_node("Softmax", ["logits"], ["out"])],
        "classifier",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 4])],
        [weight],
    )
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    before = path.read_bytes()
    assert fuse_attention(path) == {}
    assert path.read_bytes() == before


def test_the_cuda_runner_serves_the_fused_graph_and_says_so(distilbert: Path) -> None:
    """Here on the CPU placement (the graph the GPU runs, the folder's float16 one): fused, within float rounding of
    the graph as exported, which fuse_attention=False serves bit for bit."""
    feeds = _masked_feeds()
    with (
        load_runner(distilbert, "onnxruntime-cuda", device="cpu") as fused,
        load_runner(distilbert, "onnxruntime-cuda", device="cpu", fuse_attention=False) as exported,
        load_runner(distilbert, "onnxruntime") as plain,
    ):
        assert fused.graph == exported.graph == plain.graph
        assert f"Attention {LAYERS}" in fused.description
        assert "fused" not in exported.description
        for feed in feeds:
            want = plain.infer(feed)["last_hidden_state"]
            np.testing.assert_array_equal(exported.infer(feed)["last_hidden_state"], want)
            np.testing.assert_allclose(fused.infer(feed)["last_hidden_state"], want, atol=ATOL[fused.graph], rtol=0)


def test_the_graph_is_rewritten_once_for_all_the_runners_sessions(distilbert: Path, monkeypatch) -> None:
    """The fusion takes seconds on a real model: the second session opens the first one's rewritten bytes."""
    from trt_pipeline.pipeline.runners import onnxruntime_cuda

    calls = []

    def counted(graph: Path) -> dict[str, int]:
        calls.append(graph)
        return fuse_attention(graph)

    monkeypatch.setattr(onnxruntime_cuda, "fuse_attention", counted)
    feed = _masked_feeds()[0]
    with load_runner(distilbert, "onnxruntime-cuda", device="cpu", sessions=2) as runner:
        assert len(calls) == 1 and f"Attention {LAYERS}" in runner.description
        first, second = (slot.session.run(None, feed)[0] for slot in runner._slots)
    np.testing.assert_array_equal(first, second)
