"""`trt-pipeline triton engines/<model>-<precision> --repo <dir>`: a Triton Inference Server model repository.

Writes <repo>/<name>/config.pbtxt and <repo>/<name>/1/model.plan (Triton's `tensorrt_plan` platform),
<repo>/<name>/1/model.onnx (the `onnxruntime` backend), or, with `--backend python`, <repo>/<name>/1/model.py
(pipeline/triton/python_model.py) with the artifact folder's runtime files in <repo>/<name>/1/artifacts/: our
runner (pipeline.runners.load_runner) inside Triton's Python backend.  The config is built as Triton's own
ModelConfig protobuf message (tritonclient's model_config_pb2) and written with protobuf's text format, so
every field name, enum and type is checked by the schema Triton itself parses it with.

An engine built by TensorRT-RTX is not loadable by Triton's TensorRT backend (which links the full TensorRT,
and a plan only loads in the TensorRT that built it), so `auto` serves such folders through the ONNX graph;
the python form serves the RTX engine itself (where it runs), and an int8 folder's ONNX-Runtime CPU graph.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
from pathlib import Path
from typing import Any

import trt_pipeline

from ..core.errors import PipelineError
from ..core.settings import engine_command
from ..folder.artifacts import temporary_name, write_bytes, write_json
from ..folder.graph_io import graph_io as read_graph_io
from ..folder.layout import MANIFEST, REFERENCE
from ..folder.manifest import Manifest
from ..folder.reader import ArtifactFolder, open_folder
from ..runners.base import max_batch

# ONNX Runtime's optimization levels as the onnxruntime backend's `optimization { graph { level } }` spells them
# (its README: -1 basic, 1 basic and extended, 2 none; unset: all).
TRITON_GRAPH_LEVELS = {"ORT_ENABLE_ALL": 0, "ORT_ENABLE_EXTENDED": 1, "ORT_ENABLE_BASIC": -1, "ORT_DISABLE_ALL": 2}
BACKENDS = ("auto", "tensorrt_plan", "onnxruntime", "python")
# backend -> (platform, Triton backend, file in the version folder)
PLATFORMS = {
    "tensorrt_plan": ("tensorrt_plan", "tensorrt", "model.plan"),
    "onnxruntime": ("onnxruntime_onnx", "onnxruntime", "model.onnx"),
    "python": ("", "python", "model.py"),
}
# The python form: the runner's files under <version>/ARTIFACTS, its backend choice as load_runner takes it.
ARTIFACTS = "artifacts"
RUNNER_BACKENDS = ("auto", "tensorrt", "onnxruntime")
INSTANCE_KINDS = {"gpu": "KIND_GPU", "cpu": "KIND_CPU"}
# numpy dtype names -> Triton DataType names (model_config.proto).
TRITON_DTYPES = {
    "bool": "TYPE_BOOL",
    "uint8": "TYPE_UINT8",
    "uint16": "TYPE_UINT16",
    "uint32": "TYPE_UINT32",
    "uint64": "TYPE_UINT64",
    "int8": "TYPE_INT8",
    "int16": "TYPE_INT16",
    "int32": "TYPE_INT32",
    "int64": "TYPE_INT64",
    "float16": "TYPE_FP16",
    "float32": "TYPE_FP32",
    "float64": "TYPE_FP64",
    "bfloat16": "TYPE_BF16",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", type=Path, help="artifact folder, e.g. engines/resnet50-fp16")
    parser.add_argument("--repo", type=Path, required=True, help="model repository to write into (created if needed)")
    parser.add_argument(
        "--backend",
        default="auto",
        choices=BACKENDS,
        help="auto: the engine (tensorrt_plan) unless TensorRT-RTX built it or there is none, then the ONNX graph; "
        "python: our runner inside Triton's Python backend (serves TensorRT-RTX engines and the INT8 CPU graph)",
    )
    parser.add_argument(
        "--runner-backend",
        default="auto",
        choices=RUNNER_BACKENDS,
        help="with --backend python: what the runner runs (auto: the engine where it can run, else ONNX Runtime)",
    )
    parser.add_argument("--name", help="model name in the repository (default: <model>-<precision>, as serve names it)")
    parser.add_argument("--instances", type=int, default=1, help="model instances (instance_group count)")
    parser.add_argument(
        "--instance-kind",
        choices=tuple(INSTANCE_KINDS),
        help="default gpu; cpu for onnxruntime on a machine without a GPU, and the default for python (the runner "
        "picks its device itself; Triton's KIND_GPU would start one instance per GPU and refuse a machine without)",
    )
    parser.add_argument(
        "--max-queue-delay-us", type=int, default=2000, help="dynamic batching: longest wait for a fuller batch"
    )


def main(args: argparse.Namespace) -> int:
    model_dir, why = write_repository(
        args.folder,
        args.repo,
        backend=args.backend,
        name=args.name,
        instances=args.instances,
        instance_kind=args.instance_kind,
        max_queue_delay_us=args.max_queue_delay_us,
        runner_backend=args.runner_backend,
    )
    print(f"triton       {model_dir} ({why})")
    print(f"             launch: tritonserver --model-repository={Path(args.repo).resolve()} (see docs/triton.md)")
    return 0


def write_repository(
    folder: Path,
    repo: Path,
    *,
    backend: str = "auto",
    name: str | None = None,
    instances: int = 1,
    instance_kind: str | None = None,
    max_queue_delay_us: int = 2000,
    runner_backend: str = "auto",
) -> tuple[Path, str]:
    """Write the model into `repo`; returns (the model's folder, why this backend).

    instance_kind: gpu or cpu (None: cpu for the python form, else gpu).  runner_backend: the python form's
    load_runner backend."""
    opened = open_folder(folder)  # a finished folder only; every file read is checked against its sha256
    manifest = opened.manifest
    # --name "" is checked (and refused), not read as "no name given"
    name = check_model_name(model_name(manifest) if name is None else name)
    chosen, why = choose_backend(opened, backend)
    instance_kind = instance_kind or ("cpu" if chosen == "python" else "gpu")
    if runner_backend not in RUNNER_BACKENDS:
        raise PipelineError(f"unknown runner backend {runner_backend!r}", f"use one of {', '.join(RUNNER_BACKENDS)}")
    if instances < 1 or max_queue_delay_us < 0:
        raise PipelineError(
            "instances must be 1 or more and the queue delay 0 or more", "fix --instances / --max-queue-delay-us"
        )
    if chosen == "tensorrt_plan" and instance_kind != "gpu":
        raise PipelineError(
            "a TensorRT plan runs only on a GPU instance", "use --instance-kind gpu, or --backend onnxruntime"
        )
    model_dir = Path(repo) / name
    staging = Path(repo) / temporary_name(model_dir)  # the version's files, copied and checked before any is placed
    try:
        io = stage_version(opened, chosen, staging)
        config = _config(opened, chosen, name, io, instances, instance_kind, max_queue_delay_us, runner_backend)
        for path in sorted(staging.rglob("*")):
            if path.is_file():
                placed = model_dir / "1" / path.relative_to(staging)
                placed.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, placed)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    from google.protobuf import text_format

    write_bytes(model_dir / "config.pbtxt", text_format.MessageToString(config).encode())
    return model_dir, why


def stage_version(opened: ArtifactFolder, chosen: str, version: Path) -> list[dict]:
    """The version folder's files for the `chosen` backend, copied into `version` and each checked against its
    sha256 (the graph with its data file, which travels with it under its own name: the graph's references name
    it); returns the I/O the config declares."""
    filename = PLATFORMS[chosen][2]
    if chosen == "tensorrt_plan":
        opened.copy_artifact(opened.engine, version / filename)
        return engine_io(opened.manifest)
    if chosen == "onnxruntime":
        return graph_io(opened.copy_graph(opened.graph, version, as_name=filename))
    copy_runner_files(opened, version / ARTIFACTS)
    write_bytes(version / filename, python_model_source())
    return graph_io(version / ARTIFACTS / opened.graph)


def _config(
    opened: ArtifactFolder,
    chosen: str,
    name: str,
    io: list[dict],
    instances: int,
    instance_kind: str,
    max_queue_delay_us: int,
    runner_backend: str,
) -> Any:
    manifest = opened.manifest
    config = model_config(
        name,
        chosen,
        io,
        max_batch=max_batch(manifest),
        instances=instances,
        instance_kind=instance_kind,
        max_queue_delay_us=max_queue_delay_us,
    )
    level = manifest.onnxruntime_levels.get(opened.graph)
    if chosen == "onnxruntime" and level is not None:  # the build found ONNX Runtime crashing above this level
        config.optimization.graph.level = TRITON_GRAPH_LEVELS[level]
    if chosen == "python":
        add_parameter(config, "runner_backend", runner_backend)
        # The stub's Python imports trt_pipeline from here when it is not installed where Triton runs.
        add_parameter(config, "trt_pipeline_path", str(Path(trt_pipeline.__file__).parent.parent))
    return config


def model_name(manifest: Manifest) -> str:
    """The model's name here and in `trt-pipeline serve` alike: <model>-<precision>, as `make engine` names
    its folder.  The precision is part of it so that the fp16 and int8 builds of one network sit side by side in a
    repository, and a client moving between Triton and our service changes only the address."""
    model, precision = manifest.model.name if manifest.model else None, manifest.precision
    if not model or not precision:
        raise PipelineError(
            "the manifest records no model name or precision (the export did not finish)",
            f"rebuild the folder: {engine_command(model='<model>', precision='<precision>')}",
        )
    return f"{model}-{precision}"


# A model's name is a folder of the repository: one path component, no way out of --repo.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def check_model_name(name: str) -> str:
    if not MODEL_NAME.fullmatch(name) or ".." in name:
        raise PipelineError(
            f"model name {name!r} cannot be a folder of the repository",
            "use up to 128 letters, digits, '_', '-' and '.', starting with a letter or digit (no '..', no '/')",
        )
    return name


def choose_backend(opened: ArtifactFolder, backend: str) -> tuple[str, str]:
    """(tensorrt_plan | onnxruntime, why)."""
    if backend not in BACKENDS:
        raise PipelineError(f"unknown Triton backend {backend!r}", f"use one of {', '.join(BACKENDS)}")
    folder = opened.path
    build = opened.manifest.build
    builder = build.builder.module if build is not None and build.builder is not None else None
    if backend == "onnxruntime":
        return backend, "asked for the ONNX graph"
    if backend == "python":
        return backend, "asked for our runner inside Triton's Python backend"
    if builder == "tensorrt_rtx":
        if backend == "tensorrt_plan":
            raise PipelineError(
                "this engine was built by TensorRT-RTX, which Triton's TensorRT backend cannot load",
                "use --backend onnxruntime (the default for such folders), or rebuild with the full TensorRT on a "
                f"GPU machine ({engine_command(builder='tensorrt', more=True)}) matching the TensorRT in your Triton "
                "image",
            )
        return "onnxruntime", "auto: the engine was built by TensorRT-RTX, which Triton's TensorRT backend cannot load"
    if not opened.has(opened.engine) or builder is None:
        if backend == "tensorrt_plan":
            raise PipelineError(
                f"{folder} has no engine to serve",
                f"build one ({engine_command(more=True)}) or use --backend onnxruntime",
            )
        return "onnxruntime", f"auto: {folder} has no engine"
    return "tensorrt_plan", f"{'auto: ' if backend == 'auto' else ''}the engine was built by {builder}"


def copy_runner_files(opened: ArtifactFolder, folder: Path) -> None:
    """Copy into `folder` what load_runner reads from the artifact folder, each checked against its sha256: the
    manifest, the engine (if built), every graph auto may serve with its data file (the FP32 graph too: auto times
    them on the host and serves the fastest as accurate as the folder promises) and the reference inputs it times
    them on.  The calibration files serve the build, not the runner."""
    for graph in opened.servable_anywhere():
        opened.copy_graph(graph, folder)
    for name in [REFERENCE, *([opened.engine] if opened.has(opened.engine) else [])]:
        opened.copy_artifact(name, folder / name)
    write_json(folder / MANIFEST, opened.manifest.as_json())  # the record open_folder checked


def python_model_source() -> bytes:
    """The Python backend's model.py: pipeline/triton/python_model.py as it is."""
    return (Path(__file__).parent / "python_model.py").read_bytes()


def add_parameter(config: Any, key: str, value: str) -> None:
    config.parameters[key].string_value = value


def engine_io(manifest: Manifest) -> list[dict]:
    """The engine's I/O as the build stage recorded it: [{name, mode, dtype, shape}] (-1 for dynamic dims)."""
    records = manifest.build.io if manifest.build is not None else None
    if not records:
        raise PipelineError(
            "the manifest records no engine I/O (the build did not finish)", f"rebuild: {engine_command(more=True)}"
        )
    return [{"name": r["name"], "mode": r["mode"], "dtype": r["dtype"], "shape": list(r["shape"])} for r in records]


def graph_io(graph: Path) -> list[dict]:
    """The ONNX graph's I/O in the same form as engine_io (symbolic or unknown dims as -1)."""
    io = read_graph_io(graph)
    tensors = [("input", tensor) for tensor in io.inputs] + [("output", tensor) for tensor in io.outputs]
    return [{"name": t.name, "mode": mode, "dtype": t.dtype, "shape": t.sizes()} for mode, t in tensors]


def model_config(
    name: str,
    backend: str,
    io: list[dict],
    *,
    max_batch: int,
    instances: int = 1,
    instance_kind: str = "gpu",
    max_queue_delay_us: int = 2000,
) -> Any:
    """Triton's ModelConfig message: dims without the batch dim (Triton adds it back up to max_batch_size)."""
    from tritonclient.grpc import model_config_pb2 as pb

    platform, backend_name, filename = PLATFORMS[backend]
    config = pb.ModelConfig(
        name=name, platform=platform, backend=backend_name, max_batch_size=max_batch, default_model_filename=filename
    )
    for record in io:
        if not record["shape"] or record["shape"][0] != -1:
            raise PipelineError(
                f"{record['mode']} {record['name']!r} has shape {record['shape']}: no dynamic batch dim first",
                "rebuild with a dynamic batch axis (the export stage makes dim 0 dynamic)",
            )
        if record["dtype"] not in TRITON_DTYPES:
            raise PipelineError(
                f"{record['name']!r} has dtype {record['dtype']}, which Triton has no type for",
                "cast it in the model to a numeric type Triton supports",
            )
        entry = config.input.add() if record["mode"] == "input" else config.output.add()
        entry.name = record["name"]
        entry.data_type = pb.DataType.Value(TRITON_DTYPES[record["dtype"]])
        entry.dims.extend(record["shape"][1:])
    config.dynamic_batching.max_queue_delay_microseconds = max_queue_delay_us
    group = config.instance_group.add()
    group.count = instances
    group.kind = pb.ModelInstanceGroup.Kind.Value(INSTANCE_KINDS[instance_kind])
    return config
