"""A YOLO-style detector as users bring one (tests/helpers/detector_models.py), exported and simplified by the
pipeline's stages, with NMS appended: its detections through ONNX Runtime are the PyTorch model's head through the
reference NMS.

The images are scenes of flat-coloured squares on a dark background (what the random-weight detector answers
with clusters of overlapping boxes), a blank image (no detection) and a busy one (more than K).
"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
import torch

from tests.helpers.detections import assert_same_detections
from tests.helpers.detector_models import ANCHORS, CLASSES, IMAGE_SIZE, scenes, yolo_detector
from trt_pipeline.pipeline.core.nms_config import NmsConfig
from trt_pipeline.pipeline.core.sessions import onnxruntime_session
from trt_pipeline.pipeline.postprocess.nms import reference_nms
from trt_pipeline.pipeline.postprocess.nms_graph import append_nms
from trt_pipeline.pipeline.stages.export import export_onnx
from trt_pipeline.pipeline.stages.simplify import simplify_onnx

K = 20
CONFIG = NmsConfig(candidates=200, max_detections=K)


@pytest.fixture(scope="module")
def detector(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """(the model, its exported graph with NMS appended)."""
    spec = yolo_detector()
    folder = tmp_path_factory.mktemp("detector")
    export_onnx(spec, folder / "model.onnx")
    simplify_onnx(folder / "model.onnx", folder / "model.onnx")  # the exporter leaves the anchors' count symbolic
    graph = folder / "model.nms.onnx"
    onnx.save(append_nms(folder / "model.onnx", CONFIG), str(graph))
    return spec.module, graph


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_the_detectors_graph_detects_what_pytorch_and_the_reference_nms_do(detector: tuple, batch: int):
    module, graph = detector
    images = scenes(batch)
    with torch.inference_mode():
        head = module(images).numpy()
    assert head.shape == (batch, 4 + CLASSES, ANCHORS)
    expected = reference_nms(head, CONFIG).as_outputs()
    session = onnxruntime_session(graph)
    outputs = session.run(None, {"images": images.numpy()})
    actual = dict(zip([o.name for o in session.get_outputs()], outputs, strict=True))
    assert_same_detections(actual, expected, box_atol=1e-3, score_atol=1e-5)  # PyTorch's convolutions vs ORT's
    if batch >= 3:
        assert expected["count"][1, 0] == 0 and expected["count"][2, 0] == K  # blank: none; busy: more than K


def test_the_detector_with_nms_builds_with_tensorrt_rtx(detector: tuple, tmp_path: Path):
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed: pip install tensorrt-rtx-cu13")
    from trt_pipeline.pipeline.core.settings import BatchProfile
    from trt_pipeline.pipeline.stages.build import build_engine

    record = build_engine(detector[1], tmp_path / "engine.plan", batch=BatchProfile(1, 2, 8), builder="tensorrt_rtx")
    assert [(t["name"], t["shape"]) for t in record["io"]] == [
        ("images", [-1, 3, IMAGE_SIZE, IMAGE_SIZE]),
        ("boxes", [-1, K, 4]),
        ("scores", [-1, K]),
        ("classes", [-1, K]),
        ("count", [-1, 1]),
    ]
