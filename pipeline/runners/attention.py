"""Each transformer layer's attention, its LayerNorms and its GELU as ONNX Runtime's own fused kernels.

The exported graph computes attention op by op: MatMul of Q and K, scale, mask Add, Softmax, MatMul with V, each a
kernel launch and a round trip of the scores through memory.  ONNX Runtime's transformer optimizer
(onnxruntime.transformers, the BERT or BART rules) replaces that with its Attention kernel (fused attention kernels
on the GPU), the embeddings' sum and LayerNorm with EmbedLayerNormalization, each residual Add + LayerNorm with
SkipLayerNormalization and each bias + GELU with BiasGelu.  On an H200, BERT and DistilBERT folders served unfused at
1.7-2.9x torch.compile(mode="reduce-overhead")'s latency (docs/benchmarks/gpu-models.md).

What keeps the fused graph computing what the graph did (float rounding apart):
- The attention takes the raw attention mask (use_raw_attention_mask), never ONNX Runtime's default mask index
  (each row's count of ones), which assumes the padding on the right: on a DistilBERT graph the default gave outputs
  0.26 apart on a left-padded row, the raw mask 2.4e-06 (the unfused graph's own rounding).
- The attention fills masked scores with the graph's own fill (transformers' eager mask: float32's lowest), not
  ONNX Runtime's default -10000, with which a row whose every token is masked attended as if unmasked (0.21 apart
  from the graph on DistilBERT; the graph, like the eager attention it was exported from, averages every key there).
- The attention scales its scores by the graph's own scale, not ONNX Runtime's default 1/sqrt(head size) (its rules
  never read the graph's): a graph whose attentions are scaled by more than one factor, or by none, is not fused.
  BERT's rules take the scale between Q·K and the Softmax; where the query is scaled instead (Whisper's encoder:
  q_proj's output times the factor, Q·K straight into the Softmax) and no mask is added, BART's rules fuse it (they
  read a mask there as a decoder's causal one, so a masked attention of that form is left as it is).
- An attention without a mask (ViT's) scales its scores with a Mul by 1/sqrt(head size), where
  the rules look for a Div: a Mul by a power of two (0.125 for heads of 64) becomes the Div by its inverse, the
  same bit for bit; another scale is left as it is.
- A float16 graph keeps the mask's Where in float32 (its fill value, float32's lowest, is past float16), with a Cast
  after it, which hides the pattern from the optimizer: the Cast moves above the Where onto both values it selects
  from, which computes the same bit for bit (a cast of a selection is the selection of the casts).

The fused graph is kept only where an attention was fused; any other graph (a CNN, a model no rule matches) is left
as it is.  A graph whose weights live in a data file beside it (past 2 GB) is left as it is too: the optimizer
rewrites weights (Q, K and V's into one), and it would hold them all in memory.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .conv_bias import QUANTIZED

# ONNX Runtime's rules for encoders: BERT's, which match DistilBERT's, ViT's and other transformers' layers too, where
# the scores are scaled; BART's where the query is (Whisper's encoder), taken only for attentions with no mask: they
# read a mask as a decoder's causal one.
SCALED_SCORES, SCALED_QUERY = "bert", "bart"


def fuse_attention(graph: Path) -> dict[str, int]:
    """Rewrite the graph file `graph` in place with ONNX Runtime's fused transformer kernels (module doc).  Returns
    the fused kernels by op type ({}: the file is untouched)."""
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    ops = {node.op_type for node in model.graph.node}
    if "Softmax" not in ops or ops & QUANTIZED or _has_data_file(model):
        return {}
    islands = _softmax_in_float16(model)
    lookup = GraphLookup.of(model)
    rules, scale = SCALED_SCORES, attention_scale(lookup)
    if scale is None:
        rules, scale = SCALED_QUERY, query_scale(lookup)
    if scale is None:
        return {}
    fill, (heads, hidden) = mask_fill(lookup), attention_heads(lookup)
    _scale_as_division(model, lookup)
    _cast_before_where(model)
    fused = _optimized(model, rules, heads, hidden)
    counts = {op: count for op, count in fused.get_fused_operator_statistics().items() if count}
    if not counts.get("Attention"):
        return {}
    if islands and any(node.op_type == "Softmax" for node in fused.model.graph.node):
        return {}  # an island computed in float16 outside a fused Attention: not what the graph computes
    _set_unset(fused.model, "scale", scale)
    if fill is not None:
        _set_unset(fused.model, "mask_filter_value", fill)
    fused.save_model_to_file(str(graph))
    return counts


@dataclass(frozen=True)
class GraphLookup:
    """A graph's nodes, each by the tensor it writes and by the tensors it reads, its initializers by name and its
    outputs' names: what the readers and rewrites below ask."""

    nodes: list[Any]
    made_by: dict[str, Any]
    read_by: dict[str, list[Any]]
    weights: dict[str, Any]
    outputs: frozenset[str]

    @classmethod
    def of(cls, model: Any) -> GraphLookup:
        nodes = list(model.graph.node)
        made_by = {output: node for node in nodes for output in node.output}
        read_by: dict[str, list[Any]] = {}
        for node in nodes:
            for name in node.input:
                read_by.setdefault(name, []).append(node)
        weights = {tensor.name: tensor for tensor in model.graph.initializer}
        return cls(nodes, made_by, read_by, weights, frozenset(tensor.name for tensor in model.graph.output))

    def of_type(self, op_type: str) -> list[Any]:
        return [node for node in self.nodes if node.op_type == op_type]

    def only_reader(self, name: str) -> Any:
        """The one node that reads `name`, where no other node reads it and it is no output of the graph; else None."""
        readers = self.read_by.get(name, [])
        return readers[0] if len(readers) == 1 and name not in self.outputs else None

    def op(self, name: str) -> str | None:
        """The op type of the node that writes `name` (None: an input or an initializer)."""
        node = self.made_by.get(name)
        return node.op_type if node is not None else None

    def first_inputs(self, name: str, ops: tuple[str, ...]) -> list[Any] | None:
        """The nodes of types `ops` that write `name`, then each one's first input in turn; None where one is not."""
        chain = []
        for op in ops:
            node = self.made_by.get(name)
            if node is None or node.op_type != op:
                return None
            chain.append(node)
            name = node.input[0]
        return chain

    def source(self, name: str) -> str:
        """The tensor a Cast writing `name` reads, else `name`."""
        return self.made_by[name].input[0] if self.op(name) == "Cast" else name

    def constant(self, name: str) -> np.ndarray | None:
        """What an initializer or a Constant node's `value` holds, else None."""
        from onnx import numpy_helper

        if name in self.weights:
            return numpy_helper.to_array(self.weights[name])
        node = self.made_by.get(name)
        if node is not None and node.op_type == "Constant" and node.attribute[0].name == "value":
            return numpy_helper.to_array(node.attribute[0].t)
        return None

    def scalar(self, name: str) -> float | None:
        """The one number `name` holds as a constant, else None."""
        value = self.constant(name)
        return value.reshape(-1)[0].item() if value is not None and value.size == 1 else None


def _optimized(model: Any, rules: str, heads: int, hidden: int) -> Any:
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    options = FusionOptions(rules)
    options.use_raw_attention_mask(True)
    # Its modules log warnings where a rule does not apply ("failed to detect num_heads"), under their own names:
    # the package imports them as top-level modules too (fusion_attention, onnx_model, ...).
    quiet = [
        logging.getLogger(name)
        for name in list(logging.root.manager.loggerDict)
        if name.startswith(("onnxruntime.transformers", "fusion_", "onnx_model"))
    ]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        # opt_level 0: the fusions alone; ONNX Runtime's own graph rewrites run when the session opens.  use_gpu:
        # the GPU's rules, on the CPU placement too, so the tests there run the graph the GPU runs.
        return optimize_model(
            model, model_type=rules, num_heads=heads, hidden_size=hidden, opt_level=0, use_gpu=True,
            optimization_options=options,
        )  # fmt: skip
    finally:
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)


def mask_fill(graph: GraphLookup) -> float | None:
    """The one value the graph's attention masks put where a token is masked: the Where (read through a Cast) whose
    output each Softmax's input Add adds to the scores.  None where there is no such Where, or more than one value."""
    fills = set()
    for softmax in graph.of_type("Softmax"):
        add = graph.made_by.get(softmax.input[0])
        for name in add.input if add is not None and add.op_type == "Add" else []:
            if graph.op(graph.source(name)) == "Where":
                where = graph.made_by[graph.source(name)]
                fills.add(graph.scalar(graph.source(where.input[2])))
    return fills.pop() if len(fills) == 1 else None


def attention_scale(graph: GraphLookup) -> float | None:
    """The one factor every Softmax's scores are scaled by: a Mul by c (c) or a Div by d (1/d) of a MatMul, under the
    mask's Add where there is one.  None where a Softmax reads no such scale, or the factors differ."""
    scales = set()
    for softmax in graph.of_type("Softmax"):
        scores = graph.made_by.get(softmax.input[0])
        if scores is not None and scores.op_type == "Add":  # the mask's
            scores = next((graph.made_by[n] for n in scores.input if graph.op(n) in ("Mul", "Div")), None)
        factor = None
        if scores is not None and scores.op_type in ("Mul", "Div") and graph.op(scores.input[0]) == "MatMul":
            value = graph.scalar(scores.input[1])
            factor = None if value is None else float(value) if scores.op_type == "Mul" else 1 / float(value)
        scales.add(factor)
    return scales.pop() if len(scales) == 1 else None


def query_scale(graph: GraphLookup) -> float | None:
    """The one factor every attention's query is scaled by where no scores are (Whisper's encoder: q_proj's output
    times 1/sqrt(head size), then split into heads): each Softmax reads the Q·K MatMul itself, with no mask between,
    and that MatMul's query is Transpose(Reshape(Mul(Add, c))).  None where a Softmax is not of that form, or the
    factors differ.  BART's rules drop the Mul and scale by the Attention's own factor, set to c."""
    scales = set()
    for softmax in graph.of_type("Softmax"):
        chain = graph.first_inputs(softmax.input[0], ("MatMul", "Transpose", "Reshape", "Mul"))
        if chain is None or graph.op(chain[-1].input[0]) != "Add":
            return None
        scales.add(graph.scalar(chain[-1].input[1]))
    return scales.pop() if len(scales) == 1 else None


def _set_unset(model: Any, name: str, value: float) -> None:
    """Each fused Attention that the rules gave no attribute `name` takes `value`."""
    from onnx import helper

    for node in (node for node in model.graph.node if node.op_type == "Attention"):
        if not any(attribute.name == name for attribute in node.attribute):
            node.attribute.append(helper.make_attribute(name, value))


def _has_data_file(model: Any) -> bool:
    from onnx import TensorProto

    return any(tensor.data_location == TensorProto.EXTERNAL for tensor in model.graph.initializer)


def _cast_before_where(model: Any) -> None:
    """Each Cast whose input is a Where read by it alone becomes a Cast of each value the Where selects from, the
    Where then writing the Cast's output: the same values, the Where next to what reads it."""
    from onnx import helper

    graph = GraphLookup.of(model)
    rewritten = []
    for node in graph.nodes:
        where = graph.made_by.get(node.input[0]) if node.op_type == "Cast" else None
        if where is None or where.op_type != "Where" or graph.only_reader(where.output[0]) is None:
            rewritten.append(node)
            continue
        to = next(attribute.i for attribute in node.attribute if attribute.name == "to")
        for index in (1, 2):
            cast = f"{where.output[0]}_value{index}_cast"
            rewritten.insert(rewritten.index(where), helper.make_node("Cast", [where.input[index]], [cast], to=to))
            where.input[index] = cast
        where.output[0] = node.output[0]
    del model.graph.node[:]
    model.graph.node.extend(rewritten)


def _softmax_in_float16(model: Any) -> int:
    """Each attention the float16 graph keeps in float32 between two Casts, its mask's Add and Softmax (the masked
    scores reach float32's lowest, past float16, on a padded reference), written in float16 as the rules expect it:
    Add(Cast(scores, float32), mask) -> Softmax -> Cast(float16) becomes Add(scores, Cast(mask, float16)) -> Softmax,
    one Cast per mask.  Not the same values: float16's -inf where the mask is.  Only a fused Attention may stand in
    its place (it fills masked scores itself, by mask_filter_value), so fuse_attention keeps the fused graph only
    where no Softmax is left.  Returns the attentions rewritten."""
    from onnx import TensorProto, helper

    graph = GraphLookup.of(model)

    def cast_to(node: Any, to: int) -> bool:
        return node.op_type == "Cast" and helper.get_node_attr_value(node, "to") == to

    dropped, cast_masks, rewritten = set(), set(), 0
    for softmax in graph.of_type("Softmax"):
        add, down = graph.made_by.get(softmax.input[0]), graph.only_reader(softmax.output[0])
        if add is None or add.op_type != "Add" or graph.only_reader(add.output[0]) is not softmax:
            continue
        if down is None or not cast_to(down, TensorProto.FLOAT16):
            continue
        up = next((graph.made_by[n] for n in add.input if graph.op(n) == "Cast"), None)  # the scores' Cast
        if up is None or not cast_to(up, TensorProto.FLOAT) or graph.only_reader(up.output[0]) is not add:
            continue
        side = list(add.input).index(up.output[0])
        mask = add.input[1 - side]
        add.input[side], add.input[1 - side] = up.input[0], f"{mask}_float16"
        if mask not in cast_masks:
            cast_masks.add(mask)
            model.graph.node.insert(
                list(model.graph.node).index(add),
                helper.make_node("Cast", [mask], [f"{mask}_float16"], to=TensorProto.FLOAT16),
            )
        softmax.output[0] = down.output[0]
        dropped.update({up.output[0], down.output[0]})
        rewritten += 1
    kept = [node for node in model.graph.node if not (node.op_type == "Cast" and node.output[0] in dropped)]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    return rewritten


def _scale_as_division(model: Any, graph: GraphLookup) -> None:
    """Each Softmax's input Mul(MatMul, c), with c a scalar power of two, as Div(MatMul, 1/c): the same values."""
    from onnx import numpy_helper

    for softmax in graph.of_type("Softmax"):
        mul = graph.made_by.get(softmax.input[0])
        if mul is None or mul.op_type != "Mul" or graph.op(mul.input[0]) != "MatMul":
            continue
        scale = graph.constant(mul.input[1])
        if scale is None or scale.size != 1 or not np.issubdtype(scale.dtype, np.floating):
            continue
        fraction, _ = np.frexp(scale.reshape(-1)[0])
        if fraction != 0.5:  # not a power of two: x * c and x / (1 / c) may round apart
            continue
        inverse = f"{mul.input[1]}_inverse"
        if inverse not in graph.weights:
            graph.weights[inverse] = numpy_helper.from_array((1 / scale).astype(scale.dtype), inverse)
            model.graph.initializer.append(graph.weights[inverse])
        mul.op_type, mul.input[1] = "Div", inverse


def attention_heads(graph: GraphLookup) -> tuple[int, int]:
    """(heads, hidden size) of the graph's attention, from the Reshape that splits Q (or K, V) into heads: its data
    a MatMul by a [hidden, hidden] weight plus a bias, its shape a Concat ending in (heads or -1, head size).
    ONNX Runtime reads the heads from that Concat and gives up where they are -1 (transformers 5 writes
    `view(*shape, -1, head_size)`).  (0, 0), ONNX Runtime's "detect them", where no Reshape is of that form."""
    found: Counter[tuple[int, int]] = Counter()
    for node in graph.of_type("Reshape"):
        concat, add = graph.made_by.get(node.input[1]), graph.made_by.get(node.input[0])
        if concat is None or add is None or concat.op_type != "Concat" or add.op_type != "Add":
            continue
        if len(concat.input) != 4:
            continue
        width = _matmul_width(add, graph)
        heads, head_size = (graph.scalar(name) for name in concat.input[2:])
        if width and isinstance(head_size, int) and head_size > 0 and width % head_size == 0:
            found[(heads if isinstance(heads, int) and heads > 0 else width // head_size, width)] += 1
    return found.most_common(1)[0][0] if found else (0, 0)


def _matmul_width(add: Any, graph: GraphLookup) -> int | None:
    """The output width of the MatMul by a 2-D weight that `add` adds a bias to."""
    for name in add.input:
        matmul = graph.made_by.get(name)
        if matmul is not None and matmul.op_type == "MatMul" and matmul.input[1] in graph.weights:
            dims = graph.weights[matmul.input[1]].dims
            return int(dims[1]) if len(dims) == 2 else None
    return None
