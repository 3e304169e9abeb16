"""One settings object for every stage, each setting declared once (`setting`), with defaults and a `check()`."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .errors import PipelineError
from .mentions import span
from .nms_config import BOX_FORMATS, NmsConfig
from .precision import PRECISIONS, Precision, TextEnum

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
# layer such as MultiheadAttention's Reshape); dynamo first past 1 GiB of weights (its graph held in memory, TorchScript
# takes about three copies of them); pipeline/stages/export.py.
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


class Postprocess(TextEnum):
    """What the served graphs end in: the model's own outputs, or (nms) a detector's raw head thinned by greedy NMS
    into detections of fixed sizes, appended to each graph the folder serves (pipeline/stages/postprocess.py)."""

    NONE = "none"
    NMS = "nms"


POSTPROCESSES: tuple[str, ...] = tuple(postprocess.value for postprocess in Postprocess)
_NMS = NmsConfig()  # the NMS settings' defaults are NmsConfig's


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
                f"{mention(batch=text)} is not of the form min:opt:max",
                f"give three whole numbers, e.g. {mention(batch='1:8:32')}",
            )
        return cls(*(int(p) for p in parts))

    def check(self) -> None:
        if not 1 <= self.min <= self.opt <= self.max:
            raise PipelineError(
                f"batch profile {self} is not ordered 1 <= min <= opt <= max",
                f"give e.g. {mention(batch='1:8:32')}",
            )

    def __str__(self) -> str:
        return f"{self.min}:{self.opt}:{self.max}"


SETTING = "setting"  # the key of a Settings field's metadata that holds its Declared
FP16_AND_INT8 = (Precision.FP16, Precision.INT8)  # the precisions that read CALIB (FP16 scans it for overflow)
INT8_ONLY = (Precision.INT8,)
FP16_ONLY = (Precision.FP16,)


@dataclass(frozen=True)
class Declared:
    """What a Settings field says besides its name, type and default (see `setting`)."""

    make: str
    help: str
    precisions: tuple[Precision, ...]
    decides: bool
    parse: Callable[[str], Any]
    choices: tuple[str, ...] | None
    postprocess: Postprocess | None
    reads_calib: bool


def setting(
    default: Any,
    *,
    make: str,
    help: str,
    precisions: tuple[Precision, ...] = tuple(Precision),
    decides: bool = True,
    parse: Callable[[str], Any] = str,
    choices: tuple[str, ...] | None = None,
    postprocess: Postprocess | None = None,
    reads_calib: bool = False,
) -> Any:
    """A Settings field, declared once for every front end.

    make: its make variable; the command line's option is named from it (CALIB_METHOD: --calib-method,
      core/mentions.py option_of), and so is the Makefile's argument.  A bool is a switch given as NO_FLOAT_SEARCH=1
      / --no-float-search (or --no-float-search=yes), which sets the value opposite its default (read_switch).
    precisions: the precisions whose artifacts it changes; given for another it would do nothing, so it is refused.
    decides: it decides the folder's artifacts: the reuse key holds it (for its precisions) and the command that
      writes the folder again repeats it.  False: how a run goes (FORCE), or where the folder lies (OUT).
    parse, choices: how the option's text is read, and the values it may take.
    postprocess: the POSTPROCESS it configures (nms); given with another, it would do nothing, so it is refused.
    reads_calib: it says how CALIB is read; given without CALIB (an FP16 build need not have one), it would do
      nothing, so it is refused.
    """
    declared = Declared(make, help, precisions, decides, parse, choices, postprocess, reads_calib)
    return field(default=default, metadata={SETTING: declared})


# The words a switch is given as, in any case; nothing (FORCE=) is off too.  The Makefile passes a switch's word as
# it was given (FORCE=0 as --force=0) and read_switch alone reads it: make's own test ("not empty") would take 0, no
# and false for on, and a mistyped word silently for either.
SWITCH_ON = ("1", "yes", "true")
SWITCH_OFF = ("0", "no", "false")


def read_switch(name: str, word: str) -> bool:
    """The value of switch setting `name` given as `word`: on sets it opposite its default, off leaves the default;
    any other word is refused with the accepted ones."""
    folded = word.strip().lower()
    if folded not in (*SWITCH_ON, *SWITCH_OFF, ""):
        raise PipelineError(
            f"{mention_name(name)} is a switch, on or off, and {word!r} is neither",
            f"give {mention(**{name: SWITCH_ON[0]})} (or {', '.join(SWITCH_ON[1:])}) to switch it on; "
            f"{', '.join(SWITCH_OFF)} or nothing leaves it off (any case)",
        )
    return (folded in SWITCH_ON) != DEFAULTS[name]


@dataclass
class Settings:
    """Everything a run of the pipeline depends on, each setting declared once (`setting`): the command line's
    options, the Makefile's arguments, the reuse key, the rebuild command and docs/options.md follow it.

    `model` is a registry name (`resnet`, `resnet18`, ...), `package.module:factory`,
    or a path to a checkpoint, TorchScript or ExportedProgram file.
    """

    model: str = setting(
        "resnet",
        make="MODEL",
        help="registry name (resnet = resnet50, resnet18..152), package.module:factory, or a checkpoint, "
        "TorchScript (.pt), torch.export (.pt2) or ONNX file",
    )
    # check() reads a str as Precision, so Settings(precision="int8") is what the command line takes.
    precision: Precision = setting(
        Precision.FP16,
        make="PRECISION",
        help="the engine's precision (int8 needs calibration data)",
        choices=PRECISIONS,
    )
    # check() reads a str as BatchProfile.parse does, so Settings(batch="1:8:32") is what the command line takes.
    batch: BatchProfile = setting(
        BatchProfile(), make="BATCH", help="engine batch profile min:opt:max", parse=BatchProfile.parse
    )
    weights: Path | None = setting(
        None, make="WEIGHTS", help="a torchvision-style state_dict for a registry model", parse=Path
    )
    input_shape: str | None = setting(
        None,
        make="INPUT_SHAPE",
        help="input dims without the batch: 3x224x224, or name=DIMS[:dtype],... e.g. "
        "input_ids=128:int64,attention_mask=128:int64",
    )
    dynamic: str | None = setting(
        None,
        make="DYNAMIC",
        help="extra dynamic axes NAME:AXIS[=min:opt:max],... e.g. input_ids:1=1:64:128, or none; a Hugging Face "
        "model's token inputs get one by default, from 1 to the longest sequence the model takes (the config's "
        "maximum, what its position embeddings can embed, the tokenizer's model_max_length)",
    )
    out_root: Path = setting(Path("engines"), make="OUT", help="artifact root folder", decides=False, parse=Path)
    workspace_mib: int = setting(4096, make="WORKSPACE_MIB", help="builder workspace limit in MiB", parse=int)
    builder: str = setting("auto", make="BUILDER", help="TensorRT module to build with", choices=BUILDERS)
    exporter: str = setting(
        "auto",
        make="EXPORTER",
        help="torch.onnx exporter: torchscript, dynamo, or auto (dynamo where TorchScript's graph fails, first "
        "past 1 GiB of weights)",
        choices=EXPORTERS,
    )
    target: str = setting(
        "default",
        make="TARGET",
        help="GPUs a TensorRT-RTX engine runs on: default, current (this machine's GPU) or e.g. sm86,sm89",
    )
    keep_fp32: str | None = setting(
        None,
        make="KEEP_FP32",
        help="node names or op types to keep in FP32, comma-separated (e.g. TopK)",
        precisions=FP16_ONLY,
    )
    auto_fp32: bool = setting(
        True,
        make="NO_AUTO_FP32",
        help="do not keep the nodes whose values float16 cannot hold in FP32",
        precisions=FP16_ONLY,
    )
    trust_model_file: bool = setting(
        False,
        make="TRUST_MODEL_FILE",
        help="load a whole pickled nn.Module MODEL file: unpickling runs the code it names",
    )
    calib: Path | None = setting(
        None,
        make="CALIB",
        help="inputs like the served ones (int8 calibrates on them, fp16 scans them for overflow): "
        "image folder or .npy/.npz",
        precisions=FP16_AND_INT8,
        parse=Path,
    )
    calib_method: str = setting(
        CALIB_AUTO,
        make="CALIB_METHOD",
        help=f"one of {', '.join(CALIB_METHODS)}, or {CALIB_AUTO} ({' and '.join(AUTO_CALIB_METHODS)}, the better "
        "on the held-out calibration rows kept)",
        precisions=INT8_ONLY,
        choices=(CALIB_AUTO, *CALIB_METHODS),
    )
    calib_samples: int = setting(
        256,
        make="CALIB_SAMPLES",
        help="the most calibration samples read from CALIB",
        precisions=FP16_AND_INT8,
        parse=int,
        reads_calib=True,
    )
    calib_batch: int = setting(
        16,
        make="CALIB_BATCH",
        help="calibration batch size",
        precisions=FP16_AND_INT8,
        parse=int,
        reads_calib=True,
    )
    smooth: str = setting(
        SMOOTH_AUTO,
        make="SMOOTH",
        help="SmoothQuant alpha for the activations MatMul/Gemm read, in (0, 1], off, or auto (0.9 and off both "
        "built, the better on the held-out calibration rows kept)",
        precisions=INT8_ONLY,
    )
    # Reads CALIB afresh: never reuses a finished folder (the FP16 scan has no cache, so there it rebuilds).
    recalibrate: bool = setting(
        False,
        make="RECALIBRATE",
        help="calibrate afresh: ignore the calibration cache, and rebuild the folder",
        precisions=FP16_AND_INT8,
        decides=False,
        reads_calib=True,
    )
    # Refuse (instead of warning) when the held-out calibration rows are much worse than the fit ones, or none
    # could be held out (pipeline/stages/parity.py MUCH_WORSE_RATIO): the data cannot stand for served inputs.
    strict_calib: bool = setting(
        False,
        make="STRICT_CALIB",
        help="refuse, instead of warning, when INT8 is much worse on the held-out calibration rows than on the "
        "rows its ranges were fit on, or none could be held out",
        precisions=INT8_ONLY,
    )
    # Try leaving the op where the held-out error starts in float (calibration/float_search.py); False: every op INT8.
    float_search: bool = setting(
        True,
        make="NO_FLOAT_SEARCH",
        help="do not try leaving the op where the held-out error starts in float: every op INT8",
        precisions=INT8_ONLY,
    )
    force: bool = setting(False, make="FORCE", help="rebuild even when the folder is up to date", decides=False)
    # check() reads a str as Postprocess, as it does PRECISION.
    postprocess: Postprocess = setting(
        Postprocess.NONE,
        make="POSTPROCESS",
        help="what the served graphs end in: none (the model's outputs), or nms: a YOLO-style head [batch, "
        "4 + classes, anchors] thinned by greedy NMS into boxes, scores, classes and count of fixed sizes",
        choices=POSTPROCESSES,
    )
    nms_box_format: str = setting(
        _NMS.box_format,
        make="NMS_BOX_FORMAT",
        help="the head's boxes: cxcywh (YOLOv8) or xyxy",
        choices=BOX_FORMATS,
        postprocess=Postprocess.NMS,
    )
    nms_score_threshold: float = setting(
        _NMS.score_threshold,
        make="NMS_SCORE_THRESHOLD",
        help="a candidate counts only with a score above it (scores after their sigmoid)",
        parse=float,
        postprocess=Postprocess.NMS,
    )
    nms_iou_threshold: float = setting(
        _NMS.iou_threshold,
        make="NMS_IOU_THRESHOLD",
        help="a kept box suppresses another with IoU above it",
        parse=float,
        postprocess=Postprocess.NMS,
    )
    nms_candidates: int = setting(
        _NMS.candidates,
        make="NMS_CANDIDATES",
        help="the best-scored anchors per image that NMS considers (at most 3840, TensorRT's TopK limit)",
        parse=int,
        postprocess=Postprocess.NMS,
    )
    nms_max_detections: int = setting(
        _NMS.max_detections,
        make="NMS_MAX_DETECTIONS",
        help="K: the rows per image of the outputs, padded past the detections (at most the candidates)",
        parse=int,
        postprocess=Postprocess.NMS,
    )
    nms_class_agnostic: bool = setting(
        not _NMS.class_aware,
        make="NMS_CLASS_AGNOSTIC",
        help="boxes of different classes suppress each other too (by default they never do)",
        postprocess=Postprocess.NMS,
    )
    nms_head: str | None = setting(
        _NMS.head,
        make="NMS_HEAD",
        help="the output holding the head, where the model has several (the others stay outputs)",
        postprocess=Postprocess.NMS,
    )

    def check(self, given: Iterable[str] = (), *, data_besides_calib: bool = False) -> Settings:
        """Reject bad values and bad combinations; returns self so calls can chain.

        A setting given where it would do nothing is refused: a value other than its default, or any named in
        `given` (the options the command line was given, whatever their value).  data_besides_calib: the command
        calibrates on data of its own where CALIB is not given (`accuracy`'s labelled sets), which the settings
        that say how CALIB is read then read instead.
        """
        if not str(self.model).strip():  # a path of nothing is the current directory, read as a model folder
            raise PipelineError(
                f"{mention_name('model')} is empty",
                f"give a registry name (e.g. {mention(model='resnet18')}), package.module:factory, or a model file "
                "or folder",
            )
        self._check_precision()
        self._check_postprocess()
        self._check_calibration()
        calibrated = self.calib is not None or data_besides_calib
        refuse_unused(self.precision, self.postprocess, {*given, *self._changed()}, calibrated)
        self._read_text()
        self.nms_config()
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
        return self

    def _check_precision(self) -> None:
        if self.precision not in PRECISIONS:
            raise PipelineError(
                f"unknown precision {self.precision!r}",
                f"use one of {', '.join(PRECISIONS)} ({mention(precision=Precision.FP16)} is the default)",
            )
        self.precision = Precision(self.precision)

    def _check_postprocess(self) -> None:
        if self.postprocess not in POSTPROCESSES:
            raise PipelineError(
                f"unknown post-processing {self.postprocess!r}", f"use one of {', '.join(POSTPROCESSES)}"
            )
        self.postprocess = Postprocess(self.postprocess)

    def _changed(self) -> list[str]:
        """The settings whose value is not their default."""
        return [item.name for item in fields(self) if getattr(self, item.name) != item.default]

    def _read_text(self) -> None:
        """A batch or a path given as text (Settings(batch="1:8:32", calib="samples")), read as the options are."""
        if isinstance(self.batch, str):
            self.batch = BatchProfile.parse(self.batch)
        for name in (name for name, declared in DECLARED.items() if declared.parse is Path):
            if isinstance(getattr(self, name), str):
                setattr(self, name, Path(getattr(self, name)))

    def _check_calibration(self) -> None:
        if self.precision == Precision.INT8 and self.calib is None:
            raise PipelineError(
                f"{mention(precision=Precision.INT8)} needs calibration data and none was given",
                f"add {mention(calib='<folder of images, or a .npy/.npz file>')} "
                f"(e.g. {mention(calib='calibration/samples')}); no synthetic data is used for calibration",
            )
        if self.calib_samples < 1 or self.calib_batch < 1:
            raise PipelineError("calibration samples and batch must be at least 1", "give positive numbers")

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
                f"{mention(smooth=self.smooth)} is neither a smoothing alpha, {SMOOTH_OFF!r} nor {SMOOTH_AUTO!r}",
                f"give a number in (0, 1] (SmoothQuant's migration strength, e.g. {mention(smooth='0.9')}), "
                f"{mention(smooth=SMOOTH_OFF)} or {mention(smooth=SMOOTH_AUTO)} (both, the better on held-out rows "
                "kept)",
            )
        return (alpha,)

    def nms_config(self) -> NmsConfig | None:
        """The NMS settings as NmsConfig (which refuses a bad value, named here as the settings give it); None
        unless POSTPROCESS=nms."""
        if self.postprocess != Postprocess.NMS:
            return None
        try:
            return NmsConfig(
                box_format=self.nms_box_format,
                score_threshold=self.nms_score_threshold,
                iou_threshold=self.nms_iou_threshold,
                candidates=self.nms_candidates,
                max_detections=self.nms_max_detections,
                class_aware=not self.nms_class_agnostic,
                head=self.nms_head,
            )
        except PipelineError as error:
            given = {name: getattr(self, name) for name in self._changed() if DECLARED[name].postprocess}
            raise PipelineError(f"{error._problem} ({mention(**given)})", error._fix) from None

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


DECLARED: dict[str, Declared] = {item.name: item.metadata[SETTING] for item in fields(Settings)}
DEFAULTS: dict[str, Any] = Settings().as_record()


def deciding(precision: Precision, postprocess: Postprocess = Postprocess.NONE) -> tuple[str, ...]:
    """The settings that decide a folder of this precision's (and post-processing's) artifacts (the reuse key's,
    positively listed)."""
    return tuple(
        name
        for name, declared in DECLARED.items()
        if declared.decides and precision in declared.precisions and declared.postprocess in (None, postprocess)
    )


def refuse_unused(
    precision: Precision, postprocess: Postprocess, names: Iterable[str], calibrated: bool = True
) -> None:
    """A setting given for a precision whose artifacts it does not change, for a post-processing it does not
    configure, or (one that says how CALIB is read) with no calibration data (`calibrated` False), would be ignored
    in silence: refuse it, naming what it changes."""
    for name in sorted(names, key=list(DECLARED).index):
        changes, configures = DECLARED[name].precisions, DECLARED[name].postprocess
        if precision not in changes:
            raise PipelineError(
                f"{mention_name(name)} changes only {' and '.join(changes)} builds; at {precision} it would do nothing",
                f"leave {mention_name(name)} out, or build with "
                + " or ".join(mention(precision=other) for other in changes),
            )
        if configures not in (None, postprocess):
            raise PipelineError(
                f"{mention_name(name)} configures {mention(postprocess=configures)} only; with "
                f"{mention(postprocess=postprocess)} it would do nothing",
                f"leave {mention_name(name)} out, or add {mention(postprocess=configures)}",
            )
        if DECLARED[name].reads_calib and not calibrated:
            raise PipelineError(
                f"{mention_name(name)} says how {mention_name('calib')} is read, and no {mention_name('calib')} was "
                "given: it would do nothing",
                f"leave {mention_name(name)} out, or add {mention(calib='<folder of images, or a .npy/.npz file>')}",
            )


def mention(**values: Any) -> str:
    """Settings and their values in a message, worded when it is shown: mention(calib="<folder>") reads
    CALIB=<folder>, --calib <folder> or Settings(calib=<folder>) (core/mentions.py)."""
    return span([(name, DECLARED[name].make, _json_value(value)) for name, value in values.items()])


def mention_name(name: str) -> str:
    """A setting named without a value: CALIB, --calib or Settings.calib."""
    return span([(name, DECLARED[name].make)])


def engine_command(*, more: bool = False, **values: Any) -> str:
    """The command that writes a folder with these settings: make engine MODEL=x ..., trt-pipeline engine
    --model x ... or make_engine(Settings(model="x", ...)); more: "..." after them (more to give)."""
    return span(
        [(name, DECLARED[name].make, _json_value(value)) for name, value in values.items()], "engine", more=more
    )


def _json_value(value: Any) -> Any:
    """A value as JSON holds it: a Path or a BatchProfile as its text; a Precision is a str already."""
    return value if isinstance(value, (str, bool, int, float)) or value is None else str(value)


def check_target(target: str) -> None:
    """`default`, `current`, or a list of compute capabilities named as TensorRT-RTX names them (sm86,sm89)."""
    names = [name.strip().lower() for name in target.split(",")]
    if target in TARGETS or all(re.fullmatch(r"sm\d{2,3}", name) for name in names):
        return
    raise PipelineError(
        f"unknown build target {target!r}",
        f"give {mention(target='default')} (TensorRT-RTX's documented GPUs), {mention(target='current')} (the GPU "
        f"of this machine), or compute capabilities such as {mention(target='sm86,sm89')}",
    )
