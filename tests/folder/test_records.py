"""The records a manifest holds (pipeline/folder/records.py), read from JSON and written back."""

from __future__ import annotations

from tests.helpers.folder_builds import FP32_RECORD
from trt_pipeline.pipeline.core.precision import Precision
from trt_pipeline.pipeline.core.settings import Postprocess
from trt_pipeline.pipeline.folder.records import GraphRecord, PostprocessRecord, encode


def test_a_graphs_post_processing_is_read_from_json_as_postprocess_and_written_as_its_value():
    nms_record = {**FP32_RECORD, "file": "model.nms.onnx", "gate": "nms_fp32", "postprocess": "nms"}
    graph = GraphRecord.from_json(nms_record)
    assert graph.postprocess is Postprocess.NMS and graph.precision is Precision.FP32
    assert encode(graph) == nms_record
    raw = {"kind": "nms", "config": {}, "head_outputs": [{"name": "head", "dtype": "float32", "shape": ["batch", 7]}]}
    record = PostprocessRecord.from_json(raw)
    assert record.kind is Postprocess.NMS and record.as_json() == raw
