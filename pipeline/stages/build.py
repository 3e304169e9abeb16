"""Build stage: an ONNX file becomes a serialized TensorRT engine (`engine.plan`).

One code path serves TensorRT 10.x, 11.x and TensorRT-RTX: the network is strongly typed, so
precision comes from the ONNX graph (fp32, fp16 with float32 I/O, or Q/DQ int8) and no builder
precision flag is set (BuilderFlag.FP16/INT8 are removed in TensorRT 11).
"""

from __future__ import annotations

import time
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..core import trt_module
from ..core.errors import PipelineError
from ..core.settings import BatchProfile, mention, mention_name
from ..folder.artifacts import write_bytes
from ..folder.graph_files import data_files
from ..folder.graph_io import graph_io

if TYPE_CHECKING:
    import tensorrt

AxisRange = tuple[int, int, int]
Shape = tuple[int, ...]


def build_engine(
    onnx_path: Path,
    engine_path: Path,
    *,
    batch: BatchProfile,
    axis_ranges: dict[str, AxisRange] | None = None,
    workspace_mib: int = 4096,
    builder: str = "auto",
    target: str = "default",
    timing_cache: Path | None = None,
) -> dict:
    """Build `engine_path` from `onnx_path`; return a JSON-ready record for the manifest.

    `batch` gives dim 0 of every input its min/opt/max; every other dynamic dim is looked up by
    its ONNX dim_param name in `axis_ranges` (e.g. {"height": (224, 384, 512)}).  `target` is the
    GPUs a TensorRT-RTX engine is built for (pipeline.core.settings.TARGETS).
    """
    started = time.perf_counter()
    onnx_path, engine_path = Path(onnx_path), Path(engine_path)
    _check_arguments(onnx_path, batch, axis_ranges or {}, workspace_mib)
    trt = trt_module.import_trt(builder)
    config, record, plan = _build_plan(trt, onnx_path, batch, axis_ranges or {}, workspace_mib, target, timing_cache)
    write_bytes(engine_path, memoryview(plan))  # IHostMemory exposes the buffer protocol: written, not copied
    record["timing_cache"] = _save_timing_cache(config, timing_cache, record["timing_cache"])
    return {**record, "engine_bytes": plan.nbytes, "build_seconds": round(time.perf_counter() - started, 3)}


def _build_plan(
    trt: ModuleType,
    onnx_path: Path,
    batch: BatchProfile,
    axis_ranges: dict[str, AxisRange],
    workspace_mib: int,
    target: str,
    timing_cache: Path | None,
) -> tuple[tensorrt.IBuilderConfig, dict, tensorrt.IHostMemory]:
    """The config, the record and the serialized engine.  The network and the parser, which holds the weights it
    imported, live until the engine is built (TensorRT's samples keep the parser alive for the same reason), and
    no longer: they are freed on return, before the plan is written."""
    logger = trt_module.RecordingLogger.for_module(trt)
    trt_builder: tensorrt.Builder = trt.Builder(logger.trt_logger)
    network, _parser = _parse_onnx(trt, trt_builder, logger, onnx_path)
    config: tensorrt.IBuilderConfig = trt_builder.create_builder_config()
    # The workspace pool caps the scratch memory a tactic may use; TensorRT 10+ replaced
    # max_workspace_size with memory-pool limits.
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_mib << 20)
    _set_targets(trt, config, target)
    profile_shapes = _profile_shapes(network, _onnx_input_dims(onnx_path), batch, axis_ranges)
    _add_profile(trt_builder, config, profile_shapes)
    cache_record = _attach_timing_cache(trt, config, timing_cache)
    plan = _build(trt_builder, network, config, logger, onnx_path)
    record = {
        "builder": trt_module.module_record(trt),
        "target": trt_module.describe_target(trt, config),
        "profile": {name: _shapes_record(shapes) for name, shapes in profile_shapes.items()},
        "io": _io_record(network),
        "workspace_mib": workspace_mib,
        "timing_cache": cache_record,
    }
    return config, record, plan


# --------------------------------------------------------------------------- checks and parsing


def _check_arguments(
    onnx_path: Path, batch: BatchProfile, axis_ranges: dict[str, AxisRange], workspace_mib: int
) -> None:
    batch.check()
    if not onnx_path.is_file():
        raise PipelineError(f"ONNX file {onnx_path} does not exist", "run the export stage first, or give its path")
    if workspace_mib < 16:
        raise PipelineError(f"workspace of {workspace_mib} MiB is too small", "give at least 16 MiB")
    for name, bounds in axis_ranges.items():
        if len(bounds) != 3 or not 0 <= bounds[0] <= bounds[1] <= bounds[2]:
            raise PipelineError(
                f"range {bounds!r} for dynamic axis {name!r} is not (min, opt, max) with 0 <= min <= opt <= max",
                f"give e.g. axis_ranges={{{name!r}: (224, 224, 512)}}",
            )


def _network_flags(trt: ModuleType) -> int:
    """The creation flags for a strongly typed network.

    TensorRT 10.x needs STRONGLY_TYPED set, or it builds a weakly typed network.  TensorRT 11 and
    TensorRT-RTX are strongly typed only and accept the flag but ignore it (RTX's enum has it as
    its only member, value 0; TensorRT 10 has it at 1 after the ignored EXPLICIT_BATCH).  Taking
    the bit position from the module's own enum serves all three.
    """
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 0 if flag is None else 1 << int(flag)


class GraphRefused(PipelineError):
    """TensorRT's ONNX parser refused the graph (an op it does not implement, such as EyeLike on dynamic dims or
    DFT): no setting of the build changes that, so with BUILDER=auto the folder is finished without an engine
    (pipeline/stages/sequence.py run_build), its gated graphs served through ONNX Runtime."""


def _parse_onnx(
    trt: ModuleType, builder: tensorrt.Builder, logger: trt_module.RecordingLogger, onnx_path: Path
) -> tuple[tensorrt.INetworkDefinition, tensorrt.OnnxParser]:
    network = builder.create_network(_network_flags(trt))
    if network is None:
        raise RuntimeError(f"create_network failed: {logger.since(0)}")  # a bug here, not the user's
    parser: tensorrt.OnnxParser = trt.OnnxParser(network, logger.trt_logger)
    # parse_from_file, not parse(bytes): the parser then finds the external-data file (weights past
    # 2 GB are stored beside the .onnx) relative to the model's own folder, and the graph's bytes are
    # never read into Python.  data_files first: no weights are read from outside that folder.
    data_files(onnx_path)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [_describe_parser_error(parser.get_error(i)) for i in range(parser.num_errors)]
        raise GraphRefused(
            f"TensorRT's ONNX parser rejected {onnx_path} ({len(errors)} error(s)):\n    " + "\n    ".join(errors),
            "replace or remove the named nodes (unsupported ops or custom domains need a TensorRT plugin), "
            "or re-export the model with opset 17 and simplify it",
        )
    return network, parser


def _describe_parser_error(error: tensorrt.ParserError) -> str:
    """One parser error as "node <index> '<name>' (<op>): <description> [<code>]"."""
    index = error.node()
    where = "the model" if index < 0 else f"node {index} {error.node_name()!r} ({error.node_operator()})"
    return f"{where}: {error.desc()} [{error.code().name}]"


def _onnx_input_dims(onnx_path: Path) -> dict[str, list[int | str | None]]:
    """Each graph input's dims as the ONNX file names them: an int, a dim_param name, or None.

    The TensorRT network shows every dynamic dim as -1, so the names users know (`batch`,
    `height`) come from the ONNX file.
    """
    return {tensor.name: list(tensor.shape) for tensor in graph_io(onnx_path).inputs}


# --------------------------------------------------------------------------- the optimization profile


def _profile_shapes(
    network: tensorrt.INetworkDefinition,
    onnx_dims: dict[str, list[int | str | None]],
    batch: BatchProfile,
    axis_ranges: dict[str, AxisRange],
) -> dict[str, tuple[Shape, Shape, Shape]]:
    """(min, opt, max) shapes for every network input; TensorRT needs one per input with a -1."""
    batch_names = {dims[0] for dims in onnx_dims.values() if dims and isinstance(dims[0], str)}
    _check_axis_names(onnx_dims, batch_names, axis_ranges)
    shapes: dict[str, tuple[Shape, Shape, Shape]] = {}
    for i in range(network.num_inputs):
        tensor: tensorrt.ITensor = network.get_input(i)
        names = onnx_dims.get(tensor.name, [])
        ranges = [
            _axis_range(tensor.name, axis, size, names, batch, batch_names, axis_ranges)
            for axis, size in enumerate(trt_module.dims(tensor.shape))
        ]
        shapes[tensor.name] = (
            tuple(r[0] for r in ranges),
            tuple(r[1] for r in ranges),
            tuple(r[2] for r in ranges),
        )
    return shapes


def _check_axis_names(
    onnx_dims: dict[str, list[int | str | None]], batch_names: set[str], axis_ranges: dict[str, AxisRange]
) -> None:
    """Every name in axis_ranges must be a non-batch dynamic axis: a typo would otherwise go unnoticed."""
    clash = batch_names & set(axis_ranges)
    if clash:
        raise PipelineError(
            f"axis_ranges names the batch axis {sorted(clash)}, whose range comes from the batch profile",
            f"set the batch range with {mention(batch='min:opt:max')} and leave it out of axis_ranges",
        )
    known = {name for dims in onnx_dims.values() for name in dims[1:] if isinstance(name, str)} - batch_names
    unknown = set(axis_ranges) - known
    if unknown:
        raise PipelineError(
            f"axis_ranges names {sorted(unknown)}, which no dynamic input axis is called",
            f"use the ONNX dim names of the dynamic axes: {sorted(known) or 'there are none besides the batch'}",
        )


def _axis_range(
    input_name: str,
    axis: int,
    size: int,
    names: list[int | str | None],
    batch: BatchProfile,
    batch_names: set[str],
    axis_ranges: dict[str, AxisRange],
) -> AxisRange:
    name = names[axis] if axis < len(names) else None
    if axis == 0:
        return _batch_range(input_name, size, batch)
    if size >= 0:
        return (size, size, size)  # static: taken as it is
    if isinstance(name, str) and name in axis_ranges:
        return axis_ranges[name]
    if isinstance(name, str) and name in batch_names:
        return (batch.min, batch.opt, batch.max)  # the batch name reused on another axis
    label = repr(name) if isinstance(name, str) else "(unnamed)"
    raise PipelineError(
        f"input {input_name!r} axis {axis} is dynamic (ONNX dim name {label}) and has no range",
        f"declare one, e.g. axis_ranges={{{name if isinstance(name, str) else 'name'!r}: (min, opt, max)}}; "
        "an unnamed dynamic axis needs a name at export (torch.onnx.export dynamic_axes={input: {axis: 'name'}}) "
        "or a fixed size",
    )


def _batch_range(input_name: str, size: int, batch: BatchProfile) -> AxisRange:
    if size < 0:
        return (batch.min, batch.opt, batch.max)
    if batch.min == batch.opt == batch.max == size:
        return (size, size, size)
    raise PipelineError(
        f"input {input_name!r} has a fixed batch of {size} but the batch profile asks for {batch}",
        f"export with a dynamic batch axis (dynamic_axes={{{input_name!r}: {{0: 'batch'}}}}) or give "
        f"{mention(batch=str(size))}",
    )


def _add_profile(
    builder: tensorrt.Builder, config: tensorrt.IBuilderConfig, shapes: dict[str, tuple[Shape, Shape, Shape]]
) -> None:
    profile: tensorrt.IOptimizationProfile = builder.create_optimization_profile()
    for name, (low, opt, high) in shapes.items():
        profile.set_shape(name, low, opt, high)  # type: ignore[arg-type]  # tuples convert to Dims
    if config.add_optimization_profile(profile) < 0:
        raise PipelineError(f"TensorRT rejected the optimization profile {shapes}", "check the ranges given")


def _shapes_record(shapes: tuple[Shape, Shape, Shape]) -> dict:
    return {"min": list(shapes[0]), "opt": list(shapes[1]), "max": list(shapes[2])}


# --------------------------------------------------------------------------- the GPUs it runs on


def _set_targets(trt: ModuleType, config: tensorrt.IBuilderConfig, target: str) -> None:
    """Choose the compute capabilities of a TensorRT-RTX engine; the full TensorRT builds for its own GPU.

    TensorRT-RTX builds for its documented default set when none is set; CURRENT asks for the GPU
    present at build time (it needs one).
    """
    if target == "default":
        return
    if not trt_module.is_rtx(trt):
        if target == "current":
            return  # what the full TensorRT always does
        raise PipelineError(
            f"build target {target!r} needs TensorRT-RTX; the full TensorRT builds only for the GPU it runs on",
            f"leave {mention_name('target')} unset with the full TensorRT, or build with "
            f"{mention(builder='tensorrt_rtx')}",
        )
    names = ["CURRENT"] if target == "current" else [name.strip().upper() for name in target.split(",")]
    if target == "current":
        _check_current_gpu(trt)
    known = [name for name in dir(trt.ComputeCapability) if name.startswith("SM")]
    unknown = [name for name in names if name != "CURRENT" and name not in known]
    if unknown:
        raise PipelineError(
            f"{trt.__name__} {trt.__version__} cannot build for {', '.join(unknown)}",
            f"choose from {', '.join(known)}, current or default",
        )
    rtx_config: Any = config  # the compute-capability calls exist only in tensorrt_rtx (no stubs)
    rtx_config.num_compute_capabilities = len(names)
    for index, name in enumerate(names):
        if not rtx_config.set_compute_capability(getattr(trt.ComputeCapability, name), index):
            raise PipelineError(f"TensorRT-RTX refused compute capability {name}", f"choose from {', '.join(known)}")


def _check_current_gpu(trt: ModuleType) -> None:
    """TARGET=current needs a GPU that TensorRT-RTX runs on: on an H100 it writes a plan for no GPU at all."""
    gpu = trt_module.describe_gpu(0)
    if gpu is None:
        raise PipelineError(
            f"{mention(target='current')} builds for the GPU of this machine, and none is usable here",
            f"build on the GPU machine, or name its compute capability (e.g. {mention(target='sm89')})",
        )
    if not trt_module.rtx_runs_on(gpu["compute_capability"]):
        raise PipelineError(
            f"{trt.__name__} {trt.__version__} cannot build for this GPU, {gpu['name']} (compute capability "
            f"{gpu['compute_capability']}): TensorRT-RTX runs on {', '.join(trt_module.RTX_RUNTIME_TARGETS)} and later",
            "build with the full TensorRT on this GPU (builder 'tensorrt'), or serve the ONNX graph with ONNX Runtime",
        )


# --------------------------------------------------------------------------- timing cache


def _attach_timing_cache(trt: ModuleType, config: tensorrt.IBuilderConfig, path: Path | None) -> dict:
    """Load the timing cache into the config where the builder has one; say what happened.

    TensorRT-RTX does not time tactics: its ITimingCache calls are no-ops since RTX 1.2 and,
    worse, "force a GPU query during ahead-of-time compilation, which prevents CPU-only AOT
    builds" (TensorRT-RTX docs, Timing Cache Migration), so they are not called at all there.
    """
    if path is None:
        return {"status": "not requested", "path": None}
    if trt_module.is_rtx(trt):
        return {"status": "unsupported", "path": str(path), "reason": "TensorRT-RTX has no build-time timing cache"}
    existing = Path(path).read_bytes() if Path(path).is_file() else b""
    # create_timing_cache(b"") makes an empty cache; with bytes it deserializes them.
    cache: tensorrt.ITimingCache = config.create_timing_cache(existing)
    # ignore_mismatch=False: a cache from another GPU or TensorRT version is refused, not misused.
    if not config.set_timing_cache(cache, False):
        raise PipelineError(
            f"timing cache {path} does not match this GPU or TensorRT version",
            f"delete {path}; the next build writes a fresh one",
        )
    return {"status": "loaded" if existing else "created", "path": str(path)}


def _save_timing_cache(config: tensorrt.IBuilderConfig, path: Path | None, record: dict) -> dict:
    if path is None or record["status"] not in ("loaded", "created"):
        return record
    # The builder adds the tactics it timed to the attached cache; write it back for the next build.
    serialized = config.get_timing_cache().serialize()
    write_bytes(Path(path), bytes(memoryview(serialized)))  # IHostMemory exposes the buffer protocol
    return {**record, "written": True}


# --------------------------------------------------------------------------- the build


def _build(
    builder: tensorrt.Builder,
    network: tensorrt.INetworkDefinition,
    config: tensorrt.IBuilderConfig,
    logger: trt_module.RecordingLogger,
    onnx_path: Path,
) -> tensorrt.IHostMemory:
    mark = logger.mark()
    serialized = builder.build_serialized_network(network, config)
    # build_serialized_network returns None on failure; the reason is only in the log.
    if serialized is None:
        messages = logger.since(mark) or ["(TensorRT logged no warning or error)"]
        raise PipelineError(
            f"TensorRT could not build an engine from {onnx_path}:\n    " + "\n    ".join(messages),
            "fix what the messages name (often an optimization-profile range the graph cannot take, "
            "or an op unsupported for the target); a larger workspace helps only when they say memory",
        )
    return serialized


def _io_record(network: tensorrt.INetworkDefinition) -> list[dict]:
    """The network's I/O tensors in TensorRT's order: name, input/output, dtype, shape (-1 dynamic)."""
    tensors = [("input", network.get_input(i)) for i in range(network.num_inputs)]
    tensors += [("output", network.get_output(i)) for i in range(network.num_outputs)]
    return [
        {"name": t.name, "mode": mode, "dtype": trt_module.dtype_name(t.dtype), "shape": trt_module.dims(t.shape)}
        for mode, t in tensors
    ]
