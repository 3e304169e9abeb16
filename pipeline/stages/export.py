"""Stage 2: a prepared PyTorch model -> model.onnx (opset 17, dynamic batch) and reference.npz.

reference.npz holds inputs at several batch sizes and PyTorch's outputs on them,
so the parity stages (FP32, FP16, INT8) compare against PyTorch from what is on
disk, without loading the model again.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from ...models.prepare import flatten_outputs
from ...models.spec import ModelSpec, call_module, first_line, named_outputs, needs_keywords
from ..core.errors import PipelineError
from ..core.mentions import render
from ..core.random_inputs import end_token, integer_range, random_inputs
from ..core.settings import OPSET, BatchProfile, mention, mention_name
from ..folder.artifacts import write_npz
from ..folder.graph_files import atomic_graph, gather_weights
from .check import check_onnx
from .opset17 import SOURCE as DYNAMO_OPSET
from .opset17 import convert_to_opset_17

BATCH_AXIS = "batch"
SUGGESTED_MAX_SEQUENCE = 512  # the longest sequence a suggested DYNAMIC range covers (BERT's)


def output_names(spec: ModelSpec) -> list[str]:
    """Declared names, else each tensor's path in what forward() returns (models.spec.named_outputs)."""
    with torch.inference_mode():
        outputs = named_outputs(call_module(spec.module, spec.example_inputs))
    if spec.output_names is None:
        return [name for name, _ in outputs]
    names = list(spec.output_names)
    if len(names) != len(outputs):
        raise PipelineError(
            f"the model returns {len(outputs)} tensors ({', '.join(name for name, _ in outputs)}) but "
            f"{len(names)} output names are declared: {names}",
            "declare one name per returned tensor in ModelSpec.output_names, or none: each is then named by its "
            "place in what forward() returns",
        )
    return names


def dynamic_axes(spec: ModelSpec, outputs: list[str]) -> dict[str, dict[int, str]]:
    """Axis 0 of every input and output is the batch; declared extra axes keep their names."""
    axes: dict[str, dict[int, str]] = {name: {0: BATCH_AXIS} for name in [*spec.example_inputs, *outputs]}
    for tensor, declared in spec.dynamic_axes.items():
        if tensor not in axes:
            raise PipelineError(
                f"a dynamic axis is declared on {tensor!r}, which is neither an input nor an output",
                f"use one of {', '.join(axes)}",
            )
        axes[tensor].update({axis: d.name for axis, d in declared.items()})
    return axes


@contextlib.contextmanager
def _attention_fast_path_off() -> Iterator[None]:
    """nn.TransformerEncoder / MultiheadAttention in eval mode take a fused "fast path"
    (aten::_transformer_encoder_layer_fwd, nested tensors for padding masks) that no ONNX opset has; the
    plain path computes the same.  Off while exporting, restored after (torch.backends.mha)."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


@contextlib.contextmanager
def eager_attention(module: torch.nn.Module) -> Iterator[None]:
    """transformers models run and export their eager attention (MatMul, scale, mask Add, Softmax, MatMul), the
    pattern ONNX Runtime's transformer fusions recognize; transformers 5's default SDPA exports decomposed, with a
    NaN guard after the Softmax, and no attention of a DistilBERT folder was fused (ONNX Runtime 1.32's BERT
    optimizer: Attention 0 against 6 from the eager export).  The reference is computed in it too, so the gates
    judge the graph against what it computes: the same as SDPA's but on a row with every token masked (SDPA
    gives zeros there, eager attention the keys' mean).  Each model's own choice is restored after."""
    transformers = sys.modules.get("transformers")  # a model made with transformers has imported it
    models = [m for m in module.modules() if transformers and isinstance(m, transformers.PreTrainedModel)]
    before = [(model, model.config._attn_implementation) for model in models]
    try:
        for model, chosen in before:
            if chosen != "eager":
                model.set_attn_implementation("eager")
        yield
    finally:
        for model, chosen in reversed(before):
            if model.config._attn_implementation != chosen:
                model.set_attn_implementation(chosen)


def static_token_sequences(spec: ModelSpec) -> str | None:
    """A warning when integer [batch, sequence] inputs (token ids, masks) keep the example's length: the engine
    would then take that length only.  None when there are none, or their axis 1 is dynamic."""
    static = {
        name: int(tensor.shape[1])
        for name, tensor in spec.example_inputs.items()
        if tensor.dim() == 2 and not tensor.is_floating_point() and 1 not in spec.dynamic_axes.get(name, {})
    }
    if not static:
        return None
    suggestion = ",".join(f"{name}:1=1:{size}:{max(size, SUGGESTED_MAX_SEQUENCE)}" for name, size in static.items())
    inputs = ", ".join(f"{name} ({size})" for name, size in static.items())
    return render(  # printed and recorded as it is: worded here
        f"integer token input(s) {inputs} have a static sequence axis fixed by the example: the engine takes "
        f"only that length; {mention(dynamic=suggestion)} makes it dynamic"
    )


def export_onnx(spec: ModelSpec, onnx_path: Path, reference: Path | None = None, exporter: str = "auto") -> dict:
    """Export at opset 17 with the exporter asked for (auto: TorchScript, then dynamo where TorchScript's graph
    fails the checks; dynamo first past DYNAMO_FIRST_BYTES of weights) and keep the first graph that passes
    check_onnx, run on every case of `reference` (reference.npz) when given; returns the stage record, which names
    the exporter and why an earlier one was passed over."""
    warning = static_token_sequences(spec)
    if warning:
        print(f"warning: {warning}", flush=True)
    outputs = output_names(spec)
    axes = dynamic_axes(spec, outputs)
    failures: dict[str, PipelineError] = {}
    chosen: str | None = None
    with atomic_graph(onnx_path) as candidate:
        for name in exporters_to_try(spec, exporter):
            try:
                _export_checked(name, spec, outputs, axes, candidate, reference)
            except PipelineError as failure:
                failures[name] = failure
                continue
            chosen = name
            break
        if chosen is None:
            raise _no_exporter_passed(spec, failures)
    for other, passed_over in failures.items():
        print(f"note: {other} exporter passed over: {passed_over.problem}", flush=True)
    return {
        "summary": f"{onnx_path.name}: {chosen} exporter, opset {OPSET}, inputs {list(spec.example_inputs)}, "
        f"outputs {outputs}",
        "exporter": chosen,
        "passed_over": {other: f"{error.problem} ({error.fix})" for other, error in failures.items()},
        "inputs": list(spec.example_inputs),
        "outputs": outputs,
        "dynamic_axes": {name: {str(k): v for k, v in a.items()} for name, a in axes.items()},
        "opset": OPSET,
        "warnings": [warning] if warning else [],
    }


def release_module(spec: ModelSpec) -> None:
    """Let go of the PyTorch model once model.onnx and reference.npz hold all that later stages read, so that its
    weights are freed unless the caller keeps the module; the spec keeps its names and preprocessing.  Collected
    now: the exporters leave the module in reference cycles, which the collector's next pass might reach only
    stages later (measured: 0.6 GB of weights held after export until gc.collect())."""
    spec.module = torch.nn.Module()
    gc.collect()


def _export_checked(
    exporter: str,
    spec: ModelSpec,
    outputs: list[str],
    axes: dict[str, dict[int, str]],
    candidate: Path,
    reference: Path | None,
) -> None:
    """One exporter's graph at `candidate` (in a private folder, under the final file name so that the checks'
    messages name model.onnx), its weights stored as graph_files says, checked at every reference case."""
    for earlier in candidate.parent.iterdir():  # what an exporter passed over left
        earlier.unlink()
    with warnings.catch_warnings(), _attention_fast_path_off(), eager_attention(spec.module):
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            EXPORT[exporter](spec, candidate, outputs, axes)
        except (OSError, PipelineError):
            raise  # the disk said no (the command line reports it as such), or a message already made
        except Exception as error:  # the exporters raise many types; all mean "this model did not export"
            raise PipelineError(
                f"torch.onnx.export ({exporter}) failed for {spec.name}: {type(error).__name__}: {first_line(error)}",
                "make forward() traceable (no data-dependent Python control flow), or export it yourself "
                f"(opset 17, dim 0 named as the batch) and pass the file: {mention(model='path/to/model.onnx')}",
            ) from error
    gather_weights(candidate)  # past 2 GB TorchScript writes a file per tensor: one data file instead
    check_onnx(candidate, reference)


def _torchscript(spec: ModelSpec, path: Path, outputs: list[str], axes: dict[str, dict[int, str]]) -> None:
    """The TorchScript-based exporter, which targets opset 17 natively (deprecated in torch 2.9, not removed)."""
    by_name = needs_keywords(spec.module, spec.example_inputs)  # see needs_keywords
    torch.onnx.export(
        spec.module,
        () if by_name else tuple(spec.example_inputs.values()),
        str(path),
        kwargs=dict(spec.example_inputs) if by_name else None,
        input_names=list(spec.example_inputs),
        output_names=outputs,
        dynamic_axes=axes,
        opset_version=OPSET,
        do_constant_folding=True,
        dynamo=False,
    )


def _dynamo(spec: ModelSpec, path: Path, outputs: list[str], axes: dict[str, dict[int, str]]) -> None:
    """The torch.export-based exporter, from the same declaration as dynamic_shapes.  It traces sizes as
    symbols where TorchScript records a traced size as a constant (MultiheadAttention's Reshape).  It implements
    opset 18 and up; opset17.py writes its graph in 17 (torch's own fallback, onnx's version converter, fails on
    Pad and Split)."""
    try:
        import onnxscript  # noqa: F401  (torch.onnx's dynamo exporter is built on it)
    except ImportError as error:
        raise PipelineError(
            "the dynamo exporter needs onnxscript, which is not installed",
            f"pip install 'trt_pipeline[build]' (or onnxscript), or {mention(exporter='torchscript')}",
        ) from error
    by_name = needs_keywords(spec.module, spec.example_inputs)
    shapes, examples = _dynamic_shapes(spec, axes), _examples_past_one(spec, axes)
    with _quiet_loggers("torch.onnx", "onnxscript"), warnings.catch_warnings():
        # They warn of torchvision's ops being absent, and of deprecations that are torch's own.
        warnings.simplefilter("ignore", FutureWarning)
        program = torch.onnx.export(
            spec.module,
            () if by_name else tuple(examples.values()),
            str(path),
            kwargs=examples if by_name else None,
            input_names=list(spec.example_inputs),
            output_names=outputs,
            dynamic_shapes=shapes if by_name else _positional(spec.module, tuple(shapes.values())),
            opset_version=DYNAMO_OPSET,
            dynamo=True,
            external_data=True,  # model.onnx.data, which gather_weights brings back in below 2 GB
            verbose=False,
        )
    _let_go_of_weights(program)
    graph = onnx.load(str(path), load_external_data=False)  # the nodes change, the weights stay where they are
    onnx.save(convert_to_opset_17(graph, base_dir=path.parent), str(path))


def _examples_past_one(spec: ModelSpec, axes: dict[str, dict[int, str]]) -> dict[str, Any]:
    """The example inputs torch.export traces, each dynamic axis of size 1 repeated to 2 where its range allows:
    torch.export specializes a dimension whose example is 1, so a model handed over with one row (a language
    model's usual example) had its batch of 1 baked into the graph."""
    highs = {d.name: d.max for declared in spec.dynamic_axes.values() for d in declared.values()}
    examples = {}
    for tensor, value in spec.example_inputs.items():
        for axis, name in axes[tensor].items():
            if isinstance(value, torch.Tensor) and value.shape[axis] == 1 and highs.get(name, 2) >= 2:
                value = torch.cat([value, value], dim=axis)
        examples[tensor] = value
    return examples


def _positional(module: torch.nn.Module, shapes: tuple) -> tuple:
    """The inputs' dynamic shapes for a call by position: torch.export matches them to forward()'s parameters, and
    a forward(*inputs) (models.huggingface.HuggingFaceModule) takes all of them as its one parameter."""
    forward = inspect.signature(module.forward).parameters.values()
    return (shapes,) if [p.kind for p in forward] == [inspect.Parameter.VAR_POSITIONAL] else shapes


def _let_go_of_weights(program) -> None:
    """Drop the exported graph's references to the model's tensors.  onnxscript's rewrite rules keep the last graph
    they matched (onnxscript 0.7: a module-level rule's SimplePatternMatcher._graph), and with it every weight of
    the model, wrapped: the model's memory would outlive release_module by the rest of the build (measured: 1.2 GB
    held through every later stage of the 1.2 GB MLP)."""
    if program is None or getattr(program, "model", None) is None:
        return
    for value in program.model.graph.initializers.values():
        value.const_value = None
    program.exported_program = None


@contextlib.contextmanager
def _quiet_loggers(*names: str) -> Iterator[None]:
    """These loggers at ERROR for the block, their levels restored after."""
    loggers = [logging.getLogger(name) for name in names]
    before = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, before, strict=True):
            logger.setLevel(level)


def _dynamic_shapes(spec: ModelSpec, axes: dict[str, dict[int, str]]) -> dict[str, dict[int, torch.export.Dim]]:
    """torch.export's Dims of the inputs' dynamic axes: one Dim per axis name, so inputs that share an axis
    share it; a declared axis keeps its range (the batch's is the engine profile's business)."""
    ranges = {d.name: (d.min, d.max) for declared in spec.dynamic_axes.values() for d in declared.values()}
    dims: dict[str, torch.export.Dim] = {}
    for name in {axis for tensor in spec.example_inputs for axis in axes[tensor].values()}:
        low, high = ranges.get(name, (1, None))
        dims[name] = torch.export.Dim(name, min=low, max=high) if high else torch.export.Dim(name, min=low)
    return {tensor: {axis: dims[name] for axis, name in axes[tensor].items()} for tensor in spec.example_inputs}


EXPORT = {"torchscript": _torchscript, "dynamo": _dynamo}
EXPORTERS = tuple(EXPORT)  # in the order auto tries them
# Past this many bytes of weights auto tries dynamo first.  TorchScript's exporter builds and serializes the whole
# graph in memory, about three copies of the weights besides the model's own (its export stage peaked at 5.1 GB for
# 1.2 GB of weights, and would need ~21 GB at 5 GB); dynamo writes each weight from the model's tensor to the data
# file (2.9 GB there, the check's mapped session included; 9.1 s against 9.5 s: docs/benchmarks/scale.md).  Below
# it TorchScript stays first: the graphs the coverage set and the INT8 measurements were made with.
DYNAMO_FIRST_BYTES = 1 << 30


def exporters_to_try(spec: ModelSpec, exporter: str) -> tuple[str, ...]:
    """The exporters `exporter` names, in the order they are tried (auto: both, see DYNAMO_FIRST_BYTES)."""
    if exporter != "auto":
        return (exporter,)
    return tuple(reversed(EXPORTERS)) if module_bytes(spec.module) > DYNAMO_FIRST_BYTES else EXPORTERS


def module_bytes(module: torch.nn.Module) -> int:
    """The bytes of a module's parameters and buffers (each tensor once, shared ones too)."""
    tensors = {id(tensor): tensor for tensor in [*module.parameters(), *module.buffers()]}
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())


def _no_exporter_passed(spec: ModelSpec, failures: dict[str, PipelineError]) -> PipelineError:
    """One error for every exporter tried: each one's failure and fix, and the way round both that is always the
    user's (a size baked inside a library's layer is not theirs to change in forward())."""
    if len(failures) == 1:
        return next(iter(failures.values()))
    problems = "; ".join(f"{name}: {error.problem}" for name, error in failures.items())
    fixes = dict.fromkeys(error.fix for error in failures.values() if error.fix)  # the same check's fix once
    return PipelineError(
        f"no exporter made a graph of {spec.name} that passes the checks ({problems})",
        "; or ".join(fixes) + "; or export the graph yourself (opset 17, dim 0 named as the batch) and pass it: "
        f"{mention(model='path/to/model.onnx')}",
    )


def parity_batches(batch: BatchProfile) -> list[int]:
    """At least three batch sizes, always 1 and the profile's max, so a baked batch cannot hide."""
    sizes = sorted({1, batch.min, batch.opt, batch.max})
    extra = 2
    while len(sizes) < 3:
        sizes = sorted({*sizes, extra})
        extra += 1
    return sizes


def sample_inputs(spec: ModelSpec, batch: int, seed: int, axis_sizes: dict[str, int] | None = None) -> dict:
    """Random tensors shaped like the examples at `batch`; integer inputs stay in the examples' value range, and end
    each row with the token the examples' rows end with, where they show one (random_inputs.end_token)."""
    records: list[dict] = []
    sizes: dict[str, int] = {}
    int_ranges: dict[str, tuple[int, int]] = {}
    end_tokens: dict[str, int] = {}
    for name, example in spec.example_inputs.items():
        dims: list[int | str] = list(example.shape)
        for axis, declared in spec.dynamic_axes.get(name, {}).items():
            dims[axis] = declared.name
            sizes.setdefault(declared.name, int(example.shape[axis]))
        records.append({"name": name, "dtype": torch.empty(0, dtype=example.dtype).numpy().dtype, "shape": dims})
        if not example.is_floating_point():
            values = example.numpy()
            end = end_token([values]) if values.dtype.kind in "iu" else None
            if end is not None:
                end_tokens[name] = end
            int_ranges[name] = integer_range([values], end)
    all_sizes = {**sizes, **(axis_sizes or {})}
    arrays = random_inputs(records, batch, seed, axis_sizes=all_sizes, int_ranges=int_ranges, end_tokens=end_tokens)
    return {name: torch.from_numpy(array) for name, array in arrays.items()}


def reference_cases(spec: ModelSpec, batch: BatchProfile) -> list[tuple[int, dict[str, int]]]:
    """(batch, extra-axis sizes) cases: the parity batches, plus each extra axis at its max and at its min.  The
    min too: DYNAMIC=input:1 on a convolution's channels (range 1:3:3, the example's 3 its max) was never run at
    another size, so the folder advertised a range the Conv cannot take and failed at run time."""
    declared = [d for axes in spec.dynamic_axes.values() for d in axes.values()]
    highs, lows = {d.name: d.max for d in declared}, {d.name: d.min for d in declared}
    return [(b, {}) for b in parity_batches(batch)] + range_end_cases(highs, lows)


def range_end_cases(highs: dict[str, int], lows: dict[str, int]) -> list[tuple[int, dict[str, int]]]:
    """Batch 2 with every declared axis at the top of its range, then at the bottom (where that differs): a size
    baked in at export, or an axis the model fixes, fails at one end or the other.  [] where no axis is declared."""
    return [(2, sizes) for sizes in ([highs] if highs == lows else [highs, lows]) if sizes]


def write_reference(spec: ModelSpec, batch: BatchProfile, path: Path) -> dict:
    """Run PyTorch on sample inputs for every case and store inputs and outputs in one .npz."""
    outputs = output_names(spec)
    arrays: dict[str, np.ndarray] = {}
    with eager_attention(spec.module):  # as exported
        for index, (size, axis_sizes) in enumerate(reference_cases(spec, batch)):
            feed = sample_inputs(spec, size, seed=index, axis_sizes=axis_sizes)
            result = _reference_outputs(spec, feed, axis_sizes)
            arrays.update({f"case{index}/in/{name}": t.numpy() for name, t in feed.items()})
            arrays.update({f"case{index}/out/{name}": t.numpy() for name, t in zip(outputs, result, strict=True)})
    write_npz(path, arrays)
    return {"summary": f"{path.name}: PyTorch outputs at batch sizes {parity_batches(batch)}"}


def _reference_outputs(
    spec: ModelSpec, feed: dict[str, torch.Tensor], axis_sizes: dict[str, int]
) -> list[torch.Tensor]:
    """PyTorch's outputs on one case (`axis_sizes`: the declared axes it sets); a model that cannot run at a size its
    profile declares is the user's to fix."""
    try:
        with torch.inference_mode():
            return flatten_outputs(call_module(spec.module, feed))
    except (RuntimeError, ValueError, IndexError) as error:
        if axis_sizes:
            raise _fixed_axis(spec, feed, axis_sizes, error) from None
        raise refused_sizes(
            spec.name,
            "PyTorch",
            feed,
            error,
            f"narrow {mention_name('batch')} or the {mention_name('dynamic')} range to sizes the model takes, or "
            "make forward() take those sizes",
        ) from None


def _fixed_axis(
    spec: ModelSpec, feed: dict[str, torch.Tensor], axis_sizes: dict[str, int], error: Exception
) -> PipelineError:
    """The model refused a declared dynamic axis at a size of its range (batch 2 ran): it fixes that axis (a
    convolution's channels, a Linear's features), which a dynamic range cannot change."""
    declared = [
        f"{name}:{axis} ({axis_range.min}:{axis_range.opt}:{axis_range.max}, run at {axis_sizes[axis_range.name]})"
        for name, axes in spec.dynamic_axes.items()
        for axis, axis_range in axes.items()
        if axis_range.name in axis_sizes
    ]
    fix = (
        f"the model fixes an axis declared dynamic, {' or '.join(declared)}: leave it out of "
        f"{mention_name('dynamic')} ({mention(dynamic='none')} for no axis besides the batch), or give it a range "
        "of sizes forward() takes"
    )
    alike = _undeclared_alike(spec)
    if alike:  # most likely a sequence shared by token inputs, one of them left out
        fix = f"declare the range on {', '.join(alike)} too, where the inputs of one length share it; or {fix}"
    return refused_sizes(spec.name, "PyTorch", feed, error, fix)


def _undeclared_alike(spec: ModelSpec) -> list[str]:
    """NAME:AXIS=MIN:OPT:MAX for each axis no range is declared on whose example size is that of a declared axis at
    the same place (token_type_ids beside input_ids and attention_mask), with that axis's range."""
    declared = {
        (axis, int(spec.example_inputs[name].shape[axis])): span
        for name, axes in spec.dynamic_axes.items()
        for axis, span in axes.items()
    }
    alike = []
    for name, example in spec.example_inputs.items():
        for axis in range(1, example.dim()):
            span = declared.get((axis, int(example.shape[axis])))
            if span is not None and axis not in spec.dynamic_axes.get(name, {}):
                alike.append(f"{name}:{axis}={span.min}:{span.opt}:{span.max}")
    return alike


def refused_sizes(subject: str, runtime: str, feed: dict, error: Exception, fix: str) -> PipelineError:
    """`subject` cannot run in `runtime` at sizes its profile declares: the sizes, the first line of why, the fix."""
    sizes = ", ".join(f"{name} {list(value.shape)}" for name, value in feed.items())
    why = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return PipelineError(
        f"{subject} does not run in {runtime} with inputs {sizes}, sizes the profile declares "
        f"({mention_name('batch')} / {mention_name('dynamic')}): "
        f"{type(error).__name__}: {why}",
        fix,
    )
