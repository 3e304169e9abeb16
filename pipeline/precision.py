"""Stage 6: precision expressed in the graph itself.

TensorRT 11 (and TensorRT-RTX) build strongly typed networks only: the FP16/INT8
builder flags no longer choose precisions, so the ONNX graph must carry them.
FP16 = the graph converted to float16 with float32 inputs and outputs (a service
keeps feeding float32).  INT8 = explicit Q/DQ from calibration (calibration/).
"""

from __future__ import annotations

from pathlib import Path

import onnx

from pipeline.artifacts import atomic_path

GRAPH_NAMES = {"fp32": "model.onnx", "fp16": "model.fp16.onnx", "int8": "model.int8.onnx"}


def convert_fp16(onnx_path: Path, out_path: Path) -> dict:
    """Write a float16 copy of the graph whose inputs and outputs stay float32."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = onnx.load(str(onnx_path))
    # keep_io_types inserts Casts at the graph edges; ONNX Runtime's converter keeps ops with
    # no float16 kernel (its default block list) in float32 behind Casts of their own.
    converted = convert_float_to_float16(model, keep_io_types=True)
    with atomic_path(out_path) as temporary:
        onnx.save(converted, str(temporary))
    casts = sum(node.op_type == "Cast" for node in converted.graph.node)
    return {"summary": f"{out_path.name}: float16 graph, float32 I/O ({casts} Cast nodes)", "cast_nodes": casts}
