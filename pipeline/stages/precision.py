"""Stage 6: precision expressed in the graph itself.

TensorRT 11 (and TensorRT-RTX) build strongly typed networks only: the FP16/INT8
builder flags no longer choose precisions, so the ONNX graph must carry them.
FP16 = the graph converted to float16 with float32 inputs and outputs (a service
keeps feeding float32), except the nodes float16 cannot hold, which stay FP32 behind
Casts: found from the FP32 graph's own values on the reference inputs and the calibration data when
given (pipeline/stages/float16.py), or named by the user (--keep-fp32).  INT8 = explicit Q/DQ from calibration
(calibration/).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import onnx
from onnx import TensorProto

from ..core.errors import PipelineError
from ..folder.artifacts import atomic_path
from .float16 import Case, KeptNode, TensorStats, fp32_compute_share, overflowing_nodes

# The runs of each data source with the largest activations that the scan records (TensorStats.largest_cases):
# the faithful FP16 gate judges the calibration ones besides the reference inputs (pipeline/stages/sequence.py).
LARGEST_CASES = 2

# The engine's graph at each precision, from the one precision -> graph table (pipeline.folder.manifest.GRAPHS).


def convert_fp16(
    onnx_path: Path,
    out_path: Path,
    *,
    cases: Sequence[Case] = (),
    keep_fp32: Sequence[str] = (),
    auto_fp32: bool = True,
) -> dict:
    """Write a float16 copy of the graph whose inputs and outputs stay float32.

    With `cases` (batches of model inputs, each run alone) and `auto_fp32`, the nodes whose values float16
    cannot hold on them stay FP32, each recorded with the case that showed it; `keep_fp32` names more, by node
    name or op type (e.g. "TopK").
    """
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = onnx.load(str(onnx_path))
    _name_unnamed_nodes(model.graph)
    stats = TensorStats.of_runs(model, cases) if cases else None
    kept = overflowing_nodes(model, stats) if auto_fp32 and stats else []
    kept += _asked_for(model.graph, keep_fp32, already={node.name for node in kept})
    # keep_io_types inserts Casts at the graph edges; ONNX Runtime's converter keeps ops with
    # no float16 kernel (its default block list) in float32 behind Casts of their own.
    converted = convert_float_to_float16(model, keep_io_types=True, node_block_list=[node.name for node in kept])
    _skip_float16_round_trips(converted.graph)
    _sort_topologically(converted.graph)  # the converter appends its Casts at the end of the node list
    with atomic_path(out_path) as temporary:
        onnx.save(converted, str(temporary))
    casts = sum(node.op_type == "Cast" for node in converted.graph.node)
    share = fp32_compute_share(model, stats, {node.name for node in kept}) if stats else None
    summary = f"{out_path.name}: float16 graph, float32 I/O ({casts} Cast nodes)"
    if kept:
        summary += (
            f"; {len(kept)} node(s) kept FP32 ({_percent(share)} of the compute): "
            + ", ".join(f"{node.name} ({node.reason}{_where(node)})" for node in kept[:3])
            + (" ..." if len(kept) > 3 else "")
        )
    return {
        "summary": summary,
        "cast_nodes": casts,
        "auto_fp32": auto_fp32,
        "kept_fp32": [node.as_record() for node in kept],
        "fp32_compute_share": share,
        "largest_cases": _largest_cases(stats, list(cases)) if stats else {},
    }


def _largest_cases(stats: TensorStats, cases: list[Case]) -> dict[str, list[str]]:
    """{data source: the labels of its LARGEST_CASES runs with the largest activations}."""
    sources = dict.fromkeys(case.source for case in cases)
    return {
        source: stats.largest_cases([case.label for case in cases if case.source == source], LARGEST_CASES)
        for source in sources
    }


def _where(node: KeptNode) -> str:
    return f", in {node.seen_in}" if node.seen_in else ""


def _percent(share: float | None) -> str:
    return "unknown share" if share is None else f"{100 * share:.2g}%"


def _name_unnamed_nodes(graph: onnx.GraphProto) -> None:
    """The converter keeps nodes in FP32 by name: give every node one (the exporter names most)."""
    taken = {node.name for node in graph.node}
    for index, node in enumerate(graph.node):
        if not node.name:
            name = f"{node.op_type}_{index}"
            while name in taken:
                name += "_"
            node.name = name
            taken.add(name)


def _asked_for(graph: onnx.GraphProto, names: Sequence[str], already: set[str]) -> list[KeptNode]:
    """The nodes named by --keep-fp32 (node names or op types); an unknown name is an error."""
    unknown = [name for name in names if not any(name in (node.name, node.op_type) for node in graph.node)]
    if unknown:
        ops = sorted({node.op_type for node in graph.node})
        raise PipelineError(
            f"--keep-fp32 names {unknown}, which is neither a node name nor an op type of the graph",
            f"give node names from the graph (e.g. {graph.node[0].name!r}) or op types ({', '.join(ops)})",
        )
    return [
        KeptNode(node.name, node.op_type, "asked for (--keep-fp32)", 0.0)
        for node in graph.node
        if node.name not in already and (node.name in names or node.op_type in names)
    ]


def _skip_float16_round_trips(graph: onnx.GraphProto) -> None:
    """Let FP32 nodes read each other's outputs directly.

    ONNX Runtime's converter casts the output of every node it keeps in FP32 to float16, and casts it
    back for the next FP32 node: between two kept nodes the value is stored as float16 after all, and
    the overflow they were kept for happens in the Casts (measured: inf on the overflow test model).
    """
    producers = {output: node for node in graph.node for output in node.output}
    graph_outputs = {output.name for output in graph.output}
    for node in graph.node:
        source = producers.get(node.input[0]) if node.input else None
        if _is_cast(node, TensorProto.FLOAT) and source is not None and _is_cast(source, TensorProto.FLOAT16):
            for reader in graph.node:  # read the FP32 value before the round trip
                for index, name in enumerate(reader.input):
                    if name == node.output[0] and node.output[0] not in graph_outputs:
                        reader.input[index] = source.input[0]
    read = {name for node in graph.node for name in node.input} | graph_outputs
    unread = [node for node in graph.node if node.op_type == "Cast" and not any(out in read for out in node.output)]
    while unread:  # a Cast nothing reads any more, and then the Cast that fed only it
        for node in unread:
            graph.node.remove(node)
        read = {name for node in graph.node for name in node.input} | graph_outputs
        unread = [node for node in graph.node if node.op_type == "Cast" and not any(out in read for out in node.output)]


def _is_cast(node: onnx.NodeProto, to: int) -> bool:
    return node.op_type == "Cast" and any(a.name == "to" and a.i == to for a in node.attribute)


def _sort_topologically(graph: onnx.GraphProto) -> None:
    """Order the nodes so that every tensor is produced before it is read, as ONNX requires."""
    available = {value.name for value in graph.input} | {init.name for init in graph.initializer} | {""}
    pending = list(graph.node)
    ordered: list[onnx.NodeProto] = []
    while pending:
        ready = [node for node in pending if all(name in available for name in node.input)]
        if not ready:  # a cycle or a dangling input: leave the rest as it was, the checker will say
            ordered += pending
            break
        for node in ready:
            ordered.append(node)
            available.update(node.output)
        done = {id(node) for node in ready}
        pending = [node for node in pending if id(node) not in done]
    del graph.node[:]
    graph.node.extend(ordered)
