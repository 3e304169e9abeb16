"""Stage 1: put a loaded model in inference mode and prove that it is (the build runs it first, stages/sequence.py;
the PyTorch runner runs it on the model it loads, so it lives with the models, below both).

Exporting a model still in training mode is the most common silent failure of
this whole field: dropout stays active and BatchNorm normalises with the batch's
own statistics, so the exported graph answers differently from the trained one.
"""

from __future__ import annotations

import torch

from ..pipeline.core.errors import PipelineError
from ..pipeline.core.settings import mention_name
from .spec import ModelSpec, call_module, named_outputs

BATCH_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)


def prepare(spec: ModelSpec) -> dict:
    """Switch `spec.module` to eval mode with gradients off, then prove it; returns the stage record."""
    module = spec.module.eval()
    for parameter in module.parameters():  # not module.requires_grad_: ScriptModules refuse it
        parameter.requires_grad_(False)
    _refuse_training_modules(module)
    _refuse_double_precision(spec)
    _refuse_batch_statistics(module)
    first, second = _forward(spec, spec.example_inputs), _forward(spec, spec.example_inputs)
    _refuse_nondeterminism(first, second)
    _refuse_data_dependent_sizes(spec, first)
    _refuse_batch_dependence(spec, first)
    dropouts = sum(isinstance(m, torch.nn.modules.dropout._DropoutNd) for m in module.modules())
    batch_norms = sum(isinstance(m, BATCH_NORMS) for m in module.modules())
    return {
        "summary": f"eval mode proven ({dropouts} dropout inert, {batch_norms} BatchNorm on running stats)",
        "dropout_layers": dropouts,
        "batchnorm_layers": batch_norms,
        "parameters": sum(p.numel() for p in module.parameters()),
    }


def flatten_outputs(outputs: object) -> list[torch.Tensor]:
    """A model's outputs in export order: a tensor, tuples/lists and dicts (in key order), nested to any depth."""
    return [tensor for _, tensor in named_outputs(outputs)]  # models/spec.py names them


def _forward(spec: ModelSpec, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    with torch.inference_mode():
        return flatten_outputs(call_module(spec.module, inputs))


def _refuse_training_modules(module: torch.nn.Module) -> None:
    # A custom train()/eval() override can leave submodules in training mode.
    training = [name or "<root>" for name, m in module.named_modules() if m.training]
    if training:
        raise PipelineError(
            f"modules still in training mode after eval(): {', '.join(training[:5])}",
            "check any train()/eval() override in the model so that eval() reaches every submodule",
        )


def _refuse_double_precision(spec: ModelSpec) -> None:
    """The graphs start from float32: TensorRT has no float64, and the FP16 and INT8 steps convert float32 tensors, so
    a float64 model's "float16 graph" stayed float64 from end to end, said to be float16."""
    tensors = [*spec.module.named_parameters(), *spec.module.named_buffers(), *spec.example_inputs.items()]
    doubles = [name for name, tensor in tensors if tensor.dtype == torch.float64]
    if doubles:
        raise PipelineError(
            f"the model computes in float64 ({len(doubles)} float64 tensors: {', '.join(doubles[:4])}"
            f"{', ...' if len(doubles) > 4 else ''}); the graphs, their FP16 and INT8 forms and the engine start "
            "from float32",
            "give a float32 model and inputs: module.float() and float32 example inputs (a factory that sets "
            "torch.set_default_dtype(torch.float64) builds float64)",
        )


def _refuse_batch_statistics(module: torch.nn.Module) -> None:
    # Without running statistics BatchNorm uses each batch's own mean and variance
    # even in eval mode, so one sample's output depends on the rest of its batch.
    for name, m in module.named_modules():
        if isinstance(m, BATCH_NORMS) and (not m.track_running_stats or m.running_mean is None):
            raise PipelineError(
                f"BatchNorm layer {name!r} has no running statistics, so it normalises with each batch's own "
                "statistics and a sample's output depends on the rest of the batch",
                "train with track_running_stats=True (the default) and load the running_mean/running_var buffers",
            )


def _refuse_nondeterminism(first: list[torch.Tensor], second: list[torch.Tensor]) -> None:
    for index, (a, b) in enumerate(zip(first, second, strict=True)):
        if a.is_floating_point() and bool(a.isnan().any()):  # NaN != NaN: it would read as randomness below
            raise PipelineError(
                f"output {index} holds NaN for the example inputs, so nothing after it can be checked",
                "find the operation that makes NaN (a division by zero, log or sqrt of a negative, an overflow) "
                f"and fix it, or give example inputs it is defined for ({mention_name('input_shape')})",
            )
        if not torch.equal(a, b):
            raise PipelineError(
                f"output {index} changed between two identical calls in eval mode "
                f"(max difference {(a - b).abs().max().item():.3g})",
                "look for randomness in forward(), e.g. F.dropout(x, training=True) or torch.rand; "
                "use self.training to gate it",
            )


def _refuse_data_dependent_sizes(spec: ModelSpec, first: list[torch.Tensor]) -> None:
    """Every output's size must follow the inputs' sizes, not their values: a graph has one shape per output
    (x[x > 0.5], nonzero(), a detector's score filtering give a size only the values decide)."""
    try:
        other = _forward(spec, _other_values(spec.example_inputs))
    except (RuntimeError, ValueError, IndexError):
        return  # a model that takes only values like its examples (token ids, a range check): nothing to compare
    for index, (example, changed) in enumerate(zip(first, other, strict=True)):
        if example.shape != changed.shape:
            raise PipelineError(
                f"output {index} has a size that depends on the input values, not only on their sizes "
                f"({list(example.shape)} for the example inputs, {list(changed.shape)} for other values of the same "
                "shape), as x[x > 0.5], nonzero() or a detector's filtering make: an ONNX graph and an engine "
                "give each output one shape for given input sizes",
                "return fixed-size outputs (e.g. the top k with padding: scores.topk(k), with a mask or count of the "
                "ones past the threshold), or do the filtering outside the graph, on the served outputs",
            )


def _other_values(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The float inputs with other values of the same scale (seeded); integer and bool inputs (token ids,
    masks) as they are, since other values may be out of the model's range."""
    generator = torch.Generator().manual_seed(1)
    return {
        name: torch.randn(x.shape, generator=generator).to(x.dtype) * x.float().std().to(x.dtype) + x.mean()
        if x.is_floating_point() and x.numel() > 1
        else x
        for name, x in inputs.items()
    }


def _refuse_batch_dependence(spec: ModelSpec, batched: list[torch.Tensor]) -> None:
    """The first sample run alone must give the first row of the batched run."""
    single = {name: tensor[:1] for name, tensor in spec.example_inputs.items()}
    try:
        alone = _forward(spec, single)
    except RuntimeError as error:
        raise PipelineError(
            f"the model fails on a batch of 1 although it ran on a batch of "
            f"{next(iter(spec.example_inputs.values())).shape[0]}: {error}",
            "a batch size is probably baked into forward() (e.g. x.view(2, -1)); use x.flatten(1) or "
            "x.reshape(x.shape[0], -1)",
        ) from None
    for index, (row, whole) in enumerate(zip(alone, batched, strict=True)):
        if whole.dim() == 0 or row.shape[1:] != whole.shape[1:]:
            continue
        reference = whole[:1].double()
        scale = reference.abs().max().item() or 1.0
        if (row.double() - reference).abs().max().item() > 1e-4 * scale:
            raise PipelineError(
                f"output {index} for a sample depends on the other samples in its batch",
                "look for operations across the batch dimension in forward() (batch statistics, "
                "x.mean(0), sorting over the batch)",
            )
