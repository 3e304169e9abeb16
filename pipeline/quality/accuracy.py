"""`trt-pipeline accuracy`: what FP16 and INT8 cost in accuracy, measured on the actual graphs.

The FP32 graph (model.onnx, from the usual stages), its FP16 conversion and two INT8 Q/DQ graphs per
calibration method (int8-<method>: TensorRT's; int8-<method>-ort: shaped for ONNX Runtime's kernels on
this kind of CPU, with VNNI or without) all run through ONNX Runtime (CPU) on the same evaluation inputs:
  - a model with a labelled held-out set (the digits CNN) reports top-1 on it, calibrating on the
    training split only;
  - any other model is calibrated and evaluated on CALIB (or --eval), and reports how often its
    top-1 agrees with FP32's and the cosine similarity of its outputs to FP32's; evaluated on CALIB itself,
    each INT8 graph also reports both apart on the rows its ranges were fit on (in-sample) and on the rows
    held out from calibration (calibration/holdout.py), as the build's agreement gate judges them.
Every graph also reports the max / mean |output - FP32 output|, and its top-1 changes against FP32 split
into real flips and near-ties (top1_changes: where FP32 itself could not tell the two classes apart by more
than the error the lower precision makes).  accuracy.json and accuracy.md land in the FP32 artifact folder;
the graphs in its accuracy/ subfolder.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ... import models
from ...calibration.budget import fit_budget
from ...calibration.holdout import CalibrationParts, HoldoutSplit, read_calibration, split_rows
from ...calibration.int8 import CACHE_FOLDER, make_int8_graph
from ...calibration.int8_records import CalibrationConfig
from ...calibration.readers import CalibrationSource, Feed, graph_inputs, read_calibration_data
from ...models.digits import load_split
from ..core.arguments import add_settings_arguments, given_settings
from ..core.cpu import int8_cpu_kind
from ..core.errors import PipelineError
from ..core.mentions import command
from ..core.precision import Precision
from ..core.settings import DEFAULTS, Settings, mention
from ..evaluation import evaluation_session
from ..evaluation.agreement import Fp32Reference, int8_judge
from ..folder.artifacts import scratch_folder, write_bytes, write_json
from ..folder.layout import CPU_TARGETS, FP32_GRAPH, REFERENCE, graph_record
from ..folder.records import GraphRecord
from ..stages.fp16 import make_fp16_graph
from ..stages.sequence import make_engine

EVAL_BATCH = 64
SUBFOLDER = "accuracy"
NEAR_TIES_LISTED = 10  # per graph in accuracy.md; accuracy.json has them all
# A graph the report evaluates, and its record: how it is run (_run).
Graph = tuple[Path, GraphRecord]


@dataclass(frozen=True)
class TopOneChanges:
    """The samples whose top-1 class differs from FP32's, each a real flip or a near-tie (top1_changes)."""

    changed: np.ndarray  # bool per sample
    near_tie: np.ndarray  # bool per sample: changed, with FP32's margin within `tolerance`
    margin: np.ndarray  # FP32's output for its top-1 class minus for the lower precision's (0 where unchanged)
    tolerance: np.ndarray  # per sample: the error the lower precision makes there, capped by its median

    @property
    def real(self) -> np.ndarray:
        return self.changed & ~self.near_tie


def top1_changes(outputs: np.ndarray, reference: np.ndarray) -> TopOneChanges:
    """Split the top-1 changes of `outputs` (N x classes) against FP32's `reference` into real flips and near-ties.

    A change from FP32's class a to class b is a near-tie when FP32's own margin, reference[a] - reference[b], is
    at most the largest |outputs - reference| on that sample (capped by the median of that largest error over
    the set).  Such a flip needs no error beyond the size this graph already makes everywhere: moving b above a
    takes error[b] - error[a] > margin, which one logit's error of that size can do, so the class was a tie to
    within the graph's precision, and the flip is the same error the cosine already measures, counted again as
    a discrete event.  A flip whose margin exceeds that error needed two logits pushed apart by up to twice the
    sample's worst error, or one pushed further: a class-specific error, a real loss.  The cap keeps one
    sample's wild error from excusing that sample's flip; a graph that is off everywhere is excused nothing it
    is not also charged for in its cosine and |error| columns.  Units are the output's (logits, for a classifier).
    """
    flat, flat_ref = outputs.reshape(len(outputs), -1), reference.reshape(len(reference), -1)
    rows = np.arange(len(flat))
    ours, theirs = flat.argmax(1), flat_ref.argmax(1)
    error = np.abs(flat.astype(np.float64) - flat_ref).max(1)
    tolerance = np.minimum(error, np.median(error)) if len(error) else error
    margin = flat_ref[rows, theirs].astype(np.float64) - flat_ref[rows, ours]
    changed = ours != theirs
    return TopOneChanges(changed, changed & (margin <= tolerance), margin, tolerance)


@dataclass(frozen=True)
class EvaluationSet:
    """Inputs to evaluate on, their labels (None: compare with FP32 only), and calibration data."""

    feeds: list[Feed]
    labels: np.ndarray | None
    description: str
    calibration: CalibrationSource
    calibration_description: str
    # Calibration-like data the accuracy budget measures sensitivity on (never the evaluation set when
    # there is a labelled one), with its labels or None.
    tuning_feeds: list[Feed]
    tuning_labels: np.ndarray | None
    # Where the evaluation inputs are the calibration data itself: which of them INT8's ranges were fit on and
    # which were held out (rows in feed order); None where the evaluation set is apart from calibration.
    split: HoldoutSplit | None = None


def digits_evaluation(settings: Settings) -> EvaluationSet:
    """The digits CNN: calibrate on the training split, evaluate on the held-out split."""
    split = load_split()
    train = split.train_inputs

    def training_batches() -> list[np.ndarray]:
        return [train[start : start + EVAL_BATCH] for start in range(0, len(train), EVAL_BATCH)]

    return EvaluationSet(
        feeds=_chunks({"input": split.held_out_inputs}),
        labels=split.held_out_labels,
        description=f"sklearn digits held-out split ({len(split.held_out_labels)} images, labelled)",
        calibration=training_batches,
        calibration_description=f"sklearn digits training split ({len(train)} images)",
        tuning_feeds=_chunks({"input": train}),
        tuning_labels=split.train_labels,
    )


# Models with a labelled held-out set; every other model is compared with its own FP32 graph.
LABELLED_SETS: dict[str, Callable[[Settings], EvaluationSet]] = {"digits": digits_evaluation}


def measure_accuracy(
    settings: Settings, methods: list[str], eval_source: Path | None = None, budget: float | None = None
) -> Path:
    """Build or reuse the FP32 artifacts, write the FP16/INT8 graphs, evaluate all; returns the folder.

    With `budget`, the first method's INT8 graph is also written to that budget (calibration/budget.py):
    top-1 points lost on the labelled tuning data, or 100 x (1 - mean cosine to FP32) without labels."""
    name = models.canonical_name(settings.model)
    if name not in LABELLED_SETS and settings.calib is None:
        raise PipelineError(
            f"{name} has no labelled held-out set here, so accuracy needs calibration data to compare on",
            f"add {mention(calib='<folder of images or .npy/.npz>')} (e.g. `{command('calibration-images')}` then "
            f"{mention(calib='calibration/samples')}); models with a labelled set: " + ", ".join(LABELLED_SETS),
        )
    # Only what decides the FP32 artifacts: calibration options must not invalidate their reuse.
    folder = make_engine(
        Settings(model=settings.model, precision=Precision.FP32, weights=settings.weights, out_root=settings.out_root)
    )
    preprocess = models.load_model(settings.model, weights=settings.weights).preprocess
    evaluation = _evaluation_set(settings, name, folder / FP32_GRAPH, preprocess, eval_source)
    graphs = {"fp32": (folder / FP32_GRAPH, graph_record(Precision.FP32)), "fp16": _fp16(folder, settings, preprocess)}
    calibration: dict[str, dict] = {}
    samples, batch = settings.calib_samples, settings.calib_batch
    # Read once for every method: each calibrates on the same rows, as make engine's candidates do.
    parts = read_calibration(evaluation.calibration, folder / FP32_GRAPH, preprocess, samples=samples, batch=batch)
    for method in methods:
        wanted = budget if method == methods[0] else None
        int8, calibration[method] = _int8(folder, settings, method, evaluation, parts, wanted)
        graphs |= int8
    report = _report(name, folder, evaluation, graphs, calibration)
    write_json(folder / "accuracy.json", report)
    write_bytes(folder / "accuracy.md", _markdown(report).encode())
    print(_markdown(report))
    return folder


def _fp16(folder: Path, settings: Settings, preprocess) -> Graph:
    """The FP16 graph as make engine writes it: the FP32 fallback scanned on the reference inputs, and on CALIB
    where given."""
    fp32 = folder / FP32_GRAPH
    scanned = None
    if settings.calib is not None:
        scanned = read_calibration_data(
            settings.calib, graph_inputs(fp32), preprocess, samples=settings.calib_samples, batch=settings.calib_batch
        )
    graph = graph_record(Precision.FP16)
    make_fp16_graph(fp32, folder / SUBFOLDER / graph.file, folder / REFERENCE, settings, scanned)
    return folder / SUBFOLDER / graph.file, graph


def _int8(
    folder: Path,
    settings: Settings,
    method: str,
    evaluation: EvaluationSet,
    calibration: CalibrationParts,
    budget: float | None,
) -> tuple[dict[str, Graph], dict]:
    """({label: graph}, the calibration record) of `method`'s INT8 graphs: TensorRT's, the one ONNX Runtime's
    kernels run on this kind of CPU (where it could be made), and with `budget` the one to that budget,
    made from the same calibrated graph and ranges."""
    fp32, engine = folder / FP32_GRAPH, graph_record(Precision.INT8)
    path = folder / SUBFOLDER / f"model.int8.{method}.onnx"
    # The graphs ONNX Runtime's CPU runs in int8, one per kind of CPU; the row is the one this CPU serves.
    cpu_paths = {kind: cpu_graph_path(folder, method, kind) for kind in CPU_TARGETS}
    started = time.perf_counter()
    with scratch_folder(path, "int8-scratch") as scratch:
        result = make_int8_graph(
            fp32,
            path,
            calibration,
            config=replace(CalibrationConfig.from_settings(settings), methods=(method,)),  # SMOOTH= as make engine
            cache_folder=folder / CACHE_FOLDER,
            cpu_out_paths=cpu_paths,
            judge=int8_judge(Fp32Reference(fp32)),  # SMOOTH=auto picks as make engine does
            scratch=scratch,
        )
        record = {**result.calibration, "int8_stage_seconds": round(time.perf_counter() - started, 3)}
        print(f"int8 {method:<10} {result.summary}")
        graphs = {f"int8-{method}": (path, engine)}
        kind = int8_cpu_kind()
        if kind in result.written_cpu_graphs:  # absent where it could not be made
            graphs[f"int8-{method}-ort"] = (cpu_paths[kind], graph_record(Precision.INT8, CPU_TARGETS[kind]))
        if budget is not None:
            budget_path = folder / SUBFOLDER / f"model.int8.{method}.budget.onnx"
            loss = budget_loss(fp32, evaluation.tuning_feeds, evaluation.tuning_labels)
            record["budget"] = fit_budget(result.chosen.fp32_equal, budget_path, result.chosen.ranges, budget, loss)
            print(f"budget     {record['budget']['summary']}")
            graphs[f"int8-{method}-budget"] = (budget_path, engine)
    return graphs, record


def _report(name: str, folder: Path, evaluation: EvaluationSet, graphs: dict[str, Graph], calibration: dict) -> dict:
    """Every graph run on the evaluation inputs as its record says (_run), against FP32 and the labels."""
    outputs = {label: _run(path, evaluation.feeds, graph) for label, (path, graph) in graphs.items()}
    rows = {label: _metrics(outputs[label], outputs["fp32"], evaluation.labels) for label in graphs}
    report = {
        "model": name,
        "evaluation": evaluation.description,
        "calibration_data": evaluation.calibration_description,
        "labelled": evaluation.labels is not None,
        "graphs": {label: str(path.relative_to(folder)) for label, (path, _) in graphs.items()},
        "results": rows,
        "best_int8": _best_int8(rows),
        "calibration": calibration,
    }
    if evaluation.split is not None:
        report["held_out"] = held_out_columns(outputs, evaluation.split)
    return report


def held_out_columns(outputs: dict[str, np.ndarray], split: HoldoutSplit) -> dict:
    """Each INT8 graph against FP32 on the calibration rows its ranges were fit on and on the rows held out from
    them (the build's agreement gate judges the latter): agreement and cosine, side by side."""
    parts = {"in_sample": split.fit, "held_out": split.held_out}
    return {
        "split": {"rule": split.rule, "fit_rows": len(split.fit), "held_out_rows": len(split.held_out)},
        "graphs": {
            label: {
                part: _side_metrics(output[rows], outputs["fp32"][rows]) if len(rows) else None
                for part, rows in parts.items()
            }
            for label, output in outputs.items()
            if label.startswith("int8-")
        },
    }


def _side_metrics(logits: np.ndarray, reference: np.ndarray) -> dict:
    row = _metrics(logits, reference, None)
    kept = ("top1_agreement", "top1_agreement_beyond_ties", "cosine_mean", "cosine_min")
    return {"rows": len(logits), **{key: row[key] for key in kept}}


def cpu_graph_path(folder: Path, method: str, kind: str) -> Path:
    """Where the accuracy run keeps the INT8 graph for ONNX Runtime's CPU kernels of `kind` for `method`."""
    return folder / SUBFOLDER / f"model.int8.{method}.ort-{kind}.onnx"


# --------------------------------------------------------------------------- evaluation


def _evaluation_set(settings: Settings, name: str, fp32: Path, preprocess, eval_source: Path | None) -> EvaluationSet:
    if name in LABELLED_SETS:
        return LABELLED_SETS[name](settings)
    assert settings.calib is not None  # measure_accuracy checked it before building anything
    source = eval_source or settings.calib
    data = read_calibration_data(
        source, graph_inputs(fp32), preprocess, samples=settings.calib_samples, batch=settings.calib_batch
    )
    split = None if eval_source else split_rows(data.samples)
    overlap = (
        ""
        if split is None
        else f" (the calibration data itself, no labelled set: INT8 fit on {len(split.fit)} of its rows, "
        f"{len(split.held_out)} held out)"
    )
    return EvaluationSet(
        feeds=data.batches,
        labels=None,
        description=f"{data.description}, {data.samples} samples{overlap}",
        calibration=settings.calib,
        calibration_description=str(settings.calib),
        tuning_feeds=data.batches,
        tuning_labels=None,
        split=split,
    )


def budget_loss(fp32: Path, feeds: list[Feed], labels: np.ndarray | None) -> Callable[[Path], dict]:
    """The accuracy budget's loss of a graph on the tuning data, with the numbers behind it.

    Labelled: top-1 points below FP32's (the labels are the truth, so every changed answer counts, near-tie or
    not).  Unlabelled: the larger of 100 x (1 - mean cosine to FP32) and the percentage of samples whose top-1
    flips for real (top1_changes): the cosine sees the error spread over the outputs, the flips a class-specific
    error it can average away; a near-tie flip is that same spread error, so it is not charged twice."""
    reference = _run(fp32, feeds, graph_record(Precision.FP32))

    def loss(graph: Path) -> dict:
        row = _metrics(_run(graph, feeds, graph_record(Precision.INT8)), reference, labels)
        record = {
            "cosine_mean": row["cosine_mean"],
            "top1_agreement": row["top1_agreement"],
            "real_flips": row["real_flips"],
            "near_tie_flips": len(row["near_tie_flips"]),
        }
        if labels is not None:
            return {"loss": float(np.mean(reference.argmax(1) == labels) * 100 - row["top1"]), **record}
        flipped = 100 * row["real_flips"] / len(reference)
        return {"loss": max(100 * (1 - row["cosine_mean"]), flipped), **record}

    return loss


def _chunks(arrays: dict[str, np.ndarray]) -> list[Feed]:
    count = len(next(iter(arrays.values())))
    return [{n: a[start : start + EVAL_BATCH] for n, a in arrays.items()} for start in range(0, count, EVAL_BATCH)]


def _run(path: Path, feeds: list[Feed], graph: GraphRecord) -> np.ndarray:
    """The first output (the logits, for a classifier) of the graph at `path` over every batch, as float32, run as
    ONNX Runtime's CPU provider runs `graph` (its record) where it serves it: a TensorRT-shaped INT8 graph with its
    Q/DQ simulated (what TensorRT computes), a CPU-shaped one on ONNX Runtime's own int8 kernels, a float16 graph
    through ONNX Runtime's casts to float32 (not as the engine stores float16: the FP16 gate judges that)."""
    session = evaluation_session(graph, path, faithful_fp16=False)
    output = session.get_outputs()[0].name
    return np.concatenate([session.run([output], feed)[0] for feed in feeds]).astype(np.float32)


def _metrics(logits: np.ndarray, reference: np.ndarray, labels: np.ndarray | None) -> dict:
    flat, flat_ref = logits.reshape(len(logits), -1), reference.reshape(len(reference), -1)
    difference = np.abs(flat - flat_ref)
    norms = np.linalg.norm(flat, axis=1) * np.linalg.norm(flat_ref, axis=1)
    cosine = np.sum(flat * flat_ref, axis=1) / np.maximum(norms, np.finfo(np.float32).tiny)
    changes = top1_changes(flat, flat_ref)
    row = {
        "top1_agreement": round(float(np.mean(~changes.changed) * 100), 3),
        # agreement with FP32 where only real flips count as disagreements (near-ties listed apart)
        "top1_agreement_beyond_ties": round(float(np.mean(~changes.real) * 100), 3),
        "real_flips": int(changes.real.sum()),
        "near_tie_flips": [_near_tie(flat, flat_ref, changes, int(i)) for i in np.flatnonzero(changes.near_tie)],
        "cosine_mean": round(float(cosine.mean()), 6),
        "cosine_min": round(float(cosine.min()), 6),
        "max_abs_diff": float(difference.max()),
        "mean_abs_diff": float(difference.mean()),
    }
    if labels is not None:
        row["top1"] = round(float(np.mean(flat.argmax(1) == labels) * 100), 3)
    return row


def _near_tie(flat: np.ndarray, flat_ref: np.ndarray, changes: TopOneChanges, sample: int) -> dict:
    return {
        "sample": sample,
        "fp32_class": int(flat_ref[sample].argmax()),
        "class": int(flat[sample].argmax()),
        "fp32_margin": round(float(changes.margin[sample]), 6),
        "tolerance": round(float(changes.tolerance[sample]), 6),
    }


def _best_int8(rows: dict[str, dict]) -> dict:
    """The INT8 method closest to FP32: by top-1 where labelled, else by agreement beyond near-ties, then cosine."""
    int8 = {label: row for label, row in rows.items() if label.startswith("int8-")}
    if not int8:
        return {}
    metric = "top1" if "top1" in rows["fp32"] else "top1_agreement_beyond_ties"
    best = max(int8, key=lambda label: (int8[label][metric], int8[label]["cosine_mean"]))
    return {"graph": best, "metric": metric, "points_below_fp32": round(rows["fp32"][metric] - int8[best][metric], 3)}


def _markdown(report: dict) -> str:
    labelled = report["labelled"]
    header = "| graph | top-1 % | Δ vs FP32 (points) | " if labelled else "| graph | "
    lines = [
        f"# Accuracy: {report['model']}",
        "",
        f"Evaluated on {report['evaluation']}; INT8 calibrated on {report['calibration_data']}. "
        "All graphs run through ONNX Runtime (CPU).",
        "",
        header + "top-1 agreement with FP32 % | agreement beyond near-ties % | near-tie flips | "
        "cosine to FP32 (mean / min) | max abs diff | mean abs diff |",
        "|---" * (9 if labelled else 7) + "|",
    ]
    fp32 = report["results"]["fp32"]
    for label, row in report["results"].items():
        cells = [label]
        if labelled:
            cells += [f"{row['top1']:.2f}", f"{row['top1'] - fp32['top1']:+.2f}"]
        cells += [
            f"{row['top1_agreement']:.2f}",
            f"{row['top1_agreement_beyond_ties']:.2f}",
            str(len(row["near_tie_flips"])),
            f"{row['cosine_mean']:.5f} / {row['cosine_min']:.5f}",
            f"{row['max_abs_diff']:.3g}",
            f"{row['mean_abs_diff']:.3g}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    best = report["best_int8"]
    if best:
        below = f"{best['points_below_fp32']:.2f} points of {best['metric']} below FP32"
        lines += ["", f"Best INT8: {best['graph']}, {below}."]
    lines += _near_ties_markdown(report["results"])
    if "held_out" in report:
        lines += _held_out_markdown(report["held_out"])
    for method, calibration in report["calibration"].items():
        if "budget" in calibration:
            lines += _budget_markdown(method, calibration["budget"], report["labelled"])
    seconds = {m: c["collect_seconds"] for m, c in report["calibration"].items()}
    lines += ["", "Range collection (s, 0 = cached): " + ", ".join(f"{m} {s:.1f}" for m, s in seconds.items()), ""]
    return "\n".join(lines)


def _held_out_markdown(held_out: dict) -> list[str]:
    """In-sample vs held-out agreement of each INT8 graph with FP32 (held_out_columns)."""
    split = held_out["split"]
    lines = [
        "",
        "## In-sample vs held out",
        "",
        f"INT8's ranges were fit on {split['fit_rows']} of the calibration rows and never saw the other "
        f"{split['held_out_rows']} ({split['rule']}); a held-out column much worse than its in-sample one means the "
        "calibration data cannot stand for inputs it does not contain.",
        "",
        "| graph | cosine mean in-sample | held out | cosine min in-sample | held out "
        "| top-1 agreement % in-sample | held out |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, sides in held_out["graphs"].items():
        cells = [label]
        for key, form in (("cosine_mean", "{:.5f}"), ("cosine_min", "{:.5f}"), ("top1_agreement", "{:.2f}")):
            cells += [form.format(side[key]) if side else "(none held out)" for side in sides.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _near_ties_markdown(results: dict[str, dict]) -> list[str]:
    """Every graph's near-tie flips: listed apart, not hidden (pipeline.quality.accuracy.top1_changes says which)."""
    rows = [(label, tie) for label, row in results.items() for tie in row["near_tie_flips"][:NEAR_TIES_LISTED]]
    if not rows:
        return []
    lines = [
        "",
        "## Near-tie flips",
        "",
        "Top-1 changes where FP32's own margin between the two classes is within the error the graph makes on that "
        "sample (its largest |output - FP32|, capped by that error's median over the set): the class was a tie to "
        "within the graph's precision.  Counted in the agreement column, not in the one beyond near-ties; "
        f"at most {NEAR_TIES_LISTED} per graph here, all in accuracy.json.",
        "",
        "| graph | sample | FP32 class | its class | FP32 margin | tolerance |",
        "|---|---|---|---|---|---|",
    ]
    for label, tie in rows:
        cells = [label, str(tie["sample"]), str(tie["fp32_class"]), str(tie["class"])]
        cells += [f"{tie['fp32_margin']:.3g}", f"{tie['tolerance']:.3g}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _budget_markdown(method: str, budget: dict, labelled: bool) -> list[str]:
    """The accuracy budget's trade-off: each step's layers left in float, loss on the tuning data, graph size."""
    unit = (
        "top-1 points below FP32 on the tuning data"
        if labelled
        else "the larger of 100 x (1 - mean cosine to FP32) and the % of samples whose top-1 really flips"
    )
    lines = [
        "",
        f"## INT8 ({method}) to an accuracy budget of {budget['budget']:g} ({unit})",
        "",
        f"{len(budget['kept_float'])} of {budget['layers']} quantized layers left in float; "
        + ("within the budget." if budget["within_budget"] else "the budget is not reached even with all in float."),
        "",
        "| step | layers in float | last one left in float | loss | cosine mean | top-1 agreement % | real flips "
        "| near-tie flips | graph MB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for index, step in enumerate(budget["steps"]):
        last = step["kept_float"][-1] if step["kept_float"] else "(all quantized)"
        cells = [
            str(index),
            str(len(step["kept_float"])),
            last,
            f"{step['loss']:.4g}",
            f"{step['cosine_mean']:.5f}",
            f"{step['top1_agreement']:.2f}",
            str(step["real_flips"]),
            str(step["near_tie_flips"]),
            f"{step['graph_bytes'] / 1e6:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


# --------------------------------------------------------------------------- command line


# The settings `accuracy` reads, each as its declaration says (core/settings.py); MODEL defaults to the digits CNN,
# the registry model with a labelled held-out set.  CALIB_METHOD names the INT8 methods compared, as it names those
# `make engine` tries (auto: percentile and max).
ACCURACY_SETTINGS = (
    "model",
    "weights",
    "out_root",
    "calib",
    "calib_method",
    "calib_samples",
    "calib_batch",
    "recalibrate",
)
ACCURACY_DEFAULTS = {"model": "digits"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, ACCURACY_SETTINGS, ACCURACY_DEFAULTS)
    parser.add_argument("--eval", type=Path, help="evaluate on this data instead of CALIB (same formats)")
    parser.add_argument(
        "--accuracy-budget",
        type=float,
        help="also write the first method's INT8 graph with the most sensitive layers in float until it loses at "
        "most this many top-1 points (labelled set), or else both 100 x (1 - cosine to FP32) and the %% of samples "
        "whose top-1 really flips (near-ties excused) are within it [ACCURACY_BUDGET]",
    )


def main(args: argparse.Namespace) -> int:
    given = given_settings(args)
    # CALIB_METHOD names the INT8 methods compared, read as an INT8 build reads it.  The other settings are checked
    # without it, at the default PRECISION (accuracy makes every precision), which would refuse it as INT8's alone.
    methods = list(Settings(calib_method=given.pop("calib_method", DEFAULTS["calib_method"])).calib_methods())
    settings = Settings(**{**ACCURACY_DEFAULTS, **given})
    settings = settings.check(data_besides_calib=models.canonical_name(settings.model) in LABELLED_SETS)
    if args.accuracy_budget is not None and not args.accuracy_budget >= 0:
        raise PipelineError(f"--accuracy-budget {args.accuracy_budget} is not a loss", "give 0 or more, e.g. 0.5")
    measure_accuracy(settings, methods, args.eval, args.accuracy_budget)
    return 0
