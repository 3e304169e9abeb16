"""The INT8 stage: FP32 graph + calibration data -> model.int8.onnx with calibrated Q/DQ pairs.

read data -> ranges (from the cache, or collected on the FP32 graph) -> Q/DQ graph for TensorRT
(model.int8.onnx) and, from the same ranges, one for ONNX Runtime's CPU kernels (model.int8.ort.onnx,
see calibration/qdq_cpu.py).  The record it returns goes to the manifest: method and options,
samples, batches, the data's sha256, the cache's verdict and file, and each graph's Q/DQ structure.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from calibration.cache import cache_key, cache_path, load_ranges, save_ranges
from calibration.qdq import quantize_qdq
from calibration.qdq_cpu import quantize_for_cpu
from calibration.ranges import collect_ranges, method_options
from calibration.readers import CalibrationSource, graph_inputs, read_calibration_data
from models.spec import ImagePreprocess
from pipeline.artifacts import sha256_file

CACHE_FOLDER = "calibration"  # inside the artifact folder, beside model.int8.onnx
CPU_GRAPH = "model.int8.ort.onnx"  # the INT8 graph for ONNX Runtime on the CPU, beside model.int8.onnx


@dataclass(frozen=True)
class CalibrationConfig:
    """The calibration part of Settings (CALIB_METHOD, --calib-samples, --calib-batch, --recalibrate)."""

    method: str = "percentile"
    samples: int = 256
    batch: int = 16
    recalibrate: bool = False

    @classmethod
    def from_settings(cls, settings) -> CalibrationConfig:
        return cls(settings.calib_method, settings.calib_samples, settings.calib_batch, settings.recalibrate)


def make_int8_graph(
    fp32_path: Path,
    out_path: Path,
    source: CalibrationSource,
    *,
    preprocess: ImagePreprocess | None,
    config: CalibrationConfig,
    cache_folder: Path,
    cpu_out_path: Path | None = None,
) -> dict:
    """Calibrate (or reuse cached ranges) and write the Q/DQ graph (and the CPU-shaped one to `cpu_out_path`
    when given); return the stage record."""
    data = read_calibration_data(
        source, graph_inputs(fp32_path), preprocess, samples=config.samples, batch=config.batch
    )
    options = method_options(config.method)
    key = cache_key(sha256_file(fp32_path), data.digest, {**options, "samples": data.samples, "batch": config.batch})
    cache_file = cache_path(cache_folder, config.method, key)
    lookup = load_ranges(cache_file, key, recalibrate=config.recalibrate)
    ranges, collect_seconds = lookup.ranges, 0.0
    if ranges is None:
        if lookup.status.startswith("corrupted"):
            print(f"note: calibration cache {cache_file} is {lookup.status}; recalibrating")
        started = time.perf_counter()
        ranges = collect_ranges(fp32_path, data, config.method)
        collect_seconds = round(time.perf_counter() - started, 3)
        save_ranges(cache_file, key, ranges, {"source": data.description, "samples": data.samples, **options})
    structure = quantize_qdq(fp32_path, out_path, ranges)
    cpu = quantize_for_cpu(fp32_path, cpu_out_path, ranges) if cpu_out_path is not None else None
    calibration = {
        **options,
        "source": data.description,
        "samples": data.samples,
        "batch": config.batch,
        "batches": len(data.batches),
        "data_sha256": data.digest,
        "cache": lookup.status,
        "cache_file": str(cache_file),
        "collect_seconds": collect_seconds,
        "quantizer": _quantizer_name(),
    }
    verdict = "cached ranges" if lookup.status == "hit" else f"calibrated in {collect_seconds:.1f} s ({lookup.status})"
    summary = (
        f"{out_path.name}: {config.method} on {data.samples} samples, {verdict}; "
        f"{structure['quantized_ops']} ops with Q/DQ inputs, {structure['per_channel_weights']} per-channel weights"
    )
    record: dict = {"calibration": calibration, "qdq": structure}
    if cpu is not None and cpu_out_path is not None:
        kernels = cpu["int8_kernels"] + cpu["float_kernels"]
        summary += f"; {cpu_out_path.name}: {cpu['int8_kernels']} of {kernels} as ONNX Runtime int8 kernels"
        record["qdq_onnxruntime_cpu"] = {"graph": cpu_out_path.name, **cpu}
    return {"summary": summary, **record}


def _quantizer_name() -> str:
    import onnxruntime

    return f"onnxruntime {onnxruntime.__version__} quantize_static (QDQ, symmetric QInt8, per-channel weights)"
