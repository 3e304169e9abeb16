"""Activation ranges, and every other statistic calibration fits on the same rows, from one pass over the data (two
on the graph smoothing starts from).

The three methods users pick (CALIB_METHOD=) are ONNX Runtime's calibrators' rules:
  max         min/max over all batches (MinMaxCalibrater): keeps every outlier;
  percentile  the 99.99th percentile of |x| (PercentileCalibrater): clips the rare outliers;
  entropy     the threshold minimising KL divergence between the float and the 128-level histogram
              (EntropyCalibrater), TensorRT's own legacy calibration rule.
Only the tensors that feed a quantized op are calibrated, which keeps ResNet-50 calibration cheap.

ORT's calibrators each run the data through a graph of their own, so every method cost a pass, and smoothing's
maxima and bias correction's means a pass each.  Here a graph's data is run once, twice where smoothing's maxima are
asked for, one batch at a time, one batch's intermediate tensors (or a part of them) held at a time (each batch's
statistics of each tensor on a thread per core: calibration/parallel.py):
  the ranges  unoptimized as the calibrators run theirs, for every method at once: max by MinMaxCalibrater's rule,
              percentile and entropy in ORT's own HistogramCollector, fed one batch at a time as the calibrators
              feed it; the calibrators' ranges exactly; and in the same pass the input means bias correction needs
              (calibration/bias.py).  The graph runs in parts, each holding about PART_BYTES of a batch's tensors
              (pipeline/evaluation/tensors.py tensor_values_in_parts: unoptimized, the same values bit for bit):
              ViT-L/16's pass held 4 GB of them at once, past 3x its weights;
  the maxima  one session at the level the graph runs at elsewhere (pipeline/core/sessions.py), as they always were: the
              channel maxima smoothing scales come from (calibration/smooth.py), reduced in the graph
              (pipeline/evaluation/tensors.py channel_maxima: a vector a tensor, not ViT-L/16's 1.1 GB a batch).
              Measured unoptimized, they move by float rounding (an optimized session fuses ops; ResNet-50's tensors
              move by ~1e-6 of their scale), and INT8's rounding turns that into other smoothing scales and another
              graph: all-MiniLM-L6-v2's smoothed candidates' held-out errors moved by 0.7% (max: 0.0634 -> 0.0630). The
              means moved by float rounding alone: the biases they correct move in their last bits, and every held-out
              error, the kept graph's and every candidate's, is the same to 6 digits (EfficientNet-Lite0, MiniLM, whose
              graphs are the same bytes, and the 0.6 GB MLP).  The graph's outputs on the way are the FP32 graph's
              at its level, which the INT8 gate compares with on the fit rows (GraphOutputs).
A smoothed graph's ranges of the tensors smoothing does not reach are the unsmoothed graph's (Alike): not measured;
and where the unsmoothed graph's pass kept the values the smoothed part reads (its boundary, within KEPT_BYTES),
the smoothed graph's pass runs that part alone (ChangedPart), its weight inputs' means before it taken from the
unsmoothed pass: a CNN's smoothed classifier costs its own few nodes, not the network again (EfficientNet-Lite0's
int8 stage 10.0 -> 8.8 s, its graphs the same bytes).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
import onnx

from ..pipeline.core.errors import PipelineError
from ..pipeline.core.sessions import graph_level, return_freed_memory
from ..pipeline.core.settings import mention_name
from ..pipeline.evaluation.agreement import in_rows, joined
from ..pipeline.evaluation.tensors import (
    channel_maxima,
    part_graph,
    part_inputs,
    rows_per_run,
    tensor_values_in_parts,
)
from .bias import ChannelMeans, weight_inputs
from .parallel import per_tensor
from .qdq_marks import FLOATS
from .quantizable import quantizable_graph
from .readers import CalibrationData, Feed
from .smooth import ChannelMaxima

# The ops that get Q/DQ on their inputs: TensorRT runs these in INT8 and fuses the rest around them.
QUANTIZED_OPS = ("Conv", "Gemm", "MatMul")
PERCENTILE = 99.99
# ORT's default for entropy is 128 bins, too coarse for ReLU outputs whose mass sits near zero.
# TensorRT's own entropy calibrator uses 2048, but ORT's KL search is a Python loop over candidate
# thresholds (O(bins^2) per tensor): 2048 bins took 1.6 s per tensor on the digits model, 512 bins
# 0.35 s, with the same held-out accuracy.
HISTOGRAM_BINS = 512
QUANTIZED_BINS = 128  # the positive half of INT8
# The most a pass keeps of a boundary's values for another graph's changed part, all batches together
# (ChangedPart): EfficientNet-Lite0's, its classifier's input, is 4 KiB a row.
KEPT_BYTES = 256 * 2**20
# The most of a batch's calibrated tensors a pass holds at once, about (pipeline/evaluation/tensors.py
# tensor_values_in_parts): the graph runs in parts that expose this much each.  ViT-L/16's are 4 GB a batch of 8.
PART_BYTES = 512 * 2**20
T = TypeVar("T")


class Statistic(Protocol):
    """What a pass feeds: the tensors it reads, and each batch's values of them with the batch's row count, a batch
    in parts (some of its tensors a call, each tensor once a batch: the graph runs in parts)."""

    tensors: list[str]

    def add(self, values: Feed, rows: int) -> None: ...


@dataclass(frozen=True)
class Statistics:
    """What the calibration rows gave on one graph: the ranges of each method asked for, the channel maxima of the
    tensors asked for (smoothing's), the weights' input means (bias correction's; {} where not asked for), and the
    passes over the rows that took (a session's run over every batch)."""

    ranges: dict[str, object]
    maxima: dict[str, np.ndarray]
    means: dict[str, np.ndarray]
    passes: int
    shared: Shared | None = None  # what the passes kept for another graph (collect_statistics' `keep`)
    outputs: list[Feed] | None = None  # the graph's outputs on each batch, where the maxima pass kept them


def method_options(method: str) -> dict:
    """The calibrator options behind a method name, recorded in the manifest and the cache key."""
    options: dict = {"method": method, "op_types": list(QUANTIZED_OPS)}
    if method == "percentile":
        options.update(percentile=PERCENTILE, num_bins=HISTOGRAM_BINS)
    elif method == "entropy":
        options.update(num_bins=HISTOGRAM_BINS, num_quantized_bins=QUANTIZED_BINS)
    return options


@dataclass(frozen=True)
class Shared:
    """What the pass over a graph measured that another graph computes alike (ChangedPart): every tensor the graph has
    (its inputs and node outputs), its weight inputs' means, and the pass's values, batch by batch, of the tensors
    kept (`keep`: where the part another graph computes otherwise begins; None where it kept none)."""

    tensors: frozenset[str]
    means: dict[str, np.ndarray]
    batches: list[Feed] | None

    @property
    def kept(self) -> set[str]:
        """The tensors the pass kept."""
        return set(self.batches[0]) if self.batches else set()


@dataclass(frozen=True)
class Alike:
    """Ranges measured on another graph, by method, and the tensors this graph computes otherwise: every other
    tensor is the same, unoptimized (each tensor its own node's output on the same inputs), so its
    ranges are taken from there (a smoothed graph beside the unsmoothed one: calibration/smooth.py).  shared: where
    the other graph's passes kept the values the changed part reads, only that part runs (ChangedPart)."""

    ranges: dict[str, Any]  # ORT's TensorsData by method
    changed: set[str]
    shared: Shared | None = None

    def reused(self, method: str, tensors: Sequence[str]) -> dict[str, object]:
        """{tensor: its range} of `tensors` this graph computes as the other does, where the other has the method's."""
        known = self.ranges.get(method)
        return {name: known[name] for name in tensors if name not in self.changed and name in known} if known else {}


def collect_statistics(
    graph: Path,
    data: CalibrationData,
    methods: Sequence[str],
    *,
    maxima_of: Sequence[str] = (),
    means: bool = False,
    alike: Alike | None = None,
    keep: Sequence[str] = (),
) -> Statistics:
    """The ranges of every method in `methods` on `graph` (as quantizable_graph reads it) and, with `means`, the means
    of every Conv/Gemm/MatMul weight's input from one pass over `data`, and from one more the channel maxima of the
    tensors in `maxima_of` (module doc).  alike: another graph's ranges, and what this one computes otherwise: only that
    is measured, and where the other graph's pass kept the values that part reads, only that part runs (ChangedPart).
    keep: tensors whose values the pass keeps for such a graph (Statistics.shared)."""
    graph, passes = Path(graph), 0
    model = quantizable_graph(graph)  # both passes map its weights where they lie: no copy of them here
    rows = [_rows(feed) for feed in data.batches]
    ranges: list[MethodRanges] = []
    measured_means: dict[str, np.ndarray] = {}
    kept = None
    if methods or means:
        calibrated = calibrated_tensors(model) if methods else []
        ranges = [
            MethodRanges(method, calibrated, alike.reused(method, calibrated) if alike else {}) for method in methods
        ]
        wanted = weight_inputs(model) if means else {}
        part = ChangedPart.of(model, alike)
        reused = part.means(wanted) if part else {}
        input_means = ChannelMeans({name: axis for name, axis in wanted.items() if name not in reused})
        feeds = part.feeds(_read(ranges, input_means)) if part else None
        if feeds is None:  # the whole graph runs: every mean measured on it, as without a part
            reused, input_means = {}, ChannelMeans(wanted)
        source, batches = (part.model, feeds) if part and feeds is not None else (model, data.batches)
        tensors = _read(ranges, input_means)
        kept = KeptValues(keep, tensors)
        # The runs are _run_pass's alone: their sessions, and the weights they map, go when it returns.
        passes += _run_pass(
            tensor_values_in_parts(source, tensors, batches, weights=graph.parent, part_bytes=PART_BYTES),
            graph,
            batches,
            rows,
            [*ranges, input_means, kept],
        )
        measured = {**reused, **input_means.means()}
        measured_means = {name: measured[name] for name in wanted}  # in the graph's order
    maxima, outputs = ChannelMaxima(maxima_of), None
    if maxima_of:  # at the level the graph runs at elsewhere (module doc)
        step = rows_per_run(model, data.batches[0])
        level, cut = graph_level(graph), [in_rows(batch, step) for batch in data.batches]
        runs = [run for batch in cut for run in batch]
        values = channel_maxima(model, maxima.tensors, runs, weights=graph.parent, level=level)
        produced = GraphOutputs([value.name for value in model.graph.output])
        reduced = (iter([produced.keep(*run)]) for run in values)
        passes += _run_pass(reduced, graph, runs, [_rows(run) for run in runs], [maxima])
        del values, reduced  # its session
        outputs = produced.batches([len(batch) for batch in cut])
    shared = None
    if keep:
        computed = frozenset(name for node in model.graph.node for name in node.output)
        every = computed | {value.name for value in model.graph.input}
        shared = Shared(every, measured_means, kept.batches if kept else None)
    ranges_by_method = {r.method: r.ranges() for r in ranges}
    return Statistics(ranges_by_method, maxima.maxima, measured_means, passes, shared, outputs)


def _read(ranges: list[MethodRanges], means: ChannelMeans) -> list[str]:
    """The tensors a pass for `ranges` and `means` reads, once each."""
    return list(dict.fromkeys([*(name for method in ranges for name in method.tensors), *means.tensors]))


class KeptValues:
    """The values of `names` batch by batch (a statistic of a pass), where the pass reads them all, and while they
    take KEPT_BYTES at most in all; else `batches` is None."""

    def __init__(self, names: Sequence[str], read: Sequence[str]) -> None:
        self.tensors = list(names) if names and set(names) <= set(read) else []
        self._values: dict[str, list[np.ndarray]] | None = {name: [] for name in self.tensors} or None
        self._bytes = 0

    def add(self, values: Feed, rows: int) -> None:
        if self._values is None:
            return
        kept = {name: values[name] for name in self.tensors if name in values}
        self._bytes += sum(value.nbytes for value in kept.values())
        if self._bytes > KEPT_BYTES:
            self._values = None  # a boundary that large costs more memory than its pass saves time
            return
        for name, value in kept.items():
            self._values[name].append(value)

    @property
    def batches(self) -> list[Feed] | None:
        """The kept values, batch by batch."""
        if self._values is None:
            return None
        return [dict(zip(self._values, batch, strict=True)) for batch in zip(*self._values.values(), strict=True)]


class GraphOutputs:
    """The graph's own outputs on each run of the maxima pass (pipeline/evaluation/tensors.py channel_maxima gives
    them beside the maxima), kept as a boundary's values are (KeptValues: KEPT_BYTES at most in all) and put back
    together batch by batch: on the FP32 graph at the level it runs at elsewhere, they are its outputs on the fit
    rows that the INT8 gate compares with in-sample (pipeline/evaluation/agreement.py Fp32Reference), which then
    runs none of those rows again (ViT-L/16's 24: 16 s)."""

    def __init__(self, names: Sequence[str]) -> None:
        self._runs = KeptValues(names, names)

    def keep(self, maxima: Feed, outputs: Feed) -> Feed:
        """A run's maxima, its outputs kept."""
        self._runs.add(outputs, _rows(outputs))
        return maxima

    def batches(self, runs_per_batch: list[int]) -> list[Feed] | None:
        """The kept runs' outputs as the batches' (`runs_per_batch`: how many runs each batch took, in order); None
        where they were too large to keep."""
        if self._runs.batches is None:
            return None
        runs, batches = iter(self._runs.batches), []
        for count in runs_per_batch:
            parts = [next(runs) for _ in range(count)]
            batches.append({name: joined([part[name] for part in parts]) for name in parts[0]})
        return batches


class ChangedPart:
    """The nodes of a graph that compute what another graph does not (alike.changed, and the tensors that graph has
    none of: a smoothed graph's smoothing Muls), as a graph of their own whose inputs are the tensors they read
    from the rest, its boundary, fed the pass's values of them on the other graph (Shared).  Both graphs compute
    the boundary alike, and the pass runs unoptimized: the part computes what the whole graph
    would."""

    def __init__(self, model: onnx.ModelProto, boundary: list[str], shared: Shared, changed: set[str]) -> None:
        self.model, self.boundary, self.shared, self._changed = model, boundary, shared, changed
        self._computed = {name for node in model.graph.node for name in node.output} | set(boundary)

    @classmethod
    def of(cls, model: onnx.ModelProto, alike: Alike | None) -> ChangedPart | None:
        """`model`'s part that `alike` says it computes otherwise, None where its boundary was not kept."""
        if alike is None or alike.shared is None:
            return None
        shared = alike.shared
        nodes = [node for node in model.graph.node if any(_differs(name, alike, shared) for name in node.output)]
        made = {name for node in nodes for name in node.output}
        constants = {tensor.name for tensor in model.graph.initializer}
        boundary = part_inputs(nodes, constants)
        if not nodes or shared.batches is None or not set(boundary) <= shared.kept:
            return None
        first = shared.batches[0]  # kept: ChangedPart.of returns None where they are not
        outputs = [output.name for output in model.graph.output if output.name in made]
        part = part_graph(model, nodes, {name: first[name] for name in boundary}, outputs)
        return cls(part, boundary, shared, alike.changed)

    def feeds(self, tensors: Sequence[str]) -> list[Feed] | None:
        """The boundary's values for each batch of the other graph's pass, None where the part does not compute
        every one of `tensors`."""
        if self.shared.batches is None or not set(tensors) <= self._computed:
            return None
        return [{name: batch[name] for name in self.boundary} for batch in self.shared.batches]

    def means(self, wanted: dict[str, int]) -> dict[str, np.ndarray]:
        """The means of `wanted` the other graph measured and this one computes alike."""
        return {
            name: self.shared.means[name]
            for name in wanted
            if name in self.shared.means and name not in self._changed and name in self.shared.tensors
        }


def _differs(name: str, alike: Alike, shared: Shared) -> bool:
    return bool(name) and (name in alike.changed or name not in shared.tensors)


class MethodRanges:
    """One method's ranges of `tensors`, batch by batch, as ORT's calibrator for it computes them (symmetric: INT8
    here has zero point 0, so histograms are of |x|), but for those `reused` gives as they are."""

    def __init__(self, method: str, tensors: Sequence[str], reused: dict[str, object] | None = None) -> None:
        self.method, self._reused = method, reused or {}
        self.tensors = [name for name in tensors if name not in self._reused]
        self._peaks: dict[str, np.floating] = {}
        self._histograms = None if method == "max" else _histogram_collector(method)
        self._absolute = AbsoluteHistograms(HISTOGRAM_BINS) if method == "percentile" else None

    def add(self, values: Feed, rows: int) -> None:
        read = {name: values[name] for name in self.tensors if name in values}
        if self._absolute is not None:
            self._absolute.collect(read)
            return
        if self._histograms is not None:
            with contextlib.redirect_stdout(io.StringIO()):  # ORT's collector print()s its progress
                self._histograms.collect(read)
            return
        for name, peak in per_tensor(_peak, read).items():
            if name not in self._peaks or peak > self._peaks[name]:
                self._peaks[name] = peak

    def ranges(self):
        """ORT's TensorsData, as its calibrator's compute_data returns it."""
        from onnxruntime.quantization.calibrate import CalibrationMethod, TensorsData

        if self._histograms is None:
            shaped = {name: np.array([peak]) for name, peak in self._peaks.items()}  # ORT's ranges have shape (1,)
            measured = TensorsData(CalibrationMethod.MinMax, {name: (-peak, peak) for name, peak in shaped.items()})
        else:
            if self._absolute is not None:  # ORT's collector computes the thresholds from the same histograms
                self._histograms.get_histogram_dict().update(self._absolute.histograms)
            with contextlib.redirect_stdout(io.StringIO()):
                thresholds = self._histograms.compute_collection_result() if self.tensors else {}
            kind = CalibrationMethod.Percentile if self.method == "percentile" else CalibrationMethod.Entropy
            measured = TensorsData(kind, thresholds)
        return TensorsData(measured.calibration_method, {**self._reused, **measured.data})


class AbsoluteHistograms:
    """The histograms of |x| that ONNX Runtime's HistogramCollector makes for the percentile method, symmetric
    (collect_absolute_value: `bins` bins over [min|x|, max|x|] of the first batch, bins of the same width added as
    later batches reach past them; each tensor's raw minimum and maximum beside), bin for bin, from one copy of
    each tensor where it made three (a flat copy, |x|, and numpy's uniform-bins histogram, which computes every
    bin index in float64 and corrects it against the edges).  Given the edges numpy computes for it
    (np.histogram_bin_edges), np.histogram puts each value in the same bin by sorting, faster on these CPUs: the
    calibration pass's histograms of EfficientNet-Lite0 took 1.4 s where the collector took 2.2 (its int8 stage
    8.9 s)."""

    def __init__(self, bins: int) -> None:
        self.bins = bins
        self.histograms: dict[str, tuple] = {}  # tensor -> (counts, edges, min, max), as the collector keeps it

    def collect(self, values: Feed) -> None:
        self.histograms.update(per_tensor(self._histogram, values))

    def _histogram(self, name: str, value: np.ndarray) -> tuple:
        """The tensor's histogram with `value` added: (counts, edges, min, max)."""
        raw = np.asarray(value).ravel()
        if raw.size:
            low, high = np.nanmin(raw), np.nanmax(raw)
        else:
            low = high = np.array(0, dtype=raw.dtype)
        absolute = np.absolute(raw)
        if name not in self.histograms:
            edges = np.histogram_bin_edges(absolute, bins=self.bins)
            counts, edges = np.histogram(absolute, bins=edges)
            return counts, edges.astype(absolute.dtype), low, high
        old_counts, old_edges, old_low, old_high = self.histograms[name]
        peak = max(abs(low), abs(high)) if raw.size else np.nanmax(absolute)  # the collector's nanmax(|x|)
        if peak > old_edges[-1]:
            width = old_edges[1] - old_edges[0]
            old_edges = np.hstack((old_edges, np.arange(old_edges[-1] + width, peak + width, width)))
        counts, edges = np.histogram(absolute, bins=old_edges)
        counts[: len(old_counts)] += old_counts
        return counts, edges.astype(absolute.dtype), min(old_low, low), max(old_high, high)


def _peak(name: str, value: np.ndarray) -> np.floating:
    """MinMaxCalibrater's, symmetric: a batch's max(|min|, |max|) of the tensor (the ranges' the largest over them)."""
    return np.nanmax([np.abs(value.min()), np.abs(value.max())]) if value.size else value.dtype.type(0)


def _histogram_collector(method: str):
    """ORT's HistogramCollector as its PercentileCalibrater or EntropyCalibrater makes it from our options (the
    options a method does not use at ORT's defaults)."""
    from onnxruntime.quantization.calibrate import HistogramCollector

    options = method_options(method)
    return HistogramCollector(
        method=method,
        symmetric=True,
        num_bins=options["num_bins"],
        num_quantized_bins=options.get("num_quantized_bins", 2048),
        percentile=options.get("percentile", 99.999),
        scenario="same",
    )


def calibrated_tensors(model: onnx.ModelProto) -> list[str]:
    """The tensors ORT's calibrators calibrate (CalibraterBase.select_tensors_to_calibrate: every input and output of
    a quantized op that shape inference types float or float16 and that is not an initializer), found on `model` (a
    graph without its weights: graph_without_weights) as they find them on the graph they load, weights and all, and
    infer shapes on (1.2 s a graph at 0.6 GB of weights)."""
    graph = onnx.shape_inference.infer_shapes(model).graph
    types = {info.name: info.type for info in (*graph.value_info, *graph.output, *graph.input)}
    constants = {init.name for init in graph.initializer}
    return sorted(
        {
            name
            for node in graph.node
            if node.op_type in QUANTIZED_OPS
            for name in (*node.input, *node.output)
            if name in types and name not in constants and types[name].tensor_type.elem_type in FLOATS
        }
    )


def _rows(feed: Feed) -> int:
    return len(next(iter(feed.values())))


def _run_pass(
    runs: Iterator[Iterator[Feed]], graph: Path, batches: list[Feed], rows: list[int], statistics: Sequence[Statistic]
) -> int:
    """Each batch's tensors from `runs` (for each of `batches`, the calibration data's or a changed part's feeds for
    them, its tensors part by part) given to every statistic with the data batch's `rows`; 1, the pass."""
    from tqdm import tqdm

    progress = tqdm(batches, desc="calibrating", unit="batch", delay=2.0, leave=False)
    for index, feed in enumerate(progress):
        first = sum(rows[:index])
        parts = _ran(partial(next, runs), first, feed, graph)
        while (values := _ran(partial(next, parts, None), first, feed, graph)) is not None:
            for statistic in statistics:
                statistic.add(values, rows[index])
            del values  # freed before the next part runs: one part of a batch's intermediate tensors at a time
    return_freed_memory()
    return 1


def _ran(step: Callable[[], T], first: int, feed: Feed, graph: Path) -> T:
    """step(): ONNX Runtime's run of (a part of) a batch, whose first row is the data's `first`.  The reader checked
    names, dtypes, shapes and token ids against their lookup tables; what ONNX Runtime still refuses is in the values
    (its own exception types)."""
    try:
        return step()
    except Exception as error:
        shapes = ", ".join(f"{name} {list(array.shape)} {array.dtype}" for name, array in feed.items())
        rows = f"{first}-{first + _rows(feed) - 1}"
        raise PipelineError(
            f"ONNX Runtime could not run {graph.name} on calibration rows {rows} ({shapes}): "
            f"{type(error).__name__}: {error}",
            f"give calibration data the model accepts as served inputs ({mention_name('calib')}): the values, "
            "e.g. integer ids "
            "within the range the model looks them up in",
        ) from None
