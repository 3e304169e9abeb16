"""Our INT8 stage vs ONNX Runtime quantize_static on the trained EfficientNet-Lite0 (issue 25, part 3; partial).

Both quantize the same FP32 model.onnx, fit on the same calibration rows (calibration/holdout.py split_rows(40).fit
of the 40 calibration photos) and are judged on the split's held-out rows, which neither saw, with Q/DQ simulated
as TensorRT computes it (ONNX Runtime, graph optimizations off: onnxruntime_session(simulate_qdq=True)).
ModelOpt runs from its own folder, never the shared venv (installed `--no-deps` with what it imports):

    .venv/bin/pip install --no-deps --target /tmp/modelopt-site nvidia-modelopt onnx-graphsurgeon nvidia-ml-py \
        onnxslim lief

The encoder and a varied calibration set are not in this version (see docs/benchmarks/int8-vs-modelopt.md).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/int8_vs_modelopt.py --out /tmp/int8-vs-modelopt
"""

from __future__ import annotations

import argparse
import importlib.abc
import json
import sys
import time
from pathlib import Path

import numpy as np
import onnx

from tests.test_int8_cnn import PREPROCESS
from trt_pipeline.calibration.holdout import split_rows
from trt_pipeline.calibration.int8 import CalibrationConfig, make_int8_graph
from trt_pipeline.calibration.photos import export_calibration_images
from trt_pipeline.calibration.preprocess import load_image
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.sessions import onnxruntime_session
from trt_pipeline.pipeline.core.settings import Settings
from trt_pipeline.pipeline.stages.sequence import make_engine

MODEL = "tests.test_int8_cnn:efficientnet_lite0"
MODELOPT_SITE = "/tmp/modelopt-site"
COMPUTE_OPS = ("Conv", "Gemm", "MatMul")


def macs_by_op(fp32: Path) -> dict[str, int]:
    """Multiply-accumulates of each Conv/Gemm (batch 1) from its weight shape and output size, by node name."""
    model = onnx.shape_inference.infer_shapes(onnx.load(fp32))
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.value_info}
    shapes.update({v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.output})
    weights = {t.name: list(t.dims) for t in model.graph.initializer}
    macs = {}
    for node in model.graph.node:
        if node.op_type not in COMPUTE_OPS or node.input[1] not in weights:
            continue
        weight = weights[node.input[1]]
        out = shapes.get(node.output[0], [])
        spatial = int(np.prod(out[2:])) if node.op_type == "Conv" and len(out) > 2 else 1
        macs[node.name] = int(np.prod(weight)) * spatial
    return macs


def quantized_ops(graph: Path, names: set[str]) -> set[str]:
    """The compute ops (by the FP32 graph's node names) whose activation input comes from a DequantizeLinear."""
    model = onnx.load(graph)
    dequantized = {o for n in model.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    return {n.name for n in model.graph.node if n.name in names and n.input[0] in dequantized}


def judge(fp32: Path, graph: Path, images: np.ndarray, macs: dict[str, int]) -> dict:
    expected = onnxruntime_session(fp32).run(None, {"input": images})[0]
    actual = onnxruntime_session(graph, simulate_qdq=True).run(None, {"input": images})[0]
    cos = np.sum(expected * actual, 1) / (np.linalg.norm(expected, axis=1) * np.linalg.norm(actual, axis=1))
    quantized = quantized_ops(graph, set(macs))
    return {
        "cosine_min": float(cos.min()),
        "cosine_mean": float(cos.mean()),
        "top1_agreement": float(np.mean(expected.argmax(1) == actual.argmax(1))),
        "ops_quantized": f"{len(quantized)}/{len(macs)}",
        "int8_compute_share": sum(macs[n] for n in quantized) / sum(macs.values()),
    }


def ort_quantize_static(fp32: Path, out: Path, rows: np.ndarray) -> None:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Rows(CalibrationDataReader):
        def __init__(self) -> None:
            self.rows = iter(rows[i : i + 1] for i in range(len(rows)))

        def get_next(self):
            row = next(self.rows, None)
            return None if row is None else {"input": row}

    quantize_static(
        str(fp32),
        str(out),
        Rows(),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True},
    )


def our_int8(fp32: Path, photos: Path, out: Path) -> tuple[Path, float, str]:
    """Our INT8 graph: the stage function `make engine PRECISION=int8 CALIB=photos` runs, with its defaults and
    split (timed alone, as ORT's quantize_static is), and what `make_engine` itself says (its held-out gate)."""
    graph = out / "ours.int8.onnx"
    start = time.perf_counter()
    make_int8_graph(fp32, graph, photos, preprocess=PREPROCESS, config=CalibrationConfig(), cache_folder=out / "cache")
    seconds = time.perf_counter() - start
    try:
        make_engine(Settings(model=MODEL, precision="int8", calib=photos, out_root=out / "int8"))
        return graph, seconds, "passed its held-out gate"
    except PipelineError as refused:
        return graph, seconds, f"refused by the held-out gate: {refused.problem}"


class _HideTensorrt(importlib.abc.MetaPathFinder):
    """Refuses `tensorrt`: the venv's tensorrt-stubs leave an empty `tensorrt` namespace package, and ModelOpt's
    probe, finding it, calls `tensorrt.Logger` and crashes; refused, ModelOpt takes its no-TensorRT path."""

    def find_spec(self, name, path, target=None):
        if name == "tensorrt" or name.startswith("tensorrt."):
            raise ModuleNotFoundError(name)
        return None


def modelopt_quantize(fp32: Path, out: Path, rows: np.ndarray, method: str) -> None:
    """ModelOpt's ONNX PTQ, INT8, calibrated on the CPU provider (importable only from MODELOPT_SITE)."""
    if MODELOPT_SITE not in sys.path:
        # make_engine has imported the stubs by now: a module already loaded is never looked up again
        for name in [name for name in sys.modules if name == "tensorrt" or name.startswith("tensorrt.")]:
            del sys.modules[name]
        sys.meta_path.insert(0, _HideTensorrt())
        sys.path.insert(0, MODELOPT_SITE)
    from modelopt.onnx.quantization import quantize

    quantize(
        str(fp32),
        quantize_mode="int8",
        calibration_method=method,
        calibration_data={"input": rows},
        calibration_eps=["cpu"],
        output_path=str(out),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    photos = args.out / "photos"
    export_calibration_images(photos)
    paths = sorted(photos.glob("*.png"))
    images = np.stack([load_image(p, PREPROCESS) for p in paths]).astype(np.float32)
    split = split_rows(len(images))
    fp32 = make_engine(Settings(model=MODEL, precision="fp32", out_root=args.out / "fp32")) / "model.onnx"
    macs = macs_by_op(fp32)
    results = {}
    ours_graph, seconds, gate = our_int8(fp32, photos, args.out)
    results["ours"] = {**judge(fp32, ours_graph, images[split.held_out], macs), "seconds": seconds, "make_engine": gate}
    start = time.perf_counter()
    ort_graph = args.out / "ort.int8.onnx"
    ort_quantize_static(fp32, ort_graph, images[split.fit])
    results["ort_quantize_static"] = {
        **judge(fp32, ort_graph, images[split.held_out], macs),
        "seconds": time.perf_counter() - start,
    }
    for method in ("max", "entropy"):
        graph = args.out / f"modelopt-{method}.int8.onnx"
        start = time.perf_counter()
        modelopt_quantize(fp32, graph, images[split.fit], method)
        seconds = time.perf_counter() - start
        results[f"modelopt_{method}"] = {**judge(fp32, graph, images[split.held_out], macs), "seconds": seconds}
    record = {"split": split.rule, "held_out_rows": len(split.held_out), "results": results}
    (args.out / "int8-vs-modelopt.json").write_text(json.dumps(record, indent=2))
    (args.out / "int8-vs-modelopt.md").write_text(table(record))
    print(table(record))


def table(record: dict) -> str:
    """The results as the doc's Markdown table."""
    lines = [
        "| quantizer | cosine min | cosine mean | top-1 agreement | ops quantized | INT8 compute share | time (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in record["results"].items():
        lines.append(
            f"| {name} | {row['cosine_min']:.4f} | {row['cosine_mean']:.4f} | {row['top1_agreement']:.3f} | "
            f"{row['ops_quantized']} | {row['int8_compute_share']:.4f} | {row['seconds']:.1f} |"
        )
    return "\n".join(lines) + f"\n\nHeld out: {record['split']}.\n"


if __name__ == "__main__":
    main()
