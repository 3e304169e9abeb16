"""The check stage (pipeline/stages/check.py) on an exported graph."""

from __future__ import annotations

import onnx
import pytest

from tests.helpers import toy_models
from tests.helpers.exported import exported
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.stages.check import check_onnx


def test_check_refuses_another_opset(tmp_path):
    graph, _ = exported(toy_models.tiny_cnn(), tmp_path)
    model = onnx.load(str(graph))
    model.opset_import[0].version = 13
    onnx.save(model, str(graph))
    with pytest.raises(PipelineError, match="not 17"):
        check_onnx(graph)
