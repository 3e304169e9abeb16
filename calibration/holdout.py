"""Which calibration rows INT8 fits its ranges on and which it keeps back for the gate (issue 25).

Ranges calibrated on a set and judged on that same set hold every value they are judged on, so the gate there
says nothing about the next input.  `split_rows(count)` holds out about a fifth of the rows (HELD_OUT_SHARE,
at least HELD_OUT_FLOOR) for the agreement gate; calibration (ranges, smoothing statistics) fits on the rest.

Which rows: a few blocks of consecutive rows, spread evenly over the set (the end of each of up to
HELD_OUT_BLOCKS equal segments), never the last fifth alone.  Why blocks: rows arrive in file order (the
folder reader sorts paths; a .npz is in the order it was written), and neighbours are usually siblings, the
views or crops of one photo, the sentences of one template.  A held-out row whose siblings were fit on is
judged on ranges that already saw its twin, as optimistic as judging in-sample; a block of HELD_OUT_RUN
rows or more tends to take a source whole (calibration/samples: 10 photos x 4 views; of 40 rows the split
holds out rows 16-19 and 36-39, two whole photos).  Why spread: the last fifth of a folder is its last
source or two (one photo's crops only), whose range says little of the rest.  No randomness: the split is
a function of the count alone, so every stage that reads the same data (calibration, the gate, `make
accuracy`) draws the same rows, and the calibration cache can key on it.

Too few rows to hold out HELD_OUT_FLOOR and still fit on FIT_FLOOR (fewer than 16): nothing is held out;
the gate judges in-sample and says so (the build warns; STRICT_CALIB=1 refuses).  A k-fold estimate would
calibrate k times for a set too small to stand for served data anyway: more rows is the fix, not more folds.

`read_calibration` reads the data and cuts it so, once per run: the INT8 stage, its agreement gate, the FP16
scan and the detections' gate all take the one CalibrationParts it returns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from ..models.spec import ImagePreprocess
from ..pipeline.core.settings import DEFAULTS
from ..pipeline.folder.records import CalibrationSplit
from .readers import CalibrationData, CalibrationSource, graph_inputs, read_calibration_data, rows_of

HELD_OUT_SHARE = 0.2
# A mean over fewer rows is decided by one odd row; fewer fit rows than this are no calibration set.
HELD_OUT_FLOOR = 8
FIT_FLOOR = 8
HELD_OUT_BLOCKS = 4  # at most: spread over the set
HELD_OUT_RUN = 4  # rows per block at least (a source's siblings held out together)


@dataclass(frozen=True)
class HoldoutSplit:
    """Row indices into the calibration data (in the order the reader gives them): `fit` for the ranges and the
    smoothing statistics, `held_out` for the gate (empty when the set is too small), and the rule in words."""

    fit: np.ndarray
    held_out: np.ndarray
    rule: str

    @property
    def rows(self) -> int:
        return len(self.fit) + len(self.held_out)


def split_rows(count: int) -> HoldoutSplit:
    """The deterministic fit / held-out split of `count` calibration rows (the module's docstring says why)."""
    held = max(math.ceil(count * HELD_OUT_SHARE), HELD_OUT_FLOOR)
    if count - held < FIT_FLOOR:
        rule = (
            f"none held out: {count} rows cannot hold out {HELD_OUT_FLOOR} and fit on {FIT_FLOOR} "
            f"(at least {HELD_OUT_FLOOR + FIT_FLOOR}); fit on all, judged in-sample"
        )
        return HoldoutSplit(np.arange(count), np.arange(0), rule)
    blocks = max(1, min(HELD_OUT_BLOCKS, held // HELD_OUT_RUN))
    held_out = np.zeros(count, dtype=bool)
    spans = []
    for block in range(blocks):
        end = (block + 1) * count // blocks  # the end of segment `block` of `blocks` equal segments
        size = (block + 1) * held // blocks - block * held // blocks
        held_out[end - size : end] = True
        spans.append(f"{end - size}-{end - 1}")
    rule = (
        f"held out {held} of {count} rows ({HELD_OUT_SHARE:.0%}, at least {HELD_OUT_FLOOR}) in {blocks} block(s) of "
        f"consecutive rows at the end of each of {blocks} equal segments (rows {', '.join(spans)}); fit on the rest"
    )
    return HoldoutSplit(np.flatnonzero(~held_out), np.flatnonzero(held_out), rule)


@dataclass(frozen=True)
class CalibrationParts:
    """The calibration data as read (its description says where it came from), in batches of `batch` rows, and the
    same data cut by split_rows: the rows ranges and smoothing are fit on, the rows the agreement gate judges them on
    (None where the set is too small to hold any out), and the split's record.  The parts are cut on first use: the
    FP16 scan reads the data whole, and each part is a copy of its rows."""

    data: CalibrationData
    batch: int

    @cached_property
    def holdout(self) -> HoldoutSplit:
        """Which rows are fit on and which held out (the same rows for every reader of the same data: the split
        depends on the row count alone)."""
        return split_rows(self.data.samples)

    @property
    def split(self) -> CalibrationSplit:
        """The split as the manifest records it."""
        holdout = self.holdout
        return CalibrationSplit(holdout.rule, holdout.rows, tuple(int(row) for row in holdout.held_out))

    @cached_property
    def fit(self) -> CalibrationData:
        """The rows calibration fits on: every row where none can be held out."""
        fit, held_out = self.holdout.fit, self.holdout.held_out
        if not len(held_out):
            return self.data
        return rows_of(self.data, fit, self.batch, f"the {len(fit)} rows fit on")

    @cached_property
    def held_out(self) -> CalibrationData | None:
        """The rows calibration never sees; None where the set is too small to hold any out."""
        held_out = self.holdout.held_out
        if not len(held_out):
            return None
        return rows_of(self.data, held_out, self.batch, f"the {len(held_out)} held-out rows")


def read_calibration(
    source: CalibrationSource,
    fp32_path: Path,
    preprocess: ImagePreprocess | None,
    *,
    samples: int = DEFAULTS["calib_samples"],
    batch: int = DEFAULTS["calib_batch"],
) -> CalibrationParts:
    """The calibration data, checked against the FP32 graph's inputs, cut to `samples` rows in batches of `batch`
    (Settings' defaults unless told: --calib-samples, --calib-batch), to be split as split_rows says."""
    data = read_calibration_data(source, graph_inputs(fp32_path), preprocess, samples=samples, batch=batch)
    return CalibrationParts(data, batch)
