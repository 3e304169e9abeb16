"""Detections judged against detections: what the NMS gates (pipeline/stages/postprocess.py) and the benchmark
judge a served detector by, instead of the relative error of its outputs.

Two questions, two measures:
  - Does the graph's NMS compute the reference NMS?  Given the graph's own head, its detections must be
    `reference_nms` of that head: the same count and classes, boxes and scores to SAME_RTOL of their scale
    (`same_detections`).  ONNX Runtime computes the same float32 operations in the same order, so they agree to the
    bit; the tolerance leaves room for another runtime's fused kernels, not for another answer.
  - Are the detections the ones PyTorch's head and the reference NMS give?  A lower precision moves the head a
    little, and a little is enough to move a score across the threshold or an overlap across the IoU threshold:
    a detection can appear, vanish or swap with its neighbour, so equality is the wrong measure.
    `detection_agreement` matches the detections instead, image by image: an expected detection is found where
    the graph has one of the same class whose box overlaps it by MATCH_IOU or more; the agreement is the matched
    share of the larger of the two counts (1 where both are empty), and the matched pairs' scores must lie within
    the precision's tolerance.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..core.compare import compare
from ..core.precision import Precision
from . import node_tolerance

# Two boxes of one class that overlap this much are the same detection (COCO's matching threshold).
MATCH_IOU = 0.5
# The least share of detections a graph must agree on with PyTorch + the reference NMS, by precision (the
# documented margins: docs/detection.md).  FP32 differs from PyTorch by reassociation only: a detection may flip
# only where a score or an overlap lies within ~1e-6 of its threshold.  FP16 and INT8 move scores by up to their
# tolerances (node_tolerance), which flips the detections near a threshold: a few in a hundred at FP16, more at INT8.
MIN_AGREEMENT: dict[Precision, float] = {Precision.FP32: 0.99, Precision.FP16: 0.95, Precision.INT8: 0.85}
# The graph's NMS against the reference NMS of its own head: boxes and scores to this share of their scale.
SAME_RTOL = 1e-5


@dataclass(frozen=True)
class DetectionAgreement:
    """Detections against expected ones over a set of images (module doc)."""

    images: int
    same_count: int  # images with as many detections as expected
    expected: int  # detections expected, over every image
    actual: int  # detections found
    matched: int  # expected detections found (same class, IoU >= MATCH_IOU)
    iou_min: float  # of the matched pairs (1.0 where none matched)
    iou_mean: float
    score_max_diff: float  # the largest |score - expected score| of a matched pair

    @property
    def agreement(self) -> float:
        """The matched share of the larger count (1.0 where neither has a detection)."""
        larger = max(self.expected, self.actual)
        return self.matched / larger if larger else 1.0

    def passes(self, precision: Precision) -> bool:
        return self.agreement >= MIN_AGREEMENT[precision] and self.score_max_diff <= node_tolerance(precision)

    def summary(self) -> str:
        return (
            f"{self.matched} of {self.expected} expected detections found ({self.actual} found, agreement "
            f"{self.agreement:.3f}), {self.same_count} of {self.images} images with the expected count, matched IoU "
            f">= {self.iou_min:.3f}, scores within {self.score_max_diff:.2g}"
        )

    def as_record(self) -> dict:
        return {**asdict(self), "agreement": self.agreement}


def detection_agreement(expected: dict[str, np.ndarray], actual: dict[str, np.ndarray]) -> DetectionAgreement:
    """`actual` detections (boxes, scores, classes, count: pipeline/postprocess/nms.py) against `expected`."""
    pairs = [_match_image(_image(expected, b), _image(actual, b)) for b in range(len(expected["count"]))]
    ious = np.concatenate([iou for iou, _ in pairs]) if pairs else np.zeros(0)
    score_diffs = np.concatenate([diff for _, diff in pairs]) if pairs else np.zeros(0)
    counts = expected["count"].reshape(-1), actual["count"].reshape(-1)
    return DetectionAgreement(
        images=len(counts[0]),
        same_count=int(np.sum(counts[0] == counts[1])),
        expected=int(counts[0].sum()),
        actual=int(counts[1].sum()),
        matched=len(ious),
        iou_min=float(ious.min()) if len(ious) else 1.0,
        iou_mean=float(ious.mean()) if len(ious) else 1.0,
        score_max_diff=float(score_diffs.max()) if len(score_diffs) else 0.0,
    )


def _image(detections: dict[str, np.ndarray], b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Image b's detections, padding dropped: boxes [n, 4], scores [n], classes [n]."""
    n = int(detections["count"].reshape(-1)[b])
    return detections["boxes"][b, :n], detections["scores"][b, :n], detections["classes"][b, :n]


def _match_image(expected: tuple, actual: tuple) -> tuple[np.ndarray, np.ndarray]:
    """(IoU, |score difference|) of each matched pair: the expected detections best first, each taking the unmatched
    detection of its class that overlaps it most, where that is MATCH_IOU or more."""
    (boxes, scores, classes), (found_boxes, found_scores, found_classes) = expected, actual
    iou = _iou(boxes, found_boxes)
    iou[classes[:, None] != found_classes[None, :]] = 0.0
    ious, diffs = [], []
    for i in range(len(boxes)):
        j = int(np.argmax(iou[i])) if iou.shape[1] else -1
        if j >= 0 and iou[i, j] >= MATCH_IOU:
            ious.append(iou[i, j])
            diffs.append(abs(float(scores[i]) - float(found_scores[j])))
            iou[:, j] = 0.0  # taken
    return np.array(ious, np.float64), np.array(diffs, np.float64)


def _iou(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """[len(first), len(second)] IoU of x1, y1, x2, y2 boxes, in float64 (0 where the union is empty)."""
    a, b = first.astype(np.float64)[:, None], second.astype(np.float64)[None, :]
    sides = np.clip(np.minimum(a[..., 2:], b[..., 2:]) - np.maximum(a[..., :2], b[..., :2]), 0, None)
    intersection = sides[..., 0] * sides[..., 1]
    areas = [(box[..., 2] - box[..., 0]) * (box[..., 3] - box[..., 1]) for box in (a, b)]
    union = areas[0] + areas[1] - intersection
    return np.divide(intersection, union, out=np.zeros_like(intersection), where=union > 0)


def same_detections(expected: dict[str, np.ndarray], actual: dict[str, np.ndarray]) -> str | None:
    """Why `actual` is not `expected` (the reference NMS of the same head), or None where it is: the same count and
    classes per image, boxes and scores within SAME_RTOL of their scale."""
    counts = expected["count"].reshape(-1), actual["count"].reshape(-1)
    if not np.array_equal(*counts):
        b = int(np.flatnonzero(counts[0] != counts[1])[0])
        return f"image {b} has {counts[1][b]} detections, the reference NMS {counts[0][b]}"
    if not np.array_equal(expected["classes"], actual["classes"]):
        b, k = (int(i) for i in np.argwhere(expected["classes"] != actual["classes"])[0])
        found, wanted = actual["classes"][b, k], expected["classes"][b, k]
        return f"image {b}'s detection {k} is of class {found}, the reference's {wanted}"
    for name in ("boxes", "scores"):
        comparison = compare(expected[name], actual[name], rtol=SAME_RTOL)
        if not comparison.ok:
            return f"its {name} are off by {comparison.max_abs:.3g}, {comparison.max_rel:.3g} of their scale"
    return None
