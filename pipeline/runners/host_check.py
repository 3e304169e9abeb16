"""Verified on the host before it serves: the runner that would serve a folder, checked against the folder's own gate.

The build's gates ran on the build machine; a host computes with its own kernels (a GPU's real float16, this CPU's
int8 kernels).  So `auto` runs pipeline.evaluation.host's check through the very runner it picked: the folder's
reference cases at the graph's precision's tolerance, rows alone as in a batch, and for INT8 the calibration rows
the build held out, against the FP32 graph on this host's CPU.  A runner that fails it does not serve: the next
fastest does, or, where none passes, the load is refused with what was measured.  The result is cached with the
measurement (runners/fastest.py, served.json), so a host pays for it once per key.
"""

from __future__ import annotations

import io

import numpy as np

from ..core.cpu import int8_cpu_kind
from ..core.errors import PipelineError
from ..core.precision import Precision
from ..evaluation.host import MIXES_ROWS, HostCheck, check_on_host
from ..folder.graph_io import load_reference
from ..folder.layout import CALIBRATION_SAMPLE, REFERENCE
from ..folder.reader import ArtifactFolder
from ..folder.records import GraphRecord
from ..postprocess.nms import detections_of
from .base import Runner
from .onnxruntime import CPU, OnnxRuntimeRunner

# How to turn the check off, for the fixes: a load that must serve what the folder holds whatever this host computes.
SKIP = "load_runner(..., verify=False)"


def check_runner(folder: ArtifactFolder, graph: GraphRecord, runner: Runner) -> HostCheck:
    """`runner` (serving `graph`, a graph of the folder or the engine built from it) on the folder's reference cases
    at the graph's precision and, for INT8, its held-out calibration rows against the FP32 graph run here.  A folder
    that ends in NMS (POSTPROCESS=nms) is judged on detections: PyTorch's head through the reference NMS is what its
    reference cases expect."""
    nms = folder.manifest.nms()
    cases = load_reference(folder.read(REFERENCE))
    if nms is not None:
        cases = [(inputs, detections_of(expected, nms)) for inputs, expected in cases]
    sample = held_out_sample(folder) if graph.precision is Precision.INT8 else "none: not INT8"
    return check_on_host(runner.infer, graph.precision, cases, sample, detections=nms is not None)


def held_out_sample(folder: ArtifactFolder) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | str:
    """(the calibration rows the INT8 gate judged, the outputs of the folder's FP32 graph (its NMS graph, where it ends
    in NMS) on them here), or why there are none to check, which the check's verdict then states.  The rows are an
    artifact, read as the build wrote them (their sha256 checked, ArtifactFolder.read): a changed file is refused,
    naming it, before anything reads it."""
    if CALIBRATION_SAMPLE not in folder.artifacts:
        return f"the manifest records no {CALIBRATION_SAMPLE} (the build kept none; a rebuild keeps them)"
    if not folder.has(CALIBRATION_SAMPLE):
        return f"{folder.path / CALIBRATION_SAMPLE} is missing (a rebuild writes it again)"
    with np.load(io.BytesIO(folder.read(CALIBRATION_SAMPLE))) as sample:
        inputs = {name: sample[name] for name in sample.files}
    on_cpu = folder.servable(int8_cpu_kind()).on_cpu
    fp32_graph = next(graph.file for graph in on_cpu if graph.precision is Precision.FP32)
    with OnnxRuntimeRunner(folder, graph=fp32_graph, providers=[CPU]) as fp32:
        return inputs, fp32.infer(inputs)


def refused_on_host(folder: ArtifactFolder, checks: dict[str, HostCheck]) -> PipelineError:
    """No candidate computes here what the build verified: what each did, and what to do."""
    measured = "; ".join(f"{label}: {check.verdict}" for label, check in checks.items())
    if all(MIXES_ROWS in check.verdict for check in checks.values()):  # the model's doing, on any host
        fix = (
            "build a model whose every output is one row's own (a text-image model's towers apart, such as CLIP's "
            f"CLIPTextModelWithProjection and CLIPVisionModelWithProjection), or serve whole batches as they come: "
            f"{SKIP}, never batching requests together"
        )
    else:
        fix = (
            "check this host's onnxruntime (its version and provider) against the build's (the manifest's versions), "
            f"or rebuild the folder: {folder.rebuild_hint(force=True)}; {SKIP} serves it unchecked"
        )
    return PipelineError(f"no graph of {folder.path} computes on this host what its build verified ({measured})", fix)


def describe(checks: dict[str, HostCheck]) -> str:
    """The checks for runner.description: which passed, which were refused and why."""
    words = [
        f"{label} checked on this host in {check.seconds:.2f} s: {check.verdict}"
        if check.passed
        else f"{label} refused on this host: {check.verdict}"
        for label, check in checks.items()
    ]
    return "; ".join(words)
