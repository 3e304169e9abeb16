"""The host check: what a host is about to serve, run on the folder's own cases and held to the folder's own gate.

The gates ran on the build machine, where float16 was simulated and INT8's Q/DQ computed as TensorRT would; the
host that serves computes with its own kernels (a GPU's real float16, ONNX Runtime's int8 kernels of this CPU,
TF32 defaults).  So before a candidate serves, `check_on_host` runs through the very runner that would serve it:
  - every PyTorch reference case (reference.npz), against its precision's parity tolerance (RTOL; INT8 on those
    random inputs: finite only, as at build time);
  - the largest reference case again one row at a time: each row's outputs must not depend on the rows beside it
    (a graph that mixes rows across the batch cannot be batched by a service);
  - INT8: the calibration rows the build held out (the folder's calibration sample), against the FP32 graph run on
    this host's CPU provider, at the agreement gate's level (INT8_MAX_ERROR).
It imports neither onnx nor torch: the runners call it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..core.compare import compare_outputs
from ..core.precision import Precision
from . import INT8_MAX_ERROR, RTOL, node_tolerance
from .agreement import rows_agreement
from .detections import MIN_AGREEMENT, detection_agreement

Feeds = dict[str, np.ndarray]
Infer = Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]
Cases = list[tuple[Feeds, Feeds]]  # (inputs, expected outputs)
ROWS_ALONE = 4  # rows of the largest reference case run one at a time for the batch-independence check
# How a verdict says that rows run alone compute otherwise than in a batch (runners/host_check.py gives its fix).
MIXES_ROWS = "the graph mixes rows across the batch, so batching requests would change their answers"


@dataclass(frozen=True)
class HostCheck:
    """One candidate's check on this host: passed or not, what was worst (or why it failed), and what it cost."""

    passed: bool
    verdict: str
    seconds: float

    def as_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Any) -> HostCheck | None:
        """The record as served.json keeps it, or None where it is not one (a damaged cache is checked again)."""
        if (
            not isinstance(raw, dict)
            or not isinstance(raw.get("passed"), bool)
            or not isinstance(raw.get("verdict"), str)
        ):
            return None
        seconds = raw.get("seconds")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
            return None
        return cls(raw["passed"], raw["verdict"], float(seconds))


def check_on_host(
    infer: Infer,
    precision: Precision,
    cases: Cases,
    sample: tuple[Feeds, Feeds] | str = "none given",
    *,
    detections: bool = False,
) -> HostCheck:
    """Run `cases` (reference.npz's) and, for INT8, `sample` (the held-out calibration rows and the FP32 graph's
    outputs on them, or why there are none: the verdict says they were not checked) through `infer`; the first
    failure, or the worst margins, as a HostCheck.  detections: the outputs are POSTPROCESS=nms's (the expected ones
    the reference NMS of the head), judged as the build's NMS gate judges them (pipeline/evaluation/detections.py)."""
    started = time.perf_counter()
    judge = _Judge(precision, detections)
    outputs = [infer(inputs) for inputs, _ in cases]
    checks = [_reference_cases(judge, cases, outputs), _rows_alone(infer, judge, cases, outputs)]
    if judge.precision is Precision.INT8:
        checks.append(
            _held_out(judge, infer(sample[0]), sample[1]) if isinstance(sample, tuple) else _unchecked(sample)
        )
    failure = next((verdict for passed, verdict in checks if not passed), None)
    verdict = failure or "; ".join(verdict for _, verdict in checks)
    return HostCheck(failure is None, verdict, round(time.perf_counter() - started, 3))


@dataclass(frozen=True)
class _Judge:
    """How outputs are held against expected ones at a precision: as tensors, within a share of their scale, or as
    detections, by the share of them found."""

    precision: Precision
    detections: bool

    def differs(self, expected: Feeds, actual: Feeds, rtol: float) -> tuple[str | None, str]:
        """(what is off where `actual` departs from `expected`, else None; the measured margin in words): tensors
        past `rtol` of their scale, detections below the precision's share found."""
        if self.detections:
            agreement = detection_agreement(expected, actual)
            words = agreement.summary()
            return (None if agreement.passes(self.precision) else f"its detections: {words}"), words
        comparisons = compare_outputs(expected, actual, rtol=rtol)
        name, worst = max(comparisons.items(), key=lambda item: item[1].max_rel)
        words = f"output {name!r} by {worst.max_rel:.3g} of its scale {worst.scale:.3g}"
        return (None if all(c.ok for c in comparisons.values()) else words), words


def _reference_cases(judge: _Judge, cases: Cases, outputs: list[Feeds]) -> tuple[bool, str]:
    """Every reference case's `outputs` within its precision's parity tolerance of PyTorch's (INT8, on those random
    inputs: finite only, as at build time)."""
    rtol, gate = RTOL[judge.precision], _gate_words(judge, RTOL[judge.precision])
    margins = []
    for (inputs, expected), actual in zip(cases, outputs, strict=True):
        off, margin = judge.differs(expected, actual, rtol)
        if judge.precision is Precision.INT8:  # judged as at build time: finite (RTOL's comment)
            off = next((f"output {name!r} is not finite" for name, a in actual.items() if not _finite(a)), None)
        if off is not None:
            return (
                False,
                f"at batch {_rows(inputs)}, off PyTorch's reference: {off} (the {judge.precision} gate: {gate})",
            )
        margins.append(f"batch {_rows(inputs)}: {margin}")
    return True, f"{len(cases)} reference cases within the {judge.precision} gate ({gate}): {'; '.join(margins)}"


def _rows_alone(infer: Infer, judge: _Judge, cases: Cases, outputs: list[Feeds]) -> tuple[bool, str]:
    """The largest reference case's first rows, each alone, against the same rows in its batch's `outputs`."""
    largest = max(range(len(cases)), key=lambda index: _rows(cases[index][0]))
    inputs, together = cases[largest][0], outputs[largest]
    batch = _rows(inputs)
    if batch < 2:
        return True, "no reference case of two rows or more: batch independence not checked"
    tolerance = node_tolerance(judge.precision)
    for row in range(min(ROWS_ALONE, batch)):
        alone = infer({name: array[row : row + 1] for name, array in inputs.items()})
        in_batch = {name: array[row : row + 1] for name, array in together.items()}
        resized = next((name for name, array in in_batch.items() if array.shape != alone[name].shape), None)
        if resized is not None:  # an output sized by the batch past its first axis (CLIP's logits_per_image)
            return False, (
                f"row {row} run alone gives output {resized!r} of shape {alone[resized].shape}, the same row in a "
                f"batch of {batch} {in_batch[resized].shape}: {MIXES_ROWS}"
            )
        off, _ = judge.differs(in_batch, alone, tolerance)
        if off is not None:
            return False, (
                f"row {row} run alone differs from the same row run in a batch of {batch}: {off} (tolerance "
                f"{tolerance:g}): {MIXES_ROWS}"
            )
    return True, f"rows alone as in a batch of {batch}"


def _held_out(judge: _Judge, actual: Feeds, fp32: Feeds) -> tuple[bool, str]:
    """The held-out calibration rows against the FP32 graph's outputs, at the INT8 agreement gate's level."""
    if judge.detections:
        agreement = detection_agreement(fp32, actual)
        words = f"detections on the held-out calibration rows against FP32's: {agreement.summary()}"
        return agreement.passes(Precision.INT8), words
    name, worst = max(rows_agreement(fp32, actual).items(), key=lambda item: item[1].error_mean)
    numbers = f"{worst.error_mean:.3g} of its norm over {worst.rows} held-out calibration rows"
    if not worst.error_mean <= INT8_MAX_ERROR:  # NaN fails too
        return False, f"output {name!r} is off FP32 by {numbers} (the INT8 gate: {INT8_MAX_ERROR})"
    return True, f"INT8 off FP32 by {numbers} (gate {INT8_MAX_ERROR})"


def _unchecked(why: str) -> tuple[bool, str]:
    """No held-out rows to run: the reference cases stand alone, and the verdict says what was not checked."""
    return True, f"the held-out calibration rows not checked: {why}"


def _gate_words(judge: _Judge, rtol: float) -> str:
    if judge.detections:
        return f"{MIN_AGREEMENT[judge.precision]:g} of the detections found"
    return "finite" if judge.precision is Precision.INT8 else f"{rtol:g} of the output's scale"


def _finite(array: np.ndarray) -> bool:
    return not np.issubdtype(array.dtype, np.floating) or bool(np.all(np.isfinite(array)))


def _rows(inputs: Feeds) -> int:
    return int(next(iter(inputs.values())).shape[0])
