"""The engine runner: engine.plan through TensorRT (or TensorRT-RTX) with pre-allocated device bindings.

Loading checks the manifest against this machine *before* any GPU is touched: the plan's
sha256, the TensorRT module and version that built it, and the GPU it was built for.  Then it
deserializes once and pre-allocates, per execution context, device memory at the profile's max
shapes, page-locked host buffers and one stream, so infer() allocates nothing on the device.

Threads: a small pool of execution contexts (default 2), each with its own buffers and stream,
handed out through a queue; a call takes one, runs, and gives it back.  One context behind a lock
would serialise whole requests, copies included; two let one request's copies overlap another's
kernels, while each extra context costs its activation memory plus I/O buffers at max shape, so
the pool stays small (kernels of one GPU mostly serialise anyway).  contexts=1 is a plain lock.

Execution: `execute_async_v3` by default (tensor addresses bound on the context, the kernels and
the copies queued on the slot's own stream, one synchronisation per call), or `execute_v2`
(bindings by position; it runs synchronously on a stream of TensorRT's own, so the inputs are
synchronised before it and the outputs copied after it).  With TensorRT-RTX, `cuda_graphs=True`
turns on its built-in CUDA graph capture (one graph per input shape, captured after the first
calls at that shape), which removes the per-kernel launch cost at small batches.
v3 is the default because it needs one synchronisation per call where execute_v2 needs two; which is
faster has not been measured yet: the lent H100 does not run TensorRT-RTX engines
(docs/benchmarks/resnet50-h100.md), and the bench's tensorrt / tensorrt-v2 / tensorrt-graphs rows are
there for the first GPU that does.
"""

from __future__ import annotations

import queue
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.errors import PipelineError
from ..core.settings import engine_command, mention_name
from ..core.trt_module import (
    RTX_RUNTIME_TARGETS,
    RecordingLogger,
    describe_gpu,
    dims,
    import_trt,
    parse_capability,
    rtx_runs_on,
)
from ..folder.manifest import Builder, Manifest
from ..folder.reader import ArtifactFolder
from ..folder.rebuild import rebuild_hint
from .base import BATCH_AXIS, Runner, check_feed
from .device_memory import DeviceMemory, open_device_memory

if TYPE_CHECKING:
    # Type stubs only (`tensorrt-stubs`): mypy checks the TensorRT calls below against them.
    import tensorrt

DEFAULT_CONTEXTS = 2
EXECUTIONS = ("v3", "v2")  # execute_async_v3 (the default) or execute_v2


# --------------------------------------------------------------------------- checks before the GPU


def rebuild_fix(manifest: Manifest) -> str:
    return f"rebuild it on/for this machine: {rebuild_hint(manifest, force=True)}"


def read_plan(folder: ArtifactFolder) -> bytes:
    """engine.plan's bytes, checked against the manifest's sha256 (pipeline.folder.reader), refused when the build was
    skipped."""
    build = folder.manifest.build
    if build is None or build.builder is None:
        why = build.skipped if build is not None and build.skipped is not None else "no build record"
        raise PipelineError(
            f"{folder.path} has no engine: the build was skipped ({why})",
            f"use backend='onnxruntime', or install a TensorRT builder and {rebuild_fix(folder.manifest)}",
        )
    return folder.read(folder.engine)


def check_builder(manifest: Manifest, trt: ModuleType) -> None:
    """An engine deserializes only in the TensorRT flavour and version that built it."""
    built = manifest.builder()
    here = Builder(trt.__name__, str(trt.__version__))
    if built != here:
        raise PipelineError(
            f"engine.plan was built with {built.module} {built.version}, but this machine runs "
            f"{here.module} {here.version}; engines load only in the exact TensorRT that built them",
            f"{rebuild_fix(manifest)} (or install {built.module}=={built.version})",
        )


def built_for(target: dict) -> list[str] | None:
    """The compute capabilities ("8.6", ...) an engine runs on, or None where the record cannot say."""
    if target.get("kind") == "gpu":
        gpu = target.get("gpu") or {}
        return [gpu["compute_capability"]] if "compute_capability" in gpu else None
    chosen = target.get("compute_capabilities")
    if chosen == "default":
        return list(target.get("documented_default") or [])
    names = [str(name) for name in chosen or []]
    # TensorRT-RTX's ComputeCapability names: SM80 -> 8.0, SM120 -> 12.0; CURRENT is the GPU of the build.
    current = (target.get("gpu") or {}).get("compute_capability")
    parsed = [f"{name[2:-1]}.{name[-1]}" for name in names if name.startswith("SM") and name[2:].isdigit()]
    parsed += [current for name in names if name == "CURRENT" and current]
    return parsed if len(parsed) == len(names) else None


def check_gpu_target(manifest: Manifest, gpu: dict) -> None:
    """Refuse an engine that cannot run on `gpu` (describe_gpu's record): built for another architecture,
    or built by TensorRT-RTX for a GPU its runtime does not run on (Hopper, whatever the build targets)."""
    here = gpu["compute_capability"]
    if manifest.builder().module == "tensorrt_rtx" and not rtx_runs_on(here):
        raise PipelineError(
            f"this GPU, {gpu['name']} (compute capability {here}), does not run TensorRT-RTX engines: its runtime "
            f"runs on {', '.join(RTX_RUNTIME_TARGETS)} and later, and no rebuild with it changes that",
            "serve the folder with load_runner(..., backend='onnxruntime'), or build with the full TensorRT on "
            "this GPU (builder 'tensorrt')",
        )
    target = manifest.build.target if manifest.build is not None else {}
    targets = built_for(target)
    if targets is None or here in targets:
        return
    # TensorRT-RTX documents its default set as "8.0, 8.6, 8.9, 12.0, and later": later architectures run it too.
    latest = max(map(parse_capability, targets))
    if target.get("compute_capabilities") == "default" and parse_capability(here) >= latest:
        return
    raise PipelineError(
        f"engine.plan was built for compute capability {', '.join(targets)} ({target.get('kind')}), "
        f"but this GPU is {gpu['name']} with compute capability {here}",
        f"{rebuild_fix(manifest)}; or pass check_target=False to try it anyway",
    )


# --------------------------------------------------------------------------- the runner


@dataclass
class _Slot:
    """One execution context with its own device buffers, pinned host buffers and stream."""

    context: tensorrt.IExecutionContext
    stream: Any
    device: dict[str, int]  # tensor name -> device address, sized for the profile's max shape
    host: dict[str, np.ndarray]  # tensor name -> page-locked uint8 buffer of the same size
    bindings: list[int]  # device addresses in the engine's I/O-tensor order


class TensorRTRunner(Runner):
    backend = "tensorrt"

    def __init__(
        self,
        folder: ArtifactFolder,
        *,
        contexts: int = DEFAULT_CONTEXTS,
        device_memory: str = "auto",
        device: int = 0,
        check_target: bool = True,
        split_large_batches: bool = True,
        execution: str = "v3",
        cuda_graphs: bool = False,
    ):
        super().__init__(folder, split_large_batches=split_large_batches)
        manifest = folder.manifest
        if contexts < 1:
            raise PipelineError(f"contexts={contexts}", "give at least 1 execution context")
        plan = read_plan(folder)
        trt = import_trt(manifest.builder().module)
        check_builder(manifest, trt)
        _check_execution(trt, execution, cuda_graphs)
        gpu = describe_gpu(device)
        if gpu is None:
            raise PipelineError(
                f"no NVIDIA GPU {device} is usable here, and engine.plan runs only on a GPU",
                "run on a GPU machine, or load_runner(..., backend='onnxruntime')",
            )
        if check_target:
            check_gpu_target(manifest, gpu)
        self._trt = trt
        self._device = device
        self._execution = execution
        self._cuda_graphs = cuda_graphs
        self._logger = RecordingLogger.for_module(trt)
        self._memory: DeviceMemory = open_device_memory(device_memory, device)
        self._slots: list[_Slot] = []
        self._idle: queue.Queue[_Slot] = queue.Queue()
        self._closed = False
        loaded = False
        self._memory.push()
        try:
            self._engine = self._deserialize(plan)
            self._io = [self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)]
            self._check_io()
            self._bound_inputs = [(self._io.index(spec.name), spec) for spec in self.inputs]
            for _ in range(contexts):
                self._add_slot()
            loaded = True
        finally:
            if not loaded:  # nothing half-allocated stays behind a failed load
                self._release()
            self._memory.pop()
            if not loaded:
                self._memory.close()
        for slot in self._slots:
            self._idle.put(slot)
        self.description = (
            f"{trt.__name__} {trt.__version__} engine on {gpu['name']} (sm {gpu['compute_capability']}), "
            f"{contexts} execution context(s), {_EXECUTION_NAMES[execution]}"
            f"{' with TensorRT-RTX CUDA graphs' if cuda_graphs else ''}, device memory via {self._memory.name}"
        )

    # ------------------------------------------------------------------ loading

    def _deserialize(self, plan: bytes) -> tensorrt.ICudaEngine:
        mark = self._logger.mark()
        # The runtime must outlive the engines it deserialized, so the runner keeps it.
        self._runtime: tensorrt.Runtime = self._trt.Runtime(self._logger.trt_logger)
        engine = self._runtime.deserialize_cuda_engine(plan)
        if engine is None:  # TensorRT says why only through its logger
            messages = "; ".join(self._logger.since(mark)) or "no message from TensorRT"
            raise PipelineError(f"TensorRT could not deserialize engine.plan: {messages}", rebuild_fix(self.manifest))
        return engine

    def _check_io(self) -> None:
        """The engine's inputs/outputs must be the manifest's, with the same dtypes and max batch."""
        expected = {
            spec.name: (mode, spec.dtype)
            for mode, specs in (("INPUT", self.inputs), ("OUTPUT", self.outputs))
            for spec in specs
        }
        actual = {name: (self._engine.get_tensor_mode(name).name, self._dtype(name)) for name in self._io}
        if actual != expected:
            raise PipelineError(
                f"engine.plan and the manifest disagree on the I/O tensors: engine {actual}, manifest {expected}",
                rebuild_fix(self.manifest),
            )
        for spec in self.inputs:
            engine_max = self._profile(spec.name)[2][BATCH_AXIS]
            if engine_max != self.max_batch:
                raise PipelineError(
                    f"engine.plan's profile takes at most {engine_max} rows of {spec.name!r}, the manifest says "
                    f"{self.max_batch}",
                    rebuild_fix(self.manifest),
                )

    def _dtype(self, name: str) -> np.dtype:
        return np.dtype(self._trt.nptype(self._engine.get_tensor_dtype(name)))

    def _profile(self, name: str) -> list[tuple[int, ...]]:
        """(min, opt, max) shapes of an input in optimization profile 0 (the only one the build makes)."""
        return [tuple(dims(shape)) for shape in self._engine.get_tensor_profile_shape(name, 0)]

    def _add_slot(self) -> None:
        """One more execution context with its buffers; registered first, so a failure halfway frees them."""
        context = self._create_context()
        if context is None:
            raise PipelineError(
                "TensorRT could not create an execution context (out of GPU memory?)",
                "free GPU memory, or load with fewer contexts (contexts=1)",
            )
        slot = _Slot(context, self._memory.stream(), {}, {}, [])
        self._slots.append(slot)
        # With every input at its max shape, the outputs' shapes are their largest too.
        for spec in self.inputs:
            self._set_shape(context, spec.name, self._profile(spec.name)[2])
        for name in self._io:
            size = self._nbytes(name, tuple(dims(context.get_tensor_shape(name))))
            slot.device[name] = self._memory.alloc(size)
            slot.host[name] = self._memory.pinned(size)
        slot.bindings = [slot.device[name] for name in self._io]
        if self._execution == "v3":  # bound once; a torch CUDA input rebinds its own per call
            for name in self._io:
                self._bind(slot.context, name, slot.device[name])

    def _create_context(self) -> tensorrt.IExecutionContext:
        if not self._cuda_graphs:
            return self._engine.create_execution_context()
        # TensorRT-RTX only (checked in __init__); its runtime config has no type stubs.
        engine: Any = self._engine
        config = engine.create_runtime_config()
        config.cuda_graph_strategy = self._trt.CudaGraphStrategy.WHOLE_GRAPH_CAPTURE
        return engine.create_execution_context(config)

    @staticmethod
    def _bind(context: tensorrt.IExecutionContext, name: str, address: int) -> None:
        if not context.set_tensor_address(name, address):
            raise RuntimeError(f"TensorRT refused the device address of tensor {name!r}")

    def _nbytes(self, name: str, shape: tuple[int, ...]) -> int:
        if any(d < 0 for d in shape):
            raise PipelineError(
                f"output {name!r} has a data-dependent shape {shape}, which this runner does not support",
                "export the model with outputs whose shape follows from the inputs' shapes",
            )
        return int(np.prod(shape, dtype=np.int64)) * self._dtype(name).itemsize

    def _set_shape(self, context: tensorrt.IExecutionContext, name: str, shape: tuple[int, ...]) -> None:
        if not context.set_input_shape(name, shape):
            low, _, high = self._profile(name)
            raise PipelineError(
                f"input {name!r} has shape {shape}, outside the engine's profile {low} .. {high}",
                f"send shapes within the profile, or rebuild with a wider {mention_name('batch')}/"
                f"{mention_name('dynamic')} range ({engine_command(more=True)})",
            )

    # ------------------------------------------------------------------ inference

    def _check(self, feed: Mapping[str, Any]) -> int:
        return check_feed(feed, self.inputs, describe=_numpy_or_torch_cuda)

    def _run(self, feed: Mapping[str, Any]) -> dict[str, np.ndarray]:
        slot = self._idle.get()  # blocks while every context is busy
        self._memory.push()  # this thread's current context, whichever thread created the runner
        try:
            return self._execute(slot, feed)
        finally:
            self._memory.pop()
            self._idle.put(slot)

    def _execute(self, slot: _Slot, feed: Mapping[str, Any]) -> dict[str, np.ndarray]:
        addresses = self._stage_inputs(slot, feed)
        shapes = self._output_shapes(slot)
        self._enqueue(slot, addresses)
        sizes = {name: self._nbytes(name, shape) for name, shape in shapes.items()}
        for name, nbytes in sizes.items():
            self._memory.d2h_async(slot.host[name], slot.device[name], nbytes, slot.stream)
        self._memory.sync(slot.stream)
        # Copies out of the pinned buffers, which the next call on this context reuses.
        return {
            spec.name: slot.host[spec.name][: sizes[spec.name]].view(spec.dtype).reshape(shapes[spec.name]).copy()
            for spec in self.outputs
        }

    def _stage_inputs(self, slot: _Slot, feed: Mapping[str, Any]) -> dict[str, int]:
        """Set this call's input shapes and put every input on the device; return the address of each."""
        addresses: dict[str, int] = {}
        on_gpu = []
        for _, spec in self._bound_inputs:
            value = feed[spec.name]
            self._set_shape(slot.context, spec.name, tuple(value.shape))
            if type(value) is np.ndarray:
                # Through the pinned buffer: np.copyto also makes a strided input contiguous.
                staged = slot.host[spec.name][: value.nbytes].view(value.dtype).reshape(value.shape)
                np.copyto(staged, value)
                self._memory.h2d_async(slot.device[spec.name], slot.host[spec.name], value.nbytes, slot.stream)
                addresses[spec.name] = slot.device[spec.name]
            else:  # a torch CUDA tensor: bound in place on its GPU, no host round trip
                addresses[spec.name] = self._cuda_address(spec.name, value)
                on_gpu.append(value)
        if on_gpu:
            # The tensors may still be being written on torch's stream; TensorRT must not read them early.
            import torch

            torch.cuda.current_stream(on_gpu[0].device).synchronize()
        return addresses

    def _cuda_address(self, name: str, value: Any) -> int:
        if value.device.index != self._device:
            raise PipelineError(
                f"tensor {name!r} is on cuda:{value.device.index}, the engine runs on cuda:{self._device}",
                f"move it first: {name}.to('cuda:{self._device}')",
            )
        return int(value.data_ptr())

    def _output_shapes(self, slot: _Slot) -> dict[str, tuple[int, ...]]:
        """Exactly the valid rows: the output shapes follow from this call's input shapes."""
        return {spec.name: tuple(dims(slot.context.get_tensor_shape(spec.name))) for spec in self.outputs}

    def _enqueue(self, slot: _Slot, addresses: dict[str, int]) -> None:
        """Run the engine on `addresses` (tensor name -> device address; the slot's own buffers for the rest)."""
        mark = self._logger.mark()
        if self._execution == "v2":
            bindings = [addresses.get(name, address) for name, address in zip(self._io, slot.bindings, strict=True)]
            # execute_v2 runs synchronously on TensorRT's own stream, so the inputs must have landed first.
            self._memory.sync(slot.stream)
            ok = slot.context.execute_v2(bindings)
        else:
            for name, address in addresses.items():
                self._bind(slot.context, name, address)
            ok = slot.context.execute_async_v3(self._memory.handle(slot.stream))
        if not ok:
            call = "execute_v2" if self._execution == "v2" else "execute_async_v3"
            raise RuntimeError(f"TensorRT {call} failed: {'; '.join(self._logger.since(mark)) or 'no message'}")
        if self._execution == "v3":  # the slot's own buffers back in place for the next host call
            for name in addresses:
                self._bind(slot.context, name, slot.device[name])

    def infer_on_device(self, feed: Mapping[str, Any], outputs: Mapping[str, Any]) -> Mapping[str, Any]:
        """Device-resident inference: torch CUDA inputs in, results written into the caller's torch CUDA tensors.

        Nothing crosses to the host; `outputs` must hold a contiguous tensor of the output's dtype and
        exact shape for every output (at most max_batch rows: no chunking here).  Returns `outputs`
        once the engine has finished writing them.
        """
        self._refuse_if_closed()
        batch = self._check(feed)
        if batch > self.max_batch:
            raise PipelineError(
                f"infer_on_device got {batch} rows, more than the profile's max batch {self.max_batch}",
                f"send at most {self.max_batch} rows per call",
            )
        if any(isinstance(value, np.ndarray) for value in feed.values()):
            raise PipelineError("infer_on_device takes torch CUDA tensors only", "use infer() for numpy arrays")
        slot = self._idle.get()
        self._memory.push()
        try:
            addresses = self._stage_inputs(slot, feed)
            for name, shape in self._output_shapes(slot).items():
                addresses[name] = self._output_address(name, shape, outputs)
            self._enqueue(slot, addresses)
            self._memory.sync(slot.stream)
        finally:
            self._memory.pop()
            self._idle.put(slot)
        return outputs

    def _output_address(self, name: str, shape: tuple[int, ...], outputs: Mapping[str, Any]) -> int:
        spec = next(spec for spec in self.outputs if spec.name == name)
        if name not in outputs:
            raise PipelineError(f"no tensor given for output {name!r}", f"pass outputs={{{name!r}: tensor}}")
        dtype, given = _numpy_or_torch_cuda(name, outputs[name])
        if dtype != spec.dtype or tuple(given) != shape:
            raise PipelineError(
                f"output tensor {name!r} is {dtype} {tuple(given)}, this call writes {spec.dtype} {shape}",
                f"allocate it as torch.empty({shape}, dtype=torch.{spec.dtype}, device='cuda:{self._device}')",
            )
        return self._cuda_address(name, outputs[name])

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Wait for in-flight calls, then free every buffer, context and stream, and release the CUDA context."""
        if self._closed:
            return
        self._closed = True
        for _ in self._slots:
            self._idle.get()  # each slot comes back when its call finishes
        self._memory.push()
        try:
            self._release()
        finally:
            self._memory.pop()
        self._memory.close()

    def _release(self) -> None:
        """Free what was allocated so far (the context is current); also used when loading fails halfway."""
        for slot in self._slots:
            for address in slot.device.values():
                self._memory.free(address)
            for buffer in slot.host.values():
                self._memory.free_pinned(buffer)
            self._memory.destroy_stream(slot.stream)
        # TensorRT objects go in reverse order of creation (contexts, engine, runtime), while the CUDA
        # context is still current; dropping the last reference destroys them.
        self._slots.clear()
        for created in ("_engine", "_runtime"):
            if hasattr(self, created):
                delattr(self, created)


_EXECUTION_NAMES = {"v3": "execute_async_v3", "v2": "execute_v2"}


def _check_execution(trt: ModuleType, execution: str, cuda_graphs: bool) -> None:
    if execution not in EXECUTIONS:
        raise PipelineError(f"unknown execution {execution!r}", f"use one of {', '.join(EXECUTIONS)}")
    if not cuda_graphs:
        return
    if not hasattr(trt, "CudaGraphStrategy"):
        raise PipelineError(
            f"cuda_graphs=True uses TensorRT-RTX's built-in CUDA graph capture, which {trt.__name__} lacks",
            "load without cuda_graphs, or build and run the engine with tensorrt_rtx",
        )
    if execution != "v3":
        raise PipelineError("CUDA graphs capture execute_async_v3, not execute_v2", "use execution='v3'")


_TORCH_DTYPES: dict[Any, np.dtype] = {}


def _numpy_or_torch_cuda(name: str, value: Any) -> tuple[np.dtype, tuple[int, ...]]:
    """(dtype, shape) of a numpy array, or of a contiguous torch CUDA tensor (used in place)."""
    if isinstance(value, np.ndarray):
        return value.dtype, value.shape
    if type(value).__module__.startswith("torch") and hasattr(value, "is_cuda"):
        if not value.is_cuda:
            raise PipelineError(f"input {name!r} is a torch tensor on the CPU", f"pass {name}.numpy() instead")
        if not value.is_contiguous():
            raise PipelineError(f"input {name!r} is a non-contiguous CUDA tensor", f"pass {name}.contiguous()")
        return _torch_to_numpy_dtype(value.dtype), tuple(value.shape)
    raise PipelineError(
        f"input {name!r} is a {type(value).__name__}, expected a numpy array or a torch CUDA tensor",
        f"pass np.asarray(...) for {name!r}",
    )


def _torch_to_numpy_dtype(dtype: Any) -> np.dtype:
    if dtype not in _TORCH_DTYPES:
        import torch

        _TORCH_DTYPES[dtype] = torch.empty((), dtype=dtype).numpy().dtype
    return _TORCH_DTYPES[dtype]
