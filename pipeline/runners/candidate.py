"""One candidate of backend="auto" (pipeline/runners/fastest.py): a graph of the folder on an ONNX Runtime provider,
how it opens, whether a fault of it can outlive it, what it runs on, and what happened when it could not serve.

auto never lets one candidate take the load down: whatever a candidate raises while it opens, is timed or is
checked (a PipelineError, an error of ONNX Runtime, a CUDA error), it becomes a `Failure` (what happened, and the
fix that error calls for) and the next candidate is tried.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.errors import PipelineError
from ..core.precision import Precision
from ..evaluation.host import HostCheck
from ..folder.graph_io import load_reference
from ..folder.layout import REFERENCE
from ..folder.reader import ArtifactFolder
from ..folder.records import GraphRecord
from .base import Runner
from .host_check import check_runner
from .onnxruntime import CPU, CUDA, CUDA_FIX, OnnxRuntimeRunner, is_cuda_error
from .onnxruntime_cuda import UNTUNED, CaptureRefused, OnnxRuntimeCudaRunner

log = logging.getLogger(__name__)

# The fix for an error nothing here explains (no PipelineError, no CUDA error): its message is all that is known.
REPORT = (
    "report it with the folder's manifest.json and this message; the other candidates, or backend='onnxruntime' "
    f"with providers=[{CPU!r}], serve without it"
)


@dataclass(frozen=True)
class Candidate:
    """One graph of the folder on one ONNX Runtime provider (the CPU provider is always the last fallback).  On the
    CUDA provider the candidate is the onnxruntime-cuda runner (IO binding to buffers on the GPU), which serves it,
    tuned (its defaults) or not (onnxruntime_cuda.UNTUNED): each graph is both, timed against each other, since the
    tuning was measured on a few models only and its rewrites are what a GPU has not yet run."""

    record: GraphRecord
    providers: tuple[str, ...]
    tuned: bool = True  # on CUDA: the runner's defaults; False: UNTUNED's options, what they were measured against

    @property
    def graph(self) -> str:
        return self.record.file

    @property
    def precision(self) -> Precision:
        return self.record.precision

    @property
    def label(self) -> str:
        return (
            f"{self.graph} on {self.providers[0].removesuffix('ExecutionProvider')}{'' if self.tuned else ' untuned'}"
        )

    @property
    def on_cuda(self) -> bool:
        return self.providers[0] == CUDA

    @property
    def risky(self) -> bool:
        """Whether a fault of it can outlive it: the onnxruntime-cuda runner's CUDA graphs, device buffers of its own
        and rewritten graph (the bias split, NHWC) run where a CUDA error is sticky (a ConvNeXt's captured graph
        failed with 'misaligned address' on an H200, and nothing in that process could use the GPU afterwards).  A
        CPU candidate's error ends with its call."""
        return self.on_cuda

    def open(self, folder: ArtifactFolder, options: dict[str, Any]) -> Runner:
        """Its runner; on CUDA, with a CUDA graph per input shape where ONNX Runtime can capture the graph (on an H100
        it took ResNet-50's FP16 graph from 1.26 to 0.65 ms at batch 1 and the encoder's from 1.42 to 1.19 ms at
        32)."""
        if self.on_cuda:
            try:
                return OnnxRuntimeCudaRunner(folder, cuda_graph=True, **self.cuda_options(options))
            except CaptureRefused:  # nodes on the CPU: they run between the CUDA kernels, uncaptured
                return OnnxRuntimeCudaRunner(folder, **self.cuda_options(options))
        return OnnxRuntimeRunner(folder, **{**options, "graph": self.graph, "providers": list(self.providers)})

    def cuda_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """The CUDA runner's keywords but cuda_graph: its graph, UNTUNED's where it is not tuned, and of auto's
        `options` only those both runners share (the CPU's threads do not apply)."""
        shared = {name: value for name, value in options.items() if name == "split_large_batches"}
        return {"graph": self.graph, **shared, **({} if self.tuned else UNTUNED)}

    def check(self, folder: ArtifactFolder, runner: Runner) -> HostCheck:
        """The host check (runners/host_check.py) of `runner`, which serves this candidate."""
        return check_runner(folder, self.record, runner)


@dataclass(frozen=True)
class Failure:
    """Why a candidate could not serve, and the fix the error seen calls for."""

    reason: str
    fix: str

    @classmethod
    def of(cls, error: Exception, doing: str) -> Failure:
        """What `error`, raised while `doing` ("opening it", "timing it at batch 8"), says; its fix where it names
        one (a PipelineError), the CUDA fix for a CUDA error, else REPORT: nothing here knows its cause."""
        if isinstance(error, PipelineError):
            return cls(f"{doing}: {error.problem}", error.fix or REPORT)
        words = f"{type(error).__name__}: {error}"
        if is_cuda_error(words):
            return cls(f"{doing}: a CUDA error inside ONNX Runtime's kernels ({words})", CUDA_FIX)
        return cls(f"{doing}: {words}", REPORT)


def close_quietly(runner: Runner) -> None:
    """Close a runner auto does not serve.  What closing raises is logged, not raised: the load goes on to the next
    candidate (a CUDA context a fault had poisoned made closing raise 'cuMemFree failed' on an H200)."""
    try:
        runner.close()
    except Exception as error:
        log.warning("closing %r raised %s: %s", runner, type(error).__name__, error)


def profile_batches(folder: ArtifactFolder) -> list[int]:
    """The batches timed, in order while the budget lasts: the profile's opt, then its max, then its min."""
    profile = folder.manifest.batch_profile  # open_folder requires one
    assert profile is not None
    return list(dict.fromkeys([profile.opt, profile.max, profile.min]))


def timing_feed(folder: ArtifactFolder, batch: int) -> dict[str, np.ndarray]:
    """The first reference case's inputs (real sizes and token ids in range), its rows repeated to `batch`."""
    inputs, _ = load_reference(folder.read(REFERENCE))[0]
    return {name: np.take(array, np.arange(batch) % len(array), axis=0) for name, array in inputs.items()}
