"""NMS appended to a graph (pipeline/postprocess/nms_graph.py), held to the reference greedy NMS (nms.py).

The heads are scenes built to overlap: chains of boxes where each overlaps the next but not the one after (greedy
keeps every other one; suppressing "anything a better box overlaps" keeps only the first), two classes stacked on
one chain (class-aware keeps both), images with nothing above the score threshold, crowds of more boxes than K,
and clutter.  ONNX Runtime runs the graph at batch sizes it was never shaped for; TensorRT-RTX builds it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.helpers.detections import assert_same_detections
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.nms_config import NmsConfig
from trt_pipeline.pipeline.core.sessions import onnxruntime_session
from trt_pipeline.pipeline.postprocess.nms import OUTPUTS, decode, overlaps, reference_nms
from trt_pipeline.pipeline.postprocess.nms_graph import append_nms

CLASSES = 3
ANCHORS = 400
K = 50
CONFIG = NmsConfig(candidates=300, max_detections=K)  # score above 0.25, IoU above 0.45
CONFIGS = {
    "class-aware": CONFIG,
    "class-agnostic": NmsConfig(candidates=300, max_detections=K, class_aware=False),
    "xyxy": NmsConfig(box_format="xyxy", candidates=300, max_detections=K),
}
BOX, STEP = 40.0, 12.0  # a chain's boxes: IoU 0.54 with the next (above 0.45), 0.25 with the one after


def head_graph(
    rows: int | str = 4 + CLASSES, anchors: int | str = ANCHORS, dtype: int = TensorProto.FLOAT, opset: int = 17
) -> onnx.ModelProto:
    """A graph whose output "head" is its input [batch, rows, anchors] (cast to `dtype`)."""
    node = helper.make_node("Cast", ["x"], ["head"], to=dtype)
    graph = helper.make_graph(
        [node],
        "head",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", rows, anchors])],
        [helper.make_tensor_value_info("head", dtype, ["batch", rows, anchors])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _place(image: np.ndarray, rng: np.random.Generator, boxes: list, scores: list, classes: list) -> None:
    """Put boxes (cx, cy, w, h) with their class's score on anchors picked at random (anchor order is not score
    order); the other classes' scores stay the background's."""
    anchors = rng.choice(ANCHORS, len(boxes), replace=False)
    image[:4, anchors] = np.array(boxes, np.float32).T
    image[4 + np.array(classes), anchors] = scores


def _chains(image: np.ndarray, rng: np.random.Generator) -> None:
    """Six chains along x, each box overlapping the next; the first has a twin of another class on top of it."""
    boxes, scores, classes = [], [], []
    for chain in range(6):
        length = int(rng.integers(3, 9))
        label = int(rng.integers(CLASSES))
        for i in range(length):
            boxes.append((60 + STEP * i, 60 + 100 * chain, BOX, BOX))
            scores.append(0.95 - 0.1 * chain - 0.01 * i)
            classes.append(label)
            if chain == 0:  # the twin: same boxes, slightly lower scores, the next class
                boxes.append(boxes[-1])
                scores.append(scores[-1] - 0.003)
                classes.append((label + 1) % CLASSES)
    _place(image, rng, boxes, scores, classes)


def _nothing(image: np.ndarray, rng: np.random.Generator) -> None:
    """Only the background: no score above the threshold, no detection."""


def _crowd(image: np.ndarray, rng: np.random.Generator) -> None:
    """80 boxes that do not touch, all above the threshold: more than K survive."""
    boxes = [(30 + 60 * (i % 10), 30 + 60 * (i // 10), 30.0, 30.0) for i in range(80)]
    scores = rng.uniform(0.3, 1.0, len(boxes)).tolist()
    _place(image, rng, boxes, scores, rng.integers(CLASSES, size=len(boxes)).tolist())


def _clutter(image: np.ndarray, rng: np.random.Generator) -> None:
    """150 random boxes in a small area: overlaps of every degree."""
    boxes = [
        (*rng.uniform(50, 250, 2), *rng.uniform(20, 100, 2)) for _ in range(150)
    ]  # fmt: skip
    _place(image, rng, boxes, rng.uniform(0, 1, len(boxes)).tolist(), rng.integers(CLASSES, size=150).tolist())


SCENES = (_chains, _nothing, _crowd, _clutter)


def scene_heads(batch: int, seed: int = 0) -> np.ndarray:
    """[batch, 4 + CLASSES, ANCHORS] heads (cx, cy, w, h): image b is the scene SCENES[b % 4] over a background
    of random boxes whose scores are all below the threshold."""
    rng = np.random.default_rng([seed, batch])
    head = np.empty((batch, 4 + CLASSES, ANCHORS), np.float32)
    head[:, :2] = rng.uniform(0, 640, (batch, 2, ANCHORS))
    head[:, 2:4] = rng.uniform(8, 64, (batch, 2, ANCHORS))
    head[:, 4:] = rng.uniform(0, 0.2, (batch, CLASSES, ANCHORS))
    for b in range(batch):
        SCENES[b % len(SCENES)](head[b], rng)
    return head


def as_xyxy(head: np.ndarray) -> np.ndarray:
    corners = decode(head, "cxcywh")[0].transpose(0, 2, 1)
    return np.concatenate([corners, head[:, 4:]], axis=1)


def one_shot_count(head: np.ndarray, config: NmsConfig) -> np.ndarray:
    """Per image, the candidates no better candidate (of their class) overlaps: what suppression in one pass keeps,
    where greedy lets a suppressed box suppress nothing."""
    boxes, scores, classes = decode(head, config.box_format)
    counts = []
    for b in range(len(head)):
        order = np.argsort(-scores[b], kind="stable")[: config.candidates]
        order = order[scores[b][order] > np.float32(config.score_threshold)]
        alone = [j for n, j in enumerate(order) if not _overlapped(boxes[b], classes[b], order[:n], j, config)]
        counts.append(min(len(alone), config.max_detections))
    return np.array(counts)


def _overlapped(boxes: np.ndarray, classes: np.ndarray, better: np.ndarray, j: int, config: NmsConfig) -> bool:
    rivals = better[classes[better] == classes[j]] if config.class_aware else better
    return bool(len(rivals)) and bool(overlaps(boxes[rivals], boxes[j], config.iou_threshold).any())


@pytest.fixture(scope="module")
def sessions() -> dict:
    """One ONNX Runtime session per configuration, on the head graph with NMS appended."""
    return {name: onnxruntime_session(append_nms(head_graph(), c).SerializeToString()) for name, c in CONFIGS.items()}


def run(session, head: np.ndarray) -> dict[str, np.ndarray]:
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": head}), strict=True))


@pytest.mark.parametrize("batch", [1, 4, 13])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_graph_keeps_what_greedy_nms_keeps(sessions: dict, name: str, batch: int):
    config = CONFIGS[name]
    head = scene_heads(batch)
    if config.box_format == "xyxy":
        head = as_xyxy(head)
    expected = reference_nms(head, config).as_outputs()
    assert_same_detections(run(sessions[name], head), expected)
    if batch >= len(SCENES):  # the scenes hold what they are for
        assert expected["count"][1, 0] == 0 and expected["count"][2, 0] == K


def test_the_scenes_tell_greedy_from_one_pass_suppression_and_classes_apart(sessions: dict):
    head = scene_heads(4)
    greedy = reference_nms(head, CONFIG).count[:, 0]
    assert greedy[0] > one_shot_count(head, CONFIG)[0]  # the chains: every other box is kept, not the first alone
    agnostic = reference_nms(head, CONFIGS["class-agnostic"]).count[:, 0]
    assert greedy[0] > agnostic[0]  # the twin chain of another class survives only class-aware
    np.testing.assert_array_equal(run(sessions["class-aware"], head)["count"][:, 0], greedy)


def test_a_float16_head_is_suppressed_in_float32():
    config = NmsConfig(candidates=300, max_detections=K)
    graph = append_nms(head_graph(dtype=TensorProto.FLOAT16), config)
    head = scene_heads(4)
    expected = reference_nms(head.astype(np.float16).astype(np.float32), config).as_outputs()
    assert_same_detections(run(onnxruntime_session(graph.SerializeToString()), head), expected)


@pytest.mark.parametrize("anchors", [30, 400, 1000])
def test_an_anchor_count_known_at_run_time_or_below_k(anchors: int):
    """A head whose anchors are symbolic (an exporter's dynamic image size) takes min(candidates, anchors)
    candidates at run time; fewer anchors than K still give K rows (the graph pads, count says how many are real)."""
    head = scene_heads(4)[:, :, :anchors] if anchors <= ANCHORS else np.tile(scene_heads(4), 3)[:, :, :anchors]
    expected = reference_nms(head, CONFIG).as_outputs()
    for graph in (head_graph(anchors="anchors"), head_graph(anchors=anchors)):
        assert_same_detections(run(onnxruntime_session(append_nms(graph, CONFIG).SerializeToString()), head), expected)
    assert expected["count"].max() <= min(anchors, K)


def test_other_outputs_stay_and_the_model_given_is_not_changed():
    model = head_graph()
    model.graph.node.append(helper.make_node("Identity", ["x"], ["features"]))
    model.graph.output.append(helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", 7, ANCHORS]))
    before = model.SerializeToString()
    appended = append_nms(model, NmsConfig(candidates=300, max_detections=K, head="head"))
    assert [output.name for output in appended.graph.output] == ["features", *OUTPUTS]
    assert model.SerializeToString() == before
    onnx.checker.check_model(appended, full_check=True)


def test_the_subgraph_is_made_of_fixed_size_ops_and_builds_with_tensorrt_rtx(tmp_path: Path):
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed: pip install tensorrt-rtx-cu13")
    from trt_pipeline.pipeline.core.settings import BatchProfile
    from trt_pipeline.pipeline.stages.build import build_engine

    graph = tmp_path / "nms.onnx"
    onnx.save(append_nms(head_graph(), CONFIG), str(graph))
    ops = {node.op_type for node in onnx.load(str(graph)).graph.node}
    assert "Loop" in ops and not ops & {"NonMaxSuppression", "NonZero", "Compress"}  # no value-dependent size
    record = build_engine(graph, tmp_path / "engine.plan", batch=BatchProfile(1, 4, 16), builder="tensorrt_rtx")
    assert record["profile"]["x"] == {"min": [1, 7, ANCHORS], "opt": [4, 7, ANCHORS], "max": [16, 7, ANCHORS]}
    assert record["io"][1:] == [
        {"name": "boxes", "mode": "output", "dtype": "float32", "shape": [-1, K, 4]},
        {"name": "scores", "mode": "output", "dtype": "float32", "shape": [-1, K]},
        {"name": "classes", "mode": "output", "dtype": "int32", "shape": [-1, K]},
        {"name": "count", "mode": "output", "dtype": "int32", "shape": [-1, 1]},
    ]


# --------------------------------------------------------------------------- mistakes


@pytest.mark.parametrize(
    ("settings", "problem", "fix"),
    [
        ({"box_format": "xywh"}, "box format 'xywh' is unknown", "cxcywh"),
        ({"iou_threshold": 1.5}, "IoU threshold 1.5 is not in [0, 1]", "0.45"),
        ({"score_threshold": float("nan")}, "score threshold nan is not a finite number", "0.25"),
        ({"candidates": 0}, "candidates 0 is not a whole number", "1000"),
        ({"max_detections": True}, "max detections True is not a whole number", "100"),
        ({"candidates": 5000}, "more than TensorRT's TopK takes (3840)", "at most 3840"),
        ({"candidates": 50, "max_detections": 100}, "max detections 100 is more than the candidates", "<="),
    ],
)
def test_bad_settings_are_refused_with_the_fix(settings: dict, problem: str, fix: str):
    with pytest.raises(PipelineError) as caught:
        NmsConfig(**settings)
    assert problem in caught.value.problem and fix in (caught.value.fix or "")


def _rank_two() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["head"])],
        "flat",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 7])],
        [helper.make_tensor_value_info("head", TensorProto.FLOAT, ["batch", 7])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _two_outputs() -> onnx.ModelProto:
    model = head_graph()
    model.graph.node.append(helper.make_node("Identity", ["x"], ["other"]))
    model.graph.output.append(helper.make_tensor_value_info("other", TensorProto.FLOAT, ["batch", 7, ANCHORS]))
    return model


def _fixed_batch() -> onnx.ModelProto:
    model = head_graph()
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_value = 4
    return model


def _taken_name() -> onnx.ModelProto:
    model = head_graph()
    model.graph.node.insert(0, helper.make_node("Identity", ["x"], ["scores"]))
    return model


@pytest.mark.parametrize(
    ("model", "config", "problem", "fix"),
    [
        (_rank_two, CONFIG, "[batch, 4 + classes, anchors]; 'head' is ['batch', 7]", "raw detection head"),
        (
            lambda: head_graph(rows=4),
            CONFIG,
            "4 box rows + one per class (at least 5); 'head' is ['batch', 4,",
            "Transpose",
        ),
        (lambda: head_graph(rows="rows"), CONFIG, "rows fixed", "simplify stage"),
        (_fixed_batch, CONFIG, "batch dim symbolic", "dynamic batch"),
        (_two_outputs, CONFIG, "2 outputs (head, other)", "NmsConfig(head=...)"),
        (head_graph, NmsConfig(head="logits"), "no output 'logits'", "head"),
        (lambda: head_graph(opset=18), CONFIG, "opset 17 graphs; this one imports [18]", "opset 17"),
        (_taken_name, CONFIG, "tensors named ['scores']", "rename them"),
    ],
)
def test_a_head_nms_cannot_take_is_refused_naming_why(model, config: NmsConfig, problem: str, fix: str):
    with pytest.raises(PipelineError) as caught:
        append_nms(model(), config)
    assert problem in caught.value.problem and fix in (caught.value.fix or "")
