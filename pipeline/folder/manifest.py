"""manifest.json, typed (Manifest), and the one way to read, write and update it.

The stages write it (update_manifest, record_stage: pipeline/stages/sequence.py); readers decode it with
read_manifest (a damaged entry is a PipelineError naming it and the rebuild command) and open a folder through
pipeline/folder/reader.py, which enforces what a finished folder must be.  The records it holds and their validators
live in pipeline/folder/records.py, the file names and the graphs each precision writes in pipeline/folder/layout.py.
It imports no build stage.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..core.errors import PipelineError
from ..core.nms_config import NmsConfig
from ..core.precision import PRECISIONS, Precision
from ..core.sessions import OPTIMIZATION_LEVELS
from ..core.settings import BatchProfile, Postprocess
from .artifacts import write_json
from .graph_io import GraphTensor
from .layout import ARTIFACT_LAYOUT, MANIFEST
from .rebuild import rebuild_hint
from .records import (
    Artifact,
    Builder,
    BuildRecord,
    DamagedManifest,
    GraphRecord,
    Int8Agreement,
    ModelRecord,
    ParityRecord,
    PostprocessRecord,
    StageRecord,
    encode,
    optional_field,
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
    precision: Precision | None = None
    opset: int | None = None
    exporter: str | None = None  # who made model.onnx: torchscript or dynamo (stages/export.py); None: an ONNX MODEL
    settings: dict | None = None  # Settings.as_record(): what a rebuild repeats
    versions: dict[str, str] = field(default_factory=dict)
    batch_profile: BatchProfile | None = None
    axis_ranges: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # extra dynamic axes: min/opt/max
    inputs: tuple[GraphTensor, ...] = ()
    outputs: tuple[GraphTensor, ...] = ()  # what the served graphs return (with POSTPROCESS=nms: the detections)
    graphs: tuple[GraphRecord, ...] = ()  # every graph of the folder (pipeline.folder.layout.folder_graphs)
    postprocess: PostprocessRecord | None = None  # POSTPROCESS=nms: its settings and the raw head's outputs
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
    # Where it was read from (read_manifest), not written: a rebuild command names the folder where it lies now,
    # a copy's too, not the OUT it was built in.
    folder: Path | None = field(default=None, compare=False)

    def builder(self) -> Builder:
        """Who built engine.plan, or a PipelineError where no engine was built."""
        if self.build is None or self.build.builder is None:
            raise PipelineError(
                "the manifest records no engine build", f"rebuild the folder: {rebuild_hint(self, force=True)}"
            )
        return self.build.builder

    def nms(self) -> NmsConfig | None:
        """The NMS the served graphs end in (POSTPROCESS=nms), or None where they end in the model's outputs."""
        if self.postprocess is None or self.postprocess.kind is not Postprocess.NMS:
            return None
        return NmsConfig(**self.postprocess.config)

    def head_outputs(self) -> tuple[GraphTensor, ...]:
        """The model's own outputs: what reference.npz and the graphs of the raw head hold (`outputs` where the
        served graphs end in them)."""
        return self.postprocess.head_outputs if self.postprocess is not None else self.outputs

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
            if entry.name in ("stages", "folder") or value is None:
                continue
            record[entry.name] = encode(value)
        return {**record, **self.stages}

    @classmethod
    def from_json(cls, raw: dict) -> Manifest:
        """The manifest of a folder; one written by another layout keeps only what its rebuild hint needs."""
        settings = raw.get("settings") if isinstance(raw.get("settings"), dict) else None
        layout = raw.get("layout")
        if layout != ARTIFACT_LAYOUT:
            return cls(layout=layout if isinstance(layout, int) else None, settings=settings)
        known = {entry.name for entry in dataclasses.fields(cls)} - {"stages", "folder"}
        return cls(
            layout=layout,
            complete=raw.get("complete") is True,
            reuse_key=optional_field(raw, "reuse_key", str),
            created=optional_field(raw, "created", str),
            model=ModelRecord.from_json(raw["model"]) if "model" in raw else None,
            precision=_precision(raw),
            opset=optional_field(raw, "opset", int),
            exporter=optional_field(raw, "exporter", str),
            settings=settings,
            versions=dict(optional_field(raw, "versions", dict) or {}),
            batch_profile=_batch_profile(raw["batch_profile"]) if "batch_profile" in raw else None,
            axis_ranges=_axis_ranges(raw.get("axis_ranges", {})),
            inputs=_tensors(raw, "inputs"),
            outputs=_tensors(raw, "outputs"),
            graphs=_graphs(raw),
            postprocess=PostprocessRecord.from_json(raw["postprocess"]) if "postprocess" in raw else None,
            engine=optional_field(raw, "engine", str),
            artifacts=_artifacts(raw.get("artifacts", {})),
            parity_batches=tuple(optional_field(raw, "parity_batches", list) or ()),
            reference_source=optional_field(raw, "reference_source", str),
            calibration=optional_field(raw, "calibration", dict),
            build=BuildRecord.from_json(raw["build"]) if "build" in raw else None,
            agreement_int8=Int8Agreement.from_json(raw["agreement_int8"]) if "agreement_int8" in raw else None,
            timings=dict(optional_field(raw, "timings", dict) or {}),
            onnxruntime_levels=_levels(raw),
            stages={key: value for key, value in raw.items() if key not in known and isinstance(value, dict)},
        )


def _precision(raw: dict) -> Precision | None:
    precision = raw.get("precision")
    if precision is None:
        return None
    if precision not in PRECISIONS:
        raise DamagedManifest(f"its precision is {precision!r}, not one of {', '.join(PRECISIONS)}")
    return Precision(precision)


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
    for record in optional_field(raw, key, list) or []:
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


def _graphs(raw: dict) -> tuple[GraphRecord, ...]:
    graphs = raw.get("graphs", [])
    if not isinstance(graphs, list):
        raise DamagedManifest(f"its graphs are {graphs!r}, not a list of graph records")
    return tuple(GraphRecord.from_json(graph) for graph in graphs)


def _levels(raw: dict) -> dict[str, str]:
    levels = optional_field(raw, "onnxruntime_levels", dict) or {}
    if not all(isinstance(level, str) for level in levels.values()):
        raise DamagedManifest(f"its onnxruntime_levels are {levels!r}, not file names")
    unknown = {graph: level for graph, level in levels.items() if level not in OPTIMIZATION_LEVELS}
    if unknown:
        raise DamagedManifest(f"its onnxruntime_levels {unknown} are not ONNX Runtime's {OPTIMIZATION_LEVELS}")
    return levels


def _artifacts(raw: Any) -> dict[str, Artifact]:
    return {
        name: Artifact.from_json(name, record)
        for name, record in (raw.items() if isinstance(raw, dict) else [("", raw)])
    }


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
        return dataclasses.replace(Manifest.from_json(raw), folder=Path(folder))
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


def record_stage(folder: Path, name: str, record: dict | StageRecord, seconds: float) -> Manifest:
    """Record a finished stage under its name with its seconds, and its time among the timings.  A typed record
    the manifest has a field for (agreement_int8) goes there as it is; any other is kept in its JSON form."""
    manifest = read_manifest(folder) or Manifest()
    earlier = manifest.timings if manifest.layout == ARTIFACT_LAYOUT else {}
    # A stage run again moves to the end: the last stage listed is the last one that finished.
    timings = {**{stage: time for stage, time in earlier.items() if stage != name}, name: seconds}
    if isinstance(record, Int8Agreement):
        timed = dataclasses.replace(record, details={**record.details, "seconds": seconds})
        return update_manifest(folder, agreement_int8=timed, timings=timings)
    raw = {**(record if isinstance(record, dict) else record.as_json()), "seconds": seconds}
    if name == "build":
        return update_manifest(folder, build=BuildRecord.from_json(raw), timings=timings)
    return update_manifest(folder, stages={**manifest.stages, name: raw}, timings=timings)
