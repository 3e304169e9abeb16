"""docs/benchmarks/resnet50-h100-cuda.md (+ .json) from what tools/device/ort_cuda.py wrote on the GPU machine.

    python tools/device/ort_cuda_report.py RESULTS PROBE_JSON ENV_TXT docs/benchmarks/resnet50-h100-cuda [READING]

RESULTS is the unpacked results.tar.gz of `run.sh ort_collect` (speed-*/bench.json, fp16-check.json, int8-check.json);
READING, a hand-written markdown section on what the numbers say, goes after the introduction.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SPEED = {"resnet50-fp16": "ResNet-50 (FP16 folder)", "encoder-fp16": "encoder (FP16 folder)"}
SPEED_INT8 = "resnet50-int8"


def p50_table(bench: dict) -> tuple[list[str], dict]:
    """Rows backend x mode with p50 ms per batch; failures named once below the table."""
    cells: dict[tuple[str, str], dict[int, str]] = {}
    failed: dict[str, str] = {}
    for result in bench["results"]:
        if result.get("status") == "failed":
            failed[result["backend"]] = result["error"].split("\n")[0][:240]
            continue
        cells.setdefault((result["backend"], result["mode"]), {})[result["batch"]] = (
            f"{result['latency']['p50_ms']:.2f}"
        )
    batches = bench["batches"]
    lines = ["| backend | mode | " + " | ".join(f"batch {b} p50 ms" for b in batches) + " |"]
    lines.append("|---|---|" + "---|" * len(batches))
    for (backend, mode), values in cells.items():
        lines.append(f"| {backend} | {mode} | " + " | ".join(values.get(b, "-") for b in batches) + " |")
    lines += [f"\n`{name}` failed: {error}" for name, error in failed.items()]
    return lines, cells


def served_line(bench: dict) -> str:
    served = next((b for b in bench["backends"] if b["name"] == "served"), None)
    return f"What `auto` served: {served['description']}" if served else "served: not run"


def speed_section(results: Path) -> list[str]:
    lines = ["## 1. Speed: ONNX Runtime's CUDA provider beside PyTorch, and what `auto` serves", ""]
    for name, title in {**SPEED, SPEED_INT8: "ResNet-50 (INT8 folder)"}.items():
        path = results / f"speed-{name}" / "bench.json"
        if not path.is_file():
            lines += [f"### {title}: not measured (no {path.name})", ""]
            continue
        bench = json.loads(path.read_text())
        table, _ = p50_table(bench)
        verdict = bench["stability"]["verdict"]
        lines += [f"### {title}", "", *table, "", served_line(bench), "", f"Stability: {verdict}", ""]
    return lines


def _number(value: float) -> str:
    return "nan" if value != value else f"{value:.3g}"


def fp16_section(check: dict) -> list[str]:
    lines = [
        "## 2. The faithful FP16 check (CPU) against real float16 (GPU)",
        "",
        "Each FP16 graph on the folder's reference inputs (the cases the build's gate judged), against its FP32 "
        "graph on the CUDA provider (use_tf32=0): the faithful copy on the CPU (every float16 tensor rounded, "
        "overflow to inf, what the build ran) and the graph itself on the CUDA provider, in real float16. "
        "`no FP32 fallback` is the same graph converted with nothing kept in FP32.",
        "",
        "| model | graph | batch | faithful CPU max rel | real GPU max rel | faithful vs real max rel "
        "| non-finite CPU / GPU |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, entry in check.items():
        for row in entry["rows"]:
            cpu, gpu = row["faithful_cpu"], row["real_gpu"]
            lines.append(
                f"| {model} | {row['graph']} | {row['batch']} | {_number(cpu['max_rel'])} | {_number(gpu['max_rel'])} "
                f"| {_number(row['faithful_vs_real_max_rel'])} | {cpu['nonfinite']} / {gpu['nonfinite']} |"
            )
    lines.append("")
    for model, entry in check.items():
        parity = (entry["manifest"].get("parity_fp16") or {}).get("summary")
        kept = (entry["manifest"].get("fp16") or {}).get("summary")
        lines.append(f"- {model}, as the build recorded it: {parity}; {kept}")
    return [*lines, ""]


def int8_section(check: dict, bench: dict | None) -> list[str]:
    lines = [
        "## 3. The INT8 Q/DQ graph on the CUDA provider",
        "",
        f"Every node on CUDA: {check['all_nodes_on_cuda']}",
        "",
        "| inputs | batch | GPU vs FP32 cosine | CPU simulation vs FP32 cosine | GPU vs simulation max rel "
        "| top-1 GPU = simulation |",
        "|---|---|---|---|---|---|",
    ]
    for row in check["rows"]:
        lines.append(
            f"| {row['inputs']} | {row['batch']} | {row['gpu_vs_fp32']['cosine']:.6f} "
            f"| {row['simulated_cpu_vs_fp32']['cosine']:.6f} | {_number(row['gpu_vs_simulated']['max_rel'])} "
            f"| {row['top1_gpu_vs_simulated']:.3f} |"
        )
    agreement = (check.get("manifest_agreement_int8") or {}).get("summary")
    lines += ["", f"The build's gate (CPU simulation, held-out rows): {agreement}", ""]
    if bench:
        lines += ["Speed: see the INT8 folder's table in section 1.", ""]
    return lines


def rtx_section(probe: dict) -> list[str]:
    message = (probe.get("aot_deserialize") or {}).get("messages", ["?"])[0]
    return [
        "## 4. TensorRT-RTX on this GPU",
        "",
        f"tensorrt-rtx {probe.get('tensorrt_rtx')} (the newest on PyPI on 2026-11-24, `pip index versions "
        f"tensorrt-rtx`), GPU {probe['gpu']['name']} (compute capability {probe['gpu']['compute_capability']}): "
        f"still refused. `{message}`",
        "",
    ]


def main(results: Path, probe_path: Path, env_path: Path, out: Path, reading: Path | None = None) -> None:
    probe = json.loads(probe_path.read_text())
    fp16 = json.loads((results / "fp16-check.json").read_text())
    int8 = json.loads((results / "int8-check.json").read_text())
    int8_bench_path = results / f"speed-{SPEED_INT8}" / "bench.json"
    int8_bench = json.loads(int8_bench_path.read_text()) if int8_bench_path.is_file() else None
    environment = env_path.read_text()
    lines = [
        "# Our graphs on an H100 through ONNX Runtime's CUDA provider (issue 23)",
        "",
        "No TensorRT engine runs on this GPU (section 4), so this is what a Hopper host serves: the folder's graphs "
        "on `onnxruntime-gpu` 1.31.1 (CUDA 13) with the CUDA 13 libraries of the machine's torch venv. Randomly "
        "initialised ResNet-50 (no weights can be downloaded there) and a MiniLM-sized encoder (6 layers, width 384, "
        "sequence 128; `tools/device/ort_cuda.py:encoder`), seeded random inputs, every row in one process, "
        "alternating rounds (the bench harness). `ort-cuda-*` rows are bare sessions (end to end: numpy in and "
        "out) and the same session through IO binding on torch CUDA tensors (device-resident); `-graph` adds a "
        "captured CUDA graph. `torch-amp` and `torch-compile` are AMP FP16.",
        "",
        *([reading.read_text(), ""] if reading else []),
        "Commands: `python tools/device/bundle.py` and `python tools/device/bundle.py ort` here; on the device the "
        "chain in tools/device/run.sh's header (start_bare, ort_builds, ort_part x5, ort_install, ort_measure, "
        "ort_collect); then `python tools/device/ort_cuda_report.py RESULTS probe.json env.txt "
        "docs/benchmarks/resnet50-h100-cuda`.",
        "",
        "Machine:",
        "",
        "```",
        *[line for line in environment.splitlines() if line.strip() and not line.startswith(("|", "+"))],
        "```",
        "",
        *speed_section(results),
        *fp16_section(fp16),
        *int8_section(int8, int8_bench),
        *rtx_section(probe),
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    speeds = {}
    for name in [*SPEED, SPEED_INT8]:
        path = results / f"speed-{name}" / "bench.json"
        if path.is_file():
            speeds[name] = json.loads(path.read_text())
    record = {"speed": speeds, "fp16": fp16, "int8": int8, "probe": probe, "environment": environment}
    out.with_suffix(".json").write_text(json.dumps(record, indent=1, default=str) + "\n")


if __name__ == "__main__":
    if len(sys.argv) not in (5, 6):
        raise SystemExit(__doc__)
    main(*(Path(arg) for arg in sys.argv[1:]))
