"""The pipeline as a plain ordered list of stages over one artifact folder.

Each stage reads what earlier stages left in engines/<model>-<precision>/, writes
its own artifact under a temporary name, records itself in manifest.json and prints
one line.  `make_engine` runs them all and reuses a finished folder whose inputs and
settings are unchanged.  A run holds the folder's build lock from start to end, so two
runs never write one folder at once; readers open it through pipeline.folder.reader.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TypeVar

from ... import models
from ...calibration.holdout import CalibrationParts, read_calibration
from ...calibration.int8 import CACHE_FOLDER, make_int8_graph
from ...calibration.int8_records import CalibrationConfig
from ...calibration.readers import is_image_folder
from ...models.prepare import prepare
from ...models.spec import ModelSpec
from ..core.cpu import int8_cpu_kind
from ..core.errors import PipelineError
from ..core.mentions import render
from ..core.nms_config import NmsConfig
from ..core.precision import Precision
from ..core.sessions import levels_below_full
from ..core.settings import OPSET, Postprocess, Settings, deciding, mention
from ..core.trt_module import import_trt, module_record
from ..evaluation.agreement import Fp32Reference, int8_judge
from ..folder.artifacts import build_lock, sha256_file
from ..folder.graph_files import data_files, remove_graph
from ..folder.graph_io import GraphTensor, graph_io
from ..folder.layout import (
    ARTIFACT_LAYOUT,
    CPU_TARGETS,
    ENGINE,
    FP32_GRAPH,
    REFERENCE,
    artifact_names,
    folder_graphs,
    graph_record,
    postprocessed,
)
from ..folder.manifest import read_manifest, record_stage, update_manifest
from ..folder.provenance import artifact_problems, describe_artifacts, package_versions
from ..folder.rebuild import make_engine_command
from ..folder.records import (
    Builder,
    BuildRecord,
    GraphRecord,
    ModelRecord,
    PostprocessRecord,
    RowsAgreement,
    StageRecord,
    Target,
)
from .build import GraphRefused, build_engine
from .check import check_onnx
from .export import export_onnx, parity_batches, release_module, write_reference
from .fp16 import make_fp16_graph
from .fp16_overflow import Case
from .onnx_model import (
    REFERENCE_SOURCE,
    OnnxModel,
    import_onnx,
    is_onnx_model,
    open_onnx_model,
    write_onnx_reference,
)
from .parity import check_int8_agreement, check_parity
from .postprocess import Judged, append_postprocess, check_nms, held_out_rows
from .simplify import simplify_onnx

VERSIONED_PACKAGES = ("torch", "onnx", "onnxsim", "onnxruntime-gpu", "onnxruntime", "numpy")


# What a stage function returns: its record as a dict, or a typed record (pipeline.folder.records.StageRecord).
Recorded = TypeVar("Recorded", bound="dict | StageRecord")


@dataclass
class Run:
    """One pipeline run: its settings, its folder, and the model, loaded and prepared on first use."""

    settings: Settings
    folder: Path
    timings: dict[str, float] = field(default_factory=dict)
    _loaded: ModelSpec | None = None
    _prepared: bool = False
    _onnx: OnnxModel | None = None
    _calibration: CalibrationParts | None = None

    @classmethod
    def start(cls, settings: Settings) -> Run:
        settings.check()
        return cls(settings, settings.artifact_dir(models.canonical_name(settings.model)))

    @property
    def loaded(self) -> ModelSpec:
        """The model as loaded, not yet proven to be in eval mode."""
        if self._loaded is None:
            self._loaded = models.load_model(
                self.settings.model,
                weights=self.settings.weights,
                input_shape=self.settings.input_shape,
                dynamic=self.settings.dynamic,
                trust_model_file=self.settings.trust_model_file,
            )
            for note in self._loaded.notes:
                print(f"note: {note}")
        return self._loaded

    @property
    def onnx_model(self) -> OnnxModel | None:
        """MODEL=<file>.onnx, read and its dims resolved (pipeline.stages.onnx_model); None for a PyTorch model."""
        if self._onnx is None and is_onnx_model(self.settings.model):
            settings = self.settings
            self._onnx = open_onnx_model(Path(settings.model), settings.input_shape, settings.dynamic)
        return self._onnx

    @property
    def calibration(self) -> CalibrationParts | None:
        """CALIB, read once per run (on first use, by the precision stage or the NMS gate) against the FP32 graph's
        inputs, up to --calib-samples, and split as the INT8 gate holds rows out (calibration/holdout.py); None
        without CALIB.  Every stage that reads it takes this one record: the data and its split cannot differ
        between the graph and its gates."""
        settings = self.settings
        if self._calibration is None and settings.calib is not None:
            fp32, preprocess = _require(self, FP32_GRAPH), _preprocess(self)
            samples, batch = settings.calib_samples, settings.calib_batch
            self._calibration = read_calibration(settings.calib, fp32, preprocess, samples=samples, batch=batch)
        return self._calibration

    @property
    def fingerprint(self) -> str:
        return self.onnx_model.fingerprint if self.onnx_model else self.loaded.fingerprint

    @property
    def output_names(self) -> list[str] | None:
        """The model's outputs as its graph names them, known before any stage runs: an ONNX file's, or those a
        PyTorch model declares or its load-time forward pass gave (None where neither did)."""
        if self.onnx_model is not None:
            return list(self.onnx_model.outputs)
        return self.loaded.output_names

    @property
    def spec(self) -> ModelSpec:
        """The model in eval mode, proven by the prepare stage (run once, on first use)."""
        if not self._prepared:
            self.stage("prepare", prepare, self.loaded)
            self._prepared = True
        return self.loaded

    def path(self, name: str) -> Path:
        return self.folder / name

    def stage(self, name: str, function: Callable[..., Recorded], *args, **kwargs) -> Recorded:
        """Run one stage, print its line, record it (a dict, or a typed record) and its time in the manifest."""
        started = time.perf_counter()
        record = function(*args, **kwargs)
        seconds = time.perf_counter() - started
        self.timings[name] = round(seconds, 3)
        summary = record.get("summary", "done") if isinstance(record, dict) else record.summary
        print(f"{name:<12} {summary} ({seconds:.2f} s)", flush=True)
        manifest = record_stage(self.folder, name, record, round(seconds, 3))
        levels = levels_below_full(self.folder)
        if levels.items() - manifest.onnxruntime_levels.items():
            update_manifest(self.folder, onnxruntime_levels={**manifest.onnxruntime_levels, **levels})
        return record


def run_prepare(run: Run) -> None:
    if run.onnx_model is None:  # an ONNX file has no PyTorch model to prepare
        _ = run.spec


def run_export(run: Run) -> None:
    if run.onnx_model is not None:
        _import_onnx(run, run.onnx_model)
        return
    spec = run.spec
    update_manifest(
        run.folder,
        complete=False,
        model=ModelRecord(spec.name, run.settings.model, spec.fingerprint, tuple(spec.notes)),
        settings=run.settings.as_record(),
        opset=OPSET,
        precision=run.settings.precision,
        batch_profile=run.settings.batch,
        axis_ranges=_input_axis_ranges(spec),
        versions=package_versions(VERSIONED_PACKAGES),
    )
    # The reference first: the export stage checks each exporter's graph on its cases (auto keeps the one that runs).
    run.stage("reference", write_reference, spec, run.settings.batch, run.path(REFERENCE))
    record = run.stage("export", export_onnx, spec, run.path(FP32_GRAPH), run.path(REFERENCE), run.settings.exporter)
    update_manifest(run.folder, exporter=record["exporter"])
    release_module(spec)  # the later stages read the graph and the reference: the weights are on disk now


def _import_onnx(run: Run, source: OnnxModel) -> None:
    """MODEL=<file>.onnx: the file becomes model.onnx and its own FP32 outputs the reference (no PyTorch)."""
    update_manifest(
        run.folder,
        complete=False,
        model=ModelRecord(
            models.canonical_name(run.settings.model),
            run.settings.model,
            source.fingerprint,
            (f"reference: {REFERENCE_SOURCE}",),
        ),
        reference_source=REFERENCE_SOURCE,
        settings=run.settings.as_record(),
        opset=OPSET,
        precision=run.settings.precision,
        batch_profile=run.settings.batch,
        axis_ranges={name: tuple(bounds) for name, bounds in source.axis_ranges.items()},
        versions=package_versions(VERSIONED_PACKAGES),
    )
    graph = run.path(FP32_GRAPH)
    run.stage("import", import_onnx, source, graph)
    run.stage("reference", write_onnx_reference, source, graph, run.settings.batch, run.path(REFERENCE))


def run_check(run: Run) -> None:
    record = run.stage("check", check_onnx, _require(run, FP32_GRAPH), _require(run, REFERENCE))
    inputs, outputs = ([GraphTensor.from_record(r) for r in record[key]] for key in ("inputs", "outputs"))
    update_manifest(run.folder, inputs=tuple(inputs), outputs=tuple(outputs))


def run_simplify(run: Run) -> None:
    graph = _require(run, FP32_GRAPH)
    run.stage("simplify", simplify_onnx, graph, graph)


def run_parity(run: Run) -> None:
    reference = _require(run, REFERENCE)
    fp32 = graph_record(Precision.FP32)
    run.stage(fp32.gate, check_parity, _require(run, fp32.file), reference, graph=fp32)


def run_precision(run: Run) -> None:
    precision = run.settings.precision
    if precision is Precision.FP32:
        return
    engine = graph_record(precision)
    judged: tuple[Case, ...] = ()  # inputs judged against the FP32 graph besides the reference cases
    if precision is Precision.FP16:
        judged = _fp16_stage(run, engine)
    else:
        _int8_stage(run, engine)
    reference = _require(run, REFERENCE)
    target = _require(run, engine.file)
    run.stage(engine.gate, check_parity, target, reference, graph=engine, against_fp32=judged)


def _fp16_stage(run: Run, engine: GraphRecord) -> tuple[Case, ...]:
    """model.fp16.onnx; returns what its faithful gate judges besides the reference inputs: with CALIB, the
    calibration runs where the scan saw the largest activations (against the FP32 graph).  Judged there because
    real inputs overflow where the reference inputs (often random) do not, and a fallback chosen from them must
    be seen to hold on them; only a few runs (LARGEST_CASES), so the gate costs about what it did."""
    source = _require(run, FP32_GRAPH)
    calibration = run.calibration.data if run.calibration is not None else None
    reference = _require(run, REFERENCE)
    result = run.stage("fp16", make_fp16_graph, source, run.path(engine.file), reference, run.settings, calibration)
    if result.calibration is not None:
        update_manifest(run.folder, calibration=result.calibration)
    return result.judged


def _int8_stage(run: Run, engine: GraphRecord) -> None:
    """model.int8.onnx and the CPU graphs, each through its parity gate, then the agreement gate.  A CPU graph that
    could not be made is left out of the folder's graphs (the int8 record says why); the runner on such a
    CPU then takes the engine's graph.  Settings.check() has already refused int8 without CALIB.  The model is
    loaded, not prepared: calibration only needs its declared image preprocessing."""
    source, calibration = _require(run, FP32_GRAPH), run.calibration
    assert calibration is not None  # Settings.check() refuses int8 without CALIB
    fp32 = Fp32Reference(source)  # FP32's outputs on the held-out rows: computed by the judge, reused by the gate
    cpu = {kind: graph_record(Precision.INT8, target) for kind, target in CPU_TARGETS.items()}
    result = run.stage(
        "int8",
        make_int8_graph,
        source,
        run.path(engine.file),
        calibration,
        config=CalibrationConfig.from_settings(run.settings),
        cache_folder=run.path(CACHE_FOLDER),
        cpu_out_paths={kind: run.path(graph.file) for kind, graph in cpu.items()},
        judge=int8_judge(fp32),
    )
    if result.fp32_fit_outputs is not None:  # calibration ran FP32 on the fit rows at its level: the gate needs no run
        fp32.add(calibration.fit.batches, result.fp32_fit_outputs)
    written = {kind: cpu[kind] for kind in result.written_cpu_graphs}
    for kind in cpu.keys() - written.keys():  # an earlier build's graph under its name would pass for this one's
        remove_graph(run.path(cpu[kind].file))
    graphs = (graph_record(Precision.FP32), engine, *written.values())
    update_manifest(run.folder, calibration=result.calibration, graphs=graphs)
    for graph in written.values():
        graph_path, reference = _require(run, graph.file), _require(run, REFERENCE)
        run.stage(graph.gate, check_parity, graph_path, reference, graph=graph)
    for graph in _check_int8_agreement(run, fp32, calibration, engine, written, result.chosen.held_out):
        _leave_out_graph(run, graph, "it departs from FP32 on the calibration data (agreement_int8 in the manifest)")


def _preprocess(run: Run):
    """The model's declared image preprocessing where CALIB is a folder of images; the model is loaded, not
    prepared.  None for an ONNX MODEL and for model-ready data: loading the model only to learn it would hold its
    weights through the stage (the INT8 stage of a 0.6 GB MLP on model-ready rows held them beside its own)."""
    if run.onnx_model or run.settings.calib is None or not is_image_folder(run.settings.calib):
        return None
    return run.loaded.preprocess


def _check_int8_agreement(
    run: Run,
    fp32: Fp32Reference,
    parts: CalibrationParts,
    engine: GraphRecord,
    cpu_graphs: dict[str, GraphRecord],
    judged: dict[str, RowsAgreement] | None,
) -> list[GraphRecord]:
    """INT8's gate, on the calibration rows held out from the ranges' fit (with the fit rows' numbers beside them):
    the engine's graph, and the CPU graph this CPU's runner serves; returns the CPU graphs to leave out.  Where
    the held-out rows are much worse than the fit ones, it warns with the fix (STRICT_CALIB=1: refuses).

    The engine's graph past the gate stops the build.  The CPU graph is optional (int8.py): past the gate it is
    left out, and the runner on this CPU serves the engine's graph with its Q/DQ simulated instead (slower, as
    accurate as the engine).  The CPU graph for the other kind of CPU is not judged here: this CPU's kernels do
    not run it as its own CPU does (U8S8 saturates without VNNI).  judged: the engine graph's outputs on the
    held-out rows, as the INT8 stage judged its bytes (the kept candidate's): not computed again.
    """
    served = cpu_graphs.get(int8_cpu_kind())
    agreement = run.stage(
        "agreement_int8",
        check_int8_agreement,
        fp32,
        [_require(run, engine.file)],
        parts.fit.batches,
        parts.held_out.batches if parts.held_out else None,
        split=parts.split,
        strict=run.settings.strict_calib,
        optional={_require(run, served.file): served} if served else {},
        judged={_require(run, engine.file): judged} if judged else {},
    )
    if agreement.warning is not None:
        print(render(f"warning: {agreement.warning} ({mention(strict_calib=True)} refuses such a build)"), flush=True)
    left_out = {name for name, graph in agreement.graphs.items() if graph.left_out is not None}
    return [graph for graph in cpu_graphs.values() if graph.file in left_out]


def _leave_out_graph(run: Run, left_out: GraphRecord, why: str) -> None:
    """Drop a CPU graph that failed its gate from the folder's graphs and from disk, and say so."""
    manifest = read_manifest(run.folder)
    graphs = tuple(graph for graph in (manifest.graphs if manifest else ()) if graph != left_out)
    update_manifest(run.folder, graphs=graphs)
    remove_graph(run.path(left_out.file))
    instead = graph_record(left_out.precision, postprocess=left_out.postprocess).file
    print(
        f"warning: {left_out.file} left out of {run.folder.name}: {why}; a runner on this CPU serves {instead} with "
        "its Q/DQ simulated instead (as accurate as the engine, slower than ONNX Runtime's int8 kernels)",
        flush=True,
    )


def check_nms_head(run: Run) -> None:
    """POSTPROCESS=nms: NMS_HEAD against the model's outputs, before any stage runs (append_nms would find it
    wrong only once the graphs it appends to are made, in NmsConfig's words)."""
    config = run.settings.nms_config()
    names = run.output_names if config is not None else None  # loads the model: only where it is needed
    if config is None or names is None:
        return
    name_it = " or ".join(mention(nms_head=name) for name in names)
    if config.head is None and len(names) != 1:
        raise PipelineError(
            f"{mention(postprocess=Postprocess.NMS)} needs to know which output is the detection head; the model "
            f"has {len(names)} outputs ({', '.join(names)})",
            f"name it: {name_it}",
        )
    if config.head is not None and config.head not in names:
        raise PipelineError(
            f"{mention(nms_head=config.head)} names no output of the model; its outputs are {', '.join(names)}",
            f"name the head among them: {name_it}",
        )


def run_postprocess(run: Run) -> None:
    """POSTPROCESS=nms: each graph of the raw head that may serve gets its NMS graph, which passes its gate and
    serves instead (pipeline/stages/postprocess.py); the manifest's outputs become the detections, and its
    postprocess record keeps the settings and the raw head's outputs."""
    config = run.settings.nms_config()
    if config is None:
        return
    manifest = read_manifest(run.folder)
    listed = (manifest.graphs if manifest else ()) or folder_graphs(run.settings.precision)  # int8: less left-out
    heads = [graph for graph in listed if graph.postprocess is Postprocess.NONE]
    served = [postprocessed(graph, Postprocess.NMS) for graph in heads]
    paths = [_require(run, graph.file) for graph in heads]
    record = run.stage("nms", append_postprocess, paths, [run.path(graph.file) for graph in served], config)
    head_outputs = graph_io(run.path(FP32_GRAPH)).outputs
    head = config.head or head_outputs[0].name  # append_nms refused a graph of several outputs without one
    update_manifest(
        run.folder,
        graphs=(*heads, *served),
        outputs=graph_io(run.path(served[0].file)).outputs,
        postprocess=PostprocessRecord(Postprocess.NMS, record["config"], head_outputs),
    )
    rows = _held_out_detections(run, head)
    for graph in served:
        try:
            _check_nms_graph(run, graph, config, head, rows)
        except PipelineError as error:
            if graph.target is Target.ENGINE:
                raise
            # A CPU graph is optional, as at the INT8 agreement gate: the engine's NMS graph serves this CPU instead.
            for left_out in (next(h for h in heads if h.target is graph.target), graph):
                _leave_out_graph(run, left_out, f"its detections fail their gate ({error.problem})")


def _check_nms_graph(run: Run, graph: GraphRecord, config: NmsConfig, head: str, rows: list[Judged]) -> None:
    """One NMS graph's gate.  Its detections are judged where this host computes them as served: a graph shaped for
    another kind of CPU is recorded only (this CPU's int8 kernels do not compute it as that CPU does)."""
    here = graph.target in (Target.ENGINE, CPU_TARGETS[int8_cpu_kind()])
    held_out = rows if graph.precision is not Precision.FP32 else []  # FP32's head is what they are judged by
    nms_path, reference = _require(run, graph.file), _require(run, REFERENCE)
    run.stage(
        graph.gate, check_nms, nms_path, reference, config, head, graph=graph, batch=run.settings.batch,
        held_out=held_out, judge_detections=here,
    )  # fmt: skip


def _held_out_detections(run: Run, head: str) -> list[Judged]:
    """With CALIB: the calibration rows the INT8 gate holds out (calibration/holdout.py; every row where none can
    be), with the FP32 graph's head on them, which the lower precisions' detections are judged against."""
    parts = run.calibration
    if parts is None:
        return []
    fp32 = _require(run, FP32_GRAPH)
    rows, label = (parts.held_out, "held-out calibration") if parts.held_out else (parts.fit, "calibration")
    return held_out_rows(fp32, head, rows.batches, label)


def run_build(run: Run) -> None:
    """engine.plan from the engine's graph.  With BUILDER=auto the folder is finished without one where no TensorRT
    imports on this host (a Hopper GPU machine has none that builds or runs an engine: docs/runner.md), or where
    TensorRT's parser refuses the graph (an op it does not implement: XLNet's EyeLike on dynamic dims, FNet's DFT):
    its checked graphs serve through ONNX Runtime, and the manifest's build record says why no engine was built.  A
    builder asked for by name must be there and build."""
    precision, postprocess = run.settings.precision, run.settings.postprocess
    graph = _require(run, graph_record(precision, postprocess=postprocess).file)
    try:
        trt = import_trt(run.settings.builder)
    except PipelineError as error:
        _no_engine(run, error, refused_by=None)
        return
    manifest = read_manifest(run.folder)
    try:
        run.stage("build", _build, run, graph, manifest.axis_ranges if manifest is not None else {})
    except GraphRefused as error:
        _no_engine(run, error, refused_by=Builder(**module_record(trt)))


def _no_engine(run: Run, error: PipelineError, refused_by: Builder | None) -> None:
    """The folder finished without an engine, the build record saying why (and which builder refused its graph, so
    that only another one is tried again: _builder_changed); a builder asked for by name stops the build instead."""
    update_manifest(run.folder, build=BuildRecord(skipped=error.problem, builder=refused_by))
    if run.settings.builder != "auto":
        raise PipelineError(
            f"the ONNX artifacts are in {run.folder}, but no engine was built: {error.problem}", error.fix
        ) from None
    run.path(ENGINE).unlink(missing_ok=True)  # an earlier build's engine is not this folder's
    print(
        f"{'build':<12} no engine: {error.problem}; the folder's checked graphs serve through ONNX Runtime "
        f"(load_runner); for an engine: {error.fix}, then rebuild",
        flush=True,
    )


def _build(run: Run, graph: Path, axis_ranges: dict) -> dict:
    engine = run.path(ENGINE)
    record = build_engine(
        graph,
        engine,
        batch=run.settings.batch,
        axis_ranges=axis_ranges,
        workspace_mib=run.settings.workspace_mib,
        builder=run.settings.builder,
        target=run.settings.target,
        timing_cache=Path(run.settings.out_root) / "timing.cache",
    )
    builder = record["builder"]
    record["summary"] = (
        f"{engine.name} from {graph.name}: {builder['module']} {builder['version']}, "
        f"batch {run.settings.batch}, {record['engine_bytes'] / 1e6:.1f} MB"
    )
    return record


STAGES: dict[str, Callable[[Run], None]] = {
    "prepare": run_prepare,
    "export": run_export,
    "check": run_check,
    "simplify": run_simplify,
    "parity": run_parity,
    "precision": run_precision,
    "postprocess": run_postprocess,
    "build": run_build,
}


def run_stage(settings: Settings, name: str) -> Path:
    """Run one stage on what is already on disk (the command line's `trt-pipeline <stage>`).

    The folder is no longer a finished build afterwards (its artifacts may differ from the ones the manifest
    lists), so readers refuse it until make_engine runs all stages again.
    """
    run = Run.start(settings)
    check_nms_head(run)
    with _locked(run.folder):
        update_manifest(run.folder, complete=False)
        STAGES[name](run)
    return run.folder


def make_engine(settings: Settings) -> Path:
    """Every stage in order; a finished folder with the same inputs and settings is reused."""
    run = Run.start(settings)
    check_nms_head(run)
    with _locked(run.folder):
        return _make_engine(run)


def _make_engine(run: Run) -> Path:
    settings = run.settings
    key = reuse_key(settings, run.fingerprint)
    # RECALIBRATE=1 means fresh ranges, so it never reuses a finished folder.
    if not (settings.force or settings.recalibrate) and _up_to_date(run.folder, key, settings.builder):
        same = "same model, weights, settings and versions"
        print(render(f"up to date   {run.folder} ({same}; {mention(force=True)} rebuilds)"))
        return run.folder
    # timings restart: the last stage they list is where an unfinished build stopped.
    # graphs and postprocess restart too: a folder built with another POSTPROCESS lists other graphs.
    update_manifest(
        run.folder, complete=False, reuse_key=key, timings={}, onnxruntime_levels={}, graphs=(), postprocess=None
    )
    for stage in STAGES.values():
        stage(run)
    # The precision's graphs, less (int8) a CPU graph that could not be made (run_precision).
    manifest = read_manifest(run.folder)
    graphs = (manifest.graphs if manifest else None) or folder_graphs(settings.precision)
    update_manifest(
        run.folder,
        complete=True,
        reuse_key=key,
        graphs=graphs,
        engine=ENGINE,
        parity_batches=tuple(parity_batches(settings.batch)),
        artifacts=describe_artifacts(run.folder, _artifact_files(run, graphs)),
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    print(f"done         {run.folder} ({sum(run.timings.values()):.1f} s in stages)")
    return run.folder


def _artifact_files(run: Run, graphs: tuple[GraphRecord, ...]) -> list[str]:
    """The files the manifest lists with their sha256: the layout's, and the data file of each graph past 2 GB
    (read from the graph itself, which must keep its weights beside it: graph_files.data_files)."""
    data = [path.name for graph in graphs for path in data_files(run.path(graph.file))]
    return [*artifact_names(graphs), *data]


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """The folder's build lock (pipeline.folder.artifacts.build_lock), saying which killed runs' temporaries it
    removed."""
    with build_lock(folder) as removed:
        if removed:
            names = ", ".join(str(path.relative_to(folder)) for path in removed)
            print(f"cleaned      {len(removed)} temporary file(s) left by killed runs: {names}", flush=True)
        yield


def reuse_key(settings: Settings, fingerprint: str) -> str:
    """Everything that decides the artifacts: settings, model code and weights, calibration data, versions."""
    # Only the settings that decide this precision's artifacts (core/settings.py): INT8's own must not rebuild an
    # FP16 folder, nor FP16's an INT8 one.
    names = deciding(settings.precision, settings.postprocess)
    record = settings.as_record()
    payload = {
        "layout": ARTIFACT_LAYOUT,
        "settings": {name: record[name] for name in names},
        "model": fingerprint,
        # FP16 reads CALIB too (the FP32-fallback scan), so new data invalidates its graph as it does INT8's.
        "calibration": _calibration_fingerprint(settings) if "calib" in names else None,
        "versions": package_versions(VERSIONED_PACKAGES),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _calibration_fingerprint(settings: Settings) -> str:
    """sha256 over the calibration files' names and bytes: new or changed images invalidate the INT8 graph."""
    source = Path(settings.calib) if settings.calib else None
    if source is None or not source.exists():
        return "absent"  # the int8 stage itself reports the missing data
    files = sorted(p for p in source.rglob("*") if p.is_file()) if source.is_dir() else [source]
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.relative_to(source) if source.is_dir() else path.name}\0{sha256_file(path)}\n".encode())
    return digest.hexdigest()


def _input_axis_ranges(spec: ModelSpec) -> dict[str, list[int]]:
    """The engine profile's ranges for the inputs' extra dynamic axes (output-only axes need none)."""
    return {
        d.name: [d.min, d.opt, d.max]
        for tensor, axes in spec.dynamic_axes.items()
        if tensor in spec.example_inputs
        for d in axes.values()
    }


def _up_to_date(folder: Path, key: str, builder: str) -> bool:
    """A finished folder of the same key, its artifacts intact; one finished without an engine only while the builder
    that would build it now is none, or the one that refused its graph (installing one makes the next make_engine
    build the engine)."""
    manifest = read_manifest(folder)
    return (
        manifest is not None
        and manifest.complete
        and manifest.reuse_key == key
        and not artifact_problems(folder, manifest.artifacts)
        and not (manifest.build is not None and _builder_changed(manifest.build, builder))
    )


def _builder_changed(build: BuildRecord, choice: str) -> bool:
    """Whether a folder finished without an engine could get one now: a builder imports here that is not the one
    that refused its graph (None where none imported then)."""
    if build.skipped is None:
        return False
    try:
        trt = import_trt(choice)
    except PipelineError:
        return False
    return build.builder != Builder(**module_record(trt))


def _require(run: Run, name: str) -> Path:
    path = run.path(name)
    if not path.is_file():
        raise PipelineError(
            f"{path} does not exist yet",
            f"run the earlier stages first: {make_engine_command(run.settings.as_record())}",
        )
    return path
