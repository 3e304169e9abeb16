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

Feeds = dict[str, np.ndarray]
Infer = Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]
Cases = list[tuple[Feeds, Feeds]]  # (inputs, expected outputs)
ROWS_ALONE = 4  # rows of the largest reference case run one at a time for the batch-independence check


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
    infer: Infer, precision: Precision | str, cases: Cases, sample: tuple[Feeds, Feeds] | None = None
) -> HostCheck:
    """Run `cases` (reference.npz's) and, for INT8, `sample` (the held-out calibration rows and the FP32 graph's
    outputs on them) through `infer`; the first failure, or the worst margins, as a HostCheck."""
    started = time.perf_counter()
    precision = Precision(precision)
    outputs = [infer(inputs) for inputs, _ in cases]
    checks = [_reference_cases(precision, cases, outputs), _rows_alone(infer, precision, cases, outputs)]
    if precision is Precision.INT8 and sample is not None:
        checks.append(_agreement(infer, *sample))
    failure = next((verdict for passed, verdict in checks if not passed), None)
    verdict = failure or "; ".join(verdict for _, verdict in checks)
    return HostCheck(failure is None, verdict, round(time.perf_counter() - started, 3))


def _reference_cases(precision: Precision, cases: Cases, outputs: list[Feeds]) -> tuple[bool, str]:
    """Every reference case's `outputs` within its precision's parity tolerance (INT8: finite)."""
    rtol = RTOL[precision]
    worst, where = 0.0, ""
    for (inputs, expected), actual in zip(cases, outputs, strict=True):
        batch = _rows(inputs)
        for name, comparison in compare_outputs(expected, actual, rtol=rtol).items():
            passed = math.isfinite(comparison.max_abs) if precision is Precision.INT8 else comparison.ok
            if not passed:
                return False, (
                    f"output {name!r} at batch {batch} is off PyTorch's reference by {comparison.max_rel:.3g} of its "
                    f"scale {comparison.scale:.3g} (the {precision} gate's tolerance: {rtol:g})"
                )
            if comparison.max_rel >= worst:
                worst, where = comparison.max_rel, f"output {name!r} at batch {batch}"
    return True, f"{len(cases)} reference cases within {rtol:g} of PyTorch's (worst {worst:.3g}, {where})"


def _rows_alone(infer: Infer, precision: Precision, cases: Cases, outputs: list[Feeds]) -> tuple[bool, str]:
    """The largest reference case's first rows, each alone, against the same rows in its batch's `outputs`."""
    largest = max(range(len(cases)), key=lambda index: _rows(cases[index][0]))
    inputs, together = cases[largest][0], outputs[largest]
    batch = _rows(inputs)
    if batch < 2:
        return True, "no reference case of two rows or more: batch independence not checked"
    tolerance = node_tolerance(precision)
    for row in range(min(ROWS_ALONE, batch)):
        alone = infer({name: array[row : row + 1] for name, array in inputs.items()})
        expected = {name: array[row : row + 1] for name, array in together.items()}
        for name, comparison in compare_outputs(expected, alone, rtol=tolerance).items():
            if not comparison.ok:
                return False, (
                    f"output {name!r} of row {row} run alone differs from the same row run in a batch of {batch} by "
                    f"{comparison.max_rel:.3g} of its scale (tolerance {tolerance:g}): the graph mixes rows across "
                    "the batch, so batching requests would change their answers"
                )
    return True, f"rows alone as in a batch of {batch}"


def _agreement(infer: Infer, inputs: Feeds, fp32: Feeds) -> tuple[bool, str]:
    """The held-out calibration rows against the FP32 graph's outputs, at the INT8 agreement gate's level."""
    worst_name, worst = max(rows_agreement(fp32, infer(inputs)).items(), key=lambda item: item[1].error_mean)
    numbers = f"{worst.error_mean:.3g} of its norm over {worst.rows} held-out calibration rows"
    if not worst.error_mean <= INT8_MAX_ERROR:  # NaN fails too
        return False, f"output {worst_name!r} is off FP32 by {numbers} (the INT8 gate: {INT8_MAX_ERROR})"
    return True, f"INT8 off FP32 by {numbers} (gate {INT8_MAX_ERROR})"


def _rows(inputs: Feeds) -> int:
    return int(next(iter(inputs.values())).shape[0])
