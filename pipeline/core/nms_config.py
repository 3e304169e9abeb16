"""The NMS settings (POSTPROCESS=nms): what `Settings` gives, the manifest records and the NMS forms read.

On the ground floor so the settings can type them; what the settings mean, the suppression itself, is
postprocess/nms.py's reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import PipelineError

BOX_FORMATS = ("cxcywh", "xyxy")
# TensorRT's TopK takes k up to 3840 (TensorRT-RTX 1.7 refuses 3841: "K exceeds the maximum value allowed (3840)");
# the graph's first TopK takes `candidates`.
TOPK_LIMIT = 3840


@dataclass(frozen=True)
class NmsConfig:
    """How detections are chosen from a head (postprocess/nms.py's module doc); refuses a bad value when made."""

    box_format: str = "cxcywh"
    score_threshold: float = 0.25
    iou_threshold: float = 0.45
    candidates: int = 1000  # the best-scored anchors per image that NMS considers
    max_detections: int = 100  # K: rows per image in the outputs
    class_aware: bool = True  # boxes of different classes never suppress each other
    head: str | None = None  # the graph output holding the head; None: the graph's only output

    def __post_init__(self) -> None:
        if self.box_format not in BOX_FORMATS:
            raise PipelineError(f"NMS box format {self.box_format!r} is unknown", f"give one of {BOX_FORMATS}")
        _require_finite("score threshold", self.score_threshold, "give a score, e.g. 0.25 (after the sigmoid)")
        _require_finite("IoU threshold", self.iou_threshold, "give an IoU between 0 and 1, e.g. 0.45")
        if not 0 <= self.iou_threshold <= 1:
            raise PipelineError(f"NMS IoU threshold {self.iou_threshold} is not in [0, 1]", "give e.g. 0.45")
        self._check_counts()

    def _check_counts(self) -> None:
        _require_count("candidates", self.candidates, f"give 1 to {TOPK_LIMIT} (TensorRT's TopK limit), e.g. 1000")
        _require_count("max detections", self.max_detections, "give e.g. 100")
        if self.candidates > TOPK_LIMIT:
            raise PipelineError(
                f"NMS candidates {self.candidates} is more than TensorRT's TopK takes ({TOPK_LIMIT})",
                f"consider at most {TOPK_LIMIT} candidates per image",
            )
        if self.max_detections > self.candidates:
            raise PipelineError(
                f"NMS max detections {self.max_detections} is more than the candidates it considers "
                f"({self.candidates})",
                "give max detections <= candidates",
            )


def _require_finite(name: str, value: object, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PipelineError(f"NMS {name} {value!r} is not a finite number", fix)


def _require_count(name: str, value: object, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PipelineError(f"NMS {name} {value!r} is not a whole number of at least 1", fix)
