"""An INT8 graph against the FP32 graph on rows of calibration-like data: each row's |int8 - fp32| / |fp32| and
cosine, by output (what the agreement gate judges and calibration's picks compare: one evaluation for both)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..core.precision import Precision
from ..core.sessions import return_freed_memory
from ..folder.graph_files import graph_without_weights
from ..folder.layout import graph_record
from ..folder.records import RowsAgreement
from . import evaluation_session, graph_session

Feeds = dict[str, np.ndarray]
# Judges a candidate INT8 graph on rows it never saw: (graph, batches) -> each output's agreement with FP32 (the
# picks compare the worst: records.worst_output; the gate takes the kept graph's as its held-out numbers).
Judge = Callable[[Path, list[Feeds]], dict[str, RowsAgreement]]


def fp32_outputs(session, batches: list[Feeds], rows: int | None = None) -> list[dict[str, np.ndarray]]:
    """The FP32 graph's outputs (its `session`), batch by batch, `rows` rows a run (None: a batch a run)."""
    names = [output.name for output in session.get_outputs()]
    return [dict(zip(names, run_in_rows(session, names, feeds, rows), strict=True)) for feeds in batches]


def outputs_agreement(session, batches: list[Feeds], fp32: Fp32Reference) -> dict[str, RowsAgreement]:
    """Each output of `session` (a graph of `fp32`'s, quantized) on `batches` against the FP32 graph's outputs on
    them, run as many rows at a time as the FP32 graph's are."""
    expected = fp32.outputs(batches)
    names = list(expected[0])
    rows: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {name: [] for name in names}
    for feeds, wanted in zip(batches, expected, strict=True):
        actual = dict(zip(names, run_in_rows(session, names, feeds, fp32.rows_per_run(feeds)), strict=True))
        for name in names:
            rows[name].append(_row_errors(wanted[name], actual[name]))
    return {name: _agreement_record(pairs) for name, pairs in rows.items()}


def run_in_rows(session, names: list[str], feeds: Feeds, rows: int | None) -> list[np.ndarray]:
    """session.run of `names` on `feeds` `rows` rows at a time (tensors.rows_per_run), each output put back together
    (the held-out numbers of every INT8 candidate, and the gate's, the same to 6 digits as one run's on
    EfficientNet-Lite0, MiniLM, the 0.6 GB MLP and ViT-L/16)."""
    runs = [session.run(names, run) for run in in_rows(feeds, rows)]
    return [joined(list(parts)) for parts in zip(*runs, strict=True)]


def joined(parts: list[np.ndarray]) -> np.ndarray:
    """The runs' values of one tensor put back together, rows in order (one run's as it is)."""
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def in_rows(feeds: Feeds, rows: int | None) -> list[Feeds]:
    """`feeds` cut into runs of `rows` rows at most (None: one run).  In inference each row computes alone, so the
    runs give the rows' values one run would (a maximum over rows, the maximum of the runs')."""
    count = len(next(iter(feeds.values())))
    step = rows or count
    return [{name: value[start : start + step] for name, value in feeds.items()} for start in range(0, count, step)]


def rows_agreement(expected: dict[str, np.ndarray], actual: dict[str, np.ndarray]) -> dict[str, RowsAgreement]:
    """Each output of one batch against `expected` (the FP32 graph's outputs on the same rows)."""
    return {name: _agreement_record([_row_errors(wanted, actual[name])]) for name, wanted in expected.items()}


class Fp32Reference:
    """The FP32 graph INT8 graphs are judged against, and its outputs on each list of batches, run once: one per
    precision stage, handed to calibration's judge and to the agreement gate, which judge on the same held-out rows
    (each opened the FP32 graph alike, by graph_session, and ran it on them again).  A session opens for each list
    not run yet and closes once its outputs are had: held through the judging, its mapped weights counted in the
    process's memory beside the INT8 graph's (ViT-L/16's 1.2 GB), for two runs.  So a caller has a list's outputs
    before it opens the INT8 graph it compares with them: ViT-L/16's first judge, which opened its candidate first,
    held both graphs' weights (the Q/DQ session's 1.2 GB folded from its int8 ones) and peaked at 3.43 GB, the
    next ones at 2.3-2.7 GB."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # By the list's id, the list kept beside its outputs: a list freed and another made at its address would
        # otherwise be taken for it.  The lists are the calibration parts' (cached), never changed once read.
        self._outputs: dict[int, tuple[list[Feeds], list[dict[str, np.ndarray]]]] = {}
        self._rows: tuple[int | None] | None = None  # rows_per_run's answer, once found

    def rows_per_run(self, feeds: Feeds) -> int | None:
        """How many rows a run of this graph, or of a graph quantized from it, takes (tensors.rows_per_run, found once
        at `feeds`' first row: every list of batches has rows of the same shapes)."""
        if self._rows is None:
            from .tensors import rows_per_run  # onnx: the runtime's host check imports this module, never this

            self._rows = (rows_per_run(graph_without_weights(self.path), feeds),)
        return self._rows[0]

    def add(self, batches: list[Feeds], outputs: list[dict[str, np.ndarray]]) -> None:
        """The graph's `outputs` on `batches`, batch by batch, computed elsewhere at the level it runs at (the INT8
        stage's maxima pass: calibration/ranges.py GraphOutputs): not run again."""
        self._outputs[id(batches)] = (batches, outputs)

    def outputs(self, batches: list[Feeds]) -> list[dict[str, np.ndarray]]:
        """The FP32 graph's outputs on `batches`, batch by batch, run on the first call for this list."""
        if id(batches) not in self._outputs:
            outputs = fp32_outputs(graph_session(self.path), batches, self.rows_per_run(batches[0]))
            self._outputs[id(batches)] = (batches, outputs)
        return self._outputs[id(batches)][1]


def int8_judge(reference: Fp32Reference) -> Judge:
    """The gate's evaluation as a judge of candidate INT8 graphs for the engine (calibration/int8.py keeps the best
    on the held-out rows): (graph, batches) -> each output's agreement with the FP32 graph on those batches."""
    engine_int8 = graph_record(Precision.INT8)  # a candidate is judged as the engine's graph it would become

    def judge(int8_path: Path, batches: list[Feeds]) -> dict[str, RowsAgreement]:
        reference.outputs(batches)  # before the INT8 graph opens (Fp32Reference)
        agreement = outputs_agreement(evaluation_session(engine_int8, int8_path), batches, reference)
        return_freed_memory()  # its session's, closed: the weights it folded from int8 (ViT-L/16's 1.2 GB)
        return agreement

    return judge


def _row_errors(expected: np.ndarray, actual: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: (|actual - expected| / |expected|, cosine), on the flattened row."""
    left = expected.reshape(len(expected), -1).astype(np.float64)
    right = actual.reshape(len(actual), -1).astype(np.float64)
    norm_left, norm_right = np.linalg.norm(left, axis=1), np.linalg.norm(right, axis=1)
    error = np.linalg.norm(right - left, axis=1) / np.maximum(norm_left, 1e-30)
    cosine = np.sum(left * right, axis=1) / np.maximum(norm_left * norm_right, 1e-30)
    return error, cosine


def _agreement_record(pairs: list[tuple[np.ndarray, np.ndarray]]) -> RowsAgreement:
    error = np.concatenate([pair[0] for pair in pairs])
    cosine = np.concatenate([pair[1] for pair in pairs])
    return RowsAgreement(
        rows=len(error),
        error_mean=float(error.mean()),
        error_max=float(error.max()),
        cosine_mean=float(cosine.mean()),
        cosine_min=float(cosine.min()),
    )
