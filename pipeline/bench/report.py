"""The report files: bench.json (everything), bench.md (tables, environment, method), bench.png (plots)."""

from __future__ import annotations

from pathlib import Path

from ..core.cpu import instruction_sets_text
from ..folder.artifacts import atomic_path, write_bytes, write_json

END_TO_END = "end-to-end"
DEVICE_RESIDENT = "device-resident"

MODE_TITLES = {
    END_TO_END: "End to end: host arrays in, host arrays out (what a service calling `runner.infer` sees)",
    DEVICE_RESIDENT: "Device-resident: inputs already on the device, outputs left there",
}

COLUMNS = (
    "backend",
    "batch",
    "p10 ms",
    "p50 ms",
    "p90 ms",
    "p99 ms",
    "items/s (batch / p50)",
    "vs eager (p50)",
    "rounds' p50s apart",
    "peak device mem",
    "agreement vs eager FP32",
    "runs",
)


def agreement_text(agreed: dict) -> str:
    """e.g. "ok, max rel 3.1e-07 (rtol 0.001)"; the reference row says so."""
    if agreed["status"] == "reference":
        return "reference"
    if "agreement" in agreed:  # a detector's NMS outputs: detections matched (bench/harness.py)
        return (
            f"{agreed['status']}, {agreed['matched']} of {agreed['expected']} detections (agreement "
            f"{agreed['agreement']:.3f}, at least {agreed['min_agreement']:g})"
        )
    if "max_rel" not in agreed:
        return f"{agreed['status']}: {agreed.get('reason', '')}".rstrip(": ")
    return f"{agreed['status']}, max rel {agreed['max_rel']:.2g} (rtol {agreed['rtol']:g})"


def markdown_table(report: dict, mode: str) -> str:
    """One row per (backend, batch) measured in `mode`; failed cells show their error."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    rows = [r for r in report["results"] if r["mode"] == mode]
    for r in sorted(rows, key=lambda r: (_backend_order(report, r["backend"]), r["batch"])):
        if r["status"] != "ok":
            cells = [r["backend"], str(r["batch"]), f"failed: {_one_line(r['error'])}", *[""] * (len(COLUMNS) - 3)]
        else:
            s = r["latency"]
            speedup = r["speedup_vs_torch"]
            cells = [
                r["backend"],
                str(r["batch"]),
                _ms(s["p10_ms"]),
                _ms(s["p50_ms"]),
                _ms(s["p90_ms"]),
                _ms(s["p99_ms"]),
                f"{s['items_per_s']:.1f}",
                f"{speedup:.2f}x" if speedup is not None else "n/a",
                f"{r['rounds']['spread']:.0%}",
                _memory(r["peak_device_memory_bytes"]),
                agreement_text(r["agreement"]),
                str(s["samples"]),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_markdown(report: dict) -> str:
    env = report["environment"]
    parts = [
        f"# Latency: {report['model']} ({report['folder']})",
        "",
        f"Command: `{report['command']}`  ",
        f"Measured {report['created']} on {_machine_line(env)}.  ",
        f"CPU instruction sets: {instruction_sets_text(env['cpu'].get('instruction_sets'))}.  ",
        f"**Stability: {report['stability']['verdict']}.**  ",
        f"Load average (1/5/15 min) before {env['load_average']['before']}, after {env['load_average']['after']}"
        f" (the benchmark itself keeps about {env['threads']} busy; more is other jobs).",
    ]
    check = report["reference_check"]
    if check["status"] != "ok":
        parts += ["", f"**Warning: {check.get('summary', check.get('reason'))}** ({agreement_text(check)})"]
    for mode in (END_TO_END, DEVICE_RESIDENT):
        parts += ["", f"## {MODE_TITLES[mode]}", ""]
        if any(r["mode"] == mode for r in report["results"]):
            parts += [markdown_table(report, mode), ""]
        if mode == DEVICE_RESIDENT:
            parts += _device_notes(report)
    parts += ["", "## First call (not in the timings; for torch.compile, the compile time)", ""]
    parts += _first_call_lines(report)
    parts += ["", "## Backends", "", *_backend_lines(report)]
    parts += ["", "## Environment", "", *_environment_lines(env)]
    parts += ["", "## Method", "", *_method_lines(report)]
    return "\n".join(parts) + "\n"


def write_reports(report: dict, out_dir: Path) -> dict[str, Path]:
    """bench.json, bench.md and bench.png in `out_dir`, each written under a temporary name first."""
    out_dir = Path(out_dir)
    paths = {"json": out_dir / "bench.json", "md": out_dir / "bench.md", "png": out_dir / "bench.png"}
    write_json(paths["json"], report)
    write_bytes(paths["md"], render_markdown(report).encode())
    plot(report, paths["png"])
    return paths


def plot(report: dict, path: Path) -> None:
    """p50 latency and batch / p50 throughput against batch, p10-p90 whiskers, one line per backend and mode.

    Both panels use the median, so they rank the backends the same way at every batch.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    figure, (latency_axes, throughput_axes) = plt.subplots(1, 2, figsize=(12, 5.2))
    for (backend, mode), rows in _series(report).items():
        batches = [r["batch"] for r in rows]
        style = "-" if mode == END_TO_END else "--"
        label = backend if mode == END_TO_END else f"{backend} ({mode})"
        p10, p50, p90 = ([r["latency"][key] for r in rows] for key in ("p10_ms", "p50_ms", "p90_ms"))
        drawn = latency_axes.errorbar(
            batches, p50, yerr=[_minus(p50, p10), _minus(p90, p50)], fmt=style, marker="o", capsize=3, label=label
        )
        # Items per second at the p90 latency is the low end, at p10 the high end.
        per_s, slow, fast = ([b / (ms / 1e3) for b, ms in zip(batches, q, strict=True)] for q in (p50, p90, p10))
        throughput_axes.errorbar(
            batches,
            per_s,
            yerr=[_minus(per_s, slow), _minus(fast, per_s)],
            fmt=style,
            marker="o",
            capsize=3,
            color=drawn.lines[0].get_color(),
            label=label,
        )
    for axes, title, unit in (
        (latency_axes, "p50 latency per call (whiskers p10-p90)", "ms (log)"),
        (throughput_axes, "throughput = batch / p50, one call at a time (whiskers p90-p10)", "items/s (log)"),
    ):
        axes.set_title(title, fontsize=10)
        axes.set_xlabel("batch size")
        axes.set_ylabel(unit)
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xticks(report["batches"], [str(b) for b in report["batches"]])
        axes.grid(True, which="both", alpha=0.3)
    latency_axes.legend(fontsize=8)
    env = report["environment"]
    figure.suptitle(f"{report['model']}: {_machine_line(env)}", fontsize=10)
    caption = (
        f"CPU instruction sets: {instruction_sets_text(env['cpu'].get('instruction_sets'))}\n"
        f"{report['stability']['verdict']}\nload average (1/5/15 min) before {env['load_average']['before']}, "
        f"after {env['load_average']['after']}"
    )
    figure.text(0.5, 0.01, caption, ha="center", va="bottom", fontsize=8)
    figure.tight_layout(rect=(0, 0.1, 1, 1))
    with atomic_path(path) as temporary:
        figure.savefig(temporary, format="png", dpi=110)
    plt.close(figure)


def _minus(high: list[float], low: list[float]) -> list[float]:
    return [h - lo for h, lo in zip(high, low, strict=True)]


# --------------------------------------------------------------------------- pieces


def _series(report: dict) -> dict[tuple[str, str], list[dict]]:
    series: dict[tuple[str, str], list[dict]] = {}
    for r in report["results"]:
        if r["status"] == "ok":
            series.setdefault((r["backend"], r["mode"]), []).append(r)
    return {key: sorted(rows, key=lambda r: r["batch"]) for key, rows in series.items()}


def _backend_order(report: dict, name: str) -> int:
    names = [b["name"] for b in report["backends"]]
    return names.index(name) if name in names else len(names)


def _device_notes(report: dict) -> list[str]:
    notes = [
        f"- {b['name']}: {b['device_resident']}"
        for b in report["backends"]
        if b["status"] == "ran" and b["device_resident"] != "measured"
    ]
    return notes or ["(every backend that ran was measured in both modes)"]


def _first_call_lines(report: dict) -> list[str]:
    """Per backend, the seconds of its first call at each batch (end to end): allocation, autotuning, compilation."""
    firsts: dict[str, list[str]] = {}
    for r in report["results"]:
        if r["status"] == "ok" and r["mode"] == END_TO_END:
            firsts.setdefault(r["backend"], []).append(f"batch {r['batch']} {r['first_call_s']:.2f} s")
    return [f"- {name}: {', '.join(parts)}" for name, parts in firsts.items()] or ["(no backend was timed)"]


def _backend_lines(report: dict) -> list[str]:
    lines = []
    for b in report["backends"]:
        if b["status"] == "ran":
            lines.append(f"- **{b['name']}**: {b['label']}; {b['description']}. Threads: {b['threads']}.")
        elif b["status"] == "skipped":
            lines.append(f"- **{b['name']}**: skipped: {b['reason']}")
        else:
            lines.append(f"- **{b['name']}**: failed: {_one_line(b['error'])}")
    return lines


def _environment_lines(env: dict) -> list[str]:
    cpu, gpu = env["cpu"], env["gpu"]
    lines = [
        f"- CPU: {cpu['model']}, {cpu['physical_cores']} physical cores, {cpu['logical_cpus']} logical CPUs, "
        f"{instruction_sets_text(cpu.get('instruction_sets'))}",
        f"- GPU: {gpu['name']} (compute {gpu['compute_capability']}, {gpu['memory_gib']} GiB), "
        f"driver {gpu['driver'] or 'unknown'}, CUDA {gpu['cuda_torch']} (torch's build)"
        if gpu["present"]
        else f"- GPU: none ({gpu['reason']})",
        f"- Threads: {env['threads']} for torch (torch.set_num_threads) and ONNX Runtime (intra-op) alike; "
        "TF32 off for torch on a GPU, so FP32 rows are FP32",
        f"- Platform: {env['platform']}",
        "- Versions: " + ", ".join(f"{name} {version}" for name, version in env["versions"].items()),
        f"- Working directory: {env['cwd']}",
    ]
    return lines


def _method_lines(report: dict) -> list[str]:
    policy = report["policy"]
    return [
        f"- Every backend gets the same inputs (seeded random, seed {report['inputs']['seed']}) at each batch "
        f"({', '.join(map(str, report['batches']))}); loading, session creation and compilation happen before "
        "any timing.",
        f"- Per (backend, batch, mode): {policy['warmup']} warm-up calls, not timed; then up to "
        f"{policy['iterations']} timed calls or {policy['budget_s']:g} s, whichever ends first (at least 5), split "
        f"into {policy['rounds']} rounds that alternate between backends, each later round re-warmed by one untimed "
        "call, so a burst of load from another process lands on every backend rather than one.",
        "- Each sample is one call, timed with time.perf_counter from before the call until the device is "
        "synchronized (end to end: until host outputs exist); calls never overlap. Python's garbage collector "
        "is paused while timing.",
        "- p10/p50/p90/p99 are percentiles of those samples (linear interpolation); with fewer than 100 samples p99 "
        "is close to the slowest call. Throughput = batch / p50, one call at a time (no concurrency): the same "
        "statistic as the latency column, so both rank the backends alike. The plot shows p50 with p10-p90 whiskers.",
        f"- Stability: each row's samples are also summarized per round (`rounds' p50s apart` = (largest - smallest) "
        f"/ smallest of its {policy['rounds']} per-round p50s); the run is stable when every row's rounds lie within "
        f"{policy['agree_within']:.0%} of each other, else the report says `unstable: rerun on an idle machine`. "
        "Rounds that ran minutes apart disagree when other work on the machine comes and goes.",
        "- `vs eager (p50)` = p50 of PyTorch eager FP32 / p50 of the row, same batch and mode, same run.",
        "- Agreement: the first call's outputs against PyTorch eager FP32 on the same inputs (pipeline.core.compare; "
        "max |a - r| relative to the output's largest magnitude), with the parity tolerance of the row's precision. "
        "On random inputs an INT8 row's agreement only catches a broken graph (its inputs fall outside the "
        "calibrated range); INT8 accuracy is judged on real data (`make accuracy`).",
        f"- Reference check: {report['reference_check'].get('summary', report['reference_check'].get('reason'))} "
        "(PyTorch eager FP32 on the first case of reference.npz against the outputs stored there).",
        "- First call: the checked call at each batch, untimed and reported apart; for torch.compile it includes "
        "compilation (inductor also keeps an on-disk cache, so a repeated run compiles faster).",
        "- Peak device memory, read around the checked call: for torch on a GPU, the module's weights plus "
        "torch.cuda.max_memory_allocated above what was allocated before it; n/a elsewhere, with the reason "
        "under Backends.",
    ]


def _machine_line(env: dict) -> str:
    gpu = env["gpu"]
    where = gpu["name"] if gpu["present"] else "no GPU"
    return f"{env['cpu']['model']} ({env['cpu']['physical_cores']} cores), {where}, {env['threads']} threads"


def _ms(value: float) -> str:
    return f"{value:.3f}" if value < 100 else f"{value:.1f}"


def _memory(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.0f} MiB"


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300].replace("|", "/")
