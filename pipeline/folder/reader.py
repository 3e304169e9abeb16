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
  - a graph past protobuf's 2 GB keeps its weights in `<graph>.data` beside it (pipeline/folder/graph_files.py), an
    artifact with its own sha256: ONNX Runtime opens such a graph by path, so a graph is handed to it as a private
    copy (ArtifactFolder.private_graph): the graph and its data file copied into a folder only this process can
    reach, checked there, and opened there, so that the bytes checked are the bytes loaded; a graph naming weights
    in any other file (outside the folder, or another graph's) is refused;
  - what may serve the folder on a host is one answer (ArtifactFolder.servable), read from the graphs' records and
    their gates, never from file names: `auto`, the ONNX Runtime runners and the Triton writer take it.
It imports neither torch, onnx nor any build stage: serving an ONNX graph needs this module and onnxruntime.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import PipelineError, no_room
from ..core.precision import Precision
from ..core.settings import Postprocess
from .artifacts import atomic_path, running_build
from .graph_files import data_file_name
from .layout import ARTIFACT_LAYOUT, CPU_TARGETS
from .manifest import Manifest, require_manifest
from .onnx_wire import external_locations
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
    precision: Precision
    graphs: tuple[GraphRecord, ...]  # every graph of the folder, model.onnx first (pipeline.folder.layout)
    engine: str
    artifacts: dict[str, Artifact]
    postprocess: Postprocess = Postprocess.NONE  # what the served graphs end in (the manifest's postprocess record)

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
        allowed = self.precision.at_least_as_accurate()
        passed, refused = [], []
        served = (g for g in self.graphs if g.precision in allowed and g.postprocess is self.postprocess)
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

    def engine_skipped(self) -> str | None:
        """Why no engine was built into the folder (the build found no TensorRT; its graphs serve through ONNX
        Runtime), or None where one was."""
        build = self.manifest.build
        return build.skipped if build is not None else None

    def has(self, name: str) -> bool:
        """Is `name` an artifact of the folder, still on disk (not checked: read() checks)?"""
        return name in self.artifacts and (self.path / name).is_file()

    def read(self, name: str) -> bytes:
        """The bytes of the artifact `name`, read once and checked against the sha256 the build recorded.

        Callers load these bytes, not the path: bytes checked and then loaded from disk again could be another
        file by then.  (A graph goes to ONNX Runtime through private_graph, which keeps the same promise.)
        """
        path = self._listed(name)
        data = path.read_bytes()
        self._require_recorded(name, len(data), hashlib.sha256(data).hexdigest())
        return data

    def graph_files(self, name: str) -> list[str]:
        """The graph `name` and, where the folder lists one, its data file (`<graph>.data`): what a copy of the
        graph must carry (the Triton writer's, the runner's private copy)."""
        data = data_file_name(Path(name))
        return [name, *([data] if data in self.artifacts else [])]

    def copy_artifact(self, name: str, target: Path) -> None:
        """Copy the artifact `name` to `target` a block at a time, checking the bytes copied against the sha256 the
        build recorded; `target` appears only when they match (written under a temporary name, then renamed)."""
        source = self._listed(name)
        digest, size = hashlib.sha256(), 0
        with atomic_path(target) as temporary:
            with open(source, "rb") as reading, open(temporary, "wb") as writing:
                for block in iter(lambda: reading.read(1 << 20), b""):
                    digest.update(block)
                    writing.write(block)
                    size += len(block)
            self._require_recorded(name, size, digest.hexdigest())

    @contextlib.contextmanager
    def private_graph(self, name: str) -> Iterator[Path]:
        """The graph `name` as ONNX Runtime opens it, by path: the graph and its data file copied into a folder only
        this process can reach (tempfile.mkdtemp: mode 0700, in the system's temporary folder), each checked there
        against the sha256 the build recorded; yields the graph's path there, and removes the folder on exit.

        Why a copy: a graph past 2 GB cannot be loaded from bytes, and ONNX Runtime reads its data file itself.
        Checking the folder's files and then opening them there would load whatever they are by then (a rebuild
        renames new files into place), and a hard link would still follow a file written in place; the private
        copy is the file checked, and nobody else can change it before ONNX Runtime maps it (its mapping outlives
        the folder's removal).  ONNX Runtime refuses an external-data location that leaves the graph's folder, so
        the copy's folder holds all it can read; the graph's own locations are checked here too, to say which.
        Costs one sequential copy of the files, no memory: ONNX Runtime opens a graph of one file by path with one
        copy of its weights, where its bytes cost three (1.3 against 3.6 GB at 1.2 GB of weights).  The copy takes
        the weights' bytes on the temporary folder's disk (TMPDIR moves it): one without room for them is refused
        with that fix, before copying where its free space says so (a 16 MB /tmp made loading a 0.6 GB model
        fail as "ONNX Runtime cannot load ...: rebuild the folder")."""
        with tempfile.TemporaryDirectory(prefix="trt-pipeline-graph.") as private:
            needed = sum(self.artifacts[file].bytes for file in self.graph_files(name) if file in self.artifacts)
            free = shutil.disk_usage(private).free
            if free < needed:
                raise _no_room_for_copy(name, f"it needs {_gigabytes(needed)}, {_gigabytes(free)} are free there")
            try:
                copy = self.copy_graph(name, Path(private))
            except OSError as error:
                if not no_room(error):
                    raise
                raise _no_room_for_copy(name, str(error)) from None  # filled while copying: not the folder's fault
            yield copy

    def copy_graph(self, name: str, folder: Path, as_name: str | None = None) -> Path:
        """Copy the graph `name` into `folder` (as `as_name`, e.g. Triton's model.onnx) with its data file under the
        data file's own name, where the graph's references find it; each checked as copy_artifact checks, and the
        graph's references checked to name no other file (_require_own_weights).  Returns the graph's copy."""
        files = self.graph_files(name)
        copy = Path(folder) / (as_name or name)
        self.copy_artifact(name, copy)
        for data in files[1:]:
            self.copy_artifact(data, Path(folder) / data)
        self._require_own_weights(name, copy, files[1:])
        return copy

    def _require_own_weights(self, name: str, copy: Path, data: list[str]) -> None:
        """The graph (its checked copy) keeps its weights in itself or in its own data file, nowhere else."""
        try:
            others = sorted(external_locations(copy) - set(data))
        except (ValueError, IndexError):  # no protobuf at all: ONNX Runtime's refusal of it says so
            return
        if others:
            raise PipelineError(
                f"{self.path / name} keeps weights in {', '.join(map(repr, others))}, not in its own data file "
                f"({data_file_name(Path(name))}, listed with its sha256 in the manifest): weights outside the "
                "folder's checked files are never loaded",
                f"rebuild the folder: {self.rebuild_hint()}",
            )

    def _listed(self, name: str) -> Path:
        """The path of the artifact `name`, which the manifest lists and which is on disk."""
        if name not in self.artifacts:
            raise PipelineError(
                f"{name!r} is not an artifact of {self.path} (its manifest lists {', '.join(self.artifacts)})",
                "name one of those",
            )
        path = self.path / name
        if not path.is_file():
            raise PipelineError(f"{path} is missing", f"rebuild the folder: {self.rebuild_hint()}")
        return path

    def _require_recorded(self, name: str, size: int, sha256: str) -> None:
        recorded = self.artifacts[name]
        if size != recorded.bytes or sha256 != recorded.sha256:
            raise PipelineError(
                f"{self.path / name} is not the file this folder's build wrote: {size} bytes with a sha256 other "
                f"than the manifest's ({recorded.bytes} bytes); it was truncated, corrupted or replaced",
                f"rebuild the folder: {self.rebuild_hint()}",
            )

    def rebuild_hint(self, *, force: bool = False) -> str:
        """The `make engine` command that writes this folder again (force: FORCE=1, past an up-to-date folder)."""
        return rebuild_hint(self.manifest, self.path, force=force)


def _no_room_for_copy(name: str, why: str) -> PipelineError:
    """The private copy of the graph `name` did not fit in the system's temporary folder (`why`: the numbers)."""
    return PipelineError(
        f"loading {name} copies it, its weights included, into the system's temporary folder "
        f"{tempfile.gettempdir()} (a private copy, checked against the build's sha256), and it does not fit: {why}",
        "point TMPDIR at a folder on a disk with room for it (export TMPDIR=/path/with/room), or free space there",
    )


def _gigabytes(size: int) -> str:
    return f"{size / 1e9:.2f} GB"


def open_folder(path: str | Path, hint: str | None = None) -> ArtifactFolder:
    """The finished artifact folder at `path`, or a PipelineError that says why not and how to (re)build it.

    hint: the command that creates the folder, for when there is none (else derived from the folder's name).
    """
    path = Path(path)
    manifest = require_manifest(path, hint)
    _require_layout(path, manifest)
    _require_complete(path, manifest)
    missing = [key for key in _REQUIRED if not getattr(manifest, key)]
    precision = manifest.precision
    postprocess = manifest.postprocess.kind if manifest.postprocess is not None else Postprocess.NONE
    if precision is None or not any(_builds_the_engine(graph, precision, postprocess) for graph in manifest.graphs):
        missing.append(f"the {precision} graph for the {Target.ENGINE} among its graphs")
    if missing or precision is None:  # a missing precision is among them already
        raise PipelineError(
            f"the manifest of {path} lacks {', '.join(missing)}, which every finished build records",
            f"rebuild the folder: {rebuild_hint(manifest, path)}",
        )
    folder = ArtifactFolder(
        path=path,
        manifest=manifest,
        model=manifest.model.name,  # type: ignore[union-attr]  # checked above with the other required fields
        precision=precision,
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
    if folder.engine_skipped() is None:
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


def _builds_the_engine(graph: GraphRecord, precision: Precision, postprocess: Postprocess) -> bool:
    return graph.target is Target.ENGINE and graph.precision is precision and graph.postprocess is postprocess


def _graph_key(graph: GraphRecord, precision: Precision, postprocess: Postprocess) -> str:
    if _builds_the_engine(graph, precision, postprocess):
        return "graph"
    key = f"graph for {graph.target}" if graph.target is not Target.ENGINE else f"{graph.precision} graph"
    return key if graph.postprocess is Postprocess.NONE else f"{key} ({graph.postprocess})"
