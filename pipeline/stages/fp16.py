"""FP16: the graph converted to float16 (model.fp16.onnx), the nodes float16 cannot hold kept FP32.

TensorRT 11 (and TensorRT-RTX) build strongly typed networks only: the FP16/INT8 builder flags no longer choose
precisions, so the ONNX graph must carry them.  FP16 = the graph converted to float16 with float32 inputs and
outputs (a service keeps feeding float32), except the nodes float16 cannot hold, which stay FP32 behind Casts: found
from the FP32 graph's own values on the reference inputs and the calibration data when given (the scan:
pipeline/stages/fp16_overflow.py), or named by the user (--keep-fp32).  make_fp16_graph is the stage: it returns a
typed Fp16Result, whose record goes to the manifest and whose judged runs the faithful gate checks besides the
reference inputs.  (INT8 is calibration/int8.py.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

from ...calibration.readers import CalibrationData
from ..core.errors import PipelineError
from ..core.settings import Settings, mention_name
from ..evaluation.float16 import element_types
from ..folder.graph_files import atomic_graph, graph_without_weights, write_graph
from ..folder.graph_io import load_reference
from ..folder.onnx_wire import Convert
from .fp16_overflow import Case, KeptNode, TensorStats, fp32_compute_share, overflowing_nodes

# The runs of each data source with the largest activations that the scan records (TensorStats.largest_cases):
# the faithful FP16 gate judges the calibration ones besides the reference inputs (pipeline/stages/sequence.py).
LARGEST_CASES = 2
# Rows per run of the scan: every intermediate tensor of a run is held at once, so reference cases above it are left
# out and calibration batches are cut to it.
SCAN_ROWS = 8


@dataclass(frozen=True)
class Fp16Conversion:
    """What convert_fp16 wrote: its Cast nodes, the nodes kept FP32 and their share of the compute, and the runs of
    each data source with the largest activations (by label)."""

    graph: str
    casts: int
    auto_fp32: bool
    kept: tuple[KeptNode, ...]
    fp32_compute_share: float | None
    largest_cases: dict[str, list[str]]

    @property
    def summary(self) -> str:
        summary = f"{self.graph}: float16 graph, float32 I/O ({self.casts} Cast nodes)"
        if self.kept:
            summary += (
                f"; {len(self.kept)} node(s) kept FP32 ({_percent(self.fp32_compute_share)} of the compute): "
                + ", ".join(f"{node.name} ({node.reason}{_where(node)})" for node in self.kept[:3])
                + (" ..." if len(self.kept) > 3 else "")
            )
        return summary

    def as_json(self) -> dict:
        return {
            "summary": self.summary,
            "cast_nodes": self.casts,
            "auto_fp32": self.auto_fp32,
            "kept_fp32": [node.as_record() for node in self.kept],
            "fp32_compute_share": self.fp32_compute_share,
            "largest_cases": self.largest_cases,
        }


@dataclass(frozen=True)
class Fp16Result:
    """The FP16 stage's result: the conversion, the data its scan ran (the reference inputs; the calibration data,
    as the manifest's calibration records it, or None), and the calibration runs with the largest activations,
    which the faithful gate judges against the FP32 graph besides the reference inputs."""

    conversion: Fp16Conversion
    reference: dict
    calibration: dict | None
    judged: tuple[Case, ...]

    @property
    def summary(self) -> str:
        scanned = self.calibration
        more = f"; scanned {scanned['samples']} calibration samples too ({scanned['source']})" if scanned else ""
        return self.conversion.summary + more

    def as_json(self) -> dict:
        scanned = {"reference": self.reference, "calibration": self.calibration}
        return {**self.conversion.as_json(), "summary": self.summary, "scanned": scanned}


def make_fp16_graph(
    source: Path, target: Path, reference: Path, settings: Settings, calibration: CalibrationData | None = None
) -> Fp16Result:
    """model.fp16.onnx as the pipeline writes it (`make accuracy` too): the FP32 fallback judged on the reference
    inputs up to SCAN_ROWS rows and on the calibration data when given (cut into runs of SCAN_ROWS rows, each
    run alone: only each tensor's running maximum is kept), plus the nodes the settings keep."""
    references = [
        Case("reference", f"reference case {index} (batch {_rows(inputs)})", inputs)
        for index, (inputs, _) in enumerate(load_reference(reference))
        if _rows(inputs) <= SCAN_ROWS
    ]
    calibrated = calibration_cases(calibration, settings) if calibration is not None else []
    conversion = _convert(
        source, target, [*references, *calibrated], keep_fp32=settings.fp32_nodes(), auto_fp32=settings.auto_fp32
    )
    largest = set(conversion.largest_cases.get("calibration", []))
    return Fp16Result(
        conversion,
        {"file": reference.name, "cases": len(references), "rows": sum(_rows(case.feeds) for case in references)},
        _calibration_record(calibration, settings) if calibration is not None else None,
        tuple(case for case in calibrated if case.label in largest),
    )


def calibration_cases(calibration: CalibrationData, settings: Settings) -> list[Case]:
    """The calibration batches as the FP16 scan runs them, labelled by their rows: SCAN_ROWS rows at a time, or
    the profile's largest batch where it is smaller (a graph need not run beyond it)."""
    cases, start, step = [], 0, min(SCAN_ROWS, settings.batch.max)
    for batch in calibration.batches:
        for offset in range(0, _rows(batch), step):
            feeds = {name: array[offset : offset + step] for name, array in batch.items()}
            first = start + offset
            cases.append(Case("calibration", f"calibration rows {first}-{first + _rows(feeds) - 1}", feeds))
        start += _rows(batch)
    return cases


def convert_fp16(
    onnx_path: Path,
    out_path: Path,
    *,
    cases: Sequence[Case] = (),
    keep_fp32: Sequence[str] = (),
    auto_fp32: bool = True,
) -> dict:
    """Write a float16 copy of the graph whose inputs and outputs stay float32; return its record.

    With `cases` (batches of model inputs, each run alone) and `auto_fp32`, the nodes whose values float16
    cannot hold on them stay FP32, each recorded with the case that showed it; `keep_fp32` names more, by node
    name or op type (e.g. "TopK").
    """
    return _convert(onnx_path, out_path, cases, keep_fp32=keep_fp32, auto_fp32=auto_fp32).as_json()


def _convert(
    onnx_path: Path, out_path: Path, cases: Sequence[Case], *, keep_fp32: Sequence[str], auto_fp32: bool
) -> Fp16Conversion:
    """The graph is read without its weights, which stay on disk: the scan's session maps them, and the converter
    rewrites the graph's types while write_graph converts each float32 weight the converter turned float16 as it
    writes it, one tensor in memory at a time."""
    onnx_path = Path(onnx_path)
    model = graph_without_weights(onnx_path)
    _name_unnamed_nodes(model.graph)
    stats = TensorStats.of_runs(model, cases, weights=onnx_path.parent) if cases else None
    kept = overflowing_nodes(model, stats) if auto_fp32 and stats else []
    kept += _asked_for(model.graph, keep_fp32, already={node.name for node in kept})
    # keep_io_types inserts Casts at the graph edges; ONNX Runtime's converter keeps ops with
    # no float16 kernel (its default block list) in float32 behind Casts of their own.
    with _shapes_from_dims() as convert_float_to_float16:
        converted = convert_float_to_float16(model, keep_io_types=True, node_block_list=[node.name for node in kept])
    _skip_float16_round_trips(converted)
    _sort_topologically(converted.graph)  # the converter appends its Casts at the end of the node list
    with atomic_graph(out_path) as temporary:
        write_graph(converted, onnx_path.parent, temporary, convert=_weights_made_float16(model, converted))
    return Fp16Conversion(
        graph=out_path.name,
        casts=sum(node.op_type == "Cast" for node in converted.graph.node),
        auto_fp32=auto_fp32,
        kept=tuple(kept),
        fp32_compute_share=fp32_compute_share(model, stats, {node.name for node in kept}) if stats else None,
        largest_cases=_largest_cases(stats, list(cases)) if stats else {},
    )


@contextlib.contextmanager
def _shapes_from_dims() -> Iterator[Callable]:
    """ONNX Runtime's float16 converter (onnxruntime: the `cpu` or `gpu` extra), whose helper for a converted
    weight's value info reads the weight's values only to take their shape (numpy_helper.to_array(tensor).shape):
    for the block, the shape is taken from the tensor's dims, the same for every tensor and readable for one whose
    bytes are on disk (onnxruntime 1.32, transformers/float16.py make_value_info_from_tensor)."""
    from onnxruntime.transformers import float16

    def from_dims(tensor: onnx.TensorProto) -> onnx.ValueInfoProto:
        return onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims))

    original = float16.make_value_info_from_tensor
    float16.make_value_info_from_tensor = from_dims
    try:
        yield float16.convert_float_to_float16
    finally:
        float16.make_value_info_from_tensor = original


def _weights_made_float16(fp32: onnx.ModelProto, converted: onnx.ModelProto) -> dict[str, Convert]:
    """{weight: its conversion} for the float32 weights on disk the converter made float16 (it changed their type
    only: their bytes are not in the graph it was given); converted as the converter converts the ones it holds."""
    from onnx.external_data_helper import uses_external_data

    on_disk = {init.name for init in fp32.graph.initializer if uses_external_data(init)}
    made = [init.name for init in converted.graph.initializer if init.data_type == TensorProto.FLOAT16]
    return {name: _float16_bytes for name in made if name in on_disk}


# The converter's bounds (convert_float_to_float16's defaults, which _convert keeps): a nonzero value nearer zero
# than TINY becomes +-TINY, a finite one beyond LARGEST becomes +-LARGEST, so no weight changes sign or finiteness.
TINY, LARGEST = 5.96e-08, 65504.0


def to_float16(values: np.ndarray) -> np.ndarray:
    """float32 values as ONNX Runtime's converter writes them (onnxruntime.transformers.float16
    convert_np_to_float16, equal bit for bit: tests/stages/test_fp16.py): cast, then the few values past its bounds set
    to them.  Two passes over the values where the converter's own makes a dozen (and logs their extremes): 0.05 s
    against 0.39 s for 16M values, 13 s of the FP16 stage's 30 s at 2.4 GB of weights."""
    with np.errstate(over="ignore"):
        converted = values.astype(np.float16)
    magnitude = np.abs(values)
    past = ((magnitude < TINY) & (magnitude > 0)) | ((magnitude > LARGEST) & (magnitude < np.inf))
    if past.any():
        where = np.flatnonzero(past)
        bound = np.where(magnitude.flat[where] < 1, TINY, LARGEST).astype(np.float16)
        converted.flat[where] = bound * np.sign(values.flat[where]).astype(np.float16)
    return converted


def _float16_bytes(data: bytes, start: int) -> bytes:
    """A block of float32 weights as float16 ones: element by element, wherever the block starts."""
    return to_float16(np.frombuffer(data, dtype=np.float32)).tobytes()


def _calibration_record(calibration: CalibrationData, settings: Settings) -> dict:
    """The calibration data a graph was made from, with the keys the int8 record gives it (calibration/int8.py)."""
    return {
        "source": calibration.description,
        "samples": calibration.samples,
        "batch": settings.calib_batch,
        "batches": len(calibration.batches),
        "data_sha256": calibration.digest,
    }


def _largest_cases(stats: TensorStats, cases: list[Case]) -> dict[str, list[str]]:
    """{data source: the labels of its LARGEST_CASES runs with the largest activations}."""
    sources = dict.fromkeys(case.source for case in cases)
    return {
        source: stats.largest_cases([case.label for case in cases if case.source == source], LARGEST_CASES)
        for source in sources
    }


def _rows(inputs: dict) -> int:
    return int(next(iter(inputs.values())).shape[0])


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
            f"{mention_name('keep_fp32')} names {unknown}, which is neither a node name nor an op type of the graph",
            f"give node names from the graph (e.g. {graph.node[0].name!r}) or op types ({', '.join(ops)})",
        )
    return [
        KeptNode(node.name, node.op_type, "asked for (--keep-fp32)", 0.0)
        for node in graph.node
        if node.name not in already and (node.name in names or node.op_type in names)
    ]


def _skip_float16_round_trips(model: onnx.ModelProto) -> None:
    """Let FP32 nodes read each other's outputs directly.

    ONNX Runtime's converter casts the output of every node it keeps in FP32 to float16, and casts it
    back for the next FP32 node: between two kept nodes the value is stored as float16 after all, and
    the overflow they were kept for happens in the Casts (measured: inf on the overflow test model).
    Only a round trip from a float32 value: a bool mask the model casts to float for a kept node (a DETR's
    CumSum) becomes a Cast to float16 and the converter's Cast back, and its reader needs a float still.
    A graph output a kept node computes leaves in float32 likewise: its Cast back, which names the output, reads the
    FP32 value (a Cast to the type it has); through float16 it was inf past its range (a MobileOne's logits).
    """
    graph = model.graph
    float32 = {name for name, kind in element_types(model).items() if kind == TensorProto.FLOAT}
    producers = {output: node for node in graph.node for output in node.output}
    graph_outputs = {output.name for output in graph.output}
    for node in graph.node:
        source = producers.get(node.input[0]) if node.input else None
        if (
            _is_cast(node, TensorProto.FLOAT)
            and source is not None
            and _is_cast(source, TensorProto.FLOAT16)
            and source.input[0] in float32
        ):
            if node.output[0] in graph_outputs:
                node.input[0] = source.input[0]
                continue
            for reader in graph.node:  # read the FP32 value before the round trip
                for index, name in enumerate(reader.input):
                    if name == node.output[0]:
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
