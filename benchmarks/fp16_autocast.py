"""Our FP16 conversion (pipeline/stages/fp16.py convert_fp16) next to NVIDIA ModelOpt AutoCast, same models.

For each model, `python -m trt_pipeline all --precision fp16` builds model.onnx (FP32), reference.npz and our
model.fp16.onnx; AutoCast then converts the same model.onnx:

  - autocast: `convert_to_mixed_precision(model.onnx, low_precision_type="fp16", keep_io_types=True)`,
    everything else at its defaults (its reference run feeds Polygraphy's random data, range (-1, 1));
  - autocast+ref: the same, with `calibration_data` = the reference inputs (one .npz per case), the inputs
    our converter scans.

Both graphs are scored the same way: the faithful error (every float16 tensor rounded as the engine
stores it, pipeline/evaluation/float16.py faithful_session) against PyTorch on reference.npz, and the share of
compute left in FP16 (pipeline.stages.fp16_overflow.fp32_compute_share).  The nodes in FP32 are read off each converted
graph alike: a node of the FP32 graph (same name) whose float outputs are float32 after shape inference;
Casts the converters insert are not counted.  Needs `nvidia-modelopt` in the venv (not a project dependency):

    .venv/bin/pip install --no-deps nvidia-modelopt==0.47.0   # + onnx-graphsurgeon polygraphy ... (see the doc)
    .venv/bin/python benchmarks/fp16_autocast.py --out docs/benchmarks/fp16-autocast
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trt_pipeline.pipeline.core.cpu import cpu_model  # noqa: E402
from trt_pipeline.pipeline.evaluation.float16 import faithful_session  # noqa: E402
from trt_pipeline.pipeline.folder.graph_io import load_reference  # noqa: E402
from trt_pipeline.pipeline.stages.fp16_overflow import Case, TensorStats, fp32_compute_share  # noqa: E402

MODELS = {  # label: (--model, --batch)
    "overflow_ffn": ("tests.helpers.toy_models:overflow_ffn", "1:8:32"),
    "ResNet-50": ("resnet", "1:8:32"),
    "BERT-base encoder seq 32": ("benchmarks._encoders:bert_base", "1:4:8"),
    "T5-small encoder seq 32": ("benchmarks._encoders:t5_small", "1:4:8"),
}


def build(model: str, batch: str, out_root: Path) -> Path:
    """Our side: the pipeline's folder (model.onnx, reference.npz, model.fp16.onnx, manifest.json)."""
    command = [sys.executable, "-m", "trt_pipeline", "all", "--model", model, "--precision", "fp16"]
    command += ["--builder", "tensorrt_rtx", "--batch", batch, "--out", str(out_root)]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    done = [line for line in run.stdout.splitlines() if line.startswith(("done", "up to date"))]
    return Path(next(word for word in done[-1].split() if word.startswith("/")))  # a reused folder: "up to date"


def autocast(fp32_path: Path, out_path: Path, cases: list[dict[str, np.ndarray]] | None) -> float:
    """AutoCast's conversion of the FP32 graph, saved to `out_path`; returns its time (convert + save)."""
    from modelopt.onnx.autocast import convert_to_mixed_precision

    with tempfile.TemporaryDirectory(prefix="autocast-calib.") as folder:
        calibration = None
        if cases is not None:  # a folder of .npz files: one calibration batch each
            for index, inputs in enumerate(cases):
                np.savez(Path(folder) / f"case{index:02d}.npz", **inputs)
            calibration = folder
        start = time.perf_counter()
        converted = convert_to_mixed_precision(
            str(fp32_path), low_precision_type="fp16", keep_io_types=True, calibration_data=calibration
        )
        onnx.save(converted, str(out_path))
        return time.perf_counter() - start


def fp32_nodes(fp32_model: onnx.ModelProto, converted_path: Path) -> tuple[list[str], int]:
    """Nodes of the FP32 graph that stay float32 in the converted one, and how many are missing from it.

    A node counts when any of its float outputs is float32 in the converted graph (ONNX shape inference
    over its types); nodes with no float output (shapes, indices) and the converters' own Casts do not.
    """
    converted = onnx.load(str(converted_path), load_external_data=False)
    inferred = onnx.shape_inference.infer_shapes(converted)
    types = {v.name: v.type.tensor_type.elem_type for v in [*inferred.graph.value_info, *inferred.graph.output]}
    by_name = {node.name: node for node in converted.graph.node}
    kept, missing = [], 0
    for original in fp32_model.graph.node:
        node = by_name.get(original.name)
        if node is None:
            missing += 1
            continue
        if any(types.get(name) == TensorProto.FLOAT for name in node.output):
            kept.append(node.name)
    return kept, missing


def faithful_error(graph_path: Path, reference: list) -> tuple[float, bool]:
    """max over cases and outputs of max|a - r| / max|r| (float16 tensors rounded as stored), and finiteness."""
    session = faithful_session(graph_path)
    names = [output.name for output in session.get_outputs()]
    worst, finite = 0.0, True
    for inputs, expected in reference:
        actual = dict(zip(names, session.run(names, inputs), strict=True))
        for name, want in expected.items():
            got = actual[name].astype(np.float64)
            finite &= bool(np.all(np.isfinite(got)))
            error = float(np.max(np.abs(got - want))) / max(float(np.max(np.abs(want))), 1e-30)
            worst = float("nan") if np.isnan(error) or np.isnan(worst) else max(worst, error)
    return worst, finite


def measure(label: str, model: str, batch: str, out_root: Path, variants: list[str]) -> dict:
    start = time.perf_counter()
    folder = build(model, batch, out_root)
    pipeline_seconds = time.perf_counter() - start
    manifest = json.loads((folder / "manifest.json").read_text())
    fp32_path = folder / "model.onnx"
    fp32_model = onnx.load(str(fp32_path))
    reference = load_reference(folder / "reference.npz")
    cases = [inputs for inputs, _ in reference]
    stats = TensorStats.of_runs(fp32_model, [Case("reference", f"case {i}", feeds) for i, feeds in enumerate(cases)])
    float_nodes = sum(  # nodes with a float output in the FP32 graph: the ones a converter can put in FP16
        any(name in stats.max_abs for name in node.output) for node in fp32_model.graph.node
    )
    record = {
        "model": label,
        "source": model,
        "batches": sorted({int(next(iter(inputs.values())).shape[0]) for inputs in cases}),
        "fp32_nodes_total": len(fp32_model.graph.node),
        "fp32_float_nodes": float_nodes,
        "pipeline_seconds": round(pipeline_seconds, 1),
        "converters": {},
    }
    graphs = {"ours": folder / "model.fp16.onnx"}
    seconds = {"ours": manifest["fp16"]["seconds"]}
    for variant in variants:
        path = folder / f"model.{variant.replace('+', '-')}.onnx"
        seconds[variant] = autocast(fp32_path, path, cases if variant == "autocast+ref" else None)
        graphs[variant] = path
    for name, path in graphs.items():
        kept, missing = fp32_nodes(fp32_model, path)
        error, finite = faithful_error(path, reference)
        entry = {
            "faithful_max_rel": error,
            "finite": finite,
            "fp32_nodes": len(kept),
            "fp32_compute_share": fp32_compute_share(fp32_model, stats, set(kept)),
            "fp16_compute_share": 1 - fp32_compute_share(fp32_model, stats, set(kept)),
            "nodes_missing_from_graph": missing,
            "convert_seconds": round(seconds[name], 2),
            "fp32_node_names": kept,
        }
        if name == "ours":
            entry["manifest_kept_fp32"] = len(manifest["fp16"]["kept_fp32"])
            entry["manifest_fp32_compute_share"] = manifest["fp16"]["fp32_compute_share"]
            entry["convert_seconds_note"] = "manifest fp16.seconds: scan (TensorStats) + convert + save"
        else:
            entry["fp32_ops"] = _op_counts(fp32_model, kept)
        record["converters"][name] = entry
        print(f"{label:28s} {name:13s} err {error:.3g} finite {finite} fp32 nodes {len(kept)} "
              f"fp16 share {entry['fp16_compute_share']:.4%} {seconds[name]:.2f} s", flush=True)  # fmt: skip
    return record


def _op_counts(model: onnx.ModelProto, names: list[str]) -> dict[str, int]:
    wanted, counts = set(names), {}
    for node in model.graph.node:
        if node.name in wanted:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


def write_markdown(result: dict, path: Path) -> None:
    lines = [
        "# FP16: our conversion vs ModelOpt AutoCast, side by side",
        "",
        f"Measured {result['date']} on {result['cpu']} ({result['cores']} cores), "
        + ", ".join(f"{k} {v}" for k, v in result["versions"].items())
        + ".",
        "",
        f"Command: `{result['command']}`",
        "",
        "| model | converter | faithful max rel vs PyTorch | finite | nodes in FP32 (of float nodes) "
        "| compute in FP16 | convert time |",
        "|---|---|---|---|---|---|---|",
    ]
    for record in result["models"]:
        for name, entry in record["converters"].items():
            lines.append(
                f"| {record['model']} (batch {'/'.join(map(str, record['batches']))}) | {name} "
                f"| {entry['faithful_max_rel']:.3g} | {'yes' if entry['finite'] else '**no**'} "
                f"| {entry['fp32_nodes']} / {record['fp32_float_nodes']} "
                f"| {100 * entry['fp16_compute_share']:.4g}% | {entry['convert_seconds']:.2f} s |"
            )
    lines += ["", *result["notes_md"], ""]
    path.write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs/benchmarks/fp16-autocast")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "fp16-autocast")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated labels")
    parser.add_argument("--variants", default="autocast,autocast+ref")
    parser.add_argument("--notes", type=Path, help="a markdown file appended under the table")
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    records = [measure(label, *MODELS[label], args.work, variants) for label in args.models.split(",")]
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_model(),
        "cores": __import__("os").cpu_count(),
        "platform": platform.platform(),
        "command": " ".join(["python", "benchmarks/fp16_autocast.py", *sys.argv[1:]]),
        "versions": {
            package: version(package)
            for package in ("nvidia-modelopt", "onnx", "onnxruntime-gpu", "torch", "transformers")
        },
        "fp32_node_rule": fp32_nodes.__doc__.split("\n\n")[1].strip(),
        "models": records,
        "notes_md": args.notes.read_text().splitlines() if args.notes else [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    write_markdown(result, args.out.with_suffix(".md"))


if __name__ == "__main__":
    main()
