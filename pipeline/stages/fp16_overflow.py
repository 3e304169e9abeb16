"""What float16 cannot hold: the nodes that overflow, and their compute share (the FP16 stage's scan).

`overflowing_nodes` runs the FP32 graph with every intermediate tensor exposed and names the nodes that float16 cannot
hold: an output beyond FP16_SAFE, or an internal statistic that overflows (the variance of a LayerNormalization, the
sum inside a ReduceMean).  The runs are labelled cases (the reference inputs, then the calibration data when given);
only each tensor's running maximum and the case that set it are kept, so a scan over many batches holds one run's
tensors at a time.  (How a float16 graph is judged, as the engine stores it: pipeline/evaluation/float16.py.)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from ..core.compute import multiply_adds
from ..evaluation.tensors import ExposingSession

FP16_MAX = 65504.0
# Kept in FP32 above a quarter of float16's range: two bits of headroom for inputs larger than the
# reference data (ModelOpt AutoCast keeps anything beyond 512, which leaves most of a graph in FP32).
FP16_SAFE = FP16_MAX / 4
# Ops whose float16 kernel squares or sums its input internally, where the output does not show it.
SQUARING_OPS = ("LayerNormalization", "GroupNormalization", "InstanceNormalization", "ReduceSumSquare", "ReduceL2")
SUMMING_OPS = ("ReduceMean",)
# A run of the scan exposes every tensor of the graph at once: ViT-L/16 holds about 0.9 GB of them per row, 7 GB at
# the reference's batch 8.  Each case runs in slices of rows whose tensors stay under this (rows are independent in
# inference, so every tensor's maximum over the case is the same).
EXPOSED_BYTES = 512 * 2**20


@dataclass(frozen=True)
class KeptNode:
    """A node that stays FP32 in the float16 graph, and why."""

    name: str
    op_type: str
    reason: str
    max_abs: float
    seen_in: str | None = None  # the case whose run reached max_abs (Case.label); None for --keep-fp32

    def as_record(self) -> dict:
        return {
            "node": self.name,
            "op": self.op_type,
            "reason": self.reason,
            "max_abs": self.max_abs,
            "seen_in": self.seen_in,
        }


@dataclass(frozen=True)
class Case:
    """One run of a graph: its inputs, the data they come from ("reference", "calibration") and a label naming
    them within it ("reference case 2 (batch 8)", "calibration rows 16-23"), unique over a scan."""

    source: str
    label: str
    feeds: dict[str, np.ndarray]


# --------------------------------------------------------------------------- what float16 cannot hold


@dataclass(frozen=True)
class TensorStats:
    """Each float tensor's largest finite magnitude over some runs and the case that reached it, each case's own
    maxima, and each tensor's shape in the first run."""

    max_abs: dict[str, float]
    shapes: dict[str, tuple[int, ...]]
    seen: dict[str, str]  # tensor name -> label of the case whose run reached max_abs
    by_case: dict[str, dict[str, float]]  # case label -> {tensor name: its largest magnitude in that run}

    @classmethod
    def of_runs(cls, model: onnx.ModelProto, cases: Iterable[Case], *, weights: Path | None = None) -> TensorStats:
        """Run each case; only magnitudes are kept between runs.  weights: the folder `model`'s weight references are
        relative to (a graph read without its weights: pipeline.evaluation.tensors)."""
        session = ExposingSession(model, weights=weights)
        shapes: dict[str, tuple[int, ...]] = {}
        by_case: dict[str, dict[str, float]] = {}
        rows_per_run = 1  # until the first run has measured what one row's tensors take
        for case in cases:
            magnitudes = by_case.setdefault(case.label, {})
            start, rows = 0, _rows(case.feeds)
            while start < rows:
                feeds = {name: value[start : start + rows_per_run] for name, value in case.feeds.items()}
                values = session.run(feeds)
                for name, value in values.items():
                    shapes.setdefault(name, tuple(value.shape))
                    if value.dtype.kind == "f":  # token ids and indices are never float16
                        magnitudes[name] = max(magnitudes.get(name, 0.0), _max_abs(value))
                start, rows_per_run = start + _rows(feeds), _rows_per_run(values, _rows(feeds))
                del values  # before the next run: one run's tensors at a time
        max_abs: dict[str, float] = {}
        seen: dict[str, str] = {}
        for label, magnitudes in by_case.items():  # in run order: the first case to reach a maximum names it
            for name, largest in magnitudes.items():
                if name not in max_abs or largest > max_abs[name]:
                    max_abs[name], seen[name] = largest, label
        return cls(max_abs, shapes, seen, by_case)

    def largest_cases(self, labels: list[str], count: int) -> list[str]:
        """Up to `count` of `labels` whose activations come nearest the largest of them, tensor by tensor (each
        run's max |x| over the largest run's, summed over the tensors; ties to the earlier case): the data where
        float16 is likeliest to overflow.  A tensor the inputs do not move (a constant, a shape) does not count."""
        score = dict.fromkeys(labels, 0.0)
        for name in self.max_abs:
            reached = {label: self.by_case[label][name] for label in labels if name in self.by_case[label]}
            largest = max(reached.values(), default=0.0)
            if len(set(reached.values())) > 1 and largest > 0:
                for label, value in reached.items():
                    score[label] += value / largest
        return sorted(labels, key=lambda label: -score[label])[:count]


def overflowing_nodes(fp32_model: onnx.ModelProto, stats: TensorStats) -> list[KeptNode]:
    """The nodes of the FP32 graph whose values float16 cannot hold."""
    kept = []
    for node in fp32_model.graph.node:
        reason = _overflow_reason(node, stats)
        if reason is not None:
            why, magnitude, tensor = reason
            kept.append(KeptNode(node.name, node.op_type, why, magnitude, stats.seen.get(tensor)))
    return kept


def _overflow_reason(node: onnx.NodeProto, stats: TensorStats) -> tuple[str, float, str] | None:
    """Why float16 cannot run this node, with the magnitude that says so and the tensor it was seen on, or None.

    A node that reads a value beyond the range stays FP32 too: a float16 node there would cast it to
    inf on the way in.
    """
    for side, names in (("output", node.output), ("input", node.input)):
        measured = [name for name in names if name in stats.max_abs]
        tensor = max(measured, key=stats.max_abs.__getitem__, default=None)
        largest = stats.max_abs[tensor] if tensor is not None else 0.0
        if tensor is not None and largest > FP16_SAFE:
            why = f"its {side} reaches {largest:.3g}, beyond {FP16_SAFE:.0f} (float16 max {FP16_MAX:.0f})"
            return why, largest, tensor
    if not node.input or node.input[0] not in stats.max_abs or not node.output:
        return None
    source = stats.max_abs[node.input[0]]
    if node.op_type in SQUARING_OPS and source**2 > FP16_SAFE:
        return f"its input reaches {source:.3g}, whose square overflows inside the op", source, node.input[0]
    if node.op_type in SUMMING_OPS and node.output[0] in stats.shapes:
        summed = int(np.prod(stats.shapes[node.input[0]])) / max(int(np.prod(stats.shapes[node.output[0]])), 1)
        total = float(stats.max_abs[node.output[0]] * summed)
        if total > FP16_SAFE:
            return f"the sum inside it reaches {total:.3g}", total, node.output[0]
    return None


def _rows_per_run(values: dict[str, np.ndarray], rows: int) -> int:
    """The rows the next run may take: EXPOSED_BYTES over what a row's tensors took in this run of `rows` rows."""
    return max(1, int(EXPOSED_BYTES * rows // max(sum(value.nbytes for value in values.values()), 1)))


def _rows(feeds: dict[str, np.ndarray]) -> int:
    return len(next(iter(feeds.values())))


def _max_abs(value: np.ndarray) -> float:
    finite = value[np.isfinite(value)] if value.dtype.kind == "f" else value
    return float(np.max(np.abs(finite))) if finite.size else 0.0


def fp32_compute_share(fp32_model: onnx.ModelProto, stats: TensorStats, kept: set[str]) -> float:
    """The share of the graph's multiply-adds (Conv, MatMul, Gemm; one per output element elsewhere) in `kept`."""
    weights = {init.name: tuple(init.dims) for init in fp32_model.graph.initializer}
    shapes = {**stats.shapes, **weights}
    costs = {node.name: multiply_adds(node, shapes) for node in fp32_model.graph.node}
    total = sum(costs.values())
    return sum(cost for name, cost in costs.items() if name in kept) / total if total else 0.0
