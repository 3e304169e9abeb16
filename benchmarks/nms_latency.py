"""The NMS subgraph (pipeline/postprocess/nms_graph.py) alone in ONNX Runtime's CPU provider: latency per batch.

The head is YOLOv8's at 640x640: [batch, 4 + 80, 8400].  Each image holds 0 to 40 objects, each seen by 30
anchors whose boxes jitter around it (scores falling off from the object's), over a background that scores below
0.01: what a trained detector's head gives NMS to thin, chains of overlaps included.  The graph is the head
(an Identity) with NMS appended, so the latency is NMS's alone.  Also written: how many passes the greedy Loop
took per batch (it runs until nothing changes, so passes depend on the data; counted by the same iteration in
numpy), and whether the graph's detections equal the reference NMS's on every batch.

    .venv/bin/python benchmarks/nms_latency.py --out docs/benchmarks/nms-latency

Writes <out>.json and <out>.md with the CPU's model and instruction sets and the load average (a shared
machine's neighbours show in the spread between rounds).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import sys
from pathlib import Path

import numpy as np
import onnxruntime
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trt_pipeline.pipeline.bench.timing import TimingPolicy, measure, round_spread, summarize  # noqa: E402
from trt_pipeline.pipeline.core.cpu import cpu_instruction_sets, cpu_model, instruction_sets_text  # noqa: E402
from trt_pipeline.pipeline.core.nms_config import NmsConfig  # noqa: E402
from trt_pipeline.pipeline.core.sessions import onnxruntime_session  # noqa: E402
from trt_pipeline.pipeline.postprocess.nms import decode, reference_nms  # noqa: E402
from trt_pipeline.pipeline.postprocess.nms_graph import append_nms  # noqa: E402

CLASSES, ANCHORS = 80, 8400  # YOLOv8 at 640x640: 80x80 + 40x40 + 20x20 cells
IMAGE = 640.0


def detector_heads(batch: int, seed: int = 0) -> np.ndarray:
    """[batch, 84, 8400] heads as described in the module doc."""
    rng = np.random.default_rng([seed, batch])
    head = np.empty((batch, 4 + CLASSES, ANCHORS), np.float32)
    head[:, :2] = rng.uniform(0, IMAGE, (batch, 2, ANCHORS))
    head[:, 2:4] = rng.uniform(8, 160, (batch, 2, ANCHORS))
    head[:, 4:] = rng.uniform(0, 0.01, (batch, CLASSES, ANCHORS))
    for image in head:
        for _ in range(int(rng.integers(0, 41))):
            _object(image, rng)
    return head


def _object(image: np.ndarray, rng: np.random.Generator) -> None:
    centre, size = rng.uniform(40, IMAGE - 40, 2), rng.uniform(20, 200, 2)
    anchors = rng.choice(ANCHORS, 30, replace=False)
    jitter = rng.normal(0, 0.12, (2, 30))
    image[0:2, anchors] = centre[:, None] + jitter * size[:, None]
    image[2:4, anchors] = size[:, None] * np.exp(rng.normal(0, 0.15, (2, 30)))
    falloff = np.exp(-np.sum(jitter**2, axis=0) / 0.02)
    image[4 + int(rng.integers(CLASSES)), anchors] = rng.uniform(0.3, 0.95) * falloff


def loop_passes(head: np.ndarray, config: NmsConfig) -> int:
    """The passes the graph's Loop makes on this batch: the fixed-point iteration of nms_graph's module doc, from
    keep = valid until nothing changes, over every image at once (the Loop stops when no image changes)."""
    boxes, scores, classes = decode(head, config.box_format)
    passes = 0
    for b in range(len(head)):
        order = np.argsort(-scores[b], kind="stable")[: config.candidates]
        valid = scores[b][order] > np.float32(config.score_threshold)
        suppresses = _suppression(boxes[b][order], classes[b][order], config)
        keep, changed, count = valid, True, 0
        while changed:
            new = valid & ~(keep @ suppresses)
            changed, keep, count = bool((new != keep).any()), new, count + 1
        passes = max(passes, count)
    return passes


def _suppression(boxes: np.ndarray, classes: np.ndarray, config: NmsConfig) -> np.ndarray:
    """[M, M] bool: i before j, overlapping (and of one class, when class-aware)."""
    low = np.maximum(boxes[:, None, :2], boxes[None, :, :2])
    high = np.minimum(boxes[:, None, 2:], boxes[None, :, 2:])
    sides = np.maximum(high - low, np.float32(0))
    intersection = sides[..., 0] * sides[..., 1]
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    t = np.float32(config.iou_threshold)
    overlap = intersection * np.float32(1 + config.iou_threshold) > (t * area)[:, None] + (t * area)[None, :]
    size = len(boxes)
    result = overlap & np.triu(np.ones((size, size), bool), 1)
    return result & (classes[:, None] == classes[None, :]) if config.class_aware else result


def head_graph():
    node = helper.make_node("Identity", ["head_in"], ["head"])
    shape = ["batch", 4 + CLASSES, ANCHORS]
    graph = helper.make_graph(
        [node],
        "head",
        [helper.make_tensor_value_info("head_in", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("head", TensorProto.FLOAT, shape)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def bench(config: NmsConfig, batches: list[int], policy: TimingPolicy) -> list[dict]:
    session = onnxruntime_session(append_nms(head_graph(), config).SerializeToString())
    rows = []
    for batch in batches:
        head = detector_heads(batch)
        outputs = session.run(None, {"head_in": head})
        expected = reference_nms(head, config).as_outputs()
        exact = all(np.array_equal(a, b) for a, b in zip(outputs, expected.values(), strict=True))
        rounds = _timed_rounds(session, {"head_in": head}, policy)
        stats = summarize([s for samples in rounds for s in samples], batch)
        rows.append({
            "candidates": config.candidates,
            "batch": batch,
            "p50_ms": round(stats.p50_ms, 2),
            "p90_ms": round(stats.p90_ms, 2),
            "per_image_ms": round(stats.p50_ms / batch, 2),
            "samples": stats.samples,
            "round_spread": round(round_spread(rounds)["spread"], 3),
            "loop_passes": loop_passes(head, config),
            "kept_mean": float(expected["count"].mean()),
            "equals_reference": exact,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,  # so far in the process
        })  # fmt: skip
    return rows


def _timed_rounds(session, feed: dict, policy: TimingPolicy) -> list[list[float]]:
    """Seconds per session.run, in policy.rounds rounds (their medians' spread shows a busy neighbour)."""
    return [measure(lambda: session.run(None, feed), lambda: None, policy.share(i)) for i in range(policy.rounds)]


def report_markdown(record: dict) -> str:
    lines = [
        "# NMS in the graph: ONNX Runtime CPU latency",
        "",
        f"Measured {record['measured']} on {record['cpu']} ({record['instruction_sets']}), {record['cores']} cores "
        f"usable, load average {record['load_average']} (a shared machine), onnxruntime {record['onnxruntime']} "
        f"(its default threads).  Command: `{record['command']}`",
        "",
        f"Head [batch, 84, 8400] (YOLOv8 at 640x640), K = {record['max_detections']} detections per image, "
        "score > 0.25, IoU > 0.45, class-aware.  p50/p90 of one session.run of the NMS subgraph alone; loop passes: "
        "how many times the greedy Loop ran (until nothing changed); equals reference: the graph's outputs are "
        "bit-identical to the numpy reference NMS (pipeline/postprocess/nms.py); peak RSS: the process's so far "
        "(rows run in this order, so each is at least the one before).",
        "",
        "| candidates | batch | p50 ms | p90 ms | p50 ms per image | round spread | loop passes | kept per image "
        "| equals reference | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        lines.append(
            f"| {row['candidates']} | {row['batch']} | {row['p50_ms']} | {row['p90_ms']} | {row['per_image_ms']} | "
            f"{row['round_spread']} | {row['loop_passes']} | {row['kept_mean']:.1f} | {row['equals_reference']} | "
            f"{row['peak_rss_mib']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="writes <out>.json and <out>.md")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--candidates", type=int, nargs="+", default=[300, 1000])
    parser.add_argument("--max-detections", type=int, default=100)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--budget-s", type=float, default=20.0)
    args = parser.parse_args()
    policy = TimingPolicy(warmup=3, iterations=args.iterations, budget_s=args.budget_s, rounds=3).check()
    rows = []
    for candidates in args.candidates:
        config = NmsConfig(candidates=candidates, max_detections=args.max_detections)
        rows += bench(config, args.batches, policy)
    isa = cpu_instruction_sets()
    record = {
        "measured": datetime.date.today().isoformat(),
        "cpu": cpu_model(),
        "instruction_sets": instruction_sets_text(isa),
        "isa": isa,
        "cores": len(os.sched_getaffinity(0)),
        "load_average": [round(v, 2) for v in os.getloadavg()],
        "onnxruntime": onnxruntime.__version__,
        "max_detections": args.max_detections,
        "command": "python benchmarks/nms_latency.py " + " ".join(sys.argv[1:]),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(report_markdown(record))
    print(report_markdown(record))


if __name__ == "__main__":
    main()
