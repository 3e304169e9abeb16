"""SmoothQuant-style per-channel smoothing (Xiao et al. 2022, arXiv 2211.10438), applied to the FP32 graph
before calibration.

INT8 activations are per-tensor here (TensorRT's rule): one scale for a whole tensor.  A trained transformer's
LayerNorm outputs carry a few channels tens of times larger than the rest, so that one scale leaves the other
channels a handful of int8 levels.  Smoothing divides each input channel j of such an activation X by s_j and
multiplies row j of the weights it meets by s_j: X·W = (X / s)·(s·W) exactly in real arithmetic, while X / s
has flat channels and the weights (per-channel, one scale per output channel) absorb the spread.

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

max|X_j| over the calibration data along X's last axis, raised to QUIET_FLOOR times the tensor's median channel
maximum, max|W_j| over row j of every weight X meets (Q, K and V share one X, so one s for the three).  The graph
gets one `Mul(X, 1/s)` that feeds those MatMul/Gemm nodes only (a residual Add that reads X still reads X); Conv
inputs are never smoothed.

TensorRT: that it fuses this per-channel Mul into the QuantizeLinear after it (a pointwise op before a Q) is an
assumption, not found in its documentation; if it does not, the Mul runs as one more float pointwise kernel, and
the result is the same.  Measured: docs/benchmarks/int8-encoder.md.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.external_data_helper import uses_external_data

from ..pipeline.folder.graph_files import initializer_array
from ..pipeline.folder.onnx_wire import Convert
from .parallel import per_tensor
from .readers import Feed

# s is kept within these bounds: a channel that is zero over the whole calibration set (or a weight row of zeros)
# would otherwise get s = 0 or inf; a spread of 1e4 either way is far beyond what any measured outlier needs.
SCALE_BOUNDS = (1e-4, 1e4)
FLOOR = 1e-6  # max|X_j| and max|W_j| below this count as this: dead channels get a finite s
# Smoothing tames the outlier channels only: a channel's max|X_j| below QUIET_FLOOR times the tensor's median channel
# maximum counts as that, so the quiet channels keep their sizes relative to each other instead of being scaled up
# to the outliers' level.  Why: a quiet channel's calibrated maximum is the least known number of a small or narrow
# set, and scaling it up by max^-alpha leaves it no headroom.  all-MiniLM-L6-v2 calibrated on 64 templated
# sentences, judged on 128 docstring sentences no set contains (max ranges, alpha 0.9; cosine min / mean): no floor
# 0.855 / 0.939 (prose reaches past the templated maxima and clips), 1x 0.960 / 0.982, 3x 0.990 / 0.997, 4x
# 0.994 / 0.996, 8x 0.982 / 0.993, 16x 0.963 / 0.986; calibrated on 64 docstring sentences: no floor 0.991 / 0.997,
# 3x 0.992 / 0.996, 4x 0.988 / 0.994, 6x 0.980 / 0.989 (ranges and scales fit on all 64 rows, no bias correction).
# 3x: the best of the two sets taken together.  The held-out rows of a templated set cannot choose it (they are as
# narrow as the rest), so it is a rule, not a candidate.
QUIET_FLOOR = 3.0
_GRAPH_ATTRIBUTES = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


@dataclass(frozen=True)
class Consumer:
    """A MatMul/Gemm reading X as its first operand with a constant 2-D weight: its place in the node list, its
    name, and `rows_axis`, the weight's axis indexed by X's channels (0 for MatMul and Gemm, 1 with transB)."""

    index: int
    node: str
    weight: str
    rows_axis: int


def smoothable(model: onnx.ModelProto) -> dict[str, list[Consumer]]:
    """{activation X: the MatMul/Gemm nodes that read it with constant 2-D weights}, in graph order."""
    weights = {init.name: init for init in model.graph.initializer if len(init.dims) == 2}
    inputs = {value.name for value in model.graph.input}  # an initializer that is also an input can be fed
    groups: dict[str, list[Consumer]] = defaultdict(list)
    for index, node in enumerate(model.graph.node):
        if node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2:
            continue
        activation, weight = node.input[0], node.input[1]
        if weight not in weights or weight in inputs or activation in weights:
            continue
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attributes.get("transA", 0):  # X's channels are then its first axis, not its last
            continue
        groups[activation].append(Consumer(index, node.name, weight, 1 if attributes.get("transB", 0) else 0))
    return dict(groups)


class ChannelMaxima:
    """max |X_j| per channel of each tensor's last axis, batch by batch (a statistic of calibration/ranges.py's
    pass), from the tensors or from their maxima over the other axes (pipeline/evaluation/tensors.py
    channel_maxima: the same rule on those gives them back)."""

    def __init__(self, tensors: Sequence[str]) -> None:
        self.tensors = list(tensors)
        self.maxima: dict[str, np.ndarray] = {}

    def add(self, values: Feed, rows: int) -> None:
        read = {name: values[name] for name in self.tensors if name in values}  # a batch may come in parts
        for name, batch_max in per_tensor(_channel_maxima, read).items():
            self.maxima[name] = np.maximum(self.maxima[name], batch_max) if name in self.maxima else batch_max


def _channel_maxima(name: str, value: np.ndarray) -> np.ndarray:
    absolute = np.abs(np.asarray(value, dtype=np.float32))
    return absolute.reshape(-1, absolute.shape[-1]).max(axis=0)


def smoothing_scales(
    model: onnx.ModelProto,
    groups: dict[str, list[Consumer]],
    maxima: dict[str, np.ndarray],
    alpha: float,
    base: Path = Path(),
) -> dict[str, np.ndarray]:
    """s per tensor: max|X_j|^alpha / max|W_j|^(1 - alpha), W_j over every consumer's row j, within SCALE_BOUNDS,
    max|X_j| no lower than QUIET_FLOOR times the median channel's.  The weights are read one at a time, from
    `model` or, for those it references (graph_without_weights), from their files under `base`."""
    initializers = {init.name: init for init in model.graph.initializer}
    scales = {}
    for tensor, consumers in groups.items():
        rows = [np.abs(initializer_array(initializers[c.weight], base)).max(axis=1 - c.rows_axis) for c in consumers]
        weight_max = np.max(np.stack(rows), axis=0).astype(np.float64)
        activation_max = maxima[tensor].astype(np.float64)
        activation_max = np.maximum(activation_max, QUIET_FLOOR * np.median(activation_max))
        s = np.maximum(activation_max, FLOOR) ** alpha / np.maximum(weight_max, FLOOR) ** (1 - alpha)
        scales[tensor] = np.clip(s, *SCALE_BOUNDS).astype(np.float32)
    return scales


def smooth_graph(model: onnx.ModelProto, scales: dict[str, np.ndarray]) -> tuple[onnx.ModelProto, dict[str, Convert]]:
    """A copy of `model` with each tensor X of `scales` divided by s (one Mul feeding its MatMul/Gemm consumers)
    and those consumers' weight rows multiplied by s (equal to `model` in exact arithmetic), and {weight: its
    scaling} for the weights it references on disk (graph_without_weights), to apply as they are written
    (graph_files.write_graph): those are not read here.  The weights held in `model` are scaled in the copy."""
    smoothed = onnx.ModelProto()
    smoothed.CopyFrom(model)
    graph = smoothed.graph
    groups = smoothable(smoothed)
    on_disk: dict[str, Convert] = {}
    initializers = {init.name: init for init in graph.initializer}
    uses: dict[str, int] = defaultdict(int)
    for node in graph.node:
        for name in node.input:
            uses[name] += 1
    taken = {init.name for init in graph.initializer} | {out for node in graph.node for out in node.output}
    inserted: dict[int, onnx.NodeProto] = {}  # by the index of the first consumer: each Mul goes just before it
    # In graph order, not the order `scales` comes in (a cache's is sorted): the same scales, the same graph bytes.
    for tensor in sorted(scales, key=list(groups).index):
        s, consumers = scales[tensor], groups[tensor]
        divided = _unique(f"{tensor}_smoothed", taken)
        inverse = _unique(f"{tensor}_smooth_inverse", taken)
        graph.initializer.append(numpy_helper.from_array((1.0 / s).astype(np.float32), inverse))
        mul = helper.make_node("Mul", [tensor, inverse], [divided], name=_unique(f"{tensor}_smooth", taken))
        for consumer in consumers:
            node = graph.node[consumer.index]
            node.input[0] = divided
            node.input[1] = _scaled_weight(graph, initializers, uses, consumer, s, taken, on_disk)
        inserted[min(c.index for c in consumers)] = mul
    ordered = []
    for index, original in enumerate(graph.node):
        ordered += [inserted[index]] if index in inserted else []
        ordered.append(onnx.NodeProto())
        ordered[-1].CopyFrom(original)  # copied: clearing the list below detaches its elements
    del graph.node[:]
    graph.node.extend(ordered)
    return smoothed, on_disk


def smoothed_tensors(model: onnx.ModelProto, smoothed: Collection[str]) -> set[str] | None:
    """The tensors of `model` that smooth_graph computes otherwise where it smooths the tensors `smoothed` (its
    scales' keys): the outputs of the MatMul/Gemm nodes whose weights it scales, and everything computed from them.
    Every other tensor is computed there by the same node from the same inputs (the Mul it adds has a name of its
    own and feeds only those nodes).  None where `model` has subgraphs (If, Loop), which read outer tensors without
    naming them as inputs."""
    if any(attribute.type in _GRAPH_ATTRIBUTES for node in model.graph.node for attribute in node.attribute):
        return None
    groups = smoothable(model)
    changed = {model.graph.node[c.index].output[0] for tensor in smoothed for c in groups[tensor]}
    for node in model.graph.node:  # in graph order: ONNX lists a node after the nodes it reads
        if changed.intersection(node.input):
            changed.update(node.output)
    return changed


def smoothing_boundary(model: onnx.ModelProto, groups: dict[str, list[Consumer]]) -> list[str]:
    """The tensors of `model` that smoothing every tensor of `groups` leaves as they are and the part it changes
    reads: the smoothed activations (their Muls read them) and what the ops computed from the smoothed ones read
    besides ([] where smoothed_tensors cannot tell the part)."""
    changed = smoothed_tensors(model, groups)
    if changed is None:
        return []
    constants = {tensor.name for tensor in model.graph.initializer}
    read = [name for node in model.graph.node if changed.intersection(node.output) for name in node.input]
    return list(dict.fromkeys(name for name in [*groups, *read] if name and name not in changed | constants))


def smoothing_options(alpha: float | None) -> dict:
    """The smoothing rule's constants a cache key covers and the manifest records ({} when not smoothed)."""
    return {"smooth_quiet_floor": QUIET_FLOOR} if alpha is not None else {}


def smoothing_record(groups: dict[str, list[Consumer]], scales: dict[str, np.ndarray], alpha: float) -> dict:
    """What the manifest records: alpha and, per smoothed tensor, its consumers and the range of s."""
    return {
        "alpha": alpha,
        "tensors": {
            tensor: {
                "consumers": [c.node for c in groups[tensor]],
                "channels": int(s.size),
                "scale_min": round(float(s.min()), 6),
                "scale_max": round(float(s.max()), 6),
            }
            for tensor, s in scales.items()
        },
    }


def _scaled_weight(
    graph, initializers, uses, consumer: Consumer, s: np.ndarray, taken: set[str], on_disk: dict[str, Convert]
) -> str:
    """The weight's input rows times s: in place when this node is its only reader, else as a new initializer (on
    disk: a reference to the same bytes, scaled as written, by `on_disk`)."""
    target = initializers[consumer.weight]
    if uses[consumer.weight] > 1:  # other nodes read it as it is: this one gets a copy
        uses[consumer.weight] -= 1
        graph.initializer.append(target)
        target = graph.initializer[-1]
        target.name = _unique(f"{consumer.weight}_smoothed", taken)
    name, dims = target.name, tuple(target.dims)
    if uses_external_data(target):
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(target.data_type))
        on_disk[name] = lambda raw, start: _rows_times(
            np.frombuffer(raw, dtype), start // dtype.itemsize, s, consumer.rows_axis, dims
        ).tobytes()
    else:
        values = numpy_helper.to_array(target)
        scaled = _rows_times(values.reshape(-1), 0, s, consumer.rows_axis, dims).reshape(dims)
        target.CopyFrom(numpy_helper.from_array(scaled, name))
    return name


def _rows_times(values: np.ndarray, first: int, s: np.ndarray, rows_axis: int, dims: tuple[int, ...]) -> np.ndarray:
    """A run of a 2-D weight's elements (row-major, from element `first`: a block of a large one) with each times the
    s of its input row (the weight's `rows_axis`), computed in float32, in the weight's own type.  The run is cut
    into the rest of its first row, whole rows and the start of its last, each scaled by broadcasting (an index per
    element took 2.2 s of the 0.6 GB MLP's int8 stage)."""
    scaled = values.astype(np.float32)  # a copy: `values` may be a read-only view of the file's bytes
    columns = dims[1]
    row, column = divmod(first, columns)
    head = min(scaled.size, (columns - column) % columns)  # the elements left in the first row
    whole = (scaled.size - head) // columns
    parts = [
        (scaled[:head], row, column),
        (scaled[head : head + whole * columns].reshape(whole, columns), row + bool(head), 0),
        (scaled[head + whole * columns :], row + bool(head) + whole, 0),
    ]
    for part, at_row, at_column in parts:
        if not part.size:
            continue
        if part.ndim == 2:
            part *= s[None, :] if rows_axis == 1 else s[at_row : at_row + part.shape[0], None]
        else:  # within one row, from `at_column`
            part *= s[at_column : at_column + part.size] if rows_axis == 1 else s[at_row]
    return scaled.astype(values.dtype, copy=False)


def _unique(name: str, taken: set[str]) -> str:
    candidate, count = name, 0
    while candidate in taken:
        count += 1
        candidate = f"{name}_{count}"
    taken.add(candidate)
    return candidate
