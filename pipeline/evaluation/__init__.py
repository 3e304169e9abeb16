"""Evaluation: how a graph is judged, with what tolerance, so that every gate, report and pick computes what serves it.

One owner for the stages (parity, agreement), the tools (accuracy, diagnose) and calibration's picks, which import
it and never each other.  This module stays light (ONNX Runtime through pipeline/core/sessions.py, no onnx), so the
runners may import it; the parts that rewrite graphs (onnx) are its submodules: float16.py (the faithful float16
copy), tensors.py (running a graph with its intermediate tensors exposed), layers.py (where a graph departs from
FP32, node by node) and agreement.py (an INT8 graph's rows against FP32's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..core.precision import Precision
from ..core.sessions import level_that_opens, onnxruntime_session
from ..folder.graph_files import graph_beside, graph_without_weights
from ..folder.records import Evaluation, GraphRecord

CPU_PROVIDER = "CPUExecutionProvider"
# Tolerances on max |onnx - torch| relative to the output's largest magnitude.
# FP32 graphs differ from PyTorch by reassociation only (measured ~1e-6 on ResNet-50);
# FP16 carries 10-bit mantissas through ~50 layers.  INT8 on the reference inputs is a smoke check
# only: they are N(0, 1) noise, and noise outside the calibrated input range is clipped by the first
# QuantizeLinear, so its error there measures the noise, not the graph (digits, calibrated on pixels in
# [-1, 1]: 0.58 of the output scale; a model whose float mask input gets noise: 0.97, with 0.007 on its
# calibration data).  So it fails only on inf or NaN; its error is recorded beside 1.0 for reference, and
# INT8's gate is the agreement on the calibration data (INT8_MAX_ERROR).
RTOL: dict[Precision, float] = {Precision.FP32: 1e-3, Precision.FP16: 3e-2, Precision.INT8: 1.0}
# INT8's gate, on the calibration data (inputs like the ones served): the mean over rows of
# |int8 - fp32| / |fp32| (Euclidean norms of each row's output).  It sees what a cosine cannot: a ReLU
# network with one weight scale off by 10x has all its outputs 10x too large and a cosine near 1.
# 0.2 is a cosine of 0.98 at equal norms; measured: digits 0.01 (see the manifest's agreement_int8).
# It judges the calibration rows held out from the ranges' fit (calibration/holdout.py), where there are any.
INT8_MAX_ERROR = 0.2


def node_tolerance(precision: Precision) -> float:
    """How far a node's output may be from FP32's, relative to its scale: FP16's parity tolerance; for INT8 its
    gate's level on the calibration data (INT8_MAX_ERROR), not the 1.0 of the smoke check on random inputs,
    under which no node of a refused graph would ever be named."""
    return INT8_MAX_ERROR if precision is Precision.INT8 else RTOL[precision]


def simulates_qdq(graph: GraphRecord, providers: list[Any] | None = None) -> bool:
    """Whether `graph` runs with its Q/DQ simulated in float, as TensorRT computes them, on these providers: on the
    CPU provider alone (ORT's fused int8 kernels would compute something else, saturating without VNNI)."""
    on_cpu = all((p[0] if isinstance(p, tuple) else p) == CPU_PROVIDER for p in providers or [CPU_PROVIDER])
    return on_cpu and graph.evaluation is Evaluation.SIMULATED_QDQ


def evaluation_session(
    graph: GraphRecord,
    source: Path | bytes,
    *,
    faithful_fp16: bool = True,
    probe_feed: dict | None = None,
    level: str | None = None,
):
    """The ONNX Runtime session (CPU) that computes what serves `graph` (its record says how: GraphRecord.evaluation),
    on the graph file or bytes `source`: float16 as the engine stores it (faithful_fp16=False: as ONNX Runtime's CPU
    provider runs it, through casts to float32, as its runner serves it), Q/DQ as TensorRT computes them, a graph
    shaped for ONNX Runtime's CPU on its own int8 kernels, any other as it is.  probe_feed: run once in a child
    first; level: the optimization level to open at, probed already (pipeline/core/sessions.py)."""
    if faithful_fp16 and graph.evaluation is Evaluation.FAITHFUL_FP16:
        from .float16 import faithful_session  # onnx: kept out of the runtime, which never judges float16

        return faithful_session(source)
    if isinstance(source, bytes):
        return onnxruntime_session(source, simulate_qdq=simulates_qdq(graph), probe_feed=probe_feed, level=level)
    return graph_session(source, simulate_qdq=simulates_qdq(graph), probe_feed=probe_feed, level=level)


def graph_session(path: Path, *, simulate_qdq: bool = False, probe_feed: dict | None = None, level: str | None = None):
    """A CPU session on the graph file `path` for the build's few runs, holding no copy of its weights: ONNX Runtime
    maps them from disk where they lie and packs none (a graph of one file too, opened through a graph beside it
    whose initializers name their bytes in it: pipeline.folder.graph_files.graph_beside).  At 1.2 GB of weights
    that is 0.01 s and no memory to open, against 4.4 s and 1.2 GB by the path of a graph of one file and 5.7 s and
    3.6 GB by its bytes.  Crashes are probed, and the level recorded, for `path` itself (pipeline/core/sessions.py),
    unless `level` was probed already."""
    path = Path(path)
    with graph_beside(graph_without_weights(path), path.parent) as mapped:
        if level is None:
            level = level_that_opens(path, lambda chosen: _mapped(mapped, chosen, simulate_qdq), probe_feed)
        return _mapped(mapped, level, simulate_qdq)


def probe_graph(path: Path, feed: dict, *, simulate_qdq: bool = False) -> str:
    """The optimization level the runner opens the graph file `path` at (recorded in the manifest), probed with one
    run of `feed` in a child as graph_session opens it: its weights mapped, none packed.  The level is the
    optimizer's choice (ONNX Runtime crashed optimizing a TransformerEncoder's FP16 graph at full optimization);
    packing the weights for the kernels, which the probe leaves out, happens after it at every level.  Opening the
    graph itself with its weights packed cost 7.5 s of the FP16 stage's 30 s at 2.4 GB, in a child."""
    path = Path(path)
    with graph_beside(graph_without_weights(path), path.parent) as mapped:
        return level_that_opens(path, lambda chosen: _mapped(mapped, chosen, simulate_qdq), feed)


def _mapped(graph: Path, level: str, simulate_qdq: bool):
    return onnxruntime_session(graph, level=level, simulate_qdq=simulate_qdq, pack_weights=False)
