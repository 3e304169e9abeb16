"""The ONNX Runtime runner: the folder's graph that may serve here (the engine's; an int8 folder's CPU-shaped graph on
the CPU: ArtifactFolder.servable), on the CUDA provider where a GPU is present."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..core.cpu import NO_VNNI, VNNI, int8_cpu_kind
from ..core.errors import PipelineError
from ..core.sessions import OPTIMIZATION_LEVELS, onnxruntime_session
from ..core.trt_module import gpu_present
from ..evaluation import simulates_qdq
from ..folder.graph_io import GraphTensor
from ..folder.layout import cpu_kind
from ..folder.reader import ArtifactFolder
from ..folder.rebuild import rebuild_hint
from ..folder.records import GraphRecord, Target
from .base import Runner, TensorSpec, check_graph_agrees

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
_KINDS = {
    VNNI: "for this CPU's VNNI (int8 weights, U8S8)",
    NO_VNNI: "for a CPU without VNNI, like this one (uint8 weights, U8U8: U8S8 saturates in AVX2's kernels)",
}


def choose_providers(requested: list[str] | None) -> tuple[list[str], str]:
    """(providers, why): the requested ones that can run here, else CUDA then CPU where a GPU is really present, else
    CPU alone.

    onnxruntime-gpu lists CUDA (and TensorRT) as *available* even on a machine with no GPU
    or driver: availability only says the provider was compiled in.  So the decision is taken
    from the driver (gpu_present), not from get_available_providers().
    """
    import onnxruntime as ort

    if requested is not None:
        return _requested_providers(requested)
    if not gpu_present():
        return [CPU], "no NVIDIA GPU/driver present"
    if CUDA not in ort.get_available_providers():
        return [CPU], "a GPU is present but this onnxruntime build has no CUDA provider (install onnxruntime-gpu)"
    return [CUDA, CPU], "a GPU is present"


# Providers that run on an NVIDIA GPU: listed as available by onnxruntime-gpu on a host without one too.
_ON_NVIDIA_GPU = (CUDA, "TensorrtExecutionProvider")


def _requested_providers(requested: list[str]) -> tuple[list[str], str]:
    """The requested providers that can run here, in order, and why each other cannot.  ONNX Runtime itself skips a
    provider it cannot load and falls back to the CPU in silence; so a name it does not know, or a request none of
    which can run here, is refused."""
    import onnxruntime as ort

    unknown = [name for name in requested if name not in ort.get_all_providers()]
    if unknown or not requested:
        what = f": {unknown} are not ONNX Runtime provider names" if unknown else " names no provider"
        raise PipelineError(
            f"providers={requested!r}{what}",
            f"name providers this host has ({', '.join(ort.get_available_providers())}), or leave providers=None "
            "(CUDA where a GPU is present, else the CPU)",
        )
    why_not = {name: _why_unusable(name) for name in requested}
    usable = [name for name, why in why_not.items() if not why]
    unusable = "; ".join(f"{name}: {why}" for name, why in why_not.items() if why)
    if not usable:
        raise PipelineError(
            f"providers={requested!r}: none can run here ({unusable})",
            f"add {CPU!r} to fall back to the CPU, leave providers=None (CUDA where a GPU is present, else the CPU), "
            "or run on a host that has them",
        )
    return usable, f"as requested, less {unusable}" if unusable else "as requested"


def _why_unusable(provider: str) -> str:
    """Why ONNX Runtime cannot run `provider` here ('' where it can)."""
    import onnxruntime as ort

    if provider not in ort.get_available_providers():
        return "this onnxruntime build does not have it"
    if provider in _ON_NVIDIA_GPU and not gpu_present():
        return "no NVIDIA GPU/driver present"
    return ""


def choose_graph(folder: ArtifactFolder, requested: str | None, *, on_cpu: bool) -> tuple[GraphRecord, str]:
    """(the graph, why this one) for the graph= option, else the folder's own that may serve on this provider
    (ArtifactFolder.servable: on a CPU, the one shaped for its kind where the folder has one)."""
    if requested is not None:
        graph = folder.record(requested)
        if graph is None:
            graphs = sorted(graph.file for graph in folder.graphs)
            raise PipelineError(
                f"graph={requested!r} is not one of the graphs of {folder.path}",
                f"give one of them ({', '.join(graphs)}) or leave graph=None",
            )
        if graph.postprocess is not folder.postprocess:  # the raw head of a POSTPROCESS=nms folder: not its outputs
            served = sorted(graph.file for graph in folder.graphs if graph.postprocess is folder.postprocess)
            outputs = ", ".join(tensor.name for tensor in folder.manifest.outputs)
            raise PipelineError(
                f"graph={requested!r} ends in {graph.postprocess.value!r} post-processing; {folder.path} serves "
                f"{folder.postprocess.value!r} (its manifest's outputs: {outputs})",
                f"give one of {', '.join(served)}, or leave graph=None",
            )
        return graph, "asked for"
    servable = folder.servable(int8_cpu_kind())
    candidates = servable.on_cpu if on_cpu else servable.on_cuda
    if not candidates:
        raise PipelineError(
            f"no graph of {folder.path} may be served: {'; '.join(servable.refused)}",
            f"rebuild the folder: {rebuild_hint(folder.manifest, folder.path)}",
        )
    graph = candidates[-1]  # the least accurate: the folder's own precision
    if graph.target is not Target.ENGINE:
        return graph, f"the {graph.precision} graph for ONNX Runtime's CPU kernels, {_KINDS[cpu_kind(graph.target)]}"
    if graph.file == folder.graph:
        return graph, "the engine's graph"
    return graph, f"the {graph.precision} graph: the folder's own may not serve ({'; '.join(servable.refused)})"


def load_session(
    folder: ArtifactFolder,
    graph: str,
    providers: list[Any],
    rewrite: Callable[[Path], Sequence[str]] | None = None,
    **options: Any,
) -> Any:
    """A session on the folder's `graph` with `providers` (names, or (name, provider options) pairs), at the
    optimization level the build found ONNX Runtime does not crash at (recorded in the manifest where it was not the
    highest); `options` go to pipeline.core.sessions.onnxruntime_session.  The graph is opened from its private copy
    (ArtifactFolder.private_graph: its data file with it, both checked); the reader's refusal of it (missing, or not
    the bytes the build wrote) passes as it is.  `rewrite` changes that copy before it opens (after its check) and
    returns the ONNX Runtime rewrites that would undo it, which the session leaves out.  Files that match the
    manifest's sha256 were written that way by the build, so ONNX Runtime's refusal of them (a pybind exception
    type per cause) becomes the fix; and the graph's inputs and outputs must be the manifest's
    (pipeline.runners.base.check_graph_agrees)."""
    level = folder.manifest.onnxruntime_levels.get(graph, OPTIMIZATION_LEVELS[0])
    try:
        with folder.private_graph(graph) as private:
            undo = rewrite(private) if rewrite else ()
            session = onnxruntime_session(private, providers, level=level, disabled_optimizers=undo, **options)
    except PipelineError:
        raise  # already says what is wrong and what to do
    except Exception as error:  # onnxruntime's Fail, InvalidProtobuf, InvalidGraph, ... share no base but Exception
        words = f"{type(error).__name__}: {error}"
        if is_cuda_error(words):  # the GPU failed, not the file
            raise PipelineError(
                f"ONNX Runtime cannot load {folder.path / graph}: {CUDA_WORDS} ({words})", CUDA_FIX
            ) from None
        raise PipelineError(
            f"ONNX Runtime cannot load {folder.path / graph}: {words}",
            f"the build wrote it this way (its sha256 matches): rebuild the folder: {rebuild_hint(folder.manifest)}",
        ) from None
    check_graph_agrees(folder, graph, _graph_tensors(session.get_inputs()), _graph_tensors(session.get_outputs()))
    return session


# ONNX Runtime's element type names that are not numpy's (the manifest records numpy's: float32, int64, bool, ...).
_NUMPY_NAMES = {"float": "float32", "double": "float64"}


def _graph_tensors(node_args: list[Any]) -> list[GraphTensor]:
    """ONNX Runtime's NodeArgs (type "tensor(float)", dims as sizes, names or None) as the manifest's records."""
    kinds = (arg.type.removeprefix("tensor(").removesuffix(")") for arg in node_args)
    return [
        GraphTensor(arg.name, _NUMPY_NAMES.get(kind, kind), tuple(arg.shape))
        for arg, kind in zip(node_args, kinds, strict=True)
    ]


class OnnxRuntimeRunner(Runner):
    """ONNX Runtime on one graph of the artifact folder.

    graph: a file name in the folder; by default the engine's graph, except that on the CPU provider the graph
    the folder lists for this kind of CPU's target (pipeline.folder.layout: int8 writes one for CPUs with VNNI and
    one for CPUs without) is preferred: the TensorRT-shaped graph runs no int8 kernel there.
    intra_op_threads: None for ORT's default (one per physical core).  allow_spinning: False lets idle
    intra-op threads sleep, which helps many concurrent callers (a service) more than single calls.
    """

    backend = "onnxruntime"

    def __init__(
        self,
        folder: ArtifactFolder,
        *,
        providers: list[str] | None = None,
        graph: str | None = None,
        intra_op_threads: int | None = None,
        allow_spinning: bool = True,
        split_large_batches: bool = True,
    ):
        import onnxruntime as ort

        super().__init__(folder, split_large_batches=split_large_batches)
        chosen, why = choose_providers(providers)
        record, which = choose_graph(folder, graph, on_cpu=CUDA not in chosen)
        self.graph = record.file
        # The TensorRT-shaped INT8 graph on the CPU (no graph for this CPU's kernels): its Q/DQ run as TensorRT
        # computes them, in float, as its gates judged it (pipeline.evaluation).
        simulate_qdq = simulates_qdq(record, chosen)
        if simulate_qdq:
            which += ", its Q/DQ simulated in float as TensorRT computes them: slower than int8 kernels"
        self.session = load_session(
            folder,
            self.graph,
            chosen,
            intra_op_threads=intra_op_threads,
            allow_spinning=allow_spinning,
            simulate_qdq=simulate_qdq,
        )
        self._output_names = [spec.name for spec in self.outputs]
        used = self.session.get_providers()
        threads = "default intra-op threads" if intra_op_threads is None else f"{intra_op_threads} intra-op threads"
        spinning = "spinning" if allow_spinning else "no spinning"
        # ORT falls back to the CPU silently when a requested provider fails to load; report what it really uses.
        self.description = (
            f"onnxruntime {ort.__version__} running {self.graph} ({which}) on {', '.join(used)} ({why}), "
            f"{threads}, {spinning}"
        )

    def _free(self) -> None:
        del self.session  # the session holds the graph's weights and ORT's arenas

    def _run(self, feed: Mapping[str, Any]) -> dict[str, np.ndarray]:
        # InferenceSession.run is documented as safe to call concurrently on one session, so no lock here.
        try:
            results = self.session.run(self._output_names, feed if isinstance(feed, dict) else dict(feed))
        except Exception as error:  # names and shapes were checked: what is left is in the values (ORT's types)
            raise run_error(self.graph, error, self.inputs) from None
        return dict(zip(self._output_names, results, strict=True))


def run_error(graph: str, error: Exception, inputs: Sequence[TensorSpec]) -> PipelineError:
    """ONNX Runtime failed on `inputs` whose names, dtypes and shapes were checked: the fix names a cause only where
    the error shows it.  An index out of range with integer inputs: their values (token ids past an embedding's
    rows).  A CUDA error: the GPU (CUDA_FIX).  Anything else: ONNX Runtime's message is all that is known."""
    words = f"{type(error).__name__}: {error}"
    problem = f"ONNX Runtime could not run {graph} on these inputs: {words}"
    if is_cuda_error(words):
        return PipelineError(f"ONNX Runtime could not run {graph}: {CUDA_WORDS} ({words})", CUDA_FIX)
    integers = [spec.name for spec in inputs if np.issubdtype(spec.dtype, np.integer)]
    if integers and _INDEX_ERROR.search(words):
        return PipelineError(
            problem,
            f"check the values of the integer input(s) {integers}: an index among them is outside what the model "
            "indexes (token ids must lie within the range the model was built for: an embedding's rows)",
        )
    return PipelineError(
        problem,
        "the inputs' names, dtypes and shapes are the manifest's, and ONNX Runtime's message is all that is known of "
        "the cause: report it with the folder's manifest.json and this message",
    )


# ONNX Runtime's words for an index past its tensor (Gather: "indices element out of data bounds, idx=... must be
# within the inclusive range"; GatherElements, ScatterND: "out of range", "invalid indice").
_INDEX_ERROR = re.compile(r"out of (data )?bounds|out of range|outside the range|invalid ind", re.IGNORECASE)
# How ONNX Runtime's CUDA provider and the CUDA libraries word their failures ("CUDA failure 716: misaligned address"
# from cuda_graph.cc on an H200; "CUDA error cudaErrorIllegalAddress"; cuBLAS and cuDNN statuses).
_CUDA_ERROR = re.compile(r"CUDA failure|CUDA error|CUDA_ERROR_|cudaError|CUBLAS_STATUS_|CUDNN_STATUS_|CUDNN_FE")
CUDA_WORDS = (
    "a CUDA error inside ONNX Runtime's kernels, which is sticky: this process's CUDA context may fail every later "
    "call, and freeing its memory may fail too"
)
CUDA_FIX = (
    "serve from a new process with another candidate: load_runner(folder) (auto proves each GPU candidate in a child "
    "process first and skips one that fails) or backend='onnxruntime' (a plain session, no CUDA graphs or buffers of "
    f"the runner's own), or providers=[{CPU!r}]; and report it with the folder's manifest.json and this message"
)


def is_cuda_error(words: str) -> bool:
    """Whether an error's words are a CUDA failure's (_CUDA_ERROR)."""
    return _CUDA_ERROR.search(words) is not None
