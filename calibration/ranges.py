"""Activation ranges, and every other statistic calibration fits on the same rows, from two passes over the data.

The three methods users pick (CALIB_METHOD=) are ONNX Runtime's calibrators' rules:
  max         min/max over all batches (MinMaxCalibrater): keeps every outlier;
  percentile  the 99.99th percentile of |x| (PercentileCalibrater): clips the rare outliers;
  entropy     the threshold minimising KL divergence between the float and the 128-level histogram
              (EntropyCalibrater), TensorRT's own legacy calibration rule.
Only the tensors that feed a quantized op are calibrated, which keeps ResNet-50 calibration cheap.

ORT's calibrators each run the data through a graph of their own, so every method cost a pass, and smoothing's
maxima and bias correction's means a pass each.  Here a graph's data is run twice at most, one batch at a time, one
batch of intermediate tensors held at a time:
  the ranges  one session, unoptimized as the calibrators run theirs (CAPTURE_LEVEL), for every method at once: max
              by MinMaxCalibrater's rule, percentile and entropy in ORT's own HistogramCollector, fed one batch at
              a time as the calibrators feed it; the calibrators' ranges exactly;
  the rest    one session at the level the graph runs at elsewhere (pipeline/core/sessions.py), as those
              statistics always were: the channel maxima smoothing scales come from (calibration/smooth.py) and the
              input means bias correction needs (calibration/bias.py).
One session for all would do, but it would move the maxima and means by float rounding (an optimized session
fuses ops; ResNet-50's tensors move by ~1e-6 of their scale), and INT8's rounding turns that into another graph:
all-MiniLM-L6-v2's cosine on held-out sentences (max ranges, smoothed) went from 0.9912 to 0.9893.
A smoothed graph's ranges of the tensors smoothing does not reach are the unsmoothed graph's (Alike): not measured.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..pipeline.core.errors import PipelineError
from ..pipeline.core.sessions import UNOPTIMIZED, graph_level
from ..pipeline.core.settings import mention_name
from ..pipeline.evaluation.tensors import tensor_values
from ..pipeline.folder.graph_files import graph_without_weights
from .bias import ChannelMeans, weight_inputs
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
# ORT's calibrators open their graph unoptimized, so the ranges' session does: the same tensors, bit for bit (and no
# probe: pipeline/core/sessions.py).
CAPTURE_LEVEL = UNOPTIMIZED


class Statistic(Protocol):
    """What a pass feeds: the tensors it reads, and each batch's values of them with the batch's row count."""

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


def method_options(method: str) -> dict:
    """The calibrator options behind a method name, recorded in the manifest and the cache key."""
    options: dict = {"method": method, "op_types": list(QUANTIZED_OPS)}
    if method == "percentile":
        options.update(percentile=PERCENTILE, num_bins=HISTOGRAM_BINS)
    elif method == "entropy":
        options.update(num_bins=HISTOGRAM_BINS, num_quantized_bins=QUANTIZED_BINS)
    return options


@dataclass(frozen=True)
class Alike:
    """Ranges measured on another graph, by method, and the tensors this graph computes otherwise: every other
    tensor is the same, unoptimized (CAPTURE_LEVEL: each tensor its own node's output on the same inputs), so its
    ranges are taken from there (a smoothed graph beside the unsmoothed one: calibration/smooth.py)."""

    ranges: dict[str, Any]  # ORT's TensorsData by method
    changed: set[str]

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
) -> Statistics:
    """The ranges of every method in `methods` on `graph` (a graph whose constants are initializers:
    calibration.int8.calibrated_graph) from one pass over `data`, and from one more the channel maxima of the
    tensors in `maxima_of` and, with `means`, the means of every Conv/Gemm/MatMul weight's input (module doc).
    alike: another graph's ranges, and what this one computes otherwise: only that is measured."""
    graph, passes = Path(graph), 0
    model = graph_without_weights(graph)  # both passes map its weights where they lie: no copy of them here
    ranges: list[MethodRanges] = []
    if methods:
        calibrated = _calibrated_tensors(graph)
        ranges = [
            MethodRanges(method, calibrated, alike.reused(method, calibrated) if alike else {}) for method in methods
        ]
        tensors = list(dict.fromkeys(name for method in ranges for name in method.tensors))
        runs = tensor_values(model, tensors, data.batches, weights=graph.parent, level=CAPTURE_LEVEL)
        passes += _run_pass(runs, graph, data, ranges)
    maxima, input_means = ChannelMaxima(maxima_of), ChannelMeans({})
    if maxima_of or means:
        input_means = ChannelMeans(weight_inputs(model) if means else {})
        tensors = list(dict.fromkeys([*input_means.tensors, *maxima.tensors]))  # the means' first: as they ran
        runs = tensor_values(model, tensors, data.batches, weights=graph.parent, level=graph_level(graph))
        passes += _run_pass(runs, graph, data, [maxima, input_means])
    return Statistics({r.method: r.ranges() for r in ranges}, maxima.maxima, input_means.means(), passes)


class MethodRanges:
    """One method's ranges of `tensors`, batch by batch, as ORT's calibrator for it computes them (symmetric: INT8
    here has zero point 0, so histograms are of |x|), but for those `reused` gives as they are."""

    def __init__(self, method: str, tensors: Sequence[str], reused: dict[str, object] | None = None) -> None:
        self.method, self._reused = method, reused or {}
        self.tensors = [name for name in tensors if name not in self._reused]
        self._peaks: dict[str, np.floating] = {}
        self._histograms = None if method == "max" else _histogram_collector(method)

    def add(self, values: Feed, rows: int) -> None:
        if self._histograms is not None:
            with contextlib.redirect_stdout(io.StringIO()):  # ORT's collector print()s its progress
                self._histograms.collect({name: values[name] for name in self.tensors})
            return
        for name in self.tensors:
            # MinMaxCalibrater, symmetric: each batch's max(|min|, |max|), the largest over the batches.
            value = values[name]
            peak = np.nanmax([np.abs(value.min()), np.abs(value.max())]) if value.size else value.dtype.type(0)
            if name not in self._peaks or peak > self._peaks[name]:
                self._peaks[name] = peak

    def ranges(self):
        """ORT's TensorsData, as its calibrator's compute_data returns it."""
        from onnxruntime.quantization.calibrate import CalibrationMethod, TensorsData

        if self._histograms is None:
            shaped = {name: np.array([peak]) for name, peak in self._peaks.items()}  # ORT's ranges have shape (1,)
            measured = TensorsData(CalibrationMethod.MinMax, {name: (-peak, peak) for name, peak in shaped.items()})
        else:
            with contextlib.redirect_stdout(io.StringIO()):
                thresholds = self._histograms.compute_collection_result() if self.tensors else {}
            kind = CalibrationMethod.Percentile if self.method == "percentile" else CalibrationMethod.Entropy
            measured = TensorsData(kind, thresholds)
        return TensorsData(measured.calibration_method, {**self._reused, **measured.data})


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


def _calibrated_tensors(graph: Path) -> list[str]:
    """The tensors ORT's calibrators calibrate on `graph` (their own selection: every float input and output of a
    quantized op that is not a constant).  Their model, which holds the weights, goes before the pass: the pass
    maps the weights from the graph's files (writing that model's weights out again cost a copy on disk a pass)."""
    from onnxruntime.quantization.calibrate import CalibraterBase

    calibrater = CalibraterBase(Path(graph), list(QUANTIZED_OPS))
    tensors, _ = calibrater.select_tensors_to_calibrate(calibrater.model)
    return sorted(tensors)


def _run_pass(runs: Iterator[Feed], graph: Path, data: CalibrationData, statistics: Sequence[Statistic]) -> int:
    """Each batch's tensors from `runs` (tensor_values over `data`'s batches) given to every statistic; 1, the pass."""
    from tqdm import tqdm

    batches = tqdm(data.batches, desc="calibrating", unit="batch", delay=2.0, leave=False)
    for index, feed in enumerate(batches):
        values = _next_batch(runs, index, feed, graph)
        for statistic in statistics:
            statistic.add(values, len(next(iter(feed.values()))))
        del values  # freed before the next batch runs: one batch of intermediate tensors at a time
    return 1


def _next_batch(runs: Iterator[Feed], index: int, feed: Feed, graph: Path) -> Feed:
    """The next batch's tensors.  The reader checked names, dtypes, shapes and token ids against their lookup
    tables; what ONNX Runtime still refuses is in the values (its own exception types)."""
    try:
        return next(runs)
    except Exception as error:
        shapes = ", ".join(f"{name} {list(array.shape)} {array.dtype}" for name, array in feed.items())
        raise PipelineError(
            f"ONNX Runtime could not run {graph.name} on calibration batch {index} ({shapes}): "
            f"{type(error).__name__}: {error}",
            f"give calibration data the model accepts as served inputs ({mention_name('calib')}): the values, "
            "e.g. integer ids "
            "within the range the model looks them up in",
        ) from None
