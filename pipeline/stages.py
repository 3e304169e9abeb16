"""The pipeline as a plain ordered list of stages over one artifact folder.

Each stage reads what earlier stages left in engines/<model>-<precision>/, writes
its own artifact under a temporary name, records itself in manifest.json and prints
one line.  `make_engine` runs them all and reuses a finished folder whose inputs and
settings are unchanged.  A run holds the folder's build lock from start to end, so two
runs never write one folder at once; readers open it through pipeline.folder.
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

import models
from calibration.int8 import CACHE_FOLDER, CPU_GRAPHS, CalibrationConfig, make_int8_graph, written_cpu_graphs
from calibration.readers import graph_inputs, read_calibration_data
from models.spec import ModelSpec
from pipeline.artifacts import build_lock, sha256_file
from pipeline.check import check_onnx
from pipeline.cpu import int8_cpu_kind
from pipeline.errors import PipelineError
from pipeline.export import export_onnx, load_reference, parity_batches, write_reference
from pipeline.manifest import (
    ARTIFACT_LAYOUT,
    ENGINE,
    REFERENCE,
    artifact_problems,
    describe_artifacts,
    package_versions,
    read_manifest,
    update_manifest,
)
from pipeline.parity import check_int8_agreement, check_parity
from pipeline.precision import GRAPH_NAMES, convert_fp16
from pipeline.prepare import prepare
from pipeline.settings import OPSET, Settings
from pipeline.simplify import simplify_onnx

VERSIONED_PACKAGES = ("torch", "onnx", "onnxsim", "onnxruntime-gpu", "onnxruntime", "numpy")


@dataclass
class Run:
    """One pipeline run: its settings, its folder, and the model, loaded and prepared on first use."""

    settings: Settings
    folder: Path
    timings: dict[str, float] = field(default_factory=dict)
    _loaded: ModelSpec | None = None
    _prepared: bool = False

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
    def spec(self) -> ModelSpec:
        """The model in eval mode, proven by the prepare stage (run once, on first use)."""
        if not self._prepared:
            self.stage("prepare", prepare, self.loaded)
            self._prepared = True
        return self.loaded

    def path(self, name: str) -> Path:
        return self.folder / name

    def stage(self, name: str, function: Callable[..., dict], *args, **kwargs) -> dict:
        """Run one stage, print its line, record it and its time in the manifest."""
        started = time.perf_counter()
        record = function(*args, **kwargs)
        seconds = time.perf_counter() - started
        self.timings[name] = round(seconds, 3)
        print(f"{name:<12} {record.get('summary', 'done')} ({seconds:.2f} s)", flush=True)
        record["seconds"] = round(seconds, 3)
        update_manifest(self.folder, **{name: record}, timings=self.timings)
        return record


def run_prepare(run: Run) -> None:
    _ = run.spec


def run_export(run: Run) -> None:
    spec = run.spec
    update_manifest(
        run.folder,
        complete=False,
        model={"name": spec.name, "source": run.settings.model, "fingerprint": spec.fingerprint, "notes": spec.notes},
        settings=run.settings.as_record(),
        opset=OPSET,
        precision=run.settings.precision,
        batch_profile={"min": run.settings.batch.min, "opt": run.settings.batch.opt, "max": run.settings.batch.max},
        axis_ranges=_input_axis_ranges(spec),
        versions=package_versions(VERSIONED_PACKAGES),
    )
    run.stage("export", export_onnx, spec, run.path(GRAPH_NAMES["fp32"]))
    run.stage("reference", write_reference, spec, run.settings.batch, run.path(REFERENCE))


def run_check(run: Run) -> None:
    record = run.stage("check", check_onnx, _require(run, GRAPH_NAMES["fp32"]), _require(run, REFERENCE))
    update_manifest(run.folder, inputs=record["inputs"], outputs=record["outputs"])


def run_simplify(run: Run) -> None:
    graph = _require(run, GRAPH_NAMES["fp32"])
    run.stage("simplify", simplify_onnx, graph, graph)


def run_parity(run: Run) -> None:
    reference = _require(run, REFERENCE)
    run.stage("parity_fp32", check_parity, _require(run, GRAPH_NAMES["fp32"]), reference, precision="fp32")


def run_precision(run: Run) -> None:
    precision = run.settings.precision
    if precision == "fp32":
        return
    source, target = _require(run, GRAPH_NAMES["fp32"]), run.path(GRAPH_NAMES[precision])
    if precision == "fp16":
        # The reference inputs up to batch 8: every intermediate tensor of a run is held at once.
        cases = [inputs for inputs, _ in load_reference(_require(run, REFERENCE)) if _rows(inputs) <= 8]
        settings = run.settings
        run.stage(
            "fp16",
            convert_fp16,
            source,
            target,
            cases=cases,
            keep_fp32=settings.fp32_nodes(),
            auto_fp32=settings.auto_fp32,
        )
    else:
        # Settings.check() has already refused int8 without CALIB.  The model is loaded, not
        # prepared: calibration only needs its declared image preprocessing.
        record = run.stage(
            "int8",
            make_int8_graph,
            source,
            target,
            run.settings.calib,
            preprocess=run.loaded.preprocess,
            config=CalibrationConfig.from_settings(run.settings),
            cache_folder=run.path(CACHE_FOLDER),
            cpu_out_paths={kind: run.path(name) for kind, name in CPU_GRAPHS.items()},
        )
        # onnxruntime_cpu_graphs: the graphs ONNX Runtime's CPU provider runs in int8, by kind of CPU
        # (the runner on a CPU takes the one for its kind).
        # A CPU graph ORT's quantizer could not make is left out (the record says why); its CPUs run model.int8.onnx.
        cpu_graphs = written_cpu_graphs(record)
        update_manifest(run.folder, calibration=record["calibration"], onnxruntime_cpu_graphs=cpu_graphs)
        for kind, name in cpu_graphs.items():
            stage = f"parity_int8_onnxruntime_{kind.replace('-', '_')}"
            run.stage(stage, check_parity, _require(run, name), _require(run, REFERENCE), precision="int8")
        _check_int8_agreement(run, source, cpu_graphs)
    run.stage(f"parity_{precision}", check_parity, target, _require(run, REFERENCE), precision=precision)


def _check_int8_agreement(run: Run, fp32: Path, cpu_graphs: dict[str, str]) -> None:
    """INT8's gate, on the calibration data: the engine's graph, and the CPU graph this CPU's runner serves.

    The CPU graph for the other kind of CPU is not judged here: this CPU's kernels do not run it as its
    own CPU does (U8S8 saturates without VNNI).
    """
    settings = run.settings
    assert settings.calib is not None  # Settings.check() refuses int8 without CALIB
    data = read_calibration_data(
        settings.calib,
        graph_inputs(fp32),
        run.loaded.preprocess,
        samples=settings.calib_samples,
        batch=settings.calib_batch,
    )
    served = cpu_graphs.get(int8_cpu_kind())
    graphs = [_require(run, GRAPH_NAMES["int8"]), *([_require(run, served)] if served else [])]
    run.stage("agreement_int8", check_int8_agreement, fp32, graphs, data.batches)


def _rows(inputs: dict) -> int:
    return int(next(iter(inputs.values())).shape[0])


def run_build(run: Run) -> None:
    from pipeline.trt_module import import_trt

    graph = _require(run, GRAPH_NAMES[run.settings.precision])
    try:
        import_trt(run.settings.builder)
    except PipelineError as error:
        update_manifest(run.folder, build={"status": "skipped", "reason": error.problem})
        raise PipelineError(
            f"the ONNX artifacts are in {run.folder}, but no engine was built: {error.problem}", error.fix
        ) from None
    axis_ranges = {name: tuple(r) for name, r in read_manifest(run.folder).get("axis_ranges", {}).items()}
    run.stage("build", _build, run, graph, axis_ranges)


def _build(run: Run, graph: Path, axis_ranges: dict) -> dict:
    from pipeline.build import build_engine

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
    "build": run_build,
}


def run_stage(settings: Settings, name: str) -> Path:
    """Run one stage on what is already on disk (the command line's `python -m pipeline <stage>`).

    The folder is no longer a finished build afterwards (its artifacts may differ from the ones the manifest
    lists), so readers refuse it until make_engine runs all stages again.
    """
    run = Run.start(settings)
    with _locked(run.folder):
        update_manifest(run.folder, complete=False)
        STAGES[name](run)
    return run.folder


def make_engine(settings: Settings) -> Path:
    """Every stage in order; a finished folder with the same inputs and settings is reused."""
    run = Run.start(settings)
    with _locked(run.folder):
        return _make_engine(run)


def _make_engine(run: Run) -> Path:
    settings = run.settings
    key = reuse_key(settings, run.loaded.fingerprint)
    # RECALIBRATE=1 means fresh ranges, so it never reuses a finished folder.
    names = artifact_names(settings)
    if not (settings.force or settings.recalibrate) and _up_to_date(run.folder, key):
        print(f"up to date   {run.folder} (same model, weights, settings and versions; FORCE=1 rebuilds)")
        return run.folder
    update_manifest(run.folder, complete=False, reuse_key=key, layout=ARTIFACT_LAYOUT)
    for stage in STAGES.values():
        stage(run)
    update_manifest(
        run.folder,
        complete=True,
        reuse_key=key,
        graph=GRAPH_NAMES[settings.precision],
        engine=ENGINE,
        parity_batches=parity_batches(settings.batch),
        artifacts=describe_artifacts(run.folder, names),
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    print(f"done         {run.folder} ({sum(run.timings.values()):.1f} s in stages)")
    return run.folder


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """The folder's build lock (pipeline.artifacts.build_lock), saying which killed runs' temporaries it removed."""
    with build_lock(folder) as removed:
        if removed:
            names = ", ".join(str(path.relative_to(folder)) for path in removed)
            print(f"cleaned      {len(removed)} temporary file(s) left by killed runs: {names}", flush=True)
        yield


def artifact_names(settings: Settings) -> list[str]:
    """The files a finished folder lists in its manifest (describe_artifacts skips the ones not written)."""
    graphs = [GRAPH_NAMES[settings.precision], *(CPU_GRAPHS.values() if settings.precision == "int8" else [])]
    return list(dict.fromkeys([GRAPH_NAMES["fp32"], REFERENCE, *graphs, ENGINE]))


def reuse_key(settings: Settings, fingerprint: str) -> str:
    """Everything that decides the artifacts: settings, model code and weights, calibration data, versions."""
    record = {k: v for k, v in settings.as_record().items() if k not in ("force", "recalibrate")}
    payload = {
        "layout": ARTIFACT_LAYOUT,
        "settings": record,
        "model": fingerprint,
        "calibration": _calibration_fingerprint(settings) if settings.precision == "int8" else None,
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


def _up_to_date(folder: Path, key: str) -> bool:
    manifest = read_manifest(folder)
    return (
        manifest.get("complete") is True
        and manifest.get("reuse_key") == key
        and not artifact_problems(folder, manifest)
    )


def _require(run: Run, name: str) -> Path:
    path = run.path(name)
    if not path.is_file():
        raise PipelineError(
            f"{path} does not exist yet",
            f"run the earlier stages first: python -m pipeline all --model {run.settings.model} "
            f"--precision {run.settings.precision}",
        )
    return path
