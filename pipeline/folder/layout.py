"""The artifact folder's layout: every file name once, the layout version, and which graph each precision writes for
which target, with the record (pipeline/folder/records.py GraphRecord) that says what each graph is."""

from __future__ import annotations

from collections.abc import Iterable

from ..core.cpu import NO_VNNI, VNNI
from ..core.precision import Precision
from ..core.settings import Postprocess
from .records import Evaluation, GraphRecord, Target

MANIFEST = "manifest.json"
REFERENCE = "reference.npz"  # PyTorch's outputs on the reference inputs, written by export
ENGINE = "engine.plan"
FP32_GRAPH = "model.onnx"  # exported, checked and simplified; every other graph is made from it
# Which graph load_runner(backend="auto") measured fastest on a host, keyed by the host (runners/fastest.py).
# Written by readers, not by the build: a cache, never an artifact (no sha256 in the manifest).
SERVED_CHOICE = "served.json"
CACHE_FOLDER = "calibration"  # INT8's calibration cache, inside the artifact folder
# The first rows the agreement gate judges (held out from calibration where the set allows it: where a gate refused,
# the rows it refused on), model-ready, kept in the cache folder: `trt-pipeline diagnose` compares an INT8 graph
# with FP32 on them (reference.npz's random inputs are clipped by the input's Q/DQ), and a host checks its INT8
# graph on them before it serves (pipeline/runners/host_check.py).
SAMPLE = "sample.npz"
CALIBRATION_SAMPLE = f"{CACHE_FOLDER}/{SAMPLE}"

# The shape of a folder and its manifest, recorded in it as "layout".  Bump it when the stages write
# different artifacts or manifest entries: a folder of another layout is rebuilt, never reused, and
# readers refuse it.  4: the manifest records its layout; readers check every graph's sha256.
# 5: "graphs" ({target: file}) replaces "graph" and "onnxruntime_cpu_graphs".
# 6: agreement_int8 holds in-sample and held-out numbers side by side, and the calibration split.
# 7: "graphs" lists a record per graph (file, precision, target, evaluation, gate), model.onnx's too.
# 8: each graph's record says its post-processing; a POSTPROCESS=nms folder holds an NMS graph beside each graph of
#    the raw head (model.nms.onnx, model.fp16.nms.onnx, ...: postprocessed_file) and a "postprocess" record.
ARTIFACT_LAYOUT = 8

# The graph shaped for ONNX Runtime's int8 kernels on each kind of CPU (pipeline.core.cpu.int8_cpu_kind).
CPU_TARGETS = {VNNI: Target.CPU_VNNI, NO_VNNI: Target.CPU_NO_VNNI}
# Precision -> {target: graph file}: what the precision stage writes (int8: one graph for the engine, one per kind
# of CPU, from the same ranges: calibration/qdq_cpu.py).
GRAPH_FILES: dict[Precision, dict[Target, str]] = {
    Precision.FP32: {Target.ENGINE: FP32_GRAPH},
    Precision.FP16: {Target.ENGINE: "model.fp16.onnx"},
    Precision.INT8: {
        Target.ENGINE: "model.int8.onnx",
        Target.CPU_VNNI: "model.int8.ort.onnx",
        Target.CPU_NO_VNNI: "model.int8.ort-u8u8.onnx",
    },
}
# How the gates evaluate the graph TensorRT builds from at each precision: as the engine computes it.  A graph
# shaped for a CPU is judged on ONNX Runtime's own int8 kernels, which serve it there.
_ENGINE_EVALUATION = {
    Precision.FP32: Evaluation.PLAIN,
    Precision.FP16: Evaluation.FAITHFUL_FP16,
    Precision.INT8: Evaluation.SIMULATED_QDQ,
}


def graph_record(
    precision: Precision, target: Target = Target.ENGINE, postprocess: Postprocess = Postprocess.NONE
) -> GraphRecord:
    """The record of the graph `precision` writes for `target`, or (postprocess) of that graph with the
    post-processing appended (the NMS graph of the head graph; evaluated as the head graph is)."""
    evaluation = _ENGINE_EVALUATION[precision] if target is Target.ENGINE else Evaluation.ONNXRUNTIME_INT8
    file = postprocessed_file(GRAPH_FILES[precision][target], postprocess)
    return GraphRecord(file, precision, target, evaluation, _gate(precision, target, postprocess), postprocess)


def postprocessed_file(file: str, postprocess: Postprocess) -> str:
    """model.fp16.onnx -> model.fp16.nms.onnx: the graph with the post-processing appended; `file` where none."""
    return file if postprocess is Postprocess.NONE else f"{file.removesuffix('.onnx')}.{postprocess}.onnx"


def postprocessed(graph: GraphRecord, postprocess: Postprocess) -> GraphRecord:
    """The record of `graph` with the post-processing appended."""
    return graph_record(graph.precision, graph.target, postprocess)


def precision_graphs(precision: Precision) -> tuple[GraphRecord, ...]:
    """The graphs the precision stage writes, the engine's first."""
    return tuple(graph_record(precision, target) for target in GRAPH_FILES[precision])


def folder_graphs(precision: Precision, postprocess: Postprocess = Postprocess.NONE) -> tuple[GraphRecord, ...]:
    """Every graph a finished folder of this precision holds: model.onnx, then the precision's own; with a
    post-processing, then each of them with it appended (the graphs that serve)."""
    graphs = (graph_record(Precision.FP32), *precision_graphs(precision))
    heads = tuple({graph.file: graph for graph in graphs}.values())
    if postprocess is Postprocess.NONE:
        return heads
    return (*heads, *(postprocessed(graph, postprocess) for graph in heads))


def cpu_kind(target: Target) -> str:
    """The kind of CPU a CPU-shaped target is for."""
    return next(kind for kind, shaped in CPU_TARGETS.items() if shaped is target)


def artifact_names(graphs: Iterable[GraphRecord]) -> list[str]:
    """The files a finished folder with these graphs lists in its manifest, with their sha256."""
    return list(dict.fromkeys([FP32_GRAPH, REFERENCE, *(graph.file for graph in graphs), ENGINE]))


def _gate(precision: Precision, target: Target, postprocess: Postprocess) -> str:
    """The stage whose record says the graph passed its gate: a head graph's parity against PyTorch's reference
    outputs (parity_fp16), an NMS graph's against the reference NMS (nms_fp16: pipeline/stages/postprocess.py)."""
    stage = "parity" if postprocess is Postprocess.NONE else postprocess
    if target is Target.ENGINE:
        return f"{stage}_{precision}"
    return f"{stage}_{precision}_onnxruntime_{cpu_kind(target).replace('-', '_')}"
