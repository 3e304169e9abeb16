"""INT8's float search: after the pick of method and smoothing, the quantized op where the held-out error starts is
tried in float, and kept there where that buys enough accuracy for the compute it gives up (calibration/int8.py
runs it between judging the candidates and writing the graphs)."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..pipeline.core.compute import COMPUTE_OPS
from ..pipeline.core.precision import Precision
from ..pipeline.evaluation.agreement import Judge
from ..pipeline.evaluation.layers import first_node_past
from ..pipeline.folder.graph_files import remove_graph
from ..pipeline.folder.layout import graph_record
from ..pipeline.folder.records import worst_output
from .bias import correct_biases, corrected_path
from .holdout import CalibrationParts
from .int8_records import QDQ_GRAPH, CalibrationConfig, Candidate, Search
from .qdq import quantize_qdq
from .quantizable import quantizable_graph
from .share import int8_share

# After the pick of method and smoothing, the quantized op where the held-out error starts (the first node past the
# gate's level, traced back to its Conv/Gemm/MatMul) is tried in float, up to FLOAT_OPS_TRIED times.  It stays in
# float when the held-out error falls by FLOAT_MIN_GAIN or more and by at least FLOAT_GAIN_PER_SHARE times the share
# of the multiply-adds it takes out of INT8 (accuracy bought per compute given up), while INT8 still computes
# MIN_INT8_SHARE of them (ModelOpt leaves 0.33% of EfficientNet-Lite0 in float, its classifier).  On
# EfficientNet-Lite0 that is the first block's depthwise conv: 0.94% of the compute, a quarter of the error.
FLOAT_OPS_TRIED = 2
FLOAT_SEARCH_FROM = 0.05  # held-out error (of the output's norm) under which none is tried (ResNet-50 on photos: 0.025)
FLOAT_MIN_GAIN = 0.1
FLOAT_GAIN_PER_SHARE = 10.0
MIN_INT8_SHARE = 0.99


def search_float(
    search: Search, parts: CalibrationParts, config: CalibrationConfig, judge: Judge | None, scratch: Path
) -> Search:
    """The kept candidate with the ops kept in float that earned it (_keep_float), where the float search is on and
    the candidates were judged; else as it was."""
    if judge is None or parts.held_out is None or search.means is None or not config.float_search:
        return search
    chosen, record = _keep_float(search.chosen, search.means, parts.held_out.batches, judge, search.macs, scratch)
    return replace(search, chosen=chosen, float_search=record)


def _quantized(
    candidate: Candidate, exclude: tuple[str, ...], means: dict[str, np.ndarray] | None, scratch: Path
) -> tuple[Path, dict]:
    """(Q/DQ graph, its structure) for the candidate's FP32 graph (before any correction) with the ops in `exclude`
    left in float, written in `scratch`; with `means` (the candidate's), its biases corrected for the rounding of
    the weights it quantizes, which are the candidate's Q/DQ graph's (the same weights, the same ranges)."""
    scratch.mkdir(parents=True)
    calibrated, qdq = candidate.fp32_equal, scratch / QDQ_GRAPH
    if means is None:
        return qdq, quantize_qdq(calibrated, qdq, candidate.ranges, exclude=exclude, weights=candidate.weights)
    corrected = corrected_path(calibrated, "float-search")
    try:
        correct_biases(calibrated, candidate.qdq, means, corrected, skip=exclude, shifts=candidate.shifts)
        return qdq, quantize_qdq(corrected, qdq, candidate.ranges, exclude=exclude, weights=candidate.weights)
    finally:
        remove_graph(corrected)  # the quantizer's input alone


def _keep_float(
    chosen: Candidate,
    means: dict[str, np.ndarray],
    held_out: list[dict[str, np.ndarray]],
    judge: Judge,
    macs: dict[str, int],
    scratch: Path,
) -> tuple[Candidate, dict]:
    """(the candidate with the ops kept in float that earned it, the record of every op tried): see FLOAT_OPS_TRIED."""
    assert chosen.judged is not None  # _correct_biases judged every candidate
    current, error = chosen, chosen.judged.error_mean
    tried: list[dict] = []
    if error < FLOAT_SEARCH_FROM:
        return current, {"rule": f"not tried: held-out error {error:.3g} < {FLOAT_SEARCH_FROM}"}
    for attempt in range(FLOAT_OPS_TRIED):
        op = _where_error_starts(current, held_out[0])
        if op is None or op in current.float_ops:
            break
        float_ops = (*current.float_ops, op)
        correct = means if current.uncorrected else None
        path, structure = _quantized(current, float_ops, correct, scratch / str(attempt))
        share = int8_share(path, macs)["int8_compute_share"]
        outputs = judge(path, held_out)
        _, agreement = worst_output(outputs)
        gain = 1 - agreement.error_mean / error
        given_up = int8_share(current.qdq, macs)["int8_compute_share"] - share
        kept = gain >= max(FLOAT_MIN_GAIN, FLOAT_GAIN_PER_SHARE * given_up) and share >= MIN_INT8_SHARE
        tried.append(
            {
                "op": op,
                "held_out_error_mean": float(f"{agreement.error_mean:.6g}"),
                "held_out_cosine_min": float(f"{agreement.cosine_min:.6g}"),
                "int8_compute_share": float(f"{share:.6g}"),
                "kept_in_float": kept,
            }
        )
        if not kept:  # its graphs are never read again (the 1.1B LM's 1.3 GB try stayed through the CPU graphs)
            shutil.rmtree(path.parent, ignore_errors=True)
            break
        if current.qdq.parent.parent == scratch:  # the try this one replaces
            shutil.rmtree(current.qdq.parent, ignore_errors=True)
        current = replace(current, qdq=path, structure=structure, held_out=outputs, float_ops=float_ops)
        error = agreement.error_mean
    rule = (
        f"the quantized op where the held-out error starts, kept in float when that cuts it by {FLOAT_MIN_GAIN:.0%} "
        f"and by {FLOAT_GAIN_PER_SHARE:g}x the share of the compute it leaves in float, with {MIN_INT8_SHARE:.0%} of "
        f"the multiply-adds still INT8; up to {FLOAT_OPS_TRIED}, judged on the held-out rows"
    )
    return current, {"rule": rule, "tried": tried}


def _where_error_starts(candidate: Candidate, inputs: dict[str, np.ndarray]) -> str | None:
    """The Conv/Gemm/MatMul feeding the first node past the gate's level on these rows (trt-pipeline diagnose's
    first node), traced back through the ops between them; None where no node is past it."""
    # FP32's equal, not the corrected graph: corrected biases are no reference.
    first = first_node_past(candidate.fp32_equal, candidate.qdq, inputs, graph_record(Precision.INT8))
    if first is None:
        return None
    model = quantizable_graph(candidate.calibrated)
    producer = {output: node for node in model.graph.node for output in node.output}
    node = next(node for node in model.graph.node if node.name == first.node)
    while node is not None and node.op_type not in COMPUTE_OPS:
        node = producer.get(node.input[0]) if node.input else None
    return node.name if node is not None else None
