"""The INT8 stage's records (calibration/int8.py makes them): its configuration, each candidate graph, what the fit
rows gave a smoothing alpha, the search over candidates, and the graphs written with the stage's result."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..pipeline.folder.records import RowsAgreement, worst_output
from .bias import BiasShifts
from .cache import CacheLookup
from .qdq_write import QuantizedWeights
from .ranges import Shared, method_options
from .readers import Feed
from .smooth import smoothing_options

QDQ_GRAPH = "model.qdq.onnx"  # each candidate's Q/DQ graph, in its scratch folder


@dataclass(frozen=True)
class CalibrationConfig:
    """The calibration part of Settings (CALIB_METHOD, --recalibrate, SMOOTH, NO_FLOAT_SEARCH); --calib-samples and
    --calib-batch are the data's, read once per run (calibration/holdout.py read_calibration -> CalibrationParts).

    methods: the calibration methods (calibration/ranges.py), each with each smoothing alpha a candidate graph;
    with a judge and held-out rows the one with the lower held-out error is kept, else the first (Settings:
    CALIB_METHOD=auto tries percentile and max).
    smooth_alphas: SmoothQuant's alphas for the activations MatMul/Gemm read (calibration/smooth.py; None: not
    smoothed), each a candidate graph; with a judge and held-out rows the one with the lower held-out error is kept,
    else the first.  Off unless asked for here; Settings (SMOOTH=auto) tries 0.9 and off for the pipeline.
    float_search: with a judge and held-out rows, try leaving the op where the held-out error starts in float
    (calibration/float_search.py); on for the pipeline unless NO_FLOAT_SEARCH.
    Called directly (a test, a benchmark), it builds one candidate with no search unless told; the pipeline's
    search comes from Settings through from_settings, the one place the two meet.
    """

    methods: tuple[str, ...] = ("percentile",)
    recalibrate: bool = False
    smooth_alphas: tuple[float | None, ...] = (None,)
    float_search: bool = False

    @classmethod
    def from_settings(cls, settings) -> CalibrationConfig:
        return cls(
            methods=settings.calib_methods(),
            recalibrate=settings.recalibrate,
            smooth_alphas=settings.smooth_alphas(),
            float_search=settings.float_search,
        )

    @staticmethod
    def options(method: str, alpha: float | None) -> dict:
        """One candidate's calibrator options and smoothing: what the manifest records and the cache key covers."""
        return {**method_options(method), "smooth_alpha": alpha, **smoothing_options(alpha)}


@dataclass(frozen=True)
class Candidate:
    """One way of quantizing the graph (a calibration method and a smoothing alpha): its calibrated FP32 graph,
    ranges, the weights' input means there (bias correction's) and Q/DQ graph, and how it was judged.
    collect_seconds and collect_passes: those of the passes over the fit rows its smoothing's graph took (shared
    by every candidate of the same alpha; 0 where the cache had it all)."""

    method: str
    alpha: float | None
    calibrated: Path
    ranges: object
    scales: dict[str, np.ndarray]
    means: dict[str, np.ndarray]
    lookup: CacheLookup
    cache_file: Path
    collect_seconds: float
    collect_passes: int
    qdq: Path
    structure: dict
    weights: QuantizedWeights  # its smoothing alpha's, shared by every Q/DQ graph made from `calibrated`
    shifts: BiasShifts  # its smoothing alpha's bias corrections' shifts, shared as the weights are
    held_out: dict[str, RowsAgreement] | None = None  # each output's, on the held-out rows (the judge's)
    float_ops: tuple[str, ...] = ()
    # Where `calibrated` has every Conv/Gemm bias corrected (calibration/bias.py; the CPU graphs, which quantize
    # every op, are made from it): the graph before, FP32's equal, from which ops kept in float are quantized.
    uncorrected: Path | None = None
    bias_correction: dict | None = None  # the held-out errors before and after it, and whether it was kept

    @property
    def judged(self) -> RowsAgreement | None:
        """Its worst output on the held-out rows: what the picks compare (None where it was not judged)."""
        return worst_output(self.held_out)[1] if self.held_out else None

    @property
    def fp32_equal(self) -> Path:
        """Its calibrated graph before any bias correction: equal to the FP32 graph in exact arithmetic."""
        return self.uncorrected or self.calibrated

    def as_record(self) -> dict:
        """Its method, alpha and held-out numbers as compared (its biases corrected where that was kept)."""
        judged = self.judged
        numbers = {"error_mean": judged.error_mean, "cosine_min": judged.cosine_min} if judged else {}
        held_out = {f"held_out_{k}": float(f"{v:.6g}") for k, v in numbers.items()}
        corrected = {"biases_corrected": self.bias_correction["kept"]} if self.bias_correction else {}
        return {"method": self.method, "smooth_alpha": self.alpha, **held_out, **corrected}

    @property
    def label(self) -> str:
        return f"{self.method}, {_alpha_text(self.alpha)}"


@dataclass(frozen=True)
class Fitted:
    """What the fit rows gave one smoothing alpha: its scales, the FP32 graph smoothed with them (calibrated_graph),
    the ranges measured on that graph by method (not those the cache had), the weights' input means there, the
    channel maxima measured on the way (the unsmoothed graph's, where scales were to come from them) and the graph's
    outputs beside them, the passes over the fit rows and seconds that took, and its weights' Q/DQ, made as its
    candidates' graphs ask for them."""

    scales: dict[str, np.ndarray]
    calibrated: Path
    ranges: dict[str, object]
    means: dict[str, np.ndarray]
    maxima: dict[str, np.ndarray]
    passes: int
    seconds: float
    shared: Shared | None = None  # what its passes kept for a smoothed graph's (calibration/ranges.py ChangedPart)
    outputs: list[Feed] | None = None
    weights: QuantizedWeights = field(default_factory=QuantizedWeights)  # the Q/DQ of `calibrated`'s weights
    shifts: BiasShifts = field(default_factory=BiasShifts)  # its candidates' bias corrections' shifts


@dataclass(frozen=True)
class Search:
    """Every candidate tried, judged on the held-out rows where there is a judge, and the one kept; the weights'
    input means at its smoothing (bias correction's, None where nothing was judged), its ops' multiply-adds, and
    the record of the float search (None where it did not run)."""

    tried: tuple[Candidate, ...]
    chosen: Candidate
    means: dict[str, np.ndarray] | None
    macs: dict[str, int]
    float_search: dict | None = None


@dataclass(frozen=True)
class CpuGraph:
    """One graph for ONNX Runtime's CPU kernels: its structure and kernels, or why it could not be made."""

    graph: str
    details: dict
    failed: str | None = None

    def as_json(self) -> dict:
        return {"graph": self.graph, "failed": self.failed} if self.failed else {"graph": self.graph, **self.details}


@dataclass(frozen=True)
class Int8Graphs:
    """What was written: the engine's Q/DQ graph (its file name), the CPU graphs by kind of CPU, and the share of
    the compute the engine's graph runs in INT8."""

    engine: str
    cpu: dict[str, CpuGraph]
    share: dict


@dataclass(frozen=True)
class Int8Result:
    """The INT8 stage's result: the calibration record (the manifest's `calibration`), the engine graph's Q/DQ
    structure, the CPU graphs by kind (those not written say why), the stage's line, and the kept candidate (its
    ranges, and its calibrated graph before any correction, fp32_equal: the FP32 graph, or a file of the scratch
    folder, valid while it is); and the FP32 graph's outputs on the fit rows, batch by batch, where calibration's
    maxima pass kept them (at the level the graph runs at: the agreement gate's in-sample reference,
    pipeline/evaluation/agreement.py Fp32Reference.add), None where it did not."""

    calibration: dict
    qdq: dict
    cpu: dict[str, CpuGraph]
    summary: str
    chosen: Candidate
    fp32_fit_outputs: list[Feed] | None

    @property
    def written_cpu_graphs(self) -> dict[str, str]:
        """{kind of CPU: graph file} of the CPU graphs written."""
        return {kind: graph.graph for kind, graph in self.cpu.items() if graph.failed is None}

    def as_json(self) -> dict:
        cpu = {"qdq_onnxruntime_cpu": {kind: graph.as_json() for kind, graph in self.cpu.items()}} if self.cpu else {}
        return {"summary": self.summary, "calibration": self.calibration, "qdq": self.qdq, **cpu}


def _alpha_text(alpha: float | None) -> str:
    return f"alpha {alpha:g}" if alpha else "off"
