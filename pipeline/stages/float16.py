"""Float16 as the engine computes it: a faithful evaluation copy, the nodes that overflow, and their compute share.

ONNX Runtime's CPU provider has float16 kernels for almost nothing: it runs each float16 node in
float32 behind inserted Casts and then drops the cast pairs between nodes, so a float16 graph run
there never rounds or overflows between layers.  A strongly typed TensorRT engine stores every
float16 tensor as float16.  `faithful_copy` rewrites a float16 graph into a float32 one in which
every tensor that is float16 in the original passes through Cast(float16) -> Cast(float32): ONNX
Runtime keeps such a lossy pair (checked: 1e5 becomes inf, 0.1234567 becomes 0.12344), so each
tensor carries exactly the float16 value the engine stores (rounding, overflow to inf), while each
op computes in float32 (as TensorRT's float16 kernels accumulate in float32).

`overflowing_nodes` runs the FP32 graph with every intermediate tensor exposed and names the nodes
that float16 cannot hold: an output beyond FP16_SAFE, or an internal statistic that overflows
(the variance of a LayerNormalization, the sum inside a ReduceMean).  The runs are labelled cases (the
reference inputs, then the calibration data when given); only each tensor's running maximum and the case
that set it are kept, so a scan over many batches holds one run's tensors at a time.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..core.compute import multiply_adds

FP16_MAX = 65504.0
# Kept in FP32 above a quarter of float16's range: two bits of headroom for inputs larger than the
# reference data (ModelOpt AutoCast keeps anything beyond 512, which leaves most of a graph in FP32).
FP16_SAFE = FP16_MAX / 4
# Ops whose float16 kernel squares or sums its input internally, where the output does not show it.
SQUARING_OPS = ("LayerNormalization", "GroupNormalization", "InstanceNormalization", "ReduceSumSquare", "ReduceL2")
SUMMING_OPS = ("ReduceMean",)


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


# --------------------------------------------------------------------------- the faithful copy


def faithful_copy(fp16_model: onnx.ModelProto) -> onnx.ModelProto:
    """A float32 graph storing every float16 tensor of `fp16_model` as float16 (see the module docstring)."""
    model = onnx.ModelProto()
    model.CopyFrom(fp16_model)
    float16 = _float16_tensors(model)
    graph = model.graph
    for initializer in graph.initializer:
        if initializer.data_type == TensorProto.FLOAT16:
            value = numpy_helper.to_array(initializer).astype(np.float32)  # exact: float16 widens losslessly
            initializer.CopyFrom(numpy_helper.from_array(value, initializer.name))
    nodes = []
    for node in graph.node:
        _float32_attributes(node)
        rounded = [name for name in node.output if name in float16]
        for name in rounded:
            node.output[list(node.output).index(name)] = f"{name}__float32"
        nodes.append(node)
        for name in rounded:  # the value the engine stores: float16, then read back as float32
            nodes.append(helper.make_node("Cast", [f"{name}__float32"], [f"{name}__float16"], to=TensorProto.FLOAT16))
            nodes.append(helper.make_node("Cast", [f"{name}__float16"], [name], to=TensorProto.FLOAT))
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.value_info[:]
    return model


def _float16_tensors(model: onnx.ModelProto) -> set[str]:
    """Names of the node outputs that are float16 (from shape inference on the float16 graph)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    typed = [*inferred.graph.value_info, *inferred.graph.output]
    return {value.name for value in typed if value.type.tensor_type.elem_type == TensorProto.FLOAT16}


def _float32_attributes(node: onnx.NodeProto) -> None:
    """Constants and Cast targets of float16 become float32 (the pair after the node does the rounding)."""
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_type == TensorProto.FLOAT16:
            value = numpy_helper.to_array(attribute.t).astype(np.float32)
            attribute.t.CopyFrom(numpy_helper.from_array(value, attribute.t.name))
        elif node.op_type == "Cast" and attribute.name == "to" and attribute.i == TensorProto.FLOAT16:
            attribute.i = TensorProto.FLOAT


def faithful_session(fp16_path: Path):
    """An ONNX Runtime session over the faithful copy of the float16 graph at `fp16_path`."""
    from ..core.sessions import onnxruntime_session

    with tempfile.TemporaryDirectory(prefix="faithful-fp16.") as folder:
        copy = Path(folder) / "faithful.onnx"
        onnx.save(faithful_copy(onnx.load(str(fp16_path))), str(copy))
        return onnxruntime_session(copy)  # the session holds the graph in memory; the file can go


# --------------------------------------------------------------------------- every tensor of a run


def run_exposing_tensors(
    model: onnx.ModelProto, feeds: dict[str, np.ndarray], *, simulate_qdq: bool = False
) -> dict[str, np.ndarray]:
    """Every float tensor a graph computes (node outputs, graph inputs), by name, for one run.
    simulate_qdq: Q/DQ run as TensorRT computes them (pipeline.core.sessions), for the TensorRT-shaped INT8 graph."""
    return _ExposingSession(model, simulate_qdq=simulate_qdq).run(feeds)


class _ExposingSession:
    """An ONNX Runtime session over a copy of the graph whose outputs are all its float node outputs; made
    once for many runs (a session per run costs more than the run on a small graph)."""

    def __init__(self, model: onnx.ModelProto, *, simulate_qdq: bool = False) -> None:
        from ..core.sessions import onnxruntime_session

        exposed = onnx.ModelProto()
        exposed.CopyFrom(model)
        inferred = onnx.shape_inference.infer_shapes(exposed)
        known = {value.name: value for value in [*inferred.graph.value_info, *inferred.graph.output]}
        present = {output.name for output in exposed.graph.output}
        for node in exposed.graph.node:
            for name in node.output:
                value = known.get(name)
                if value is not None and name not in present and value.type.tensor_type.elem_type == TensorProto.FLOAT:
                    exposed.graph.output.append(value)
                    present.add(name)
        with tempfile.TemporaryDirectory(prefix="exposed.") as folder:
            path = Path(folder) / "exposed.onnx"
            onnx.save(exposed, str(path))
            self.session = onnxruntime_session(path, simulate_qdq=simulate_qdq)
        self.names = [output.name for output in self.session.get_outputs()]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {**feeds, **dict(zip(self.names, self.session.run(self.names, feeds), strict=True))}


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
    def of_runs(cls, model: onnx.ModelProto, cases: Iterable[Case]) -> TensorStats:
        """Run each case; only magnitudes are kept between runs."""
        session = _ExposingSession(model)
        shapes: dict[str, tuple[int, ...]] = {}
        by_case: dict[str, dict[str, float]] = {}
        for case in cases:
            magnitudes = by_case.setdefault(case.label, {})
            for name, value in session.run(case.feeds).items():
                shapes.setdefault(name, tuple(value.shape))
                if value.dtype.kind == "f":  # token ids and indices are never float16
                    magnitudes[name] = max(magnitudes.get(name, 0.0), _max_abs(value))
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
