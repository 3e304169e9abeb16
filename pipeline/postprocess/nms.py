"""Non-maximum suppression for a YOLO-style head: the reference every other form is held to (its settings,
NmsConfig, are core/nms_config.py's).

The head is one tensor [batch, 4 + classes, anchors]: per anchor, a box (cx, cy, w, h or x1, y1, x2, y2, in image
coordinates) and a score per class (already through their sigmoid).  Each anchor is one candidate: its best
class and that class's score (ties: the lowest class index).  Per image, the `candidates` best-scored anchors are
considered (ties: the lowest anchor index, as ONNX TopK orders them); greedy NMS visits them by score, drops a
candidate whose score is not above `score_threshold`, and keeps one unless a kept candidate (of the same class,
when class_aware) overlaps it with IoU above `iou_threshold`.  The first `max_detections` kept are the detections.

The outputs have fixed sizes, so a graph can return them: boxes [B, K, 4] (x1, y1, x2, y2), scores [B, K],
classes [B, K] (int32) and count [B, 1] (int32): the first count[b, 0] rows of image b are its detections, the
rest padding (boxes and scores 0, classes -1).  count keeps a dim after the batch, as TensorRT's EfficientNMS plugin
writes num_detections [batch, 1]: a tensor of the batch dim alone has no per-image dims, which Triton's model
config cannot declare without a reshape (and its clients would then read [B, 1] while our runners returned [B]).

IoU > t, intersection / (area_i + area_j - intersection) > t, is computed as intersection * (1 + t) > t * area_i +
t * area_j in float32: the same where the union is positive, without a division (two empty boxes never overlap, as
0/0 is not above t either), and with one pass over the [M, M] pairs fewer in the graph.  The graph computes the
same operations in the same order, so the two agree to the bit on ONNX Runtime.  numpy only: the runtime may
import this.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.errors import PipelineError
from ..core.nms_config import NmsConfig

OUTPUTS = ("boxes", "scores", "classes", "count")
PADDING_CLASS = -1


@dataclass(frozen=True)
class Detections:
    """Fixed-size detections (module doc): boxes [B, K, 4], scores [B, K], classes [B, K], count [B, 1]."""

    boxes: np.ndarray
    scores: np.ndarray
    classes: np.ndarray
    count: np.ndarray

    def as_outputs(self) -> dict[str, np.ndarray]:
        """Keyed by the graph's output names (OUTPUTS)."""
        return dict(zip(OUTPUTS, (self.boxes, self.scores, self.classes, self.count), strict=True))


def reference_nms(head: np.ndarray, config: NmsConfig) -> Detections:
    """Greedy NMS of every image of `head` [B, 4 + classes, anchors] (module doc), one candidate at a time."""
    if head.ndim != 3 or head.shape[1] < 5:
        raise PipelineError(
            f"a detection head is [batch, 4 + classes, anchors]; this one is {list(head.shape)}",
            "give the raw head: 4 box rows, then one score row per class, for every anchor",
        )
    boxes, scores, classes = decode(head.astype(np.float32), config.box_format)
    results = [_image_nms(boxes[b], scores[b], classes[b], config) for b in range(head.shape[0])]
    return Detections(*(np.stack(parts) for parts in zip(*results, strict=True)))


def detections_of(outputs: dict[str, np.ndarray], config: NmsConfig) -> dict[str, np.ndarray]:
    """A head graph's outputs as its NMS graph returns them (nms_graph.append_nms): the other outputs first, then the
    reference NMS of the head (the only output where config.head is None) as OUTPUTS."""
    head = config.head or next(iter(outputs))
    kept = {name: value for name, value in outputs.items() if name != head}
    return {**kept, **reference_nms(outputs[head], config).as_outputs()}


def decode(head: np.ndarray, box_format: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per anchor: its box as x1, y1, x2, y2 [B, N, 4], its best score [B, N] and that class [B, N]."""
    first, second = head[:, 0:2], head[:, 2:4]
    if box_format == "cxcywh":
        half = second * np.float32(0.5)
        first, second = first - half, first + half
    boxes = np.concatenate([first, second], axis=1).transpose(0, 2, 1)
    scores = head[:, 4:]
    return boxes, scores.max(axis=1), scores.argmax(axis=1).astype(np.int32)


def _image_nms(
    boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray, config: NmsConfig
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One image: the kept candidates' boxes, scores and classes padded to K rows, and their count."""
    kept = greedy_keep(boxes, scores, classes, config)
    k = config.max_detections
    out_boxes = np.zeros((k, 4), np.float32)
    out_scores = np.zeros(k, np.float32)
    out_classes = np.full(k, PADDING_CLASS, np.int32)
    out_boxes[: len(kept)], out_scores[: len(kept)], out_classes[: len(kept)] = boxes[kept], scores[kept], classes[kept]
    return out_boxes, out_scores, out_classes, np.array([len(kept)], np.int32)


def greedy_keep(boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray, config: NmsConfig) -> list[int]:
    """The anchors greedy NMS keeps, best first, at most max_detections of them (the later ones cannot change
    which come first)."""
    order = np.argsort(-scores, kind="stable")[: config.candidates]  # ties: the lower index first, as TopK
    threshold = np.float32(config.score_threshold)  # as the graph holds it
    kept: list[int] = []
    for index in order:
        if not scores[index] > threshold:
            break  # sorted: no later candidate is above it
        rivals = [k for k in kept if not config.class_aware or classes[k] == classes[index]]
        if rivals and overlaps(boxes[rivals], boxes[index], config.iou_threshold).any():
            continue
        kept.append(int(index))
        if len(kept) == config.max_detections:
            break
    return kept


def overlaps(kept: np.ndarray, box: np.ndarray, iou_threshold: float) -> np.ndarray:
    """Whether each of `kept` [k, 4] overlaps `box` [4] with IoU above the threshold (module doc: in float32,
    as the graph computes it)."""
    low = np.maximum(kept[:, :2], box[:2])
    high = np.minimum(kept[:, 2:], box[2:])
    sides = np.maximum(high - low, np.float32(0))
    intersection = sides[:, 0] * sides[:, 1]
    threshold = np.float32(iou_threshold)
    return intersection * np.float32(1 + iou_threshold) > threshold * area(kept) + threshold * area(box[None])[0]


def area(boxes: np.ndarray) -> np.ndarray:
    return (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
