"""docs/benchmarks/resnet50-h100-cuda.md (+ .json) from what tools/device/ort_cuda.py wrote on the GPU machine.

    python tools/device/ort_cuda_report.py OUT RESULTS ENV_TXT [--tried RESULTS ENV_TXT]... [--reading MD]
        [--earlier JSON]

RESULTS is the unpacked results.tar.gz of `run.sh ort_collect` (speed-*/bench.json, served-*.json, and where the run
made them profile-check.json and graph_memory-check.json); --tried (once per run, in order), a further run of the
variants (ROWS=all) or leads tried, shown as runs 2, 3, ...; --reading, a hand-written markdown section
on what the numbers say, after the introduction; --earlier, the report this one replaces, whose accuracy checks and
TensorRT-RTX probe (fp16-check.json, int8-check.json, probe.json of that run) are carried over where RESULTS has
none.
"""

from __future__ import annotations

import argparse
import json
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
    disagreed = {
        (result["backend"], result["mode"])
        for result in bench["results"]
        if (result.get("agreement") or {}).get("status") == "mismatch"
    }
    lines = ["| backend | mode | " + " | ".join(f"batch {b} p50 ms" for b in batches) + " |"]
    lines.append("|---|---|" + "---|" * len(batches))
    for (backend, mode), values in cells.items():
        name = (
            f"{backend} (outputs disagreed with the reference: not a result)"
            if (backend, mode) in disagreed
            else backend
        )
        lines.append(f"| {name} | {mode} | " + " | ".join(values.get(b, "-") for b in batches) + " |")
    lines += [f"\n`{name}` failed: {error}" for name, error in failed.items()]
    return lines, cells


def served_line(bench: dict) -> str:
    served = next((b for b in bench["backends"] if b["name"] == "served"), None)
    return f"What `auto` served: {served['description']}" if served else "served: not run"


def speed_section(results: Path, speeds: dict, title: str, level: str = "###") -> list[str]:
    """Each folder's bench (`speeds`, _speeds of `results`): its table, what auto served and measured, stability."""
    lines = [title, ""]
    for name, heading in {**SPEED, SPEED_INT8: "ResNet-50 (INT8 folder)"}.items():
        bench = speeds.get(name)
        if bench is None:
            continue
        table, _ = p50_table(bench)
        verdict = bench["stability"]["verdict"]
        lines += [f"{level} {heading}", "", *table, "", served_line(bench), "", *served_choice(results, name)]
        lines += [f"Stability: {verdict}", ""]
    return lines


def served_choice(results: Path, name: str) -> list[str]:
    """What auto measured (ms per call by batch) and its host check (part A), from the folder's served.json."""
    path = results / f"served-{name}.json"
    if not path.is_file():
        return []
    record = json.loads(path.read_text())
    timed = "; ".join(
        f"batch {batch}: " + ", ".join(f"{label} {ms:.2f} ms" for label, ms in medians.items())
        for batch, medians in record["ms"].items()
    )
    checks = [
        f"{label}: {'passed' if check['passed'] else 'refused'} in {check['seconds']:.2f} s ({check['verdict']})"
        for label, check in record["checks"].items()
    ]
    return [f"`auto`'s measurement (served.json): {timed}. Served: {record['served']}.", "", *checks, ""]


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


def profile_section(
    profile: dict | None, memory: dict | None, title: str = "## 1c. Where the time and memory go"
) -> list[str]:
    """Where the time goes (ort_cuda.py profile: each row's kernels per call) and what each captured CUDA graph
    keeps (ort_cuda.py graph_memory); nothing where this run has neither."""
    if not (profile or memory):
        return []
    lines = [title, ""]
    if profile:
        lines += [
            f"{profile['folder']}, batch {profile['batch']}, device-resident; kernel times from torch.profiler's "
            "CUDA trace (CUPTI sees ONNX Runtime's kernels as well as torch's). Kernel time short of the span is the "
            "GPU waiting on the host.",
            "",
            "| row | wall us/call | kernels/call | kernel us/call | span us/call |",
            "|---|---|---|---|---|",
        ]
        for name, row in profile["rows"].items():
            if "unavailable" in row or "kernel_us_per_call" not in row:
                lines.append(f"| {name} | {row.get('unavailable', 'no kernels traced')} | | | |")
                continue
            lines.append(
                f"| {name} | {row['wall_us_per_call']:.0f} | {row['kernels_per_call']:.0f} "
                f"| {row['kernel_us_per_call']:.0f} | {row['span_us_per_call']:.0f} |"
            )
        for name, row in profile["rows"].items():
            top = "; ".join(
                f"`{k['name'][:70]}` x{k['per_call']:.0f} {k['us_per_call']:.0f} us" for k in row.get("top", [])
            )
            lines += ["", f"- {name}, its kernels by time per call: {top}"] if top else []
        lines.append("")
    if memory:
        lines += [
            f"Device memory the onnxruntime-cuda runner (one slot, {memory['folder']}) holds above what was in use "
            f"before it loaded, after its first calls at each batch in turn (cudaMemGetInfo; a slot captures its first "
            f"{memory['max_graphs']} shapes):",
            "",
            "| runner | " + " | ".join(step["after"] for step in memory["uncaptured"]) + " |",
            "|---|" + "---|" * len(memory["uncaptured"]),
        ]
        for kind in ("uncaptured", "captured"):
            if kind in memory:
                lines.append(f"| {kind} (MiB) | " + " | ".join(f"{step['mb']:.0f}" for step in memory[kind]) + " |")
        lines.append("")
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


def main(arguments: argparse.Namespace) -> None:
    results, environment = arguments.results, arguments.env.read_text()
    earlier = json.loads(arguments.earlier.read_text()) if arguments.earlier else {}
    fp16, int8, probe = (_checked(results, earlier, key) for key in ("fp16", "int8", "probe"))
    carried = "" if (results / "fp16-check.json").is_file() else " (from the earlier run: not rerun)"
    speeds = _speeds(results)
    profile, memory = _json(results / "profile-check.json"), _json(results / "graph_memory-check.json")
    tried = [
        {"speed": _speeds(path), "profile": _json(path / "profile-check.json"), "path": path, "env": env}
        for path, env in arguments.tried or []
    ]
    lines = [
        "# Our graphs on an H100 through ONNX Runtime's CUDA provider (issues 23 and 36)",
        "",
        "No TensorRT engine runs on this GPU (section 4), so this is what a Hopper host serves: the folder's graphs "
        "on `onnxruntime-gpu` 1.31.1 (CUDA 13) with the CUDA 13 libraries of the machine's torch venv. Randomly "
        "initialised ResNet-50 (no weights can be downloaded there) and a MiniLM-sized encoder (6 layers, width 384, "
        "sequence 128; `tools/device/ort_cuda.py:encoder`), seeded random inputs, every row in one process, "
        "alternating rounds (the bench harness). `served` is `load_runner(folder)` (auto: its measured pick and its "
        "host check); `onnxruntime-cuda` is the runner on the folder's engine graph with its defaults, `-graphs` "
        "with a CUDA graph per input shape; `rt-*` rows are the same runner with one default changed back (`nchw`: "
        "prefer_nhwc=0; `pinned`: inputs through a page-locked copy; `cudnn-bias`: cuDNN adding each convolution's "
        "bias, as before the runner split them into Adds) or one lead tried (`fusebias`: fuse_conv_bias=1; `c4`: its "
        "3-channel convolution padded to 4; `biasadd`: the biases as Adds, before the runner did so); `ort-*` rows "
        "are bare sessions (`ort-graph`: IO binding and a CUDA graph on the FP16 graph as the runner opens it, each "
        "convolution's bias an Add, replaying on the input bound when staged; `-copies`: the caller's tensors copied "
        "in and out each call, as the runner does; `-one-stream`, a lead tried: those copies on the stream ONNX "
        "Runtime computes on, with no wait between, measured in a process of its own; in runs of "
        "commit d215ed2 and before, `ort-graph` ran the FP16 graph as it is). "
        "End to end: numpy in and out; "
        "device-resident: torch CUDA tensors in and out. `torch-amp` and `torch-compile` are AMP FP16, `torch` FP32, "
        "all with TF32 off.",
        "",
        *([arguments.reading.read_text(), ""] if arguments.reading else []),
        "Commands: `python tools/device/bundle.py ort` here; on the device the issue-36 chain in "
        "tools/device/run.sh's header (served_start, then served_measure, then ort_collect); then `python "
        "tools/device/ort_cuda_report.py docs/benchmarks/resnet50-h100-cuda RESULTS env.txt --tried RESULTS-2 "
        "env-2.txt --reading READING.md --earlier docs/benchmarks/resnet50-h100-cuda.json`.",
        "",
        "Machine:",
        "",
        "```",
        *_machine(environment),
        "```",
        "",
        *speed_section(results, speeds, "## 1. Speed: what `auto` serves, the runner, and PyTorch"),
    ]
    lines += profile_section(profile, memory)
    lines += ["## 1d. Variants and leads tried in further runs", ""] if tried else []
    for run, further in enumerate(tried, start=2):
        lines += speed_section(further["path"], further["speed"], f"### Run {run}", level="####")
        lines += profile_section(further["profile"], None, f"#### Run {run}: where the time goes")
        lines += ["Its machine:", "", "```", *_machine(further["env"].read_text()), "```", ""]
    lines += [f"## Sections 2 to 4{carried}", ""] if carried else []
    lines += [*fp16_section(fp16), *int8_section(int8, None), *rtx_section(probe)]
    out = arguments.out
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    record = {
        "speed": speeds,
        "served": {name: _json(results / f"served-{name}.json") for name in SPEED if name in speeds},
        "tried": [{"speed": further["speed"], "profile": further["profile"]} for further in tried],
        "profile": profile,
        "graph_memory": memory,
        "fp16": fp16,
        "int8": int8,
        "probe": probe,
        "environment": environment,
    }
    out.with_suffix(".json").write_text(json.dumps(record, indent=1, default=str) + "\n")


def _machine(environment: str) -> list[str]:
    return [line for line in environment.splitlines() if line.strip() and not line.startswith(("|", "+"))]


def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _speeds(results: Path) -> dict:
    benches = {name: _json(results / f"speed-{name}" / "bench.json") for name in [*SPEED, SPEED_INT8]}
    return {name: bench for name, bench in benches.items() if bench is not None}


def _checked(results: Path, earlier: dict, key: str) -> dict:
    """This run's fp16/int8 check or RTX probe, else the earlier report's."""
    name = {"fp16": "fp16-check.json", "int8": "int8-check.json", "probe": "probe.json"}[key]
    return _json(results / name) or earlier[key]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("results", type=Path)
    parser.add_argument("env", type=Path)
    parser.add_argument("--tried", nargs=2, type=Path, metavar=("RESULTS", "ENV_TXT"), action="append")
    parser.add_argument("--reading", type=Path)
    parser.add_argument("--earlier", type=Path)
    main(parser.parse_args())
