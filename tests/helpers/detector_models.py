"""A YOLO-style detector for tests, as users bring one: no weights needed, outputs shaped like a trained model's.

A small strided conv backbone, two feature levels (strides 8 and 16), and an anchor-free head per level, decoded
in the graph as YOLOv8 exports it: one tensor [batch, 4 + classes, anchors], the boxes as cx, cy, w, h in the
input image's pixels and the class scores after their sigmoid.  The class logits start from YOLO's prior bias
(a score of about 0.02), so an image gets a few clusters of confident, overlapping boxes (which NMS must thin) and
a blank image gets none.  Seeded: every call gives the same weights.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.helpers.toy_models import EXAMPLE_BATCH, _seeded
from trt_pipeline.models.spec import ModelSpec

IMAGE_SIZE = 128
CLASSES = 3
STRIDES = (8, 16)
ANCHORS = sum((IMAGE_SIZE // stride) ** 2 for stride in STRIDES)  # 320
PRIOR_BIAS = -4.0  # sigmoid(-4) = 0.018: YOLO's initial class bias, most anchors see nothing


def _conv(inputs: int, outputs: int) -> nn.Sequential:
    conv = nn.Conv2d(inputs, outputs, 3, stride=2, padding=1, bias=False)
    nn.init.kaiming_normal_(conv.weight)  # activations keep their scale, as batch norm keeps a trained net's
    return nn.Sequential(conv, nn.SiLU())


class _Level(nn.Module):
    """One feature level's head: per cell, box distances (left, top, right, bottom) and class logits."""

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.box = nn.Conv2d(channels, 4, 1)
        self.classes = nn.Conv2d(channels, CLASSES, 1)
        nn.init.constant_(self.classes.bias, PRIOR_BIAS)
        nn.init.normal_(self.classes.weight, std=1.5)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        height, width = features.shape[2:]
        ys = (torch.arange(height, dtype=features.dtype) + 0.5) * self.stride
        xs = (torch.arange(width, dtype=features.dtype) + 0.5) * self.stride
        centre_y, centre_x = torch.meshgrid(ys, xs, indexing="ij")
        distances = nn.functional.softplus(self.box(features) + 1.0) * self.stride  # about 1.3 strides each side
        x1, y1 = centre_x - distances[:, 0], centre_y - distances[:, 1]
        x2, y2 = centre_x + distances[:, 2], centre_y + distances[:, 3]
        boxes = torch.stack([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1], dim=1)  # cx, cy, w, h
        scores = torch.sigmoid(self.classes(features))
        return torch.cat([boxes, scores], dim=1).flatten(2)  # [B, 4 + classes, cells]


class YoloStyleDetector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(_conv(3, 16), _conv(16, 32), _conv(32, 32))  # stride 8
        self.down = _conv(32, 64)  # stride 16
        self.levels = nn.ModuleList([_Level(32, STRIDES[0]), _Level(64, STRIDES[1])])

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        fine = self.stem(images)
        coarse = self.down(fine)
        return torch.cat([self.levels[0](fine), self.levels[1](coarse)], dim=2)  # [B, 4 + classes, ANCHORS]


def yolo_detector() -> ModelSpec:
    """The detector on 3x128x128 images; its one output, "head", is [batch, 4 + 3, 320]."""
    with _seeded():
        module = YoloStyleDetector().eval()
        example = {"images": torch.rand(EXAMPLE_BATCH, 3, IMAGE_SIZE, IMAGE_SIZE)}
    return ModelSpec(name="yolo_detector", module=module, example_inputs=example, output_names=["head"])


def scenes(batch: int, seed: int = 0) -> torch.Tensor:
    """Images like the detector's: 1 to 5 squares (10 to 40 pixels, one colour each) on a dark background (what the
    random-weight detector answers with clusters of overlapping boxes); image 1 black, image 2 of 12 squares."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.full((batch, 3, IMAGE_SIZE, IMAGE_SIZE), 0.1)
    for b in range(batch):
        squares = 0 if b == 1 else 12 if b == 2 else int(torch.randint(1, 6, (1,), generator=generator))
        for _ in range(squares):
            x, y = torch.randint(0, IMAGE_SIZE - 30, (2,), generator=generator).tolist()
            side = int(torch.randint(10, 40, (1,), generator=generator))
            images[b, :, y : y + side, x : x + side] = torch.rand(3, 1, 1, generator=generator)
    images[1:2] = 0
    return images
