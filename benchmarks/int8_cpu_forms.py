"""Each form of the INT8 graph for ONNX Runtime's CPU provider on this CPU: digits top-1 and ResNet-50 latency.

The forms differ in their weights (calibration/qdq_cpu.py WEIGHT_FORMS): uint8 (U8U8, the one the
pipeline builds), int8 (U8S8, ONNX Runtime's recommendation for x86) and int8 with 7-bit values
(U8S8 reduce_range).  All come from the same cached calibration ranges.  Writes <out>.json and <out>.md
with the CPU's model and instruction sets (the result depends on them: without VNNI, U8S8 saturates).

    .venv/bin/python benchmarks/int8_cpu_forms.py --out docs/benchmarks/int8-cpu-forms-<cpu>

Digits: the trained CNN, calibrated on its training split with each method, top-1 on the held-out split.
No engine is built (every stage but the build runs), so no TensorRT is needed.
ResNet-50: randomly initialised (no weights are downloaded), calibrated (percentile) on the 40 photos of
`python -m trt_pipeline calibration-images`; latency of one session per form at each batch (ONNX Runtime's default
threads: one per physical core), and agreement with the FP32 graph on those photos.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trt_pipeline.calibration.cache import read_cache  # noqa: E402
from trt_pipeline.calibration.int8 import CACHE_FOLDER, calibrated_graph  # noqa: E402
from trt_pipeline.calibration.qdq_cpu import WEIGHT_FORMS, quantize_for_cpu  # noqa: E402
from trt_pipeline.pipeline.bench.timing import Share, measure, summarize  # noqa: E402
from trt_pipeline.pipeline.core.cpu import (  # noqa: E402
    cpu_instruction_sets,
    cpu_model,  # noqa: E402
    instruction_sets_text,
)


def cached_calibrations(folder: Path, scratch: Path) -> dict:
    """{method: (the graph its ranges belong to, its ranges)} from the folder's calibration cache: the FP32 graph as
    the INT8 stage calibrated it (calibration.int8.calibrated_graph: smoothed with the cached scales)."""
    found = {}
    for path in sorted((folder / CACHE_FOLDER).glob("*.json")):
        method, cached = path.stem.split("-")[0], read_cache(path)
        graph = calibrated_graph(folder / "model.onnx", cached.smoothing or {}, scratch / f"calibrated-{method}.onnx")
        found[method] = (graph, cached.ranges)
    return found


def session(graph: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])


def run(graph_session, inputs: np.ndarray) -> np.ndarray:
    name = graph_session.get_inputs()[0].name
    return np.concatenate([graph_session.run(None, {name: inputs[i : i + 32]})[0] for i in range(0, len(inputs), 32)])


def digits(scratch: Path) -> dict:
    from trt_pipeline.models.digits import load_split
    from trt_pipeline.pipeline.core.settings import Settings

    split = load_split()
    np.save(scratch / "digits-train.npy", split.train_inputs)
    folder = Path()
    for method in ("max", "percentile", "entropy"):
        settings = Settings(model="digits", precision="int8", calib=scratch / "digits-train.npy", out_root=scratch)
        folder = _onnx_artifacts(replace(settings, calib_method=method, calib_samples=len(split.train_inputs)))

    def top1(graph: Path) -> float:
        return float(np.mean(run(session(graph), split.held_out_inputs).argmax(1) == split.held_out_labels))

    rows = {"fp32": round(100 * top1(folder / "model.onnx"), 2)}
    for method, (calibrated, ranges) in cached_calibrations(folder, scratch).items():
        for form in WEIGHT_FORMS:
            graph = scratch / f"digits-{method}-{form}.onnx"
            quantize_for_cpu(calibrated, graph, ranges, weights=form)
            rows[f"{method} {form}"] = round(100 * top1(graph), 2)
    return rows


def _onnx_artifacts(settings) -> Path:
    """Every stage but the build: ONNX Runtime runs the graphs, so no TensorRT is needed."""
    from trt_pipeline.pipeline.stages.sequence import run_stage

    for stage in ("export", "check", "simplify", "parity", "precision"):
        folder = run_stage(settings, stage)
    return folder


def resnet50(scratch: Path, batches: list[int], budget_s: float) -> dict:
    from trt_pipeline.calibration.photos import export_calibration_images
    from trt_pipeline.calibration.preprocess import IMAGE_SUFFIXES, load_image
    from trt_pipeline.models.spec import ImagePreprocess
    from trt_pipeline.pipeline.core.settings import Settings

    photos = scratch / "photos"
    export_calibration_images(photos)
    folder = _onnx_artifacts(Settings(model="resnet", precision="int8", calib=photos, out_root=scratch))
    images = np.stack(
        [load_image(p, ImagePreprocess()) for p in sorted(photos.rglob("*")) if p.suffix.lower() in IMAGE_SUFFIXES]
    )
    reference = run(session(folder / "model.onnx"), images)
    graphs = {"fp32": folder / "model.onnx"}
    calibrated, ranges = cached_calibrations(folder, scratch)["percentile"]
    for form in WEIGHT_FORMS:
        graphs[form] = scratch / f"resnet50-{form}.onnx"
        quantize_for_cpu(calibrated, graphs[form], ranges, weights=form)
    rows = {}
    for name, graph in graphs.items():
        graph_session = session(graph)
        logits = run(graph_session, images)
        row = _agreement(reference, logits)
        for batch in batches:
            feed = {graph_session.get_inputs()[0].name: images[:batch]}
            share = Share(warmup=3, iterations=200, budget_s=budget_s, min_samples=5)
            stats = summarize(measure(lambda: graph_session.run(None, feed), lambda: None, share), batch)  # noqa: B023
            row[f"batch {batch} p50 ms"] = round(stats.p50_ms, 2)
        rows[name] = row
    return rows


def _agreement(reference: np.ndarray, logits: np.ndarray) -> dict:
    cosine = np.sum(reference * logits, 1) / (np.linalg.norm(reference, axis=1) * np.linalg.norm(logits, axis=1))
    return {
        "top1 agreement %": round(100 * float(np.mean(reference.argmax(1) == logits.argmax(1))), 1),
        "cosine min": round(float(cosine.min()), 4),
    }


def markdown(report: dict) -> str:
    lines = [
        "# INT8 graph forms for ONNX Runtime's CPU provider",
        "",
        f"Measured {report['measured']} on {report['cpu']} ({report['instruction_sets']}), "
        f"onnxruntime {report['onnxruntime']}.  Command: `{report['command']}`",
        "",
        "## Digits CNN: top-1 % on the held-out split (360 images)",
        "",
        "| graph | top-1 % |",
        "|---|---|",
        *(f"| {name} | {value:.2f} |" for name, value in report["digits"].items()),
        "",
        "## ResNet-50 (random weights): agreement with FP32 on the 40 photos, latency",
        "",
    ]
    columns = list(next(iter(report["resnet50"].values())))
    lines += ["| graph | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for name, row in report["resnet50"].items():
        lines.append(f"| {name} | " + " | ".join(str(row[column]) for column in columns) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="report path without suffix (.json and .md written)")
    parser.add_argument("--batches", default="1,8", help="ResNet-50 batch sizes")
    parser.add_argument("--budget-s", type=float, default=5.0, help="seconds of timed calls per form and batch")
    args = parser.parse_args()
    import onnxruntime

    isa = cpu_instruction_sets()
    with tempfile.TemporaryDirectory(prefix="int8-forms.") as scratch:
        report = {
            "measured": time.strftime("%Y-%m-%d"),
            "cpu": cpu_model(),
            "instruction_sets": instruction_sets_text(isa),
            "isa": isa,
            "onnxruntime": onnxruntime.__version__,
            "command": " ".join(["python", *sys.argv]),
            "digits": digits(Path(scratch)),
            "resnet50": resnet50(Path(scratch), [int(b) for b in args.batches.split(",")], args.budget_s),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
