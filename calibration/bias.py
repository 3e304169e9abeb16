"""Empirical bias correction (Nagel et al. 2019, "Data-Free Quantization Through Weight Equalization and Bias
Correction", arXiv 1906.04721, section 4.2), applied to the FP32 graph a Q/DQ graph is made from.

Rounding a weight to int8 moves each output channel o of a Conv/Gemm by sum_i (W_q - W)[o, i] * x_i, and over data
whose inputs have a non-zero mean (a ReLU6's output: all of them) that is a systematic shift, E[x_i] times the
rounding error summed over the kernel.  Subtracting (W_q - W) · E[x] from the op's float bias removes that shift
exactly in expectation; TensorRT reads the bias in float (the Q/DQ graph quantizes no bias), so the correction
costs nothing at run time.  W_q is read from the Q/DQ graph itself (ONNX Runtime's own rounding and scales) and
E[x] is measured on the fit rows, one mean per input channel (over batch and space: the padded border is ignored).

On EfficientNet-Lite0 the first block's depthwise conv is where the held-out error starts: its 3x3 kernels are
high-pass filters whose taps (up to 17.7) nearly cancel, so each tap's rounding error is large beside the output.
Quantizing its weights alone (its input in float) gives cosine min 0.933 on the held-out photos; with this
correction 0.9955 (its input alone quantized: 0.9949).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..pipeline.core.sessions import file_key
from ..pipeline.folder.artifacts import temporary_name
from ..pipeline.folder.graph_files import graph_without_weights, initializer_array, write_graph
from .parallel import per_tensor
from .quantizable import quantizable_graph
from .readers import Feed

CORRECTED_OPS = ("Conv", "Gemm", "MatMul")  # a MatMul's bias is the constant of the one Add reading its output


def corrected_path(source: Path, kind: str | None) -> Path:
    """Where the graph `source` with its biases corrected goes (for the engine's graph, kind None, a kind of CPU's,
    or the float search's): beside it, where write_graph references the weights it keeps (none copied: onnx loads
    no external data out of the graph's folder, nor through a link), under this process's temporary name for
    _corrected_name(kind).  In the scratch it goes with the scratch; beside the artifact folder's FP32 graph
    (candidates without smoothing calibrate from it where it has a data file: past 2 GB) the INT8 stage deletes
    it, and the next build a killed run's.  A copy in the scratch took the weights twice over on a 2.4 GB MLP."""
    return source.parent / temporary_name(source.parent / _corrected_name(kind))


def _corrected_name(kind: str | None) -> str:
    return f"model.calibrated.corrected{f'-{kind}' if kind else ''}.onnx"


class WeightRounding(Protocol):
    """{weight name: its rounded values, dequantized, in float64}, for the weights a quantized graph rounds, and
    what identifies a weight's rounding (equal for equal rounded values: BiasShifts' key)."""

    def __contains__(self, weight: str) -> bool: ...

    def __getitem__(self, weight: str) -> np.ndarray: ...

    def identity(self, weight: str) -> str: ...


class BiasShifts:
    """Each op's output shift (W_q - W) · E[x] once computed, by all it is computed from: the FP32 graph file, the op,
    its weight's rounding (WeightRounding.identity) and its input's means.  The candidates of one smoothing alpha
    round their weights alike (calibration/qdq_write.py QuantizedWeights) and share the means, and the kept
    candidate's FP32 graph and the float search's tries correct the same ops again: a shift is computed once, not
    up to five times (each time the weight and its rounding read from disk, both in float64)."""

    def __init__(self) -> None:
        self._shifts: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}  # key -> (its means, kept alive: the key
        self.computed = 0  # holds their id), shift; how many shifts were computed, not found

    def shift(self, key: tuple, mean: np.ndarray, compute: Callable[[], np.ndarray]) -> np.ndarray:
        """The shift for `key` and the means `mean`, computed by `compute` the first time."""
        full = (*key, id(mean))
        if full not in self._shifts:
            self._shifts[full] = (mean, compute())
            self.computed += 1
        return self._shifts[full][1]


def correct_biases(
    calibrated: Path,
    quantized: Path | WeightRounding,
    means: dict[str, np.ndarray],
    out_path: Path | None = None,
    *,
    skip: tuple[str, ...] = (),
    quantized_out: Path | None = None,
    shifts: BiasShifts | None = None,
) -> dict:
    """Write `calibrated` to `out_path` with each Conv/Gemm/MatMul's bias corrected for the int8 rounding of its
    weight in `quantized` (a Q/DQ graph made from `calibrated`: TensorRT's or a CPU graph, or the rounding of one's
    weights alone: qdq_cpu.Uint8Rounding) given `means` (ChannelMeans), but for the ops named in `skip` (kept in
    float: they round nothing); return {"ops": how many, "largest": the largest |correction|}.  quantized_out:
    write `quantized` (a graph) there with the same corrected biases, where it keeps its biases float (TensorRT's):
    the graph quantize_qdq makes of the corrected one (the same weights, the same ranges), without quantizing every
    weight again; with it alone (no `out_path`), no FP32 copy is written.  Both graphs' weights stay on disk: each
    is read when its op is corrected, and copied as the graphs are written.  shifts: the shifts computed already
    (by an earlier call on the same graph, weights and means), taken from there and added to it."""
    calibrated = Path(calibrated)
    model = quantizable_graph(calibrated)
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    qdq, rounded = _rounding(quantized)
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    largest, slots, file = 0.0, [], file_key(calibrated)
    shifts = shifts or BiasShifts()
    for index, node in enumerate(graph.node):
        slot = _bias_slot(node, readers, initializers)
        if slot is None or node.name in skip or node.input[0] not in means:
            continue
        if not _correctable(node, initializers, rounded):
            continue
        weight, mean = initializers[node.input[1]], means[node.input[0]]

        def compute(node=node, weight=weight, mean=mean) -> np.ndarray:
            error = rounded[weight.name]
            # In place, the float32 weight cast as it is read: one float64 copy of the weight, not two.
            np.subtract(error, initializer_array(weight, calibrated.parent), out=error)
            return _output_shift(node, error, mean)

        shift = shifts.shift((file, index, node.name, rounded.identity(weight.name)), mean, compute)
        largest = max(largest, float(np.abs(shift).max()))
        _add_to_bias(graph, *slot, node.input[1], initializers, readers, -shift, calibrated.parent)
        slots.append(slot)
    if quantized_out is not None:  # before `model` is written: writing points its tensors at its own data file
        assert isinstance(quantized, Path) and qdq is not None, "a Q/DQ graph is written from a Q/DQ graph"
        _copy_biases(slots, initializers, qdq.graph)
        write_graph(qdq, quantized.parent, quantized_out, scratch=True)
    if out_path is not None:
        write_graph(model, calibrated.parent, out_path, scratch=True)
    return {"ops": len(slots), "largest": round(largest, 6)}


def _rounding(quantized: Path | WeightRounding) -> tuple[onnx.ModelProto | None, WeightRounding]:
    """(the Q/DQ graph, without its weights, or None where `quantized` is a rounding alone; its weights' rounding)."""
    if not isinstance(quantized, Path):
        return None, quantized
    qdq = graph_without_weights(quantized)
    return qdq, DequantizedWeights(qdq, quantized.parent)


def weight_inputs(model: onnx.ModelProto) -> dict[str, int]:
    """{the input of every Conv/Gemm/MatMul that correct_biases may correct: its channel axis}."""
    initializers = {init.name for init in model.graph.initializer}
    return {
        node.input[0]: 1 if node.op_type == "Conv" else -1
        for node in model.graph.node
        if node.op_type in CORRECTED_OPS and node.input[0] not in initializers and node.input[1] in initializers
    }


class ChannelMeans:
    """The mean of each tensor per channel (along the axis `tensors` gives it) over the rows seen, batch by batch (a
    statistic of calibration/ranges.py's pass)."""

    def __init__(self, tensors: dict[str, int]) -> None:
        self.tensors, self._axes = list(tensors), tensors
        self._sums: dict[str, np.ndarray] = {}
        self._rows: dict[str, int] = {}  # by tensor: a pass gives a batch's tensors in parts

    def add(self, values: Feed, rows: int) -> None:
        def channel_mean(name: str, value: np.ndarray) -> np.ndarray:
            value = np.asarray(value, dtype=np.float64)
            axes = tuple(axis for axis in range(value.ndim) if axis != self._axes[name] % value.ndim)
            return value.mean(axis=axes) * rows  # weighted by rows: batches may differ in size

        for name, mean in per_tensor(channel_mean, {n: values[n] for n in self.tensors if n in values}).items():
            self._sums[name] = self._sums[name] + mean if name in self._sums else mean
            self._rows[name] = self._rows.get(name, 0) + rows

    def means(self) -> dict[str, np.ndarray]:
        return {name: total / self._rows[name] for name, total in self._sums.items()}


def _copy_biases(slots: list[tuple[onnx.NodeProto, int]], initializers: dict, qdq: onnx.GraphProto) -> None:
    """The corrected biases at `slots` (their holders' inputs) into the Q/DQ graph made from the same graph: each
    holder found there by its output (the quantizer renames the inputs it quantizes, not the outputs it leaves
    float), each bias by name (added where correct_biases added one); a bias this leaves unread is dropped, as the
    quantizer drops what nothing reads (it gave each reader of a shared bias a copy of its own)."""
    holders = {node.output[0]: node for node in qdq.node}
    present = {init.name: init for init in qdq.initializer}
    replaced = set()
    for holder, index in slots:
        bias, target = holder.input[index], holders[holder.output[0]]
        if len(target.input) > index:
            replaced.add(target.input[index])
            target.input[index] = bias
        else:
            target.input.append(bias)
        if bias in present:
            present[bias].CopyFrom(initializers[bias])
        else:
            qdq.initializer.append(initializers[bias])
            present[bias] = qdq.initializer[-1]
    read = {name for node in qdq.node for name in node.input} | {output.name for output in qdq.output}
    for name in replaced - read:
        if name in present:
            qdq.initializer.remove(present[name])


class DequantizedWeights:
    """{FP32 weight name: its int8 value times its scales}, read from the Q/DQ graph's weight DequantizeLinears
    (ONNX Runtime names the int8 initializer `<weight>_quantized`; a quantized bias lands here too, unread), each
    computed when asked for, from `qdq` or from the files under `base` it references (graph_without_weights): all
    of them at once, in float64, would hold twice the FP32 weights' bytes."""

    def __init__(self, qdq: onnx.ModelProto, base: Path) -> None:
        self._initializers = {init.name: init for init in qdq.graph.initializer}
        self._base = base
        self._nodes = {
            node.input[0].removesuffix("_quantized"): node
            for node in qdq.graph.node
            if node.op_type == "DequantizeLinear" and node.input[0] in self._initializers
        }

    def __contains__(self, weight: str) -> bool:
        return weight in self._nodes

    def identity(self, weight: str) -> str:
        """The sha256 of the weight's int8 values, scales, zero points and axis: equal for equal dequantized values."""
        node, digest = self._nodes[weight], hashlib.sha256()
        for name in node.input:
            tensor = self._initializers.get(name)
            digest.update(initializer_array(tensor, self._base).tobytes() if tensor is not None else b"-")
        digest.update(str(next((a.i for a in node.attribute if a.name == "axis"), 1)).encode())
        return digest.hexdigest()

    def __getitem__(self, weight: str) -> np.ndarray:
        node, initializers, base = self._nodes[weight], self._initializers, self._base
        values = _array(initializers[node.input[0]], base)
        scale = _array(initializers[node.input[1]], base)
        zero = initializers.get(node.input[2]) if len(node.input) > 2 else None  # the CPU graphs' uint8 weights
        zero_point = _array(zero, base) if zero is not None else np.zeros(1)
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        if scale.size > 1:
            shape = [1] * values.ndim
            shape[axis] = -1
            scale, zero_point = scale.reshape(shape), zero_point.reshape(shape if zero_point.size > 1 else (1,))
        values -= zero_point
        values *= scale
        return values


def _correctable(node: onnx.NodeProto, initializers: dict, rounded: WeightRounding) -> bool:
    """A Conv/Gemm/MatMul with an activation input and a 2-D (4-D for Conv) weight that is int8 in the Q/DQ graph
    (a Gemm in its plain form: no transA, alpha and beta 1)."""
    if node.op_type not in CORRECTED_OPS or node.input[1] not in rounded or node.input[0] in initializers:
        return False
    if node.op_type != "Conv" and len(initializers[node.input[1]].dims) != 2:
        return False
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    plain = attributes.get("alpha", 1.0) == 1.0 and attributes.get("beta", 1.0) == 1.0
    return plain and not attributes.get("transA", 0)


def _output_shift(node: onnx.NodeProto, error: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """(W_q - W) · E[x] per output channel: what the weight's rounding adds to the op's output on average."""
    if node.op_type in ("Gemm", "MatMul"):
        transposed = any(a.name == "transB" and a.i for a in node.attribute)
        return (error if transposed else error.T) @ mean
    groups = next((a.i for a in node.attribute if a.name == "group"), 1)
    outputs, per_group = error.shape[0], error.shape[1]
    kernel = error.reshape(outputs, per_group, -1).sum(axis=2)  # the rounding error summed over each kernel
    group_of = np.arange(outputs) // (outputs // groups)
    channels = group_of[:, None] * per_group + np.arange(per_group)[None, :]  # input channel of each (o, i)
    return (kernel * mean[channels]).sum(axis=1)


def _bias_slot(node: onnx.NodeProto, readers: dict, initializers: dict) -> tuple[onnx.NodeProto, int] | None:
    """(the node, its input) that holds the op's bias: a Conv/Gemm's third input (added where it has none, so
    where it is not a constant: None), a MatMul's single reader Add's 1-D constant (None where it has none)."""
    if node.op_type in ("Conv", "Gemm"):
        has_bias = len(node.input) > 2 and bool(node.input[2])
        return (node, 2) if not has_bias or node.input[2] in initializers else None
    if node.op_type != "MatMul" or len(readers.get(node.output[0], [])) != 1:
        return None
    add = readers[node.output[0]][0]
    if add.op_type != "Add" or len(add.input) != 2:
        return None
    index = 1 - list(add.input).index(node.output[0])
    constant = initializers.get(add.input[index])
    return (add, index) if constant is not None and len(constant.dims) == 1 else None


def _add_to_bias(
    graph: onnx.GraphProto,
    holder: onnx.NodeProto,
    index: int,
    weight: str,
    initializers: dict,
    readers: dict,
    delta: np.ndarray,
    base: Path,
) -> None:
    """holder.input[index] (the bias) += delta: in place where nothing else reads it, else (or where the op has
    none) as a new initializer named after the `weight`; either way held in the graph (a bias on disk is read from
    under `base`)."""
    bias = holder.input[index] if len(holder.input) > index and holder.input[index] else None
    if bias is not None and len(readers.get(bias, [])) == 1:
        updated = _array(initializers[bias], base) + delta
        initializers[bias].CopyFrom(numpy_helper.from_array(updated.astype(np.float32), bias))
        return
    before = _array(initializers[bias], base) if bias is not None else 0.0
    name = f"{weight}_corrected_bias"
    graph.initializer.append(numpy_helper.from_array((before + delta).astype(np.float32), name))
    initializers[name] = graph.initializer[-1]
    if len(holder.input) > index:  # an empty name there means no bias: replaced all the same
        holder.input[index] = name
    else:
        holder.input.append(name)


def _array(tensor: onnx.TensorProto, base: Path) -> np.ndarray:
    """A constant's values in float64, read from the graph or from its file under `base` (graph_without_weights)."""
    return initializer_array(tensor, base).astype(np.float64)
