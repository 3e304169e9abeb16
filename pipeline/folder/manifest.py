"""manifest.json and the folder's layout: what built the artifacts of a folder, typed, and every file name in it.

This module owns the record: its types (Manifest and the records it holds), the one way the stages write it
(update_manifest, record_stage), its decoding for readers (read_manifest: a damaged entry is a PipelineError
naming it), the folder's file names and which graph each precision writes for which target (GRAPHS), the layout
version, and the one "rebuild it" hint every error about a folder ends with.  Readers open a folder through
pipeline/folder/reader.py, which enforces what a finished folder must be.  It imports no build stage.
"""

from __future__ import annotations

import dataclasses
import json
import platform
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from ..core.cpu import NO_VNNI, VNNI
from ..core.errors import PipelineError
from ..core.sessions import OPTIMIZATION_LEVELS
from ..core.settings import PRECISIONS, BatchProfile
from .artifacts import sha256_file, write_json
from .graph_io import GraphTensor
from .rebuild import rebuild_hint

# --------------------------------------------------------------------------- the layout: every file name once

MANIFEST = "manifest.json"
REFERENCE = "reference.npz"  # PyTorch's outputs on the reference inputs, written by export
ENGINE = "engine.plan"
FP32_GRAPH = "model.onnx"  # exported, checked and simplified; every other graph is made from it
# Which graph load_runner(backend="auto") measured fastest on a host, keyed by the host (runners/fastest.py).
# Written by readers, not by the build: a cache, never an artifact (no sha256 in the manifest).
SERVED_CHOICE = "served.json"

# The targets a graph is written for.  ENGINE_TARGET: the graph TensorRT builds engine.plan from, which ONNX
# Runtime runs too (on a GPU, and on a CPU when the folder has no graph for that CPU).  CPU_TARGETS: graphs
# shaped for ONNX Runtime's CPU kernels on each kind of CPU (pipeline.core.cpu; U8S8 saturates without VNNI).
ENGINE_TARGET = "engine"
CPU_TARGETS = {VNNI: "onnxruntime-cpu-vnni", NO_VNNI: "onnxruntime-cpu-no-vnni"}
# Precision -> {target: graph file}: what the precision stage writes, what the manifest's "graphs" lists and
# what the runner chooses from.
GRAPHS: dict[str, dict[str, str]] = {
    "fp32": {ENGINE_TARGET: FP32_GRAPH},
    "fp16": {ENGINE_TARGET: "model.fp16.onnx"},
    "int8": {
        ENGINE_TARGET: "model.int8.onnx",
        CPU_TARGETS[VNNI]: "model.int8.ort.onnx",
        CPU_TARGETS[NO_VNNI]: "model.int8.ort-u8u8.onnx",
    },
}

# The shape of a folder and its manifest, recorded in it as "layout".  Bump it when the stages write
# different artifacts or manifest entries: a folder of another layout is rebuilt, never reused, and
# readers refuse it.  4: the manifest records its layout; readers check every graph's sha256.
# 5: "graphs" ({target: file}) replaces "graph" and "onnxruntime_cpu_graphs".
# 6: agreement_int8 holds in-sample and held-out numbers side by side, and the calibration split.
ARTIFACT_LAYOUT = 6


def engine_graph(precision: str) -> str:
    """The graph file TensorRT builds from at this precision."""
    return GRAPHS[precision][ENGINE_TARGET]


def cpu_graphs(precision: str) -> dict[str, str]:
    """{kind of CPU: graph file} of the graphs this precision writes for ONNX Runtime's CPU kernels (int8 only)."""
    return {kind: GRAPHS[precision][target] for kind, target in CPU_TARGETS.items() if target in GRAPHS[precision]}


def graph_precision(name: str) -> str:
    """The precision a graph file of GRAPHS computes in (model.onnx: fp32; every INT8 form: int8)."""
    return next(precision for precision, graphs in GRAPHS.items() if name in graphs.values())


def parity_stage(name: str) -> str:
    """The parity stage whose record says the graph `name` passed its gate against PyTorch's reference outputs."""
    precision = graph_precision(name)
    kind = next((kind for kind, graph in cpu_graphs(precision).items() if graph == name), None)
    return f"parity_{precision}" if kind is None else f"parity_int8_onnxruntime_{kind.replace('-', '_')}"


def artifact_names(graphs: dict[str, str]) -> list[str]:
    """The files a finished folder with these graphs (target -> file) lists in its manifest, with their sha256."""
    return list(dict.fromkeys([FP32_GRAPH, REFERENCE, *graphs.values(), ENGINE]))


# --------------------------------------------------------------------------- the records


@dataclass(frozen=True)
class ModelRecord:
    name: str  # canonical (resnet50, toy_models-tiny_cnn)
    source: str  # as the user named it (MODEL=)
    fingerprint: str  # over code and weights: part of the reuse key
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Artifact:
    """One file of the folder as the build recorded it."""

    sha256: str
    bytes: int


@dataclass(frozen=True)
class Builder:
    module: str  # tensorrt or tensorrt_rtx
    version: str


@dataclass(frozen=True)
class BuildRecord:
    """The build stage's record: who built engine.plan for which GPUs, or why no engine was built."""

    skipped: str | None = None  # why no engine was built; None when one was
    builder: Builder | None = None
    target: dict = field(default_factory=dict)  # pipeline.core.trt_module.describe_target's record
    io: tuple[dict, ...] = ()  # the engine's tensors: {name, mode, dtype, shape (-1 for dynamic dims)}
    details: dict = field(default_factory=dict)  # the rest of the stage's record (profile, sizes, times)

    def as_json(self) -> dict:
        """The stage's record as build_engine wrote it ({"status": "skipped", "reason"} where none was built)."""
        return {
            **({"status": "skipped", "reason": self.skipped} if self.skipped is not None else {}),
            **({"builder": _encode(self.builder)} if self.builder is not None else {}),
            **({"target": self.target} if self.target else {}),
            **({"io": list(self.io)} if self.io else {}),
            **self.details,
        }

    @classmethod
    def from_json(cls, raw: Any) -> BuildRecord:
        if not isinstance(raw, dict):
            raise DamagedManifest(f"its build is {raw!r}, not a record")
        builder = raw.get("builder")
        if builder is not None and not (isinstance(builder, dict) and {"module", "version"} <= set(builder)):
            raise DamagedManifest(f"its build's builder is {builder!r}, not a module and a version")
        return cls(
            skipped=str(raw.get("reason")) if raw.get("status") == "skipped" else None,
            builder=Builder(str(builder["module"]), str(builder["version"])) if builder else None,
            target=dict(raw.get("target") or {}),
            io=tuple(raw.get("io") or ()),
            details={k: v for k, v in raw.items() if k not in ("status", "reason", "builder", "target", "io")},
        )


@dataclass(frozen=True)
class ParityRecord:
    """A parity stage's result: the worst error against PyTorch over the reference cases."""

    max_abs: float
    max_rel: float  # of the output's scale
    rtol: float


@dataclass(frozen=True)
class CalibrationSplit:
    """Which calibration rows INT8's ranges were fit on and which its agreement gate judged (calibration/holdout.py):
    the rule in words, the row count, and the held-out rows (indices in the reader's order; the rest were fit on)."""

    rule: str
    rows: int
    held_out: tuple[int, ...] = ()

    def as_json(self) -> dict:
        counts = {"fit_rows": self.rows - len(self.held_out), "held_out_rows": len(self.held_out)}
        return {"rule": self.rule, "rows": self.rows, **counts, "held_out": list(self.held_out)}

    @classmethod
    def from_json(cls, raw: Any) -> CalibrationSplit:
        held_out = raw.get("held_out") if isinstance(raw, dict) else None
        if (
            not isinstance(raw, dict)
            or not isinstance(raw.get("rule"), str)
            or not isinstance(raw.get("rows"), int)
            or not isinstance(held_out, list)
            or not all(isinstance(row, int) and 0 <= row < raw["rows"] for row in held_out)
        ):
            raise DamagedManifest(f"its calibration split {raw!r} is not a rule, a row count and held-out rows")
        return cls(raw["rule"], raw["rows"], tuple(held_out))


@dataclass(frozen=True)
class RowsAgreement:
    """One output of an INT8 graph against FP32 on a set of rows: each row's |int8 - fp32| / |fp32| and cosine."""

    rows: int
    error_mean: float
    error_max: float
    cosine_mean: float
    cosine_min: float

    @classmethod
    def from_json(cls, raw: Any) -> RowsAgreement:
        names = [entry.name for entry in dataclasses.fields(cls)]
        if not isinstance(raw, dict) or not all(isinstance(raw.get(name), (int, float)) for name in names):
            raise DamagedManifest(f"its INT8 agreement holds {raw!r}, not {', '.join(names)}")
        return cls(int(raw["rows"]), *(float(raw[name]) for name in names[1:]))


@dataclass(frozen=True)
class GraphAgreement:
    """One INT8 graph against FP32, by output: in-sample (the rows its ranges were fit on) and held out (rows they
    never saw; empty where none could be held out) side by side.  The gate judges the held-out rows."""

    in_sample: dict[str, RowsAgreement]
    held_out: dict[str, RowsAgreement] = field(default_factory=dict)
    left_out: str | None = None  # why an optional graph past the gate was left out of the folder

    @property
    def judged_on(self) -> str:
        return "held_out" if self.held_out else "in_sample"

    def worst(self) -> tuple[str, RowsAgreement]:
        """The output the gate decides on (the largest mean error on the judged rows) and its numbers there."""
        judged = self.held_out or self.in_sample
        name = max(judged, key=lambda output: judged[output].error_mean)
        return name, judged[name]

    def held_out_ratio(self) -> float | None:
        """The worst output's held-out error over its in-sample error; None where nothing is held out."""
        if not self.held_out:
            return None
        name, held_out = self.worst()
        return held_out.error_mean / max(self.in_sample[name].error_mean, 1e-12)

    def as_json(self) -> dict:
        if not self.in_sample:  # left out before it was measured: its reason stands alone
            return {"left_out": self.left_out}
        name, worst = self.worst()
        ratio = self.held_out_ratio()
        judged = {"rows": self.judged_on, "output": name, "error_mean": worst.error_mean}
        judged |= {"cosine_mean": worst.cosine_mean, "held_out_vs_in_sample": ratio}
        outputs = {output: {"in_sample": _encode(rows)} for output, rows in self.in_sample.items()}
        for output, rows in self.held_out.items():
            outputs[output]["held_out"] = _encode(rows)
        return {"judged": judged, "outputs": outputs, **({"left_out": self.left_out} if self.left_out else {})}

    @classmethod
    def from_json(cls, raw: Any) -> GraphAgreement:
        if isinstance(raw, dict) and set(raw) == {"left_out"} and isinstance(raw["left_out"], str):
            return cls({}, left_out=raw["left_out"])
        outputs = raw.get("outputs") if isinstance(raw, dict) else None
        if not isinstance(outputs, dict) or not outputs or not all(isinstance(o, dict) for o in outputs.values()):
            raise DamagedManifest(f"its INT8 agreement holds {raw!r}, not a record of each output")
        held_out = {name: o["held_out"] for name, o in outputs.items() if "held_out" in o}
        if held_out and len(held_out) != len(outputs):
            raise DamagedManifest(f"its INT8 agreement has held-out numbers for some outputs only: {sorted(held_out)}")
        return cls(
            in_sample={name: RowsAgreement.from_json(o.get("in_sample")) for name, o in outputs.items()},
            held_out={name: RowsAgreement.from_json(record) for name, record in held_out.items()},
            left_out=_optional(raw, "left_out", str),
        )


@dataclass(frozen=True)
class Int8Agreement:
    """The INT8 agreement gate's record (stage agreement_int8, pipeline/stages/parity.py): the split of the calibration
    data, each graph's in-sample and held-out numbers, the gate and the ratio past which held-out error counts as
    much worse than in-sample, and the warning the build printed (the set cannot stand for served data)."""

    gate: float
    much_worse_ratio: float
    split: CalibrationSplit
    graphs: dict[str, GraphAgreement]
    warning: str | None = None
    details: dict = field(default_factory=dict)  # summary, evaluation, seconds

    def as_json(self) -> dict:
        record = {"gate": self.gate, "much_worse_ratio": self.much_worse_ratio, "split": self.split.as_json()}
        record["graphs"] = {name: graph.as_json() for name, graph in self.graphs.items()}
        return {**self.details, **record, **({"warning": self.warning} if self.warning else {})}

    @classmethod
    def from_json(cls, raw: Any) -> Int8Agreement:
        graphs = raw.get("graphs") if isinstance(raw, dict) else None
        if not isinstance(graphs, dict) or not all(isinstance(raw.get(k), float) for k in ("gate", "much_worse_ratio")):
            raise DamagedManifest(f"its agreement_int8 is {raw!r}, not the INT8 gate's record")
        known = {"gate", "much_worse_ratio", "split", "graphs", "warning"}
        return cls(
            gate=raw["gate"],
            much_worse_ratio=raw["much_worse_ratio"],
            split=CalibrationSplit.from_json(raw.get("split")),
            graphs={name: GraphAgreement.from_json(graph) for name, graph in graphs.items()},
            warning=_optional(raw, "warning", str),
            details={key: value for key, value in raw.items() if key not in known},
        )


@dataclass(frozen=True)
class Manifest:
    """manifest.json, typed.  On disk it is readable JSON with these keys, and each stage's record under the
    stage's name (parity_fp32, fp16, int8, build, ...)."""

    layout: int | None = None
    complete: bool = False
    reuse_key: str | None = None
    created: str | None = None
    model: ModelRecord | None = None
    precision: str | None = None
    opset: int | None = None
    exporter: str | None = None  # who made model.onnx: torchscript or dynamo (stages/export.py); None: an ONNX MODEL
    settings: dict | None = None  # Settings.as_record(): what a rebuild repeats
    versions: dict[str, str] = field(default_factory=dict)
    batch_profile: BatchProfile | None = None
    axis_ranges: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # extra dynamic axes: min/opt/max
    inputs: tuple[GraphTensor, ...] = ()
    outputs: tuple[GraphTensor, ...] = ()
    graphs: dict[str, str] = field(default_factory=dict)  # target -> graph file (GRAPHS[precision])
    engine: str | None = None
    artifacts: dict[str, Artifact] = field(default_factory=dict)
    parity_batches: tuple[int, ...] = ()
    reference_source: str | None = None  # what reference.npz holds when it is not PyTorch's outputs (an ONNX MODEL)
    # The calibration data (CALIB) the graphs were made from: source, samples, data_sha256.  int8: and the ranges
    # it gave; fp16: the data the FP32-fallback scan ran besides the reference inputs (stages["fp16"]["scanned"]).
    calibration: dict | None = None
    build: BuildRecord | None = None
    agreement_int8: Int8Agreement | None = None  # INT8's gate, in-sample and held out (stage agreement_int8)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage, in the order they ran
    # Graphs ONNX Runtime crashed on at its highest optimization level during the build, and the level that
    # worked (pipeline/core/sessions.py): the runner opens them at that level.
    onnxruntime_levels: dict[str, str] = field(default_factory=dict)
    stages: dict[str, dict] = field(default_factory=dict)  # the other stages' records, by stage name

    def builder(self) -> Builder:
        """Who built engine.plan, or a PipelineError where no engine was built."""
        if self.build is None or self.build.builder is None:
            raise PipelineError(
                "the manifest records no engine build", f"rebuild the folder: {rebuild_hint(self, force=True)}"
            )
        return self.build.builder

    def parity(self, stage: str) -> ParityRecord | None:
        """The record of a parity stage (parity_fp32, parity_fp16, ...), or None where it did not run."""
        record = self.stages.get(stage)
        if record is None:
            return None
        return ParityRecord(float(record["max_abs"]), float(record["max_rel"]), float(record["rtol"]))

    def as_json(self) -> dict:
        record: dict[str, Any] = {}
        for entry in dataclasses.fields(self):
            value = getattr(self, entry.name)
            if entry.name == "stages" or value is None:
                continue
            record[entry.name] = _encode(value)
        return {**record, **self.stages}

    @classmethod
    def from_json(cls, raw: dict) -> Manifest:
        """The manifest of a folder; one written by another layout keeps only what its rebuild hint needs."""
        settings = raw.get("settings") if isinstance(raw.get("settings"), dict) else None
        layout = raw.get("layout")
        if layout != ARTIFACT_LAYOUT:
            return cls(layout=layout if isinstance(layout, int) else None, settings=settings)
        known = {entry.name for entry in dataclasses.fields(cls)} - {"stages"}
        return cls(
            layout=layout,
            complete=raw.get("complete") is True,
            reuse_key=_optional(raw, "reuse_key", str),
            created=_optional(raw, "created", str),
            model=_model(raw["model"]) if "model" in raw else None,
            precision=_precision(raw),
            opset=_optional(raw, "opset", int),
            exporter=_optional(raw, "exporter", str),
            settings=settings,
            versions=dict(_optional(raw, "versions", dict) or {}),
            batch_profile=_batch_profile(raw["batch_profile"]) if "batch_profile" in raw else None,
            axis_ranges=_axis_ranges(raw.get("axis_ranges", {})),
            inputs=_tensors(raw, "inputs"),
            outputs=_tensors(raw, "outputs"),
            graphs=_names(raw, "graphs"),
            engine=_optional(raw, "engine", str),
            artifacts=_artifacts(raw.get("artifacts", {})),
            parity_batches=tuple(_optional(raw, "parity_batches", list) or ()),
            reference_source=_optional(raw, "reference_source", str),
            calibration=_optional(raw, "calibration", dict),
            build=BuildRecord.from_json(raw["build"]) if "build" in raw else None,
            agreement_int8=Int8Agreement.from_json(raw["agreement_int8"]) if "agreement_int8" in raw else None,
            timings=dict(_optional(raw, "timings", dict) or {}),
            onnxruntime_levels=_levels(raw),
            stages={key: value for key, value in raw.items() if key not in known and isinstance(value, dict)},
        )


class DamagedManifest(Exception):
    """An entry of manifest.json that is not what the stages write (read_manifest makes it a PipelineError)."""


def _encode(value: Any) -> Any:
    if isinstance(value, GraphTensor):
        return value.as_record()
    if isinstance(value, (BuildRecord, Int8Agreement)):
        return value.as_json()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {entry.name: _encode(getattr(value, entry.name)) for entry in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {key: _encode(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(item) for item in value]
    return value


def _optional(raw: dict, key: str, kind: type) -> Any:
    value = raw.get(key)
    if value is not None and not isinstance(value, kind):
        raise DamagedManifest(f"its {key} is {value!r}, not a {kind.__name__}")
    return value


def _precision(raw: dict) -> str | None:
    precision = raw.get("precision")
    if precision is not None and precision not in PRECISIONS:
        raise DamagedManifest(f"its precision is {precision!r}, not one of {', '.join(PRECISIONS)}")
    return precision


def _model(raw: Any) -> ModelRecord:
    if not isinstance(raw, dict) or not all(isinstance(raw.get(key), str) for key in ("name", "source")):
        raise DamagedManifest(f"its model is {raw!r}, not a record with a name and a source")
    return ModelRecord(raw["name"], raw["source"], str(raw.get("fingerprint", "")), tuple(raw.get("notes") or ()))


def _batch_profile(raw: Any) -> BatchProfile:
    sizes = [raw.get(key) for key in ("min", "opt", "max")] if isinstance(raw, dict) else [None] * 3
    low, opt, high = (size if isinstance(size, int) else 0 for size in sizes)
    if high < 1:
        raise DamagedManifest(f"its batch_profile {raw} has no max of 1 row or more (the file was edited or damaged)")
    if not 1 <= low <= opt <= high:
        raise DamagedManifest(f"its batch_profile {raw} is not whole numbers 1 <= min <= opt <= max")
    return BatchProfile(low, opt, high)


def _axis_ranges(raw: Any) -> dict[str, tuple[int, int, int]]:
    ranges: dict[str, tuple[int, int, int]] = {}
    for name, sizes in raw.items() if isinstance(raw, dict) else [("", raw)]:
        if not isinstance(sizes, list) or len(sizes) != 3 or not all(isinstance(size, int) for size in sizes):
            raise DamagedManifest(f"its axis_ranges {raw} are not [min, opt, max] by axis name")
        ranges[name] = (sizes[0], sizes[1], sizes[2])
    return ranges


def _tensors(raw: dict, key: str) -> tuple[GraphTensor, ...]:
    tensors = []
    for record in _optional(raw, key, list) or []:
        shape = record.get("shape") if isinstance(record, dict) else None
        if (
            not isinstance(shape, list)
            or not isinstance(record.get("name"), str)
            or not isinstance(record.get("dtype"), str)
            or not all(d is None or isinstance(d, (int, str)) for d in shape)
            or not _is_numpy_dtype(record["dtype"])
        ):
            raise DamagedManifest(f"its {key} hold {record!r}, not a tensor's name, dtype and shape")
        tensors.append(GraphTensor.from_record(record))
    return tuple(tensors)


def _is_numpy_dtype(name: str) -> bool:
    try:
        np.dtype(name)
    except TypeError:
        return False
    return True


def _names(raw: dict, key: str) -> dict[str, str]:
    names = _optional(raw, key, dict) or {}
    if not all(isinstance(name, str) for name in names.values()):
        raise DamagedManifest(f"its {key} are {names!r}, not file names")
    return dict(names)


def _levels(raw: dict) -> dict[str, str]:
    levels = _names(raw, "onnxruntime_levels")
    unknown = {graph: level for graph, level in levels.items() if level not in OPTIMIZATION_LEVELS}
    if unknown:
        raise DamagedManifest(f"its onnxruntime_levels {unknown} are not ONNX Runtime's {OPTIMIZATION_LEVELS}")
    return levels


def _artifacts(raw: Any) -> dict[str, Artifact]:
    artifacts: dict[str, Artifact] = {}
    for name, record in raw.items() if isinstance(raw, dict) else [("", raw)]:
        if not isinstance(record, dict) or not isinstance(record.get("sha256"), str):
            raise DamagedManifest(f"its artifacts hold {record!r} for {name!r}, not a sha256 and a size")
        artifacts[name] = Artifact(record["sha256"], int(record.get("bytes", -1)))
    return artifacts


# --------------------------------------------------------------------------- reading and writing


def read_manifest(folder: Path) -> Manifest | None:
    """The folder's manifest, or None where there is none yet."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise PipelineError(
            f"{path} is not valid JSON ({error})", f"rebuild the folder: {rebuild_hint(None, folder)}"
        ) from None
    if not isinstance(raw, dict):
        raise PipelineError(
            f"{path} holds a JSON {type(raw).__name__}, not the object a manifest is",
            f"rebuild the folder: {rebuild_hint(None, folder)}",
        )
    try:
        return Manifest.from_json(raw)
    except DamagedManifest as damage:
        settings = raw.get("settings") if isinstance(raw.get("settings"), dict) else None
        raise PipelineError(
            f"the manifest {path} is damaged: {damage}",
            f"rebuild the folder: {rebuild_hint(Manifest(settings=settings), folder)}",
        ) from None


def require_manifest(folder: Path, hint: str | None = None) -> Manifest:
    """The manifest of an artifact folder, finished or not, or a PipelineError naming the `make engine` (or `hint`)
    that creates it.  Loading artifacts goes through pipeline.folder.reader.open_folder, which also requires it
    finished."""
    folder = Path(folder)
    hint = hint or rebuild_hint(None, folder)
    if not folder.is_dir():
        raise PipelineError(f"artifact folder {folder} does not exist", f"create it with `{hint}`")
    manifest = read_manifest(folder)
    if manifest is None:
        raise PipelineError(f"{folder} has no {MANIFEST}: it is not an artifact folder", f"create one with `{hint}`")
    return manifest


def update_manifest(folder: Path, **fields: Any) -> Manifest:
    """Set fields of the folder's manifest (Manifest's names and types) and rewrite it atomically.

    A manifest of another layout is started afresh: nothing of an earlier version's record is carried over.
    """
    manifest = read_manifest(folder) or Manifest()
    if manifest.layout != ARTIFACT_LAYOUT:
        manifest = Manifest(layout=ARTIFACT_LAYOUT, settings=manifest.settings)
    manifest = dataclasses.replace(manifest, **fields)
    write_json(Path(folder) / MANIFEST, manifest.as_json())
    return manifest


def record_stage(folder: Path, name: str, record: dict) -> Manifest:
    """Record a finished stage (its record, with "seconds") under its name, and its time among the timings."""
    manifest = read_manifest(folder) or Manifest()
    earlier = manifest.timings if manifest.layout == ARTIFACT_LAYOUT else {}
    # A stage run again moves to the end: the last stage listed is the last one that finished.
    timings = {**{stage: seconds for stage, seconds in earlier.items() if stage != name}, name: record["seconds"]}
    if name == "build":
        return update_manifest(folder, build=BuildRecord.from_json(record), timings=timings)
    if name == "agreement_int8":
        return update_manifest(folder, agreement_int8=Int8Agreement.from_json(record), timings=timings)
    return update_manifest(folder, stages={**manifest.stages, name: record}, timings=timings)


def describe_artifacts(folder: Path, names: list[str]) -> dict[str, Artifact]:
    """sha256 and size of each artifact present in the folder."""
    paths = [Path(folder) / name for name in names]
    return {p.name: Artifact(sha256_file(p), p.stat().st_size) for p in paths if p.is_file()}


def artifact_problems(folder: Path, manifest: Manifest) -> list[str]:
    """Artifacts that are missing or whose sha256 differs from the manifest's."""
    problems = []
    for name, recorded in manifest.artifacts.items():
        path = Path(folder) / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif sha256_file(path) != recorded.sha256:
            problems.append(f"{name} does not match its sha256 in the manifest (truncated or modified)")
    return problems


def package_versions(packages: tuple[str, ...]) -> dict[str, str]:
    """Python's version and each installed package's; packages not installed are left out."""
    found = {"python": platform.python_version()}
    for package in packages:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return found
