"""POSTPROCESS=nms: greedy NMS appended to every graph the folder serves, and the gate each NMS graph passes.

The stage runs after the precision stage and before the build.  Each graph of the raw head that may serve (model.onnx,
the precision's graph for the engine, an int8 folder's graphs for ONNX Runtime's CPU kernels) gets NMS appended
(pipeline/postprocess/nms_graph.py) as its NMS graph, model.fp16.onnx -> model.fp16.nms.onnx (pipeline/folder/layout.py
postprocessed_file); the NMS graphs serve, and TensorRT builds the engine from the precision's.  The graphs of the raw
head stay: their gates judge the head against PyTorch, and diagnose compares them node by node.

Why after the precision and not before it: appended before the float16 conversion, the NMS Loop's body reads tensors
of the outer graph that the converter renames, and the faithful float16 copy is then "not topologically sorted";
appended before calibration, INT8's agreement gate would judge the detections (a small move of the head reorders or
swaps boxes: off by 0.47 of the output's norm, measured) and its Q/DQ would quantize the IoU arithmetic.  Appended
after, the NMS computes in float32 inside FP16 and INT8 graphs alike: the float16 graph's head output is float32
already (float32 I/O), and nothing of the subgraph is quantized.

The gate (check_nms, stage nms_<precision>[_onnxruntime_<cpu>]), on every reference case and a batch between the
profile's opt and max that no case had (batches the build never used), with the graph evaluated as its record says:
  1. its detections are the reference NMS (pipeline/postprocess/nms.py) of its own head, exposed as an output:
     the same count and classes, boxes and scores to a tight tolerance (evaluation/detections.py same_detections);
  2. its detections agree with the reference NMS of PyTorch's head (reference.npz) and, where calibration data was
     given, of the FP32 graph's head on the held-out calibration rows (images like the served ones): the share of
     detections matched (same class, IoU >= MATCH_IOU) and the matched scores' difference, within the precision's
     gate (detection_agreement).  INT8 on the reference inputs (random noise, clipped by its input's Q/DQ) is
     recorded, not judged, as its parity there is a smoke check only (pipeline/evaluation RTOL).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from ..core.compare import compare
from ..core.errors import PipelineError
from ..core.nms_config import NmsConfig
from ..core.precision import Precision
from ..core.sessions import onnxruntime_session
from ..core.settings import BatchProfile, Postprocess, mention
from ..evaluation import evaluation_session, node_tolerance, probe_graph, simulates_qdq
from ..evaluation.agreement import fp32_outputs
from ..evaluation.detections import MIN_AGREEMENT, SAME_RTOL, DetectionAgreement, detection_agreement, same_detections
from ..folder.artifacts import atomic_path
from ..folder.graph_io import graph_io, load_reference
from ..folder.records import GraphRecord
from ..postprocess.nms import OUTPUTS, reference_nms
from ..postprocess.nms_graph import append_nms

Feeds = dict[str, np.ndarray]


@dataclass(frozen=True)
class Judged:
    """Inputs whose detections the gate judges, with the head they are expected from: PyTorch's (`reference`) or
    the FP32 graph's (held-out calibration rows)."""

    label: str
    feeds: Feeds
    head: np.ndarray
    gated: bool = True  # False: recorded only (INT8 on the random reference inputs)


def append_postprocess(heads: Sequence[Path], targets: Sequence[Path], config: NmsConfig) -> dict:
    """Each graph of `heads` with NMS appended, written to the target beside it (the stage "nms")."""
    for head, target in zip(heads, targets, strict=True):
        with atomic_path(target) as scratch:
            onnx.save(append_nms(head, config), str(scratch))
    io = graph_io(targets[0])
    outputs = ", ".join(f"{t.name} {list(t.shape)} {t.dtype}" for t in io.outputs)
    settings = (
        f"{config.box_format} head, score > {config.score_threshold:g}, IoU > {config.iou_threshold:g}, "
        f"{config.candidates} candidates, K = {config.max_detections}, "
        f"{'class-aware' if config.class_aware else 'class-agnostic'}"
    )
    return {
        "summary": f"{', '.join(t.name for t in targets)}: NMS appended ({settings}) -> {outputs}",
        "graphs": {head.name: target.name for head, target in zip(heads, targets, strict=True)},
        "config": dataclasses.asdict(config),
    }


def check_nms(
    nms_path: Path,
    reference_path: Path,
    config: NmsConfig,
    head: str,
    *,
    graph: GraphRecord,
    batch: BatchProfile,
    held_out: Sequence[Judged] = (),
    judge_detections: bool = True,
) -> dict:
    """The gate of one NMS graph (module doc); a PipelineError where its NMS is not the reference's or its
    detections do not agree with the expected ones.  judge_detections=False: their agreement is recorded only (a
    graph shaped for another kind of CPU than this one)."""
    judged = [*_reference_cases(reference_path, head, batch, graph.precision), *held_out]
    session, names = _session(nms_path, graph, head, judged[0].feeds)
    errors = []  # (max abs, max rel) of the boxes and scores against the reference NMS of the graph's own head
    agreements: dict[str, list[tuple[dict, dict]]] = {}
    for case in judged:
        outputs = dict(zip(names, session.run(names, case.feeds), strict=True))
        detections = {name: outputs[name] for name in OUTPUTS}
        own = reference_nms(outputs[head], config).as_outputs()
        why = same_detections(own, detections)
        if why is not None:
            raise _nms_error(nms_path, graph, case, why)
        errors += [_error(own[name], detections[name]) for name in ("boxes", "scores")]
        agreements.setdefault(case.label, []).append((reference_nms(case.head, config).as_outputs(), detections))
    records = {label: _agreement(pairs) for label, pairs in agreements.items()}
    gated = {case.label for case in judged if case.gated and judge_detections}
    for label in gated:
        if not records[label].passes(graph.precision):
            raise _agreement_error(nms_path, graph, label, records[label])
    batches = sorted({_rows(case.feeds) for case in judged if case.label == "reference"})
    worst = {"max_abs": max(error[0] for error in errors), "max_rel": max(error[1] for error in errors)}
    return _record(nms_path, graph, batches, worst, records, gated)


def _reference_cases(reference_path: Path, head: str, batch: BatchProfile, precision: Precision) -> list[Judged]:
    """PyTorch's reference cases, and one more cut from the largest: a batch between the profile's opt and max
    that no case has (the build tunes at opt; max and this one it never ran)."""
    cases = [(inputs, outputs[head]) for inputs, outputs in load_reference(reference_path)]
    sizes = {_rows(inputs) for inputs, _ in cases}
    between = (batch.opt + batch.max) // 2
    largest = max(cases, key=lambda case: _rows(case[0]))
    if between not in sizes and batch.opt < between < _rows(largest[0]):
        cases.append(({name: value[:between] for name, value in largest[0].items()}, largest[1][:between]))
    gated = precision is not Precision.INT8  # INT8 on random inputs: a smoke check (module doc)
    return [Judged("reference", inputs, expected, gated) for inputs, expected in cases]


def _session(nms_path: Path, graph: GraphRecord, head: str, feeds: Feeds):
    """(session, output names): the NMS graph evaluated as its record says, its head exposed as one more output.  The
    served file is probed first: the level ONNX Runtime opens it at is recorded for the runner (core/sessions.py)."""
    level = probe_graph(nms_path, feeds, simulate_qdq=simulates_qdq(graph))
    model = onnx.load(str(nms_path))
    model.graph.output.append(onnx.ValueInfoProto(name=head))
    session = evaluation_session(graph, model.SerializeToString(), level=level)
    return session, [output.name for output in session.get_outputs()]


def _nms_error(nms_path: Path, graph: GraphRecord, case: Judged, why: str) -> PipelineError:
    return PipelineError(
        f"{nms_path.name}'s NMS departs from the reference NMS of its own head ({graph.evaluation} evaluation) "
        f"at batch {_rows(case.feeds)} of the {case.label} inputs: {why}",
        "a bug of the NMS subgraph or of ONNX Runtime's kernels: build without it "
        f"({mention(postprocess=Postprocess.NONE)}) and apply reference_nms (pipeline/postprocess/nms.py) to the "
        "served head, and report the case",
    )


def _error(expected: np.ndarray, actual: np.ndarray) -> tuple[float, float]:
    """(max |actual - expected|, that over expected's largest magnitude)."""
    comparison = compare(expected, actual, rtol=SAME_RTOL)
    return comparison.max_abs, comparison.max_rel


def _agreement(pairs: list[tuple[dict, dict]]) -> DetectionAgreement:
    """The detections of every batch of one data source against the expected ones, as one set of images."""
    expected, actual = (
        {name: np.concatenate([pair[side][name] for pair in pairs]) for name in OUTPUTS} for side in (0, 1)
    )
    return detection_agreement(expected, actual)


def _agreement_error(nms_path: Path, graph: GraphRecord, label: str, agreement: DetectionAgreement) -> PipelineError:
    against = "PyTorch's head" if label == "reference" else "the FP32 graph's head"
    problem = (
        f"{nms_path.name}'s detections depart from the reference NMS of {against} on the {label} inputs: "
        f"{agreement.summary()} (gate: agreement >= {MIN_AGREEMENT[graph.precision]}, matched scores within "
        f"{node_tolerance(graph.precision):g} for {graph.precision})"
    )
    folder = nms_path.parent
    fixes = {
        Precision.FP32: "ONNX Runtime computes the head otherwise than PyTorch: compare them with the ONNX Runtime "
        "runner and the parity_fp32 record",
        Precision.FP16: f"keep the head's last layers in FP32 ({mention(keep_fp32='<node or op type>')}; "
        f"trt-pipeline diagnose {folder} names where FP16 departs), or build {mention(precision=Precision.FP32)}",
        Precision.INT8: f"calibrate on images like the served ones ({mention(calib='...')}; trt-pipeline diagnose "
        f"{folder} names where INT8 departs), or build {mention(precision=Precision.FP16)}",
    }
    return PipelineError(problem, fixes[graph.precision])


def _record(
    nms_path: Path, graph: GraphRecord, batches: list[int], worst: dict, records: dict, gated: set[str]
) -> dict:
    agreed = "; ".join(
        f"vs {'PyTorch' if label == 'reference' else 'FP32 on ' + label} + reference NMS: {record.summary()}"
        + ("" if label in gated else " (recorded, not judged)")
        for label, record in records.items()
    )
    return {
        "summary": f"{nms_path.name}: the reference NMS of its own head at batch {batches}; {agreed}",
        "evaluation": str(graph.evaluation),
        "rtol": SAME_RTOL,
        **worst,
        "batches": batches,
        "detections": {
            label: {**record.as_record(), "judged": label in gated, "min_agreement": MIN_AGREEMENT[graph.precision]}
            for label, record in records.items()
        },
    }


def held_out_rows(fp32_path: Path, head: str, batches: Sequence[Feeds], label: str) -> list[Judged]:
    """Calibration rows with the FP32 graph's head on them: what a lower precision's detections are judged against."""
    heads = fp32_outputs(onnxruntime_session(fp32_path), list(batches))
    return [Judged(label, feeds, outputs[head]) for feeds, outputs in zip(batches, heads, strict=True)]


def _rows(feeds: Feeds) -> int:
    return int(next(iter(feeds.values())).shape[0])
