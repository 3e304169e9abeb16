"""Output dims named after the input dims they follow (part of the check stage, where a reference is given).

An exporter names an output dim it cannot tie to a declared axis after the node that makes it: TorchScript writes
DistilBERT's `last_hidden_state` as [batch, LayerNormalizationlast_hidden_state_dim_1, 768], though that dim is the
input's `sequence`.  The manifest then records a dim no input names, which a runner must treat as data-dependent.

ONNX Runtime's symbolic shape inference (onnxruntime.tools.symbolic_shape_infer) carries the inputs' dim names
through the graph as sympy expressions; onnx's own shape inference, even with data propagation, names such a dim
`unk__N` (measured on a tiny DistilBERT from TorchScript and from dynamo, and on a Conv/Concat toy).  Each output
dim that is not fixed and not already an input's dim takes the inferred name where it is
  - an input's dim ("sequence"), or
  - an expression over the inputs' dims as sympy writes it ("2*sequence", a strided convolution's
    "floor(height/2 - 1/2) + 1"): it says what the size is, where an exporter's name said only where it came from,
and where it holds on every case of the reference (the outputs' real sizes at each batch and axis size).  The
inference merges dims a broadcast requires equal ("auto_merge": DistilBERT's position slice, Min(64, sequence),
becomes `sequence`); checking each name on the reference keeps a wrong merge out.  Any other dim keeps the name it
has: a size only the data decides (NonZero's count) stays data-dependent, as does a dim the inference cannot follow.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from ..folder.graph_files import atomic_graph, graph_without_weights, write_graph
from ..folder.graph_io import Dim, dim_size, graph_io, load_reference

# Integer initializers that symbolic shape inference may compute sizes from (shape and index tables) are read
# in up to this size; larger ones and every float weight stay where they lie.
INDEX_TENSOR_BYTES = 1 << 20
_INTEGER_TYPES = {onnx.TensorProto.INT64, onnx.TensorProto.INT32}

# (the size of each named input dim, each output's shape) in one reference case
Case = tuple[dict[str, int], dict[str, tuple[int, ...]]]


def name_output_dims(onnx_path: Path, reference: Path) -> dict[str, dict[int, str]]:
    """Rename the output dims of the graph at `onnx_path` that follow from its inputs' dims (module doc), rewriting
    the graph only where a name changes; returns {output: {axis: new name}}."""
    model = graph_without_weights(onnx_path)
    inferred = _inferred_outputs(model, onnx_path.parent)
    cases = _cases(model, reference)
    named = {dim for tensor in graph_io(model).inputs for dim in tensor.shape if isinstance(dim, str)}
    renamed: dict[str, dict[int, str]] = {}
    for output in model.graph.output:
        for axis, dim in enumerate(output.type.tensor_type.shape.dim):
            if dim.HasField("dim_value") or dim.dim_param in named:
                continue
            name = _at(inferred.get(output.name, ()), axis)
            if isinstance(name, str) and cases and all(_holds(name, output.name, axis, case) for case in cases):
                dim.dim_param = name
                renamed.setdefault(output.name, {})[axis] = name
    if renamed:
        with atomic_graph(onnx_path) as temporary:
            write_graph(model, onnx_path.parent, temporary)
    return renamed


def _inferred_outputs(model: onnx.ModelProto, folder: Path) -> dict[str, tuple[Dim, ...]]:
    """Each output's dims as symbolic shape inference derives them from the inputs, the graph's own output shapes
    and value_info left out (the inference keeps a declared name over the one it derives); {} where it fails."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    bare = onnx.ModelProto()
    bare.CopyFrom(model)  # no weights: graph_without_weights left them where they lie
    _values_for_inference(bare, folder)
    for output in bare.graph.output:
        output.type.tensor_type.ClearField("shape")
    del bare.graph.value_info[:]
    # SymbolicShapeInference.infer_shapes's own loop, less its ending: where some shape stays unknown it saves the
    # graph as sym_shape_infer_temp.onnx, with a data file, in the working directory, and raises (onnxruntime
    # 1.32).  The outputs it did infer are what is wanted here, and nothing is written.
    inference = SymbolicShapeInference(int_max=2**31 - 1, auto_merge=True, guess_output_rank=False, verbose=0)
    try:
        inference._preprocess(bare)
        while inference.run_:
            inference._infer_impl()
        inference._update_output_from_vi()
    except Exception:  # an op it has no rule for, a custom domain: the graph's own names stay
        return {}
    return {tensor.name: tensor.shape for tensor in graph_io(inference.out_mp_).outputs}


def _values_for_inference(model: onnx.ModelProto, folder: Path) -> None:
    """The initializers graph_without_weights left where they lie, as the inference needs them: integer ones up to
    INDEX_TENSOR_BYTES read in (it computes sizes from their values: shape and index tables, such as position ids
    sliced to the sequence), every other one an input of its shape.  The inference reads any initializer an Add or
    Mul touches (DistilBERT's 12 KiB feed-forward bias stopped it), and one not in the graph from the working
    directory, which fails."""
    from onnx.external_data_helper import ExternalDataInfo, load_external_data_for_tensor, uses_external_data

    kept = []
    for tensor in model.graph.initializer:
        if not uses_external_data(tensor):
            kept.append(tensor)
        elif tensor.data_type in _INTEGER_TYPES and (ExternalDataInfo(tensor).length or 0) <= INDEX_TENSOR_BYTES:
            load_external_data_for_tensor(tensor, str(folder))
            kept.append(tensor)
        else:
            model.graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims))
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)


def _at(dims: tuple[Dim, ...], axis: int) -> Dim:
    return dims[axis] if axis < len(dims) else None


def _cases(model: onnx.ModelProto, reference: Path) -> list[Case]:
    """The named input dims' sizes and the outputs' shapes of every reference case."""
    io = graph_io(model)
    cases: list[Case] = []
    for inputs, outputs in load_reference(reference):
        sizes = {
            dim: int(np.shape(inputs[tensor.name])[axis])
            for tensor in io.inputs
            if tensor.name in inputs
            for axis, dim in enumerate(tensor.shape)
            if isinstance(dim, str)
        }
        cases.append((sizes, {name: tuple(np.shape(value)) for name, value in outputs.items()}))
    return cases


def _holds(name: str, output: str, axis: int, case: Case) -> bool:
    sizes, shapes = case
    shape = shapes.get(output)
    return shape is not None and axis < len(shape) and dim_size(name, sizes) == shape[axis]
