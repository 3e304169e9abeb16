"""The INT8 stage's time on ResNet-50 with the 40 photos, before and after a change, and what it picked (issues 38,
56).

Each checkout (--source: this one by default, labelled "after"; --before DIR: another, e.g. `git archive <commit>`
unpacked, labelled "before") builds `make engine MODEL=resnet PRECISION=int8 CALIB=<the 40 photos>
BUILDER=tensorrt_rtx` into a fresh folder, one stage a process: export, check, simplify and parity, then the
precision stage, whose process holds the int8 stage (and its parity and agreement gates).  The checkouts take
turns, --rounds times, so that both meet the same load on a shared machine; the load average is recorded at each
start.  A run's numbers: the int8 stage's seconds as the manifest records them (the goal's number), the precision
process's wall and CPU seconds (user + system, from wait4: CPU time grows less than wall time when other jobs take
the cores) and peak RSS, the calibration's seconds and passes over the fit rows, and the pick (method, smoothing, biases
corrected, ops left in float) with the held-out numbers, which must be the same for both.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/int8_stage.py --before /path/to/old/checkout --rounds 3

writes int8-stage.json (a later run replaces it) and int8-stage.md into --docs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.scale import read_raw_manifest, run_measured, source_commit  # noqa: E402
from trt_pipeline.pipeline.bench.environment import describe_environment, physical_cores  # noqa: E402
from trt_pipeline.pipeline.core.cpu import instruction_sets_text  # noqa: E402

STAGES = ("export", "check", "simplify", "parity", "precision")  # build (TensorRT-RTX) follows: not measured here
JSON_NAME, MARKDOWN_NAME = "int8-stage.json", "int8-stage.md"
SIGNIFICANT = 6  # digits to which the runs' picks and held-out numbers must agree


def run(command: list[str], cwd: Path, log: Path) -> dict:
    """Run `command` in `cwd` (whose trt_pipeline it imports), its output to `log`: wall and CPU seconds, peak RSS."""
    measured = run_measured(command, cwd, log)
    if measured.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed in {cwd}: see {log}")
    peak_gib = round(measured.peak_rss_bytes / 2**30, 2)
    return {"wall_seconds": measured.wall_seconds, "cpu_seconds": measured.cpu_seconds, "peak_rss_gib": peak_gib}


def build(source: Path, photos: Path, out: Path) -> dict:
    """ResNet-50 INT8 on the photos, one stage a process; the precision process's times and the manifest's record."""
    options = ["--model", "resnet", "--precision", "int8", "--calib", str(photos), "--builder", "tensorrt_rtx"]
    load = [round(value, 2) for value in os.getloadavg()]
    for stage in STAGES:
        command = [sys.executable, "-m", "trt_pipeline", stage, *options, "--out", str(out)]
        times = run(command, source, out / f"{stage}.log")
    manifest = read_raw_manifest(out)
    calibration = manifest["calibration"]
    graph = manifest["agreement_int8"]["graphs"]["model.int8.onnx"]["outputs"]["output"]["held_out"]
    return {
        "load_average": load,
        "int8_seconds": manifest["timings"]["int8"],
        "precision_process": times,
        "collect_seconds": calibration["collect_seconds"],
        "collect_passes": calibration.get("collect_passes"),  # not recorded before it was counted
        "pick": {
            "method": calibration["method"],
            "smooth_alpha": calibration["smooth_alpha"],
            "biases_corrected": calibration["bias_correction"]["kept"],
            "float_ops": calibration["int8_share"]["float_ops"],
            "candidates": calibration["search"]["candidates"],
            "held_out": graph,
        },
    }


def measure(args: argparse.Namespace) -> dict:
    sources = {"after": Path(args.source).resolve()}
    if args.before:
        sources = {"before": Path(args.before).resolve(), **sources}
    started = time.perf_counter()
    runs: dict[str, list[dict]] = {label: [] for label in sources}
    with tempfile.TemporaryDirectory(prefix="int8-stage.") as work:
        photos = Path(work) / "photos"
        command = [sys.executable, "-m", "trt_pipeline", "calibration-images", "--out", str(photos)]
        run(command, ROOT, Path(work) / "photos.log")
        for round_ in range(args.rounds):
            for label, source in sources.items():
                out = Path(work) / f"{label}-{round_}"
                out.mkdir()
                runs[label].append(build(source, photos, out))
                print(f"{label} round {round_ + 1}: {runs[label][-1]['int8_seconds']:.1f} s", flush=True)
    given = {"before": args.before_commit}
    return {
        "commits": {label: source_commit(source, given.get(label)) for label, source in sources.items()},
        "seconds": round(time.perf_counter() - started, 1),
        "environment": describe_environment(threads=physical_cores()),
        "runs": runs,
    }


def render_markdown(report: dict) -> str:
    environment = report["environment"]
    cpu = environment["cpu"]
    versions = ", ".join(f"{name} {version}" for name, version in environment["versions"].items() if version)
    lines = [
        "# The INT8 stage on ResNet-50 with the 40 photos, before and after (issues 38 and 56)",
        "",
        "Generated by `benchmarks/int8_stage.py`: `make engine MODEL=resnet PRECISION=int8 CALIB=<the 40 photos of "
        "make calibration-images>` (CALIB_METHOD=auto, SMOOTH=auto: four candidates), one stage a process, the "
        "checkouts taking turns. int8 s: the stage's own seconds (manifest.json); the precision process also runs "
        "the INT8 parity and agreement gates. Passes: runs of a graph over the 32 fit rows (-: not counted by that "
        "checkout).",
        "",
        f"{cpu['model']}, {cpu['physical_cores']} physical cores shared with other jobs, "
        f"{instruction_sets_text(cpu['instruction_sets'])}; {versions}. Commits: "
        + ", ".join(f"{label} {commit}" for label, commit in report["commits"].items())
        + f". Measured in {report['seconds']:.0f} s by `{environment['command']}`.",
        "",
        "| checkout | round | load average (1, 5, 15 min) | int8 s | precision process wall s | CPU s | peak RSS | "
        "calibration s | passes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, runs in report["runs"].items():
        for index, row in enumerate(runs):
            process = row["precision_process"]
            lines.append(
                f"| {label} | {index + 1} | {', '.join(map(str, row['load_average']))} | {row['int8_seconds']:.1f} | "
                f"{process['wall_seconds']:.1f} | {process['cpu_seconds']:.1f} | {process['peak_rss_gib']:.2f} GiB | "
                f"{row['collect_seconds']:.1f} | "
                f"{row['collect_passes'] if row['collect_passes'] is not None else '-'} |"
            )
    lines += ["", "Median int8 s: " + "; ".join(
        f"{label} {statistics.median(r['int8_seconds'] for r in runs):.1f}" for label, runs in report["runs"].items()
    ) + ".", ""]  # fmt: skip
    picks = {json.dumps(_significant(r["pick"]), sort_keys=True) for runs in report["runs"].values() for r in runs}
    same = len(picks) == 1
    first = report["runs"][next(iter(report["runs"]))][0]["pick"]
    held_out = first["held_out"]
    lines += [
        f"The pick and held-out numbers of every run are {'the same' if same else 'NOT the same'} (to "
        f"{SIGNIFICANT} significant digits, as the manifest's records round them): "
        f"{first['method']}, smoothing alpha {first['smooth_alpha']}, biases corrected {first['biases_corrected']}, "
        f"ops in float {first['float_ops'] or 'none'}; held-out error {held_out['error_mean']:.6g} "
        f"(max {held_out['error_max']:.6g}), cosine mean {held_out['cosine_mean']:.6g}, min "
        f"{held_out['cosine_min']:.6g}; candidates' held-out errors: "
        + "; ".join(
            f"{c['method']}, alpha {c['smooth_alpha']}: {c['held_out_error_mean']}" for c in first["candidates"]
        )
        + ".",
        "",
    ]
    return "\n".join(lines)


def _significant(value):
    """`value` with every float rounded to SIGNIFICANT digits: sums in another order (an ONNX Runtime session that
    maps its weights instead of packing them) move the held-out means in their last bits, not the pick."""
    if isinstance(value, float):
        return float(f"{value:.{SIGNIFICANT}g}")
    if isinstance(value, dict):
        return {key: _significant(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_significant(item) for item in value]
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=str(ROOT), help="the checkout measured as 'after'")
    parser.add_argument("--before", help="another checkout, measured as 'before', taking turns with --source")
    parser.add_argument("--before-commit", help="the commit --before holds, where it is no git checkout")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "benchmarks", help="where the report goes")
    parser.add_argument("--render", action="store_true", help="rewrite the markdown from the JSON")
    args = parser.parse_args()
    if not args.render:
        args.docs.mkdir(parents=True, exist_ok=True)
        (args.docs / JSON_NAME).write_text(json.dumps(measure(args), indent=2) + "\n")
    (args.docs / MARKDOWN_NAME).write_text(render_markdown(json.loads((args.docs / JSON_NAME).read_text())))


if __name__ == "__main__":
    main()
