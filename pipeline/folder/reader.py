"""Reading an artifact folder: the one way the runners, the benchmark, the service and the Triton writer open it.

The stages write engines/<model>-<precision>/ (pipeline/stages/sequence.py) under a build lock; everything else only
reads it, through `open_folder`, so every reader holds to the same rules:
  - a folder whose last build did not finish (its manifest's `complete` is not true: a rebuild killed halfway,
    a gate that failed, a build running now) is never loaded: its files may be half the old build and half
    the new;
  - a folder written by another artifact layout (an earlier version of the stages) is refused: rebuild it;
  - every graph or plan handed out is a plain file name of the folder, listed in the manifest's artifacts, and
    is read once with its bytes checked against the sha256 the build recorded: a graph swapped for another
    model's, or one the manifest names outside the folder, is refused;
  - what may serve the folder on a host is one answer (ArtifactFolder.servable), read from the graphs' records and
    their gates, never from file names: `auto`, the ONNX Runtime runners and the Triton writer take it.
It imports neither torch, onnx nor any build stage: serving an ONNX graph needs this module and onnxruntime.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import PipelineError
from ..core.precision import Precision
from ..core.settings import POSTPROCESS_NONE
from .artifacts import running_build
from .layout import ARTIFACT_LAYOUT, CPU_TARGETS
from .manifest import Manifest, require_manifest
from .rebuild import rebuild_hint
from .records import Artifact, GraphRecord, Target

# What a finished folder's manifest always holds (make_engine writes them all before `complete`).
_REQUIRED = ("model", "precision", "settings", "graphs", "engine", "artifacts", "inputs", "outputs", "batch_profile")


@dataclass(frozen=True)
class ArtifactFolder:
    """A finished artifact folder, checked by open_folder: what readers look up, by name."""

    path: Path
    manifest: Manifest = field(repr=False)  # the whole record, typed
    model: str  # the model's canonical name (resnet50, toy_models-tiny_cnn)
    precision: str
    graphs: tuple[GraphRecord, ...]  # every graph of the folder, model.onnx first (pipeline.folder.layout)
    engine: str
    artifacts: dict[str, Artifact]
    postprocess: str = POSTPROCESS_NONE  # what the served graphs end in (the manifest's postprocess record)

    @property
    def engine_graph(self) -> GraphRecord:
        """The graph the engine was built from (open_folder checked that the folder lists it)."""
        return next(graph for graph in self.graphs if _builds_the_engine(graph, self.precision, self.postprocess))

    @property
    def graph(self) -> str:
        """The file of the graph the engine was built from."""
        return self.engine_graph.file

    def record(self, name: str) -> GraphRecord | None:
        """The manifest's record of the graph file `name`, or None where the folder lists no such graph."""
        return next((graph for graph in self.graphs if graph.file == name), None)

    def servable(self, cpu_kind: str) -> Servable:
        """What may serve the folder on a host with this kind of CPU (pipeline.core.cpu.int8_cpu_kind), the one
        answer the runners and `auto` take: the graphs as accurate as the folder's precision promises (an int8
        folder may serve its FP32 graph; an fp32 folder never serves INT8), ending in the folder's post-processing
        (a POSTPROCESS=nms folder serves its NMS graphs, never the raw head's), whose gates passed.  On the CPU
        provider a graph shaped for this kind of CPU stands for the engine-shaped graph of its precision (which runs
        there only with its Q/DQ simulated in float) and graphs shaped for other CPUs are left out; the CUDA provider
        runs the engine-shaped graphs."""
        passed, refused = self._gated()
        here = CPU_TARGETS[cpu_kind]
        shaped = {graph.precision for graph in passed if graph.target is here}
        on_cpu = [g for g in passed if g.target is here or (g.target is Target.ENGINE and g.precision not in shaped)]
        on_cuda = [graph for graph in passed if graph.target is Target.ENGINE]
        return Servable(tuple(on_cpu), tuple(on_cuda), tuple(refused))

    def servable_anywhere(self) -> list[str]:
        """The files of every graph that may serve the folder on some host (servable, on each kind of CPU)."""
        on_hosts = [self.servable(kind) for kind in CPU_TARGETS]
        return list(dict.fromkeys(graph.file for host in on_hosts for graph in (*host.on_cuda, *host.on_cpu)))

    def _gated(self) -> tuple[list[GraphRecord], list[str]]:
        """(the graphs as accurate as the folder's precision promises whose gates passed, "file: why not" of the
        others), model.onnx first."""
        allowed = Precision(self.precision).at_least_as_accurate()
        passed, refused = [], []
        served = (g for g in self.graphs if g.precision in allowed and g.postprocess == self.postprocess)
        for graph in served:
            failure = self._gate_failure(graph)
            if failure is None:
                passed.append(graph)
            else:
                refused.append(f"{graph.file}: {failure}")
        return passed, refused

    def _gate_failure(self, graph: GraphRecord) -> str | None:
        """Why `graph` may not be served, or None where its gates passed: its gate must have recorded a pass, and
        an INT8 graph the agreement gate judged must not have been left out by it."""
        if self.manifest.parity(graph.gate) is None:
            return f"no pass of its gate ({graph.gate}) in the manifest"
        agreement = self.manifest.agreement_int8
        judged = agreement.graphs.get(graph.file) if agreement is not None else None
        if judged is not None and judged.left_out is not None:
            return f"it failed the INT8 agreement gate ({judged.left_out})"
        return None

    def has(self, name: str) -> bool:
        """Is `name` an artifact of the folder, still on disk (not checked: read() checks)?"""
        return name in self.artifacts and (self.path / name).is_file()

    def read(self, name: str) -> bytes:
        """The bytes of the artifact `name`, read once and checked against the sha256 the build recorded.

        Callers load these bytes, not the path: bytes checked and then loaded from disk again could be another
        file by then.
        """
        recorded = self.artifacts.get(name)
        if recorded is None:
            raise PipelineError(
                f"{name!r} is not an artifact of {self.path} (its manifest lists {', '.join(self.artifacts)})",
                "name one of those",
            )
        path = self.path / name
        if not path.is_file():
            raise PipelineError(f"{path} is missing", f"rebuild the folder: {self.rebuild_hint()}")
        data = path.read_bytes()
        if len(data) != recorded.bytes or hashlib.sha256(data).hexdigest() != recorded.sha256:
            raise PipelineError(
                f"{path} is not the file this folder's build wrote: {len(data)} bytes with a sha256 other than the "
                f"manifest's ({recorded.bytes} bytes); it was truncated, corrupted or replaced",
                f"rebuild the folder: {self.rebuild_hint()}",
            )
        return data

    def rebuild_hint(self, *, force: bool = False) -> str:
        """The `make engine` command that writes this folder again (force: FORCE=1, past an up-to-date folder)."""
        return rebuild_hint(self.manifest, self.path, force=force)


def open_folder(path: str | Path, hint: str | None = None) -> ArtifactFolder:
    """The finished artifact folder at `path`, or a PipelineError that says why not and how to (re)build it.

    hint: the command that creates the folder, for when there is none (else derived from the folder's name).
    """
    path = Path(path)
    manifest = require_manifest(path, hint)
    _require_layout(path, manifest)
    _require_complete(path, manifest)
    missing = [key for key in _REQUIRED if not getattr(manifest, key)]
    postprocess = manifest.postprocess.kind if manifest.postprocess is not None else POSTPROCESS_NONE
    if not any(_builds_the_engine(graph, str(manifest.precision), postprocess) for graph in manifest.graphs):
        missing.append(f"the {manifest.precision} graph for the {Target.ENGINE} among its graphs")
    if missing:
        raise PipelineError(
            f"the manifest of {path} lacks {', '.join(missing)}, which every finished build records",
            f"rebuild the folder: {rebuild_hint(manifest, path)}",
        )
    folder = ArtifactFolder(
        path=path,
        manifest=manifest,
        model=manifest.model.name,  # type: ignore[union-attr]  # checked above with the other required fields
        precision=str(manifest.precision),
        graphs=manifest.graphs,
        engine=str(manifest.engine),
        artifacts=manifest.artifacts,
        postprocess=postprocess,
    )
    _require_named_files(folder)
    return folder


def _require_layout(path: Path, manifest: Manifest) -> None:
    layout = manifest.layout
    if layout != ARTIFACT_LAYOUT:
        written = f"layout {layout}" if layout is not None else f"a layout before {ARTIFACT_LAYOUT}"
        raise PipelineError(
            f"{path} was written by another version of the pipeline ({written}; this version reads layout "
            f"{ARTIFACT_LAYOUT})",
            f"rebuild it: {rebuild_hint(manifest, path)}",
        )


def _require_complete(path: Path, manifest: Manifest) -> None:
    if manifest.complete:
        return
    pid = running_build(path)
    if pid is not None:
        raise PipelineError(
            f"process {pid} is building {path} now; until it finishes, its files may mix the earlier build with "
            "the new one, so none of them is loaded",
            f"wait for process {pid} to finish, then load the folder again",
        )
    raise PipelineError(
        f"{path} holds an unfinished build ({_why_unfinished(manifest)}); its files may mix an earlier build with "
        "a later one, so none of them is loaded",
        f"finish the build: {rebuild_hint(manifest, path)}",
    )


def _why_unfinished(manifest: Manifest) -> str:
    if manifest.build is not None and manifest.build.skipped is not None:
        return f"the engine build was skipped: {manifest.build.skipped}"
    stages = list(manifest.timings)
    if not stages:
        return "it stopped before its first stage finished"
    return f"it stopped after the {stages[-1]} stage: killed, or the next stage failed"


def _require_named_files(folder: ArtifactFolder) -> None:
    """Every file the manifest names is a plain file name of the folder (never a path out of it) with a sha256."""
    named = {_graph_key(graph, folder.precision, folder.postprocess): graph.file for graph in folder.graphs}
    named["engine"] = folder.engine
    for key, name in [*named.items(), *((f"artifacts[{name!r}]", name) for name in folder.artifacts)]:
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
            raise PipelineError(
                f"the manifest of {folder.path} names {name!r} as its {key}, which is not a file name inside the "
                "folder; readers load only the folder's own files",
                f"rebuild the folder: {folder.rebuild_hint()}",
            )
    unlisted = {key: name for key, name in named.items() if name not in folder.artifacts}
    if unlisted:
        key, name = next(iter(unlisted.items()))
        raise PipelineError(
            f"the manifest of {folder.path} names {name} as its {key} but records no sha256 for it, so it cannot be "
            "checked",
            f"rebuild the folder: {folder.rebuild_hint()}",
        )


@dataclass(frozen=True)
class Servable:
    """The graphs that may serve a folder on one host, most accurate first, on ONNX Runtime's CPU provider and on
    its CUDA provider, and why each other graph may not ("file: reason")."""

    on_cpu: tuple[GraphRecord, ...]
    on_cuda: tuple[GraphRecord, ...]
    refused: tuple[str, ...]


def _builds_the_engine(graph: GraphRecord, precision: str, postprocess: str) -> bool:
    return graph.target is Target.ENGINE and graph.precision == precision and graph.postprocess == postprocess


def _graph_key(graph: GraphRecord, precision: str, postprocess: str) -> str:
    if _builds_the_engine(graph, precision, postprocess):
        return "graph"
    key = f"graph for {graph.target}" if graph.target is not Target.ENGINE else f"{graph.precision} graph"
    return key if graph.postprocess == POSTPROCESS_NONE else f"{key} ({graph.postprocess})"
