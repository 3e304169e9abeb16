"""A toy model exported the way the build stages do it: model.onnx and reference.npz in a folder."""

from __future__ import annotations

from trt_pipeline.models.prepare import prepare
from trt_pipeline.models.spec import ModelSpec
from trt_pipeline.pipeline.core.settings import BatchProfile
from trt_pipeline.pipeline.stages.export import export_onnx, write_reference

PROFILE = BatchProfile(1, 4, 8)


def exported(spec: ModelSpec, folder) -> tuple:
    prepare(spec)
    graph, reference = folder / "model.onnx", folder / "reference.npz"
    export_onnx(spec, graph)
    write_reference(spec, PROFILE, reference)
    return graph, reference
