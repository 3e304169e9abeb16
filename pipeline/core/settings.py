"""One settings object for every stage, with defaults and a `check()`."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import PipelineError
from .precision import PRECISIONS, Precision

OPSET = 17  # fixed: TensorRT 10/11 and ONNX Runtime all read it; recorded in the manifest
BUILDERS = ("auto", "tensorrt", "tensorrt_rtx")
CALIB_METHODS = ("max", "percentile", "entropy")
# INT8: CALIB_METHOD=auto builds the graph with each of AUTO_CALIB_METHODS (times each SMOOTH candidate) and keeps the
# one with the lower error on the held-out calibration rows; the first is kept where no rows can be held out.
# Neither wins everywhere: max was the better on a trained sentence encoder's held-out rows (all-MiniLM-L6-v2,
# 0.063 vs 0.079 of the output's norm, calibrated on templated sentences), percentile clips the rare outliers of
# CNN activations (docs/benchmarks/int8-vs-modelopt.md).  Entropy is left out: slower, and never the better there.
CALIB_AUTO = "auto"
AUTO_CALIB_METHODS = ("percentile", "max")
# Who turns the model into ONNX: torch.onnx's TorchScript-based exporter, its torch.export-based one (dynamo), or
# auto: TorchScript, and dynamo where TorchScript's graph fails the checks (a declared axis baked inside a torch
# layer such as MultiheadAttention's Reshape); pipeline/stages/export.py.
EXPORTERS = ("auto", "torchscript", "dynamo")
# INT8: SmoothQuant-style smoothing of the activations MatMul/Gemm read (calibration/smooth.py), by its alpha, or off,
# or auto: the INT8 stage builds both (DEFAULT_SMOOTH_ALPHA and off) and keeps the one with the lower error on the
# held-out calibration rows.  Neither wins everywhere: alpha 0.9 is the best measured on a trained sentence encoder
# (all-MiniLM-L6-v2, docs/benchmarks/int8-encoder.md: 0.5 does not help it, 0.8 and 0.9 do, 0.9 most), while on a
# trained CNN smoothing its classifier Gemm costs 0.055 of mean cosine (docs/benchmarks/int8-vs-modelopt.md).
SMOOTH_OFF = "off"
SMOOTH_AUTO = "auto"
DEFAULT_SMOOTH_ALPHA = 0.9
# The GPUs an engine is built for.  default: TensorRT-RTX's documented ahead-of-time set (the full
# TensorRT always builds for the GPU it runs on); current: the GPU present at build time; or a
# comma-separated list of TensorRT-RTX compute capabilities, e.g. sm86,sm89.
TARGETS = ("default", "current")


@dataclass(frozen=True)
class BatchProfile:
    """The optimization profile's batch range: min <= opt <= max."""

    min: int = 1
    opt: int = 8
    max: int = 32

    @classmethod
    def parse(cls, text: str) -> BatchProfile:
        """Parse `min:opt:max` (or a single `n`, meaning n:n:n)."""
        parts = text.split(":")
        if len(parts) == 1:
            parts = parts * 3
        if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
            raise PipelineError(
                f"BATCH={text!r} is not of the form min:opt:max",
                "give three whole numbers, e.g. BATCH=1:8:32",
            )
        return cls(*(int(p) for p in parts))

    def check(self) -> None:
        if not 1 <= self.min <= self.opt <= self.max:
            raise PipelineError(
                f"batch profile {self} is not ordered 1 <= min <= opt <= max",
                "give e.g. BATCH=1:8:32",
            )

    def __str__(self) -> str:
        return f"{self.min}:{self.opt}:{self.max}"


@dataclass
class Settings:
    """Everything a run of the pipeline depends on.

    `model` is a registry name (`resnet`, `resnet18`, ...), `package.module:factory`,
    or a path to a checkpoint, TorchScript or ExportedProgram file.
    """

    model: str = "resnet"
    precision: Precision | str = Precision.FP16  # check() makes a str a Precision
    batch: BatchProfile = field(default_factory=BatchProfile)
    weights: Path | None = None
    input_shape: str | None = None
    dynamic: str | None = None
    out_root: Path = Path("engines")
    workspace_mib: int = 4096
    builder: str = "auto"
    exporter: str = "auto"
    target: str = "default"
    keep_fp32: str | None = None  # FP16: node names or op types kept in FP32, comma-separated
    auto_fp32: bool = True  # FP16: keep the nodes whose values float16 cannot hold in FP32
    trust_model_file: bool = False  # load a whole pickled nn.Module file (runs the code it names)
    calib: Path | None = None
    calib_method: str = CALIB_AUTO  # int8: one of CALIB_METHODS, or "auto"
    calib_samples: int = 256
    calib_batch: int = 16
    smooth: str = SMOOTH_AUTO  # int8: SmoothQuant alpha in (0, 1] for MatMul/Gemm activations, "off" or "auto"
    recalibrate: bool = False
    # int8: refuse (instead of warning) when the held-out calibration rows are much worse than the fit ones, or
    # none could be held out (pipeline/stages/parity.py MUCH_WORSE_RATIO): the data cannot stand for served inputs.
    strict_calib: bool = False
    # int8: try leaving the op where the held-out error starts in float (calibration/int8.py); False: every op INT8.
    float_search: bool = True
    force: bool = False

    def check(self) -> Settings:
        """Reject bad values and bad combinations; returns self so calls can chain."""
        if self.precision not in PRECISIONS:
            raise PipelineError(
                f"unknown precision {self.precision!r}",
                f"use one of {', '.join(PRECISIONS)} (PRECISION=fp16 is the default)",
            )
        self.precision = Precision(self.precision)
        if self.builder not in BUILDERS:
            raise PipelineError(f"unknown builder {self.builder!r}", f"use one of {', '.join(BUILDERS)}")
        if self.exporter not in EXPORTERS:
            raise PipelineError(f"unknown exporter {self.exporter!r}", f"use one of {', '.join(EXPORTERS)}")
        check_target(self.target)
        self.calib_methods()
        self.smooth_alphas()
        self.batch.check()
        if self.workspace_mib < 16:
            raise PipelineError(f"workspace of {self.workspace_mib} MiB is too small", "give at least 16 MiB")
        if self.weights is not None and not Path(self.weights).is_file():
            raise PipelineError(f"weights file {self.weights} does not exist", "give the path of a state_dict (.pth)")
        if self.precision == "int8" and self.calib is None:
            raise PipelineError(
                "PRECISION=int8 needs calibration data and none was given",
                "add CALIB=<folder of images, or a .npy/.npz file> (e.g. CALIB=calibration/samples); "
                "no synthetic data is used for calibration",
            )
        if self.calib_samples < 1 or self.calib_batch < 1:
            raise PipelineError("calibration samples and batch must be at least 1", "give positive numbers")
        return self

    def calib_methods(self) -> tuple[str, ...]:
        """CALIB_METHOD as the calibration methods the INT8 stage tries, first the one it keeps without held-out
        rows to choose by; a PipelineError for anything else."""
        if self.calib_method == CALIB_AUTO:
            return AUTO_CALIB_METHODS
        if self.calib_method not in CALIB_METHODS:
            raise PipelineError(
                f"unknown calibration method {self.calib_method!r}",
                f"use one of {', '.join(CALIB_METHODS)} or {CALIB_AUTO} (the default: "
                f"{' and '.join(AUTO_CALIB_METHODS)}, the better on held-out rows kept)",
            )
        return (self.calib_method,)

    def smooth_alphas(self) -> tuple[float | None, ...]:
        """SMOOTH as the SmoothQuant alphas the INT8 stage tries (None: off), first the one it keeps without
        held-out rows to choose by; a PipelineError for anything else."""
        text = str(self.smooth).strip().lower()
        if text == SMOOTH_AUTO:
            return (DEFAULT_SMOOTH_ALPHA, None)
        if text == SMOOTH_OFF:
            return (None,)
        try:
            alpha = float(text)
        except ValueError:
            alpha = float("nan")
        if not 0 < alpha <= 1:  # NaN fails too
            raise PipelineError(
                f"SMOOTH={self.smooth!r} is neither a smoothing alpha, {SMOOTH_OFF!r} nor {SMOOTH_AUTO!r}",
                f"give a number in (0, 1] (SmoothQuant's migration strength, e.g. SMOOTH=0.9), SMOOTH={SMOOTH_OFF} "
                f"or SMOOTH={SMOOTH_AUTO} (both, the better on held-out rows kept)",
            )
        return (alpha,)

    def fp32_nodes(self) -> list[str]:
        """--keep-fp32 as a list of node names or op types."""
        return [name.strip() for name in (self.keep_fp32 or "").split(",") if name.strip()]

    def artifact_dir(self, model_name: str) -> Path:
        """engines/<model>-<precision>/ for a canonical model name."""
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", model_name).strip("_") or "model"
        return Path(self.out_root) / f"{slug}-{self.precision}"

    def as_record(self) -> dict:
        """A JSON-ready copy, for the manifest and for the reuse key."""
        record = asdict(self)
        record["batch"] = str(self.batch)
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in record.items()}


def check_target(target: str) -> None:
    """`default`, `current`, or a list of compute capabilities named as TensorRT-RTX names them (sm86,sm89)."""
    names = [name.strip().lower() for name in target.split(",")]
    if target in TARGETS or all(re.fullmatch(r"sm\d{2,3}", name) for name in names):
        return
    raise PipelineError(
        f"unknown build target {target!r}",
        "give TARGET=default (TensorRT-RTX's documented GPUs), TARGET=current (the GPU of this machine), "
        "or compute capabilities such as TARGET=sm86,sm89",
    )
