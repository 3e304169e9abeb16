"""Stage 3: onnx.checker (full), shape inference, opset 17, and a batch axis that stayed symbolic."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ..core.errors import PipelineError
from ..core.sessions import crash_in_child, run_in_child
from ..core.settings import OPSET, mention_name
from ..evaluation import graph_session
from ..folder.graph_files import data_files, graph_beside, graph_without_weights
from ..folder.graph_io import graph_io, load_reference
from .einsum import lowercase_einsums
from .output_dims import name_output_dims

# Files this process checked, by what identifies their bytes (files_key), with the reference they ran on: the record.
_CHECKED: dict[tuple, dict] = {}


def check_onnx(onnx_path: Path, reference: Path | None = None) -> dict:
    """Validate the graph at `onnx_path`; returns its inputs and outputs (name, dtype, shape).

    With `reference` (reference.npz), the graph also runs on every case's inputs: each batch size and each
    declared dynamic axis at a second size, so a size baked in at export is caught here, naming the node.
    Every step reads the graph by its path or without its weights, so a graph past 2 GB (external data) is
    checked as one below it.  With `reference`, the output dims that follow from the inputs' dims are named after
    them first (stages/output_dims.py: the graph is rewritten where a name changes, and the record's
    "renamed_output_dims" says which); each Einsum's equation is written in lowercase letters (stages/einsum.py).
    Files this process checked already (the export checks the graph it keeps, and the check stage of the same run
    meets the same files) are not checked again: the weights are touched once.
    """
    key = _files(onnx_path, reference)
    if key not in _CHECKED:
        lowered = lowercase_einsums(Path(onnx_path))
        renamed = name_output_dims(Path(onnx_path), reference) if reference is not None else {}
        key = _files(onnx_path, reference)  # a rewritten equation or a renamed dim rewrote the graph
        _CHECKED[key] = _with_lowered(_with_renamed(_check(Path(onnx_path), reference), renamed), lowered)
        return dict(_CHECKED[key])  # a copy: the caller adds to its record
    earlier = _CHECKED[key]
    return {**earlier, "summary": earlier["summary"] + " (the same files, checked earlier in this run)"}


def _with_renamed(record: dict, renamed: dict[str, dict[int, str]]) -> dict:
    if not renamed:
        return record
    named = ", ".join(f"{output}[{axis}] = {name}" for output, axes in renamed.items() for axis, name in axes.items())
    return {
        **record,
        "summary": f"{record['summary']}; output dims named after the inputs': {named}",
        "renamed_output_dims": {
            output: {str(axis): name for axis, name in axes.items()} for output, axes in renamed.items()
        },
    }


def _with_lowered(record: dict, lowered: int) -> dict:
    if not lowered:
        return record
    return {**record, "summary": f"{record['summary']}; {lowered} Einsum equation(s) in lowercase letters"}


def _files(onnx_path: Path, reference: Path | None) -> tuple:
    return files_key([onnx_path, *data_files(onnx_path)]), files_key([reference]) if reference else None


def files_key(paths: list[Path]) -> tuple:
    """What identifies files' bytes without reading them: device, inode, size and modification time (a rename keeps
    them, any rewrite changes them)."""
    stats = [Path(path).stat() for path in paths]
    return tuple((stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns) for stat in stats)


def _check(onnx_path: Path, reference: Path | None) -> dict:
    model = graph_without_weights(onnx_path)
    try:
        # The checker reads the graph by path, its weights referenced where they lie: it checks that every reference
        # stays in the folder and within its file, and reads none of them (a graph of one file by its own path: 2.4 GB
        # and 1.3 s at 1.2 GB of weights).
        with graph_beside(model, onnx_path.parent) as referenced:
            onnx.checker.check_model(str(referenced), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as error:
        raise PipelineError(f"{onnx_path} is not a valid ONNX graph: {error}", "re-export the model") from None
    _require_opset(model)
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    _refuse_baked_batch(inferred)
    if reference is not None:
        _run_every_case(onnx_path, reference)
    io = graph_io(inferred)
    return {
        "summary": f"checker + shape inference passed, opset {OPSET}, batch axis symbolic",
        "inputs": [tensor.as_record() for tensor in io.inputs],
        "outputs": [tensor.as_record() for tensor in io.outputs],
        "nodes": len(model.graph.node),
    }


def _run_every_case(onnx_path: Path, reference: Path) -> None:
    """The graph must run at every size the reference holds; ONNX Runtime's refusal names the node.

    Here, before simplify, and not left to parity: onnxsim folds such a baked Reshape into a graph that runs
    at the other size with wrong shapes (measured on tests.helpers.toy_models:baked_sequence_model).

    The cases run in a forked child (pipeline/core/sessions.py): this is the first time ONNX Runtime runs the
    exported graph at every size, and a graph can crash it there (a Longformer's TorchScript graph, on the reference
    case of one row of 16 tokens with its random mask: SIGFPE, and the build died with no message).  A crash is then
    the exporter's failure, naming the inputs, and auto goes on to the other exporter.  Where the child neither
    crashed nor returned (a Python error, a hang), the cases run here, where an error is reported as always.
    """
    ran = run_in_child(_first_refusal, onnx_path, reference)
    if ran.crash is not None:
        raise _crashed(onnx_path, reference, ran.crash)
    refusal = ran.value if ran.returned else _first_refusal(onnx_path, reference)
    if refusal is not None:
        shapes, message = refusal
        raise PipelineError(
            f"{onnx_path.name} does not run with inputs {_sizes(shapes)}: a size was baked into the graph at export "
            f"(ONNX Runtime: {message})",
            "in forward() take sizes from the tensors (x.shape[1], x.reshape(x.shape[0], x.shape[1], -1)) "
            f"instead of literal numbers, or leave that axis out of {mention_name('dynamic')}",
        )


def _first_refusal(onnx_path: Path, reference: Path) -> tuple[dict[str, list[int]], str] | None:
    """The first case ONNX Runtime refuses to run (its inputs' shapes, the first line of why), None if it runs all."""
    session = graph_session(onnx_path)
    for inputs, _ in load_reference(reference):
        try:
            session.run(None, inputs)
        except Exception as error:  # ORT raises its own exception types (Fail, InvalidArgument, RuntimeException)
            message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            return _shapes(inputs), message
    return None


def _run_case(onnx_path: Path, inputs: dict) -> None:
    graph_session(onnx_path).run(None, inputs)


# What each signal a crash of ONNX Runtime's kernels ends in says, for the error.
CRASH_MEANS = {
    "SIGFPE": "an arithmetic fault, such as an integer division by zero",
    "SIGSEGV": "a memory fault",
    "SIGBUS": "a memory fault",
}


def _crashed(onnx_path: Path, reference: Path, crash: str) -> PipelineError:
    """The error for a graph whose cases crashed ONNX Runtime: each case is run alone in a child to name its inputs
    (only here, after a crash; they are left out where no case crashes alone)."""
    cases = [inputs for inputs, _ in load_reference(reference)]
    crashing = next((inputs for inputs in cases if crash_in_child(_run_case, onnx_path, inputs)), None)
    where = f" with the reference's inputs {_sizes(_shapes(crashing))}" if crashing is not None else ""
    return PipelineError(
        f"ONNX Runtime crashed ({crash}, {CRASH_MEANS.get(crash, 'a fault in its kernels')}) running "
        f"{onnx_path.name}{where}: the exported graph computes something there that it cannot run",
        f"export it with the other exporter ({mention_name('exporter')}): a traced graph keeps what its example "
        "computed, such as sizes or indices derived from the inputs' values, which other inputs break; or narrow "
        f"{mention_name('batch')} or the {mention_name('dynamic')} range to sizes it runs at; or try another "
        "onnxruntime version",
    )


def _shapes(inputs: dict[str, np.ndarray]) -> dict[str, list[int]]:
    return {name: list(value.shape) for name, value in inputs.items()}


def _sizes(shapes: dict[str, list[int]]) -> str:
    return ", ".join(f"{name} {shape}" for name, shape in shapes.items())


def _require_opset(model: onnx.ModelProto) -> None:
    default = [entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx")]
    if default != [OPSET]:
        raise PipelineError(f"the graph imports opset {default}, not {OPSET}", f"export with opset_version={OPSET}")


def _refuse_baked_batch(model: onnx.ModelProto) -> None:
    """Every graph input and output must keep a symbolic dim 0.

    The classic failure is a batch size baked into a Reshape (x.view(2, -1) traced to a
    constant shape): the graph then runs at the export batch only.  Name that node.
    """
    for value in [*model.graph.input, *model.graph.output]:
        dims = value.type.tensor_type.shape.dim
        if dims and not dims[0].HasField("dim_param"):
            culprit = _baked_reshape(model)
            where = f" by Reshape node {culprit[0]!r} with the constant shape {culprit[1]}" if culprit else ""
            raise PipelineError(
                f"{value.name!r} has the fixed batch dimension {dims[0].dim_value}: the batch size was baked "
                f"into the graph{where}",
                "in forward() use x.flatten(1) or x.reshape(x.shape[0], -1) instead of a literal batch size",
            )


def _baked_reshape(model: onnx.ModelProto) -> tuple[str, list[int]] | None:
    """A Reshape whose target shape is a constant with a positive leading dim, fed a symbolic batch."""
    constants = {init.name: init for init in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            constants[node.output[0]] = node.attribute[0].t
    symbolic = {
        v.name
        for v in [*model.graph.input, *model.graph.value_info]
        if v.type.tensor_type.shape.dim and v.type.tensor_type.shape.dim[0].HasField("dim_param")
    }
    for node in model.graph.node:
        if node.op_type != "Reshape" or node.input[1] not in constants:
            continue
        shape = numpy_helper.to_array(constants[node.input[1]]).tolist()  # a shape: small, so never left out
        if node.input[0] in symbolic and shape and shape[0] > 0:
            return node.name or node.output[0], shape
    return None
