"""Runners: one interface over the TensorRT engine, ONNX Runtime and PyTorch.

    from . import load_runner
    with load_runner("engines/resnet50-fp16") as runner:      # backend="auto"
        outputs = runner.infer({"input": batch})               # {name: np.ndarray} -> {name: np.ndarray}

Importing this package loads every runner's module, and none of them imports a GPU library, TensorRT, onnxruntime
or torch before a runner of its kind opens; loading an ONNX Runtime runner imports no build stage (nor torch).
Every runner opens its folder through pipeline.folder.reader: an unfinished folder, one of an older layout, or a
graph or plan whose sha256 is not the manifest's is refused with the command that rebuilds it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..core.errors import PipelineError
from ..core.trt_module import describe_gpu, gpu_present, import_trt
from ..evaluation.host import HostCheck
from ..folder.reader import ArtifactFolder, open_folder
from .base import Runner, TensorSpec
from .candidate import Failure, close_quietly
from .fastest import fastest_onnxruntime_runner
from .host_check import check_runner, describe
from .onnxruntime import OnnxRuntimeRunner
from .onnxruntime_cuda import OnnxRuntimeCudaRunner
from .options import check_options
from .tensorrt import TensorRTRunner, check_gpu_target
from .torch import TorchRunner

BACKENDS = ("auto", "tensorrt", "onnxruntime", "onnxruntime-cuda", "torch")

log = logging.getLogger(__name__)

__all__ = ["BACKENDS", "Runner", "TensorSpec", "load_runner"]


def load_runner(
    path: str | Path | ArtifactFolder, backend: str = "auto", *, verify: bool = True, **options: Any
) -> Runner:
    """A runner for the artifact folder `path` (a path, or a folder already opened by
    pipeline.folder.reader.open_folder).

    backend: "tensorrt" (engine.plan), "onnxruntime" (the graph the engine was built from),
    "onnxruntime-cuda" (that graph on ONNX Runtime's CUDA provider with IO binding and optional CUDA graphs; refused,
    with the fix, where the provider or a GPU is missing), "torch" (the model itself), or "auto": the engine where it
    can run here (a GPU, TensorRT and engine.plan), else the folder's graph ONNX Runtime runs fastest on this host,
    on its CUDA provider (the onnxruntime-cuda runner) or its CPU one, measured and cached in the folder
    (pipeline.runners.fastest; an explicit graph= or providers= skips measuring).  `options` go to the runner (e.g.
    split_large_batches=False, providers=[...] for ONNX Runtime, amp=True for torch, contexts=2 for the engine,
    cuda_graph=True for onnxruntime-cuda); each is checked against the runner's own keyword, its type and, for a
    count, 1 or more (pipeline.runners.options) before anything loads.

    verify (auto only): what auto picks is first run on the folder's own cases and held to its gate on this host
    (pipeline.runners.host_check): a graph that fails does not serve, the next fastest does, or the load is refused
    with what was measured.  Cached with the measurement in served.json; False serves unchecked.

    auto never lets one candidate take the load down: one that fails to open, to be timed or its check, for any
    reason, is skipped (its reason in runner.description and served.json) and the next is tried; a GPU candidate
    proves itself in a child process first (pipeline.runners.proving).  Only where none can serve is the load
    refused, with every candidate's reason.
    """
    if backend not in BACKENDS:
        raise PipelineError(f"unknown runner backend {backend!r}", f"use one of {', '.join(BACKENDS)}")
    folder = path if isinstance(path, ArtifactFolder) else open_folder(path)
    why = f"asked for backend={backend!r}"
    measure = backend == "auto" and not {"graph", "providers"} & set(options)  # explicit choices win
    if backend == "auto":
        backend, why = _choose_backend(folder)
    runner_class = _runner_class(backend)
    check_options(runner_class, backend, options)
    runner: Runner
    if measure and backend == "onnxruntime":
        runner, measured = fastest_onnxruntime_runner(folder, options, verify=verify)
        why = f"{why}; {measured}"
    elif measure and backend == "tensorrt":
        runner, why = _auto_engine(folder, options, why, verify=verify)
    else:
        runner = runner_class(folder, **options)
    runner.description = f"{runner.description}; picked because {why}"
    log.info("runner for %s: %s", folder.path, runner.description)
    return runner


def _auto_engine(folder: ArtifactFolder, options: dict[str, Any], why: str, *, verify: bool) -> tuple[Runner, str]:
    """The engine's runner where it opens and (to `verify`) passes the host check, else the fastest ONNX Runtime graph
    that does (the engine's options do not apply to it), and why.  Whatever the engine raises, opening or checked,
    sends auto on to the graphs.  Not cached: an engine is checked at every load (a GPU runs the reference cases in
    well under a second)."""
    try:
        runner = TensorRTRunner(folder, **options)
    except Exception as error:  # anything at all: the graphs may serve
        failed = Failure.of(error, "opening it")
        fallback, measured = fastest_onnxruntime_runner(folder, {}, verify=verify)
        return fallback, f"{why}, but {folder.engine} failed {failed.reason}; so {measured}"
    if not verify:
        return runner, why
    try:
        check = {folder.engine: check_runner(folder, folder.engine_graph, runner)}
    except Exception as error:  # as a failed check, with what it raised
        check = {folder.engine: HostCheck(False, Failure.of(error, "its check raised").reason, 0.0)}
    if check[folder.engine].passed:
        return runner, f"{why}; {describe(check)}"
    close_quietly(runner)
    fallback, measured = fastest_onnxruntime_runner(folder, {}, verify=True)
    return fallback, f"{why}, but {describe(check)}; so {measured}"


def _choose_backend(folder: ArtifactFolder) -> tuple[str, str]:
    """("tensorrt", why) where the engine can run on this machine, else ("onnxruntime", why not)."""
    manifest = folder.manifest
    skipped = folder.engine_skipped()
    if skipped is not None:
        return "onnxruntime", f"auto: no engine was built into {folder.path} ({skipped})"
    if not folder.has(folder.engine):
        return "onnxruntime", f"auto: {folder.path} has no {folder.engine}"
    if not gpu_present():
        return "onnxruntime", "auto: no NVIDIA GPU/driver present, which the engine needs"
    builder = manifest.build.builder.module if manifest.build and manifest.build.builder else "auto"
    try:
        import_trt(builder)
    except PipelineError as error:
        return "onnxruntime", f"auto: the engine was built with {builder}, which cannot load here ({error.problem})"
    gpu = describe_gpu(0)
    try:
        if gpu is not None:
            check_gpu_target(manifest, gpu)
    except PipelineError as error:
        return "onnxruntime", f"auto: the engine cannot run on this GPU ({error.problem})"
    return "tensorrt", f"auto: a GPU, {builder} and {folder.engine} are present"


def _runner_class(backend: str) -> type[Runner]:
    runners: dict[str, type[Runner]] = {
        "tensorrt": TensorRTRunner,
        "torch": TorchRunner,
        "onnxruntime-cuda": OnnxRuntimeCudaRunner,
    }
    return runners.get(backend, OnnxRuntimeRunner)
