"""Greedy NMS appended to an ONNX graph, in fixed sizes: `append_nms(model, NmsConfig(...))`.

Why not ONNX's NonMaxSuppression: TensorRT-RTX 1.7 parses it but its builder refuses it ("has no runners that
implement it"), and its output's size depends on the values.  This subgraph uses ops TensorRT-RTX builds and ONNX
Runtime runs, and no size depends on the values: M = min(candidates, anchors), K = max_detections.

  head [B, 4+C, N] -> best class and score per anchor -> TopK: the M best candidates, sorted by score
  -> boxes as x1, y1, x2, y2 -> pairwise overlaps [B, M, M] -> S[i, j]: i comes before j, they overlap (and
  share the class, when class-aware) -> greedy suppression (below) -> TopK over the kept, in their order: K rows
  -> boxes [B, K, 4], scores [B, K], classes [B, K], count [B, 1], padded past count.

The anchors N may be symbolic (a head exported for several image sizes, or one whose size the exporter could not
trace): M is then taken at run time.  Where N may be below K, K never-valid anchors are appended first.

Greedy suppression is sequential: a box suppressed by a box that was itself suppressed stays (A > B > C with A~B,
B~C: A and C are kept).  Its result is the one `keep` with keep[j] = valid[j] and no i with keep[i] and S[i, j].
An ONNX Loop iterates that equation from keep = valid; after t passes the first t candidates are final (each
depends only on those before it), so M passes make it exact, and it stops earlier, after the first pass that
changes nothing: the longest chain of suppressions plus one or two passes (2 to 4 on a YOLO-like head, see
docs/benchmarks/nms-latency.md).  The arithmetic is float32 (an FP16 head is cast first: boxes in image
coordinates would lose whole pixels in float16).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..core.errors import PipelineError
from ..core.nms_config import NmsConfig
from ..core.settings import OPSET
from .nms import OUTPUTS, PADDING_CLASS

PREFIX = "nms/"  # every node and constant of the subgraph is named under it (a precision pass can keep them fp32)
FLOAT_HEADS = (TensorProto.FLOAT, TensorProto.FLOAT16)


def append_nms(model: onnx.ModelProto | Path, config: NmsConfig) -> onnx.ModelProto:
    """The graph with its head output replaced by the detections (OUTPUTS); its other outputs stay.  A path is
    loaded with its external data; the model given is not changed."""
    model = onnx.load(str(model)) if isinstance(model, (str, Path)) else model
    _require_opset(model)
    head = _head_output(model, config)
    batch, classes, anchors = _head_sizes(_inferred(model, head.name))
    _refuse_taken_names(model)
    nodes = _Nodes()
    head_tensor = head.name
    if head.type.tensor_type.elem_type != TensorProto.FLOAT:
        head_tensor = nodes.one("Cast", head_tensor, to=TensorProto.FLOAT)
    # Fewer anchors than K (or a count known only at run time): K empty anchors after them keep every TopK valid.
    padded = anchors is None or anchors < config.max_detections
    _detections(nodes, head_tensor, classes, padded, config)
    return _appended(model, nodes, head.name, _output_infos(batch, config.max_detections))


def _appended(model: onnx.ModelProto, nodes: _Nodes, head: str, outputs: list[onnx.ValueInfoProto]) -> onnx.ModelProto:
    """A copy of the model with the nodes added and `outputs` in place of the head among its outputs."""
    appended = onnx.ModelProto()
    appended.CopyFrom(model)
    graph = appended.graph
    graph.node.extend(nodes.nodes)
    graph.initializer.extend(nodes.constants)
    kept = [output for output in graph.output if output.name != head]
    del graph.output[:]
    graph.output.extend([*kept, *outputs])
    return appended


# --------------------------------------------------------------------------- the head


def _require_opset(model: onnx.ModelProto) -> None:
    """The subgraph is written in opset 17's forms (ReduceMax's axes an attribute, ReduceSum's an input)."""
    opsets = [entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx")]
    if opsets != [OPSET]:
        raise PipelineError(
            f"NMS is appended to opset {OPSET} graphs; this one imports {opsets}", f"export at opset {OPSET}"
        )


def _head_output(model: onnx.ModelProto, config: NmsConfig) -> onnx.ValueInfoProto:
    outputs = {output.name: output for output in model.graph.output}
    if config.head is None and len(outputs) != 1:
        raise PipelineError(
            f"the graph has {len(outputs)} outputs ({', '.join(outputs)}); NMS needs to be told which is the head",
            "name the head output in NmsConfig(head=...)",
        )
    name = config.head or next(iter(outputs))
    if name not in outputs:
        raise PipelineError(f"the graph has no output {name!r} to append NMS to", f"name one of {', '.join(outputs)}")
    return outputs[name]


def _inferred(model: onnx.ModelProto, name: str) -> onnx.ValueInfoProto:
    """The output as shape inference sees it: an exporter declares as symbols sizes it did not trace (TorchScript's
    "Concathead_dim_1" for YOLO's 4 + classes rows) that inference can resolve to numbers."""
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    return next(output for output in inferred.graph.output if output.name == name)


def _head_sizes(head: onnx.ValueInfoProto) -> tuple[str, int, int | None]:
    """(the batch dim's name, classes, anchors: None where only the run knows) of a head [batch, 4 + classes,
    anchors] whose box-and-class rows are fixed; a head of another form is refused, naming what is wrong."""
    tensor = head.type.tensor_type
    dims = [d.dim_param if d.HasField("dim_param") else (d.dim_value if d.HasField("dim_value") else None)
            for d in tensor.shape.dim]  # fmt: skip
    form = f"{head.name!r} is {dims} {helper.tensor_dtype_to_np_dtype(tensor.elem_type)}"
    if tensor.elem_type not in FLOAT_HEADS or len(dims) != 3:
        raise PipelineError(
            f"NMS needs a float head [batch, 4 + classes, anchors]; {form}",
            "append NMS to the raw detection head (YOLOv8's layout), before any post-processing of its own",
        )
    batch, rows, anchors = dims
    if not isinstance(batch, str):
        raise PipelineError(f"NMS needs the head's batch dim symbolic; {form}", "export with a dynamic batch axis")
    if not isinstance(rows, int) or rows < 5:
        raise PipelineError(
            f"NMS needs the head's rows fixed at 4 box rows + one per class (at least 5); {form}",
            "append NMS after the simplify stage (onnxsim fixes sizes an exporter left symbolic); a head laid out "
            "[batch, anchors, 4 + classes] needs a Transpose first",
        )
    return batch, rows - 4, anchors if isinstance(anchors, int) else None


def _refuse_taken_names(model: onnx.ModelProto) -> None:
    taken = {name for node in model.graph.node for name in node.output}
    taken |= {value.name for value in [*model.graph.input, *model.graph.initializer]}
    clash = sorted(name for name in taken if name in OUTPUTS or name.startswith(PREFIX))
    if clash:
        raise PipelineError(
            f"the graph already has tensors named {clash}, names the NMS outputs or its nodes take",
            f"rename them at export (output_names=...): NMS writes {', '.join(OUTPUTS)} and nodes under {PREFIX!r}",
        )


def _output_infos(batch: str, k: int) -> list[onnx.ValueInfoProto]:
    """boxes [B, K, 4] float32, scores [B, K] float32, classes [B, K] int32, count [B, 1] int32 (OUTPUTS' order)."""
    forms: list[tuple[int, list[str | int]]] = [
        (TensorProto.FLOAT, [batch, k, 4]),
        (TensorProto.FLOAT, [batch, k]),
        (TensorProto.INT32, [batch, k]),
        (TensorProto.INT32, [batch, 1]),
    ]
    return [helper.make_tensor_value_info(name, *form) for name, form in zip(OUTPUTS, forms, strict=True)]


# --------------------------------------------------------------------------- the subgraph


class _Nodes:
    """The nodes and constants being appended, each named under PREFIX with a running number."""

    def __init__(self, prefix: str = PREFIX) -> None:
        self.prefix = prefix
        self.nodes: list[onnx.NodeProto] = []
        self.constants: list[onnx.TensorProto] = []
        self._numbers = itertools.count()

    def add(self, op: str, *inputs: str, outputs: int = 1, **attributes) -> list[str]:
        label = f"{self.prefix}{op}_{next(self._numbers)}"
        names = [label] if outputs == 1 else [f"{label}:{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op, list(inputs), names, name=label, **attributes))
        return names

    def one(self, op: str, *inputs: str, output: str | None = None, **attributes) -> str:
        """One node with one output: named `output` (a graph output) or after the node."""
        name = self.add(op, *inputs, **attributes)[0]
        if output is not None:
            self.nodes[-1].output[0] = name = output
        return name

    def constant(self, label: str, value: np.ndarray | np.generic) -> str:
        name = f"{self.prefix}{label}_{next(self._numbers)}"
        self.constants.append(numpy_helper.from_array(np.asarray(value), name))
        return name


def _detections(nodes: _Nodes, head: str, classes: int, padded: bool, config: NmsConfig) -> None:
    """The nodes from the float32 head to the four outputs, OUTPUTS (module doc)."""
    boxes, class_scores = nodes.add("Split", head, nodes.constant("split", np.array([4, classes])), axis=1, outputs=2)
    scores = nodes.one("ReduceMax", class_scores, axes=[1], keepdims=1)  # [B, 1, N]
    corners = _corners(nodes, boxes, config.box_format)  # [B, 4, N]: x1, y1, x2, y2
    if padded:
        corners, scores = _padded(nodes, corners, scores, config.max_detections)
    # M = min(candidates, anchors): a constant where the anchors are (the builders fold it), else known at run time.
    anchors = nodes.one("Shape", scores, start=2, end=3)
    size = nodes.one("Min", anchors, nodes.constant("candidates", np.array([config.candidates])))
    count = _scalar(nodes, size)
    order = nodes.one("Range", nodes.constant("first", np.array(0)), count, nodes.constant("step", np.array(1)))
    top_scores, top = nodes.add("TopK", scores, size, axis=2, outputs=2)  # [B, 1, M], best first
    top_corners = nodes.one("GatherElements", corners, _rows(nodes, top, 4), axis=2)  # [B, 4, M]
    # The class of the M candidates only: ArgMax over [B, C, N] costs ONNX Runtime more than all of NMS at M = 300.
    # A padding anchor (never valid) reads the last anchor's scores instead.
    anchor = _last_anchor_at_most(nodes, top, class_scores) if padded else top
    top_class_scores = nodes.one("GatherElements", class_scores, _rows(nodes, anchor, classes), axis=2)  # [B, C, M]
    top_labels = nodes.one("Cast", nodes.one("ArgMax", top_class_scores, axis=1), to=TensorProto.INT32)  # [B, 1, M]
    suppresses = _suppression_matrix(nodes, top_corners, top_labels, order, config)
    valid = nodes.one("Greater", top_scores, nodes.constant("score_threshold", np.float32(config.score_threshold)))
    keep = _greedy_keep(nodes, suppresses, nodes.one("Cast", valid, to=TensorProto.FLOAT), count)
    _first_kept(nodes, keep, top_corners, top_scores, top_labels, order, config.max_detections)


def _padded(nodes: _Nodes, corners: str, scores: str, k: int) -> tuple[str, str]:
    """K more anchors after the head's, never valid (score -inf, an empty box), so that M >= K always."""
    batch = nodes.one("Shape", scores, start=0, end=1)
    per_image = nodes.one("Concat", batch, nodes.constant("ones", np.ones(2, np.int64)), axis=0)  # [B, 1, 1]

    def pad(tensor: str, label: str, value: np.ndarray) -> str:
        return nodes.one("Concat", tensor, nodes.one("Expand", nodes.constant(label, value), per_image), axis=2)

    return (
        pad(corners, "empty_boxes", np.zeros((1, 4, k), np.float32)),
        pad(scores, "no_scores", np.full((1, 1, k), -np.inf, np.float32)),
    )


def _last_anchor_at_most(nodes: _Nodes, index: str, class_scores: str) -> str:
    """`index` with the padding anchors' indices (past the head's last) replaced by the last one."""
    last = nodes.one("Sub", nodes.one("Shape", class_scores, start=2, end=3), nodes.constant("one", np.array([1])))
    return nodes.one("Min", index, last)


def _scalar(nodes: _Nodes, vector: str) -> str:
    """A one-element vector as a scalar (Range's and Loop's counts)."""
    return nodes.one("Squeeze", vector, nodes.constant("axis", np.array([0])))


def _corners(nodes: _Nodes, boxes: str, box_format: str) -> str:
    """[B, 4, N] boxes as x1, y1, x2, y2 (nms.decode computes the same)."""
    if box_format == "xyxy":
        return boxes
    centre, size = nodes.add("Split", boxes, nodes.constant("split", np.array([2, 2])), axis=1, outputs=2)
    half = nodes.one("Mul", size, nodes.constant("half", np.float32(0.5)))
    return nodes.one("Concat", nodes.one("Sub", centre, half), nodes.one("Add", centre, half), axis=1)


def _rows(nodes: _Nodes, index: str, rows: int) -> str:
    """An index [B, 1, M] repeated over `rows` rows, [B, rows, M], for GatherElements (Expand broadcasts)."""
    return nodes.one("Expand", index, nodes.constant("rows", np.array([1, rows, 1])))


def _suppression_matrix(nodes: _Nodes, corners: str, labels: str, order: str, config: NmsConfig) -> str:
    """float32 [B, M, M]: 1 where candidate i (row) comes before candidate j (column) and suppresses it."""
    rows = nodes.add("Split", corners, nodes.constant("split", np.ones(4, np.int64)), axis=1, outputs=4)
    columns = [nodes.one("Transpose", row, perm=[0, 2, 1]) for row in rows]  # [B, M, 1]: candidate i
    low = [nodes.one("Max", columns[axis], rows[axis]) for axis in (0, 1)]
    high = [nodes.one("Min", columns[axis], rows[axis]) for axis in (2, 3)]
    sides = [nodes.one("Relu", nodes.one("Sub", high[axis], low[axis])) for axis in (0, 1)]
    intersection = nodes.one("Mul", *sides)
    # IoU > t as intersection * (1 + t) > t * area_i + t * area_j (nms.overlaps): one [B, M, M] op fewer than
    # through the union, and no division.
    area = nodes.one("Mul", nodes.one("Sub", rows[2], rows[0]), nodes.one("Sub", rows[3], rows[1]))  # [B, 1, M]
    scaled_area = nodes.one("Mul", area, nodes.constant("iou_threshold", np.float32(config.iou_threshold)))
    bound = nodes.one("Add", nodes.one("Transpose", scaled_area, perm=[0, 2, 1]), scaled_area)
    scale = nodes.constant("one_plus_iou_threshold", np.float32(1 + config.iou_threshold))
    overlap = nodes.one("Greater", nodes.one("Mul", intersection, scale), bound)
    column = nodes.one("Unsqueeze", order, nodes.constant("axis", np.array([1])))  # [M, 1]
    suppresses = nodes.one("And", overlap, nodes.one("Less", column, order))  # [M, M]: i before j
    if config.class_aware:
        same_class = nodes.one("Equal", nodes.one("Transpose", labels, perm=[0, 2, 1]), labels)
        suppresses = nodes.one("And", suppresses, same_class)
    return nodes.one("Cast", suppresses, to=TensorProto.FLOAT)


def _greedy_keep(nodes: _Nodes, suppresses: str, valid: str, passes: str) -> str:
    """float32 [B, 1, M], 1 for the candidates greedy NMS keeps: the Loop of the module doc, at most M passes."""
    body = _Nodes(f"{PREFIX}loop/")
    keep_in, condition_in, pass_number = f"{PREFIX}loop/keep_in", f"{PREFIX}loop/condition_in", f"{PREFIX}loop/pass"
    hits = body.one("MatMul", keep_in, suppresses)  # [B, 1, M]: how many kept candidates suppress each
    zero = body.constant("zero", np.float32(0))
    keep = body.one("Mul", valid, body.one("Cast", body.one("Equal", hits, zero), to=TensorProto.FLOAT))
    changes = body.one("ReduceSum", body.one("Abs", body.one("Sub", keep, keep_in)), keepdims=0)
    changed = body.one("Greater", changes, zero)
    graph = helper.make_graph(
        body.nodes,
        f"{PREFIX}greedy",
        [
            helper.make_tensor_value_info(pass_number, TensorProto.INT64, []),
            helper.make_tensor_value_info(condition_in, TensorProto.BOOL, []),
            helper.make_tensor_value_info(keep_in, TensorProto.FLOAT, None),
        ],
        [
            helper.make_tensor_value_info(changed, TensorProto.BOOL, []),
            helper.make_tensor_value_info(keep, TensorProto.FLOAT, None),
        ],
        initializer=body.constants,
    )
    return nodes.one("Loop", passes, nodes.constant("start", np.array(True)), valid, body=graph)


def _first_kept(nodes: _Nodes, keep: str, corners: str, scores: str, labels: str, order: str, k: int) -> None:
    """The outputs: the first K kept candidates in their order (by score), padded."""
    # Kept candidate j gets M - j, the others 0: TopK then takes the kept in candidate order.
    size = nodes.one("Cast", nodes.one("Shape", order), to=TensorProto.FLOAT)
    priority = nodes.one("Sub", size, nodes.one("Cast", order, to=TensorProto.FLOAT))  # [M]
    found_priority, chosen = nodes.add(
        "TopK", nodes.one("Mul", keep, priority), nodes.constant("k", np.array([k])), axis=2, outputs=2
    )
    zero = nodes.constant("zero", np.float32(0))
    found = nodes.one("Greater", found_priority, zero)  # [B, 1, K]
    boxes = nodes.one("Where", found, nodes.one("GatherElements", corners, _rows(nodes, chosen, 4), axis=2), zero)
    chosen_scores = nodes.one("Where", found, nodes.one("GatherElements", scores, chosen, axis=2), zero)
    padding = nodes.constant("padding_class", np.int32(PADDING_CLASS))
    chosen_labels = nodes.one("Where", found, nodes.one("GatherElements", labels, chosen, axis=2), padding)
    axes = nodes.constant("axes", np.array([2]))
    count = nodes.one("ReduceSum", nodes.one("Cast", found, to=TensorProto.FLOAT), axes, keepdims=0)  # [B, 1]
    squeeze = nodes.constant("axis", np.array([1]))
    boxes_name, scores_name, classes_name, count_name = OUTPUTS
    nodes.one("Transpose", boxes, perm=[0, 2, 1], output=boxes_name)
    nodes.one("Squeeze", chosen_scores, squeeze, output=scores_name)
    nodes.one("Squeeze", chosen_labels, squeeze, output=classes_name)
    nodes.one("Cast", count, to=TensorProto.INT32, output=count_name)
