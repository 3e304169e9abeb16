"""Running a graph with its intermediate tensors exposed as outputs: what the FP16 overflow scan, the node-by-node
comparison, calibration's statistics (smoothing maxima, bias means, compute shapes) read.

The graph is a ModelProto: its weights in it, or (`weights`: the folder its references are relative to) a graph read
by pipeline.folder.graph_files.graph_without_weights, whose weights stay on disk and are mapped by ONNX Runtime,
never copied: the exposed copy is written beside them.
"""

from __future__ import annotations

import contextlib
import itertools
import tempfile
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..core.sessions import UNOPTIMIZED, onnxruntime_session
from ..folder.graph_files import INLINE_TENSOR_BYTES, graph_beside, set_location
from ..folder.onnx_wire import tensor_bytes

FLOAT = TensorProto.FLOAT
_GRAPH_ATTRIBUTES = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
# The most that the tensors a run computes take, all together, where its rows can be run fewer at a time
# (rows_per_run): 2 of ViT-L/16's images a run.
RUN_BYTES = 5 * 2**29


def tensor_values(
    model: onnx.ModelProto,
    tensors: Iterable[str],
    feeds: Iterable[dict],
    *,
    weights: Path | None = None,
    level: str | None = None,
) -> Iterator[dict]:
    """For each of `feeds`, {tensor: its value} for `tensors` of `model`, run on the CPU provider with them exposed
    as outputs of a copy of the graph (a graph input among them is the feed's own).  level: the optimization level
    to open that copy at, where the caller knows it (pipeline/core/sessions.py: the level a graph file already
    probed opens at); None: the highest that does not crash, probed in a child.  The session is opened here and
    the copy dropped; each run's values are held only by the caller, who holds one batch of intermediate tensors at
    a time by dropping each before asking for the next."""
    names = list(dict.fromkeys(tensors))
    with _weightless_copy(model, weights) as (exposed, folder):
        fed = {value.name for value in exposed.graph.input}
        present = {value.name for value in exposed.graph.output}
        wanted = [name for name in names if name not in fed]
        exposed.graph.output.extend(onnx.ValueInfoProto(name=name) for name in wanted if name not in present)
        session = _session(exposed, folder, level=level)
    return (_exposed_values(session, wanted, names, feed) for feed in feeds)


def rows_per_run(model: onnx.ModelProto, feed: dict) -> int | None:
    """How many rows to run at once so that the tensors one run computes, all together (shape inference's sizes at
    `feed`'s first row), take RUN_BYTES at most (one row at least); None where inference sizes none: all of them.
    A run holds the tensors of all its rows that are alive at once (ViT-L/16 computes 1.17 GB of them an image; its
    run of 8 images held 1.7 GB beside its weights, of 2 a quarter of it), and each row computes alone
    (agreement.in_rows); a model whose rows are small runs whole, as a run of few rows reads all of its weights again
    (the 0.6 GB MLP's gate took 4x as long in runs of 2 rows).  The FP16 scan, which exposes every tensor, measures
    its rows per run from its first run instead (stages/fp16_overflow.py)."""
    one_row = {name: value[:1] for name, value in feed.items()}
    computed = {name for node in model.graph.node for name in node.output if name}
    per_row = sum(_inferred_bytes(model, one_row, computed).values())
    return max(1, RUN_BYTES // per_row) if per_row else None


def channel_maxima(
    model: onnx.ModelProto, tensors: Iterable[str], feeds: Iterable[dict], *, weights: Path, level: str
) -> Iterator[tuple[dict, dict]]:
    """For each of `feeds`, ({tensor: max |x| over every axis but the last} for `tensors` of `model`, {output: its
    value} for the graph's own outputs), computed in a copy of the graph (an Abs and a ReduceMax reading each
    tensor, their result an output) on the CPU provider at `level`, as tensor_values runs it: a run holds a vector a
    tensor, not the tensor (ViT-L/16's smoothed activations are 1.1 GB a batch of 8, held twice while ONNX
    Runtime's outputs are copied out).  A graph input among them, or a tensor of one axis or of a rank shape
    inference does not know, comes whole: its maxima are the caller's (the same rule on a vector of maxima gives
    the vector).  Read by another node, not an output, each tensor blocks the same fusions of the optimizer as an
    output does: the values are the exposed run's (the INT8 graphs of the models checked the same bytes:
    docs/precision.md).  The graph's outputs come with them at no cost: the values a session on the graph itself
    gives at `level` (bit for bit on ViT-L/16, all-MiniLM-L6-v2 and EfficientNet-Lite0; the reductions added
    read the tensors and feed nothing of the graph)."""
    names = list(dict.fromkeys(tensors))
    ranks = _ranks(model)
    with _weightless_copy(model, weights) as (copy, folder):
        fed = {value.name for value in copy.graph.input}
        present = {value.name for value in copy.graph.output}
        outputs, opset = {}, _opset(copy)
        for name in (name for name in names if name not in fed):
            if ranks.get(name, 0) < 2:
                outputs[name] = name
            else:
                outputs[name] = f"{name}::channel_max"
                copy.graph.node.extend(_max_abs_nodes(name, outputs[name], ranks[name], opset))
        copy.graph.output.extend(onnx.ValueInfoProto(name=out) for out in outputs.values() if out not in present)
        session = _session(copy, folder, level=level)
    produced = [value.name for value in model.graph.output]
    read = list(dict.fromkeys([*produced, *outputs.values()]))
    for feed in feeds:
        values = dict(zip(read, session.run(read, feed), strict=True))
        maxima = {name: values[outputs[name]] if name in outputs else feed[name] for name in names}
        yield maxima, {name: values[name] for name in produced}


def _ranks(model: onnx.ModelProto) -> dict[str, int]:
    """{tensor: its rank} where shape inference finds one."""
    graph = onnx.shape_inference.infer_shapes(model).graph
    return {
        info.name: len(info.type.tensor_type.shape.dim)
        for info in (*graph.value_info, *graph.output)
        if info.type.tensor_type.HasField("shape")
    }


def _opset(model: onnx.ModelProto) -> int:
    return next(entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx"))


def _max_abs_nodes(name: str, out: str, rank: int, opset: int) -> list[onnx.NodeProto]:
    """|name| reduced by max over every axis but the last into `out` (ReduceMax takes its axes as an input from
    opset 18, as an attribute before)."""
    axes = list(range(rank - 1))
    absolute = helper.make_node("Abs", [name], [f"{out}::abs"], name=f"{out}::abs")
    if opset >= 18:
        axes_name = f"{out}::axes"
        constant = helper.make_node(
            "Constant",
            [],
            [axes_name],
            name=axes_name,
            value=helper.make_tensor(axes_name, TensorProto.INT64, [len(axes)], axes),
        )
        reduce = helper.make_node("ReduceMax", [f"{out}::abs", axes_name], [out], name=out, keepdims=0)
        return [absolute, constant, reduce]
    return [absolute, helper.make_node("ReduceMax", [f"{out}::abs"], [out], name=out, axes=axes, keepdims=0)]


def tensor_values_in_parts(
    model: onnx.ModelProto,
    tensors: Iterable[str],
    feeds: Iterable[dict],
    *,
    weights: Path,
    part_bytes: int,
) -> Iterator[Iterator[dict]]:
    """For each of `feeds`, the values of `tensors` part by part, unoptimized: `model` (read without its weights,
    which lie under `weights`) cut into consecutive runs of its nodes (GraphParts), each exposing about `part_bytes`
    of `tensors` at most, and fed what it reads from the parts before it.  Unoptimized, each node runs its own kernel
    on the same inputs, so the parts compute what the whole graph does, bit for bit, while one part's values are
    held at a time (the caller drops each part's before asking for the next): ViT-L/16's calibrated tensors are
    4 GB a batch of 8 images."""
    names = list(dict.fromkeys(tensors))
    feeds = iter(feeds)
    first = next(feeds, None)
    if first is None:
        return
    parts = GraphParts(model, names, first, part_bytes)
    for feed in itertools.chain([first], feeds):
        yield parts.values(feed, weights)


class GraphParts:
    """`model`'s nodes (in order: ONNX keeps them sorted so that each reads only what comes before it) cut where
    the tensors of `names` their outputs hold pass `part_bytes` (their sizes inferred at the feed's shapes), each
    part a graph of its own: its inputs are what it reads from the graph's inputs and the parts before it, its
    outputs the tensors of `names` it computes and what the parts after it read (a part that computes neither is
    left out).  One part where a node holds a graph of its own (If, Loop: it reads names no input lists) or where
    no size can be inferred."""

    def __init__(self, model: onnx.ModelProto, names: list[str], feed: dict, part_bytes: int) -> None:
        self.model, self.names = model, names
        wanted = set(names)
        nodes = list(model.graph.node)
        sizes = _inferred_bytes(model, feed, wanted)
        nested = any(attribute.type in _GRAPH_ATTRIBUTES for node in nodes for attribute in node.attribute)
        fed = {value.name for value in model.graph.input}  # an initializer a feed may replace is read as fed
        constants = {tensor.name for tensor in model.graph.initializer} - fed
        self.nodes: list[list] = []
        self.reads: list[list[str]] = []  # each part's inputs
        self.exposed: list[list[str]] = []  # each part's outputs
        self.later: list[set[str]] = []  # what the parts after each read
        self._whole = None  # a graph in one part: its session, opened on the first feed
        later: set[str] = set()
        for part in reversed([nodes] if nested or not sizes else _cut(nodes, sizes, part_bytes)):
            made = dict.fromkeys(name for node in part for name in node.output if name)
            exposed = [name for name in made if name in later or name in wanted]
            if exposed:
                reads = part_inputs(part, constants)
                self.nodes.insert(0, part)
                self.reads.insert(0, reads)
                self.exposed.insert(0, exposed)
                self.later.insert(0, set(later))
                later |= set(reads)

    def values(self, feed: dict, weights: Path) -> Iterator[dict]:
        """The values of `names`, part by part, on `feed` (the dtypes of each part's inputs taken from the values it
        is fed).  A graph in parts opens each part's session for its run alone: ONNX Runtime maps a session's
        weights while it lives, and ViT-L/16's parts' sessions held through the pass kept its 1.2 GB of weights
        mapped (a pass of 3 batches, its values dropped as they came: 2.99 GB at peak, 1.83 with a session a run;
        opening a part unoptimized took 4 ms).  A graph in one part keeps its session for the next feeds."""
        live = dict(feed)
        fed = {name: feed[name] for name in self.names if name in feed}
        for index, (reads, exposed, later) in enumerate(zip(self.reads, self.exposed, self.later, strict=True)):
            inputs = {name: live[name] for name in reads}
            session = self._whole if self._whole is not None else self._session(index, inputs, weights)
            if len(self.reads) == 1:
                self._whole = session
            values = dict(zip(exposed, session.run(exposed, inputs), strict=True))
            del session  # a part's: gone before the next part runs
            live = {name: value for name, value in {**live, **values}.items() if name in later}
            yield {**fed, **{name: values[name] for name in self.names if name in values}}
            fed = {}

    def _session(self, index: int, inputs: dict, weights: Path):
        part = part_graph(self.model, self.nodes[index], inputs, self.exposed[index])
        with _weightless_copy(part, weights) as (exposed, folder):
            return _session(exposed, folder, level=UNOPTIMIZED)


def part_graph(model: onnx.ModelProto, nodes: list, inputs: dict, outputs: list[str]) -> onnx.ModelProto:
    """A graph of `model`'s `nodes` alone, fed `inputs` ({name: a value of its dtype}), reading the initializers of
    `model` they read (where `model` references its weights, referencing them where they lie), with `outputs`."""
    part = onnx.ModelProto()
    part.CopyFrom(model)  # a graph read without its weights: its nodes' bytes, not its weights'
    graph = part.graph
    del graph.node[:], graph.input[:], graph.output[:], graph.value_info[:]
    graph.node.extend(nodes)
    read = {name for node in nodes for name in node.input}
    kept = [tensor for tensor in graph.initializer if tensor.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    graph.input.extend(
        helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.asarray(value).dtype), None)
        for name, value in inputs.items()
    )
    graph.output.extend(onnx.ValueInfoProto(name=name) for name in outputs)
    return part


def part_inputs(nodes: list, constants: set[str]) -> list[str]:
    """What `nodes` read that none of them computes and `constants` (initializers) do not hold: a part's inputs."""
    made = {name for node in nodes for name in node.output}
    return list(dict.fromkeys(
        name for node in nodes for name in node.input if name and name not in made and name not in constants
    ))  # fmt: skip


def _cut(nodes: list, sizes: dict[str, int], part_bytes: int) -> list[list]:
    """`nodes` in consecutive runs, a new one begun where the next node's tensors of `sizes` would take the run's
    past `part_bytes` (a node whose own take more has a run of its own)."""
    parts: list[list] = [[]]
    held = 0
    for node in nodes:
        size = sum(sizes.get(name, 0) for name in node.output)
        if parts[-1] and held + size > part_bytes:
            parts.append([])
            held = 0
        parts[-1].append(node)
        held += size
    return parts


def _inferred_bytes(model: onnx.ModelProto, feed: dict, names: set[str]) -> dict[str, int]:
    """{tensor of `names`: its bytes} at `feed`'s shapes, as ONNX's shape inference finds them (a tensor it cannot
    size counts as the mean of those it can); {} where it sizes none."""
    shaped = onnx.ModelProto()
    shaped.CopyFrom(model)
    del shaped.graph.input[:]
    shaped.graph.input.extend(
        helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape)
        for name, value in feed.items()
    )
    try:
        graph = onnx.shape_inference.infer_shapes(shaped, data_prop=True).graph
    except Exception:  # onnx's inference refuses some graphs ORT runs: no sizes, one part
        return {}
    sizes = {}
    for info in (*graph.value_info, *graph.output):
        tensor = info.type.tensor_type
        dims = tensor.shape.dim
        if info.name in names and tensor.elem_type and all(dim.HasField("dim_value") for dim in dims):
            item = helper.tensor_dtype_to_np_dtype(tensor.elem_type).itemsize
            sizes[info.name] = int(np.prod([dim.dim_value for dim in dims])) * item
    if not sizes:
        return {}
    unknown = int(np.mean(list(sizes.values())))
    return {name: sizes.get(name, unknown) for name in names}


def _exposed_values(session, wanted: list[str], names: list[str], feed: dict) -> dict:
    """One run's {tensor: value} for `names`: the exposed outputs in `wanted`, the rest from the feed."""
    values = dict(zip(wanted, session.run(wanted, feed), strict=True)) if wanted else {}
    return {name: values[name] if name in values else feed[name] for name in names}


def run_exposing_tensors(
    model: onnx.ModelProto,
    feeds: dict[str, np.ndarray],
    *,
    simulate_qdq: bool = False,
    weights: Path | None = None,
    only: Collection[str] | None = None,
    level: str | None = None,
) -> dict[str, np.ndarray]:
    """Every float tensor a graph computes (node outputs, graph inputs), by name, for one run; `only`: of the node
    outputs, those it names (ExposingSession).
    simulate_qdq: Q/DQ run as TensorRT computes them (pipeline.core.sessions), for the TensorRT-shaped INT8 graph.
    level: as tensor_values'."""
    return ExposingSession(model, simulate_qdq=simulate_qdq, weights=weights, only=only, level=level).run(feeds)


class ExposingSession:
    """An ONNX Runtime session over a copy of the graph whose outputs are all its float node outputs (`only`: those
    it names, where a caller reads no others: a run holds every output it exposes, and an INT8 graph's own
    DequantizeLinear outputs are its weights in float); made once for many runs (a session per run costs more
    than the run on a small graph)."""

    def __init__(
        self,
        model: onnx.ModelProto,
        *,
        simulate_qdq: bool = False,
        weights: Path | None = None,
        only: Collection[str] | None = None,
        level: str | None = None,
    ) -> None:
        with _weightless_copy(model, weights) as (exposed, folder):
            inferred = onnx.shape_inference.infer_shapes(exposed)
            known = {value.name: value for value in [*inferred.graph.value_info, *inferred.graph.output]}
            present = {output.name for output in exposed.graph.output}
            for node in exposed.graph.node:
                for name in node.output:
                    if only is not None and name not in only:
                        continue
                    value = known.get(name)
                    if value is not None and name not in present and value.type.tensor_type.elem_type == FLOAT:
                        exposed.graph.output.append(value)
                        present.add(name)
            self.session = _session(exposed, folder, simulate_qdq=simulate_qdq, level=level)
        self.names = [output.name for output in self.session.get_outputs()]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {**feeds, **dict(zip(self.names, self.session.run(self.names, feeds), strict=True))}


def _session(exposed: onnx.ModelProto, folder: Path, *, simulate_qdq: bool = False, level: str | None = None):
    """A CPU session on `exposed`, written beside the weights it references (in `folder`), which ONNX Runtime maps
    and packs none of (the session keeps the graph; the file can go), with no arena: the tensors a run exposes are
    the caller's to free, and an arena would keep their memory for the session's life."""
    with graph_beside(exposed, folder) as path:
        return onnxruntime_session(path, simulate_qdq=simulate_qdq, level=level, pack_weights=False, arena=False)


@contextlib.contextmanager
def _weightless_copy(model: onnx.ModelProto, weights: Path | None) -> Iterator[tuple[onnx.ModelProto, Path]]:
    """(a copy of `model` whose large initializers reference their bytes on disk, the folder they are in): `model`'s
    own references where it was read without its weights (`weights`: their folder); else its weights written to a
    scratch folder's data file one tensor at a time, never copied in memory (each tensor's bytes are taken out of
    `model` while it is copied, and put back).  A copy of a model with its weights in it, and shape inference on
    one, held them two and three times over."""
    if weights is not None:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        yield copy, weights
        return
    # Sized from type and dims: reading raw_data to measure it would copy it.
    large = [t for t in model.graph.initializer if t.HasField("raw_data") and tensor_bytes(t) >= INLINE_TENSOR_BYTES]
    with tempfile.TemporaryDirectory(prefix="exposed.") as folder:
        data = Path(folder) / "weights.data"
        places, aside = [], []
        try:
            with open(data, "wb") as out:
                for tensor in large:
                    raw = tensor.raw_data
                    tensor.ClearField("raw_data")
                    aside.append((tensor, raw))
                    places.append((out.tell(), len(raw)))
                    out.write(raw)
            copy = onnx.ModelProto()
            copy.CopyFrom(model)
        finally:
            for tensor, raw in aside:
                tensor.raw_data = raw
        positions = {tensor.name: place for tensor, place in zip(large, places, strict=True)}
        for tensor in copy.graph.initializer:
            if tensor.name in positions:
                set_location(tensor, data.name, *positions[tensor.name])
        yield copy, Path(folder)
