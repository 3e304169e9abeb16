"""ONNX Runtime's quantize_static with precomputed ranges: the reference calibration/qdq_write.py's graphs are held to,
byte for byte (tests/calibration/test_qdq.py, test_qdq_cpu.py)."""

from __future__ import annotations

from pathlib import Path

import onnx

from trt_pipeline.calibration.quantizable import constants_as_initializers


def quantize_static_graph(graph: Path, scratch: Path, ranges, *, weight_type=None, reduce_range=False, **options):
    """quantize_static's graph of `graph` as the INT8 stage reads it (its Constant nodes as initializers:
    calibration/quantizable.py; QDQ, per-channel weights, int8 unless `weight_type` says otherwise) for `ranges` (ORT
    TensorsData), written in `scratch` with its data file and read back whole; `options` pick the rest."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.calibrate import save_tensors_data

    scratch.mkdir(parents=True, exist_ok=True)
    model = onnx.load(str(graph))
    if constants_as_initializers(model.graph):  # quantize_static would quantize a Constant's output as an activation
        graph = scratch / "quantizable.onnx"
        onnx.save(model, str(graph), save_as_external_data=True, location="quantizable.onnx.data")
    ranges_file = scratch / "ranges.json"  # quantize_static takes precomputed ranges only as a cache file
    save_tensors_data(ranges, ranges_file)
    target = scratch / "reference.onnx"
    quantize_static(
        str(graph),
        str(target),
        calibration_data_reader=None,
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        reduce_range=reduce_range,
        weight_type=weight_type or QuantType.QInt8,
        calibrate_method=ranges.calibration_method,
        calibration_cache_path=ranges_file,
        use_external_data_format=True,
        **options,
    )
    return onnx.load(str(target))
