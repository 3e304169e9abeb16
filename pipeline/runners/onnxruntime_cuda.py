"""The ONNX Runtime CUDA runner: the folder's graph on ONNX Runtime's CUDA provider through IO binding.

Where no engine runs (a Hopper GPU, whose TensorRT-RTX refuses it, with no full TensorRT), this is the GPU path:
the folder's graph as it is (an FP16 graph computes in real float16 on the GPU, unlike on the CPU provider), its
inputs and outputs bound to buffers allocated once at the profile's max shapes, so a call allocates nothing.

Every float32 op stays float32: the CUDA provider's `use_tf32` is 0 (its default, 1, lets cuBLAS/cuDNN round FP32
matmuls and convolutions to TF32's 10-bit mantissa, which the gates never judged).

Threads: a small pool of slots (default 2), each one session with its own IO binding and buffers, handed out
through a queue like the engine runner's execution contexts.  Each slot has its own session because a captured CUDA
graph belongs to its session and replays that session's fixed addresses.

cuda_graph=True turns on the provider's CUDA graph (`enable_cuda_graph`): one graph captured per input shape
(`gpu_graph_id`, a new id per shape seen), replayed on the slot's fixed buffers, which removes the per-kernel launch
cost at small batches.  ONNX Runtime captures only a session whose every node runs on CUDA; a graph with a node on
the CPU is refused at load, saying so.

The binding code takes its placement as a parameter: device="cpu" runs the same IO binding, pool and checks on
ONNX Runtime's CPU provider (numpy buffers), which is how they are tested on machines without a GPU.
"""

from __future__ import annotations

import queue
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.errors import PipelineError
from ..folder.graph_io import GraphTensor
from ..folder.manifest import rebuild_hint
from ..folder.reader import ArtifactFolder
from .base import BATCH_AXIS, Runner, TensorSpec, check_feed
from .onnxruntime import CPU, CUDA, choose_graph, load_session

DEFAULT_SESSIONS = 2


def require_cuda_provider() -> None:
    """Refuse, with the fix, a host where ONNX Runtime's CUDA provider cannot run: not compiled in (the `cpu`
    extra's onnxruntime), or compiled in without a GPU (onnxruntime-gpu lists it as available even then)."""
    import onnxruntime as ort

    from ..core.trt_module import gpu_present

    available = ort.get_available_providers()
    if CUDA not in available:
        raise PipelineError(
            f"backend='onnxruntime-cuda' needs ONNX Runtime's {CUDA}, which this onnxruntime {ort.__version__} does "
            f"not have (get_available_providers() returned {available})",
            "install the gpu extra in place of the cpu one (pip uninstall onnxruntime; pip install "
            "'trt-pipeline[gpu]', which brings onnxruntime-gpu), or use backend='onnxruntime'",
        )
    if not gpu_present():
        raise PipelineError(
            f"backend='onnxruntime-cuda': onnxruntime lists {CUDA}, but no NVIDIA GPU/driver is usable here",
            "run on a GPU machine, or use backend='onnxruntime' (the CPU provider)",
        )


@dataclass(frozen=True)
class Placement:
    """Where a runner's buffers live, in ONNX Runtime's OrtDevice names ("cuda" or "cpu") and ordinal."""

    device_type: str
    device_id: int = 0

    @classmethod
    def parse(cls, device: str) -> Placement:
        kind, _, ordinal = device.partition(":")
        if kind in ("cuda", "cpu") and (ordinal.isdigit() or not ordinal) and not (kind == "cpu" and ordinal):
            return cls(kind, int(ordinal or 0))
        raise PipelineError(f"device={device!r}", "give 'cuda', 'cuda:<ordinal>', or 'cpu' (the CPU provider)")


class HostBuffers:
    """Buffers in host memory for the CPU provider; "on the device" values are numpy arrays."""

    def __init__(self, placement: Placement):
        self.placement = placement

    def alloc(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, dtype=np.uint8)

    def address(self, buffer: Any) -> int:
        return int(buffer.ctypes.data)

    def describe(self, name: str, value: Any) -> tuple[np.dtype, tuple[int, ...]]:
        if not isinstance(value, np.ndarray):
            raise PipelineError(f"tensor {name!r} is a {type(value).__name__}", "pass a numpy array on device='cpu'")
        if not value.flags.c_contiguous:
            raise PipelineError(f"tensor {name!r} is not contiguous", f"pass np.ascontiguousarray({name})")
        return value.dtype, value.shape

    def write(self, buffer: np.ndarray, value: np.ndarray) -> None:
        """The rows of `value` into the start of `buffer` (a strided array made contiguous on the way)."""
        np.copyto(buffer[: value.nbytes].view(value.dtype).reshape(value.shape), value)

    def read(self, buffer: np.ndarray, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return buffer[:nbytes].view(dtype).reshape(shape).copy()  # the buffer is reused by the next call

    def view(self, buffer: Any, dtype: np.dtype, shape: tuple[int, ...]) -> Any:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return buffer[:nbytes].view(dtype).reshape(shape)

    def wait(self) -> None:
        """Nothing is queued on a host."""


class TorchCudaBuffers(HostBuffers):
    """Buffers in GPU memory as torch uint8 tensors (PyTorch shares the device's primary context with ONNX Runtime);
    "on the device" values are contiguous torch CUDA tensors on this GPU, bound in place."""

    def __init__(self, placement: Placement):
        import torch

        super().__init__(placement)
        self._torch = torch
        self.device = torch.device("cuda", placement.device_id)

    def alloc(self, nbytes: int) -> Any:
        return self._torch.empty(nbytes, dtype=self._torch.uint8, device=self.device)

    def address(self, buffer: Any) -> int:
        return int(buffer.data_ptr())

    def describe(self, name: str, value: Any) -> tuple[np.dtype, tuple[int, ...]]:
        from .tensorrt import _numpy_or_torch_cuda

        dtype, shape = _numpy_or_torch_cuda(name, value)
        if not isinstance(value, np.ndarray) and value.device != self.device:
            raise PipelineError(
                f"tensor {name!r} is on {value.device}, the runner on {self.device}",
                f"move it first: {name}.to('{self.device}')",
            )
        return dtype, shape

    def write(self, buffer: Any, value: Any) -> None:
        """A host array or a CUDA tensor into the start of `buffer`; ordered before the run by wait()."""
        source = self._torch.from_numpy(np.ascontiguousarray(value)) if isinstance(value, np.ndarray) else value
        self.view(buffer, np.dtype(value.dtype), tuple(value.shape)).copy_(source)

    def read(self, buffer: Any, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        return self.view(buffer, dtype, shape).cpu().numpy()  # a copy: .cpu() of a CUDA tensor

    def view(self, buffer: Any, dtype: np.dtype, shape: tuple[int, ...]) -> Any:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return buffer[:nbytes].view(getattr(self._torch, dtype.name)).view(shape)

    def wait(self) -> None:
        """ONNX Runtime runs on its own stream: what torch queued (copies, the caller's writes) must land first."""
        self._torch.cuda.current_stream(self.device).synchronize()


@dataclass
class _Slot:
    """One session with its IO binding and its buffers at the max shapes, at fixed addresses."""

    session: Any
    binding: Any
    buffers: dict[str, Any]  # tensor name -> buffer
    graph_ids: dict[tuple[tuple[int, ...], ...], int] = field(default_factory=dict)  # input shapes -> gpu_graph_id


class OnnxRuntimeCudaRunner(Runner):
    """The folder's graph on ONNX Runtime's CUDA provider with IO binding (module doc).

    graph: a file name of the folder; by default the engine's graph (model.fp16.onnx for an FP16 folder, computed in
    float16).  device: "cuda", "cuda:<n>", or "cpu" (the same binding on the CPU provider).  sessions: the pool's
    size.  cuda_graph: capture and replay one CUDA graph per input shape.
    """

    backend = "onnxruntime-cuda"

    def __init__(
        self,
        folder: ArtifactFolder,
        *,
        graph: str | None = None,
        device: str = "cuda",
        sessions: int = DEFAULT_SESSIONS,
        cuda_graph: bool = False,
        split_large_batches: bool = True,
    ):
        import onnxruntime as ort

        super().__init__(folder, split_large_batches=split_large_batches)
        self.placement = Placement.parse(device)
        on_cuda = self.placement.device_type == "cuda"
        if sessions < 1:
            raise PipelineError(f"sessions={sessions}", "give at least 1 session")
        if cuda_graph and not on_cuda:
            raise PipelineError("cuda_graph=True captures CUDA graphs, which need device='cuda'", "load on a GPU")
        if on_cuda:
            require_cuda_provider()
        self.graph, which = choose_graph(folder, graph, on_cpu=not on_cuda)
        self.cuda_graph = cuda_graph
        self._dims = _dim_sources(self.manifest.inputs, self.manifest.outputs)
        self._max_shapes = {spec.name: self._max_shape(spec) for spec in (*self.inputs, *self.outputs)}
        self._memory = TorchCudaBuffers(self.placement) if on_cuda else HostBuffers(self.placement)
        self._slots = [self._slot() for _ in range(sessions)]
        self._idle: queue.Queue[_Slot] = queue.Queue()
        for slot in self._slots:
            self._idle.put(slot)
        used = self._slots[0].session.get_providers()
        graphs = ", a CUDA graph captured per input shape" if cuda_graph else ""
        tf32 = ", TF32 off (float32 ops stay float32)" if on_cuda else ""
        self.description = (
            f"onnxruntime {ort.__version__} running {self.graph} ({which}) on {', '.join(used)} with IO binding to "
            f"buffers pre-allocated on {device} at the max shapes{graphs}{tf32}, {sessions} session(s)"
        )

    # ------------------------------------------------------------------ loading

    def _max_shape(self, spec: TensorSpec) -> tuple[int, ...]:
        """The largest shape of a tensor: the profile's max batch, each named dim at the top of its range."""
        tensors = self.manifest.inputs + self.manifest.outputs
        dims = next(tensor.shape for tensor in tensors if tensor.name == spec.name)
        shape = []
        for axis, dim in enumerate(dims):
            if isinstance(dim, int):
                shape.append(dim)
            elif axis == BATCH_AXIS:
                shape.append(self.max_batch)
            elif isinstance(dim, str) and dim in self.manifest.axis_ranges:
                shape.append(self.manifest.axis_ranges[dim][2])
            else:
                raise PipelineError(
                    f"tensor {spec.name!r} has dim {axis} of unbounded size ({dim!r}), so its buffer cannot be "
                    "allocated ahead",
                    "use backend='onnxruntime', or rebuild with a DYNAMIC range for that axis: "
                    f"{rebuild_hint(self.manifest)}",
                )
        return tuple(shape)

    def _provider(self) -> list[Any]:
        if self.placement.device_type == "cpu":
            return [CPU]
        options = {
            "device_id": str(self.placement.device_id),
            "use_tf32": "0",
            "enable_cuda_graph": "1" if self.cuda_graph else "0",
        }
        # The CPU provider serves the nodes the CUDA one has no kernel for; with a CUDA graph none may (_slot).
        return [(CUDA, options), CPU]

    def _slot(self) -> _Slot:
        try:
            session = load_session(self.folder, self.graph, self._provider(), no_cpu_fallback=self.cuda_graph)
        except PipelineError as error:
            # With the CPU fallback disabled, a node without a CUDA kernel fails the load; ORT's own message stays in.
            if self.cuda_graph:
                raise PipelineError(
                    f"cuda_graph=True: ONNX Runtime captures a CUDA graph only where every node of {self.graph} runs "
                    f"on {CUDA}, and here some would fall back to the CPU ({error.problem})",
                    "load without cuda_graph (the nodes left on the CPU then run between the CUDA kernels)",
                ) from None
            raise
        buffers = {
            spec.name: self._memory.alloc(int(np.prod(self._max_shapes[spec.name])) * spec.dtype.itemsize)
            for spec in (*self.inputs, *self.outputs)
        }
        return _Slot(session, session.io_binding(), buffers)

    # ------------------------------------------------------------------ inference

    def _check(self, feed: Mapping[str, Any]) -> int:
        return check_feed(feed, self.inputs, describe=self._memory.describe)

    def _run(self, feed: Mapping[str, Any]) -> dict[str, np.ndarray]:
        slot = self._idle.get()  # blocks while every session is busy
        try:
            for spec in self.inputs:
                self._memory.write(slot.buffers[spec.name], feed[spec.name])
            shapes = self._execute(slot, feed, {})
            return {
                spec.name: self._memory.read(slot.buffers[spec.name], spec.dtype, shapes[spec.name])
                for spec in self.outputs
            }
        finally:
            self._idle.put(slot)

    def infer_on_device(self, feed: Mapping[str, Any], outputs: Mapping[str, Any]) -> Mapping[str, Any]:
        """Device-resident inference, as the engine runner's: inputs already on the device (torch CUDA tensors; numpy
        arrays on device='cpu'), results written into the caller's `outputs` (contiguous, of the output's dtype and
        exact shape), no host copy, at most max_batch rows.  Returns `outputs` once written.  The caller's tensors
        are bound in place; with a CUDA graph, whose addresses are fixed, they are copied to and from its buffers on
        the device."""
        self._refuse_if_closed()
        batch = self._check(feed)
        if batch > self.max_batch:
            raise PipelineError(
                f"infer_on_device got {batch} rows, more than the profile's max batch {self.max_batch}",
                f"send at most {self.max_batch} rows per call",
            )
        shapes = self._output_shapes(feed)
        for spec in self.outputs:
            self._check_output(spec, shapes[spec.name], outputs)
        slot = self._idle.get()
        try:
            if not self.cuda_graph:
                self._execute(slot, feed, {**feed, **outputs})
                return outputs
            for spec in self.inputs:
                self._memory.write(slot.buffers[spec.name], feed[spec.name])
            self._execute(slot, feed, {})
            for spec in self.outputs:
                outputs[spec.name].copy_(self._memory.view(slot.buffers[spec.name], spec.dtype, shapes[spec.name]))
            self._memory.wait()  # the copies out, queued on torch's stream
            return outputs
        finally:
            self._idle.put(slot)

    def _check_output(self, spec: TensorSpec, shape: tuple[int, ...], outputs: Mapping[str, Any]) -> None:
        if spec.name not in outputs:
            raise PipelineError(f"no tensor given for output {spec.name!r}", f"pass outputs={{{spec.name!r}: tensor}}")
        dtype, given = self._memory.describe(spec.name, outputs[spec.name])
        if dtype != spec.dtype or tuple(given) != shape:
            raise PipelineError(
                f"output tensor {spec.name!r} is {dtype} {tuple(given)}, this call writes {spec.dtype} {shape}",
                f"allocate it with dtype {spec.dtype} and shape {shape} on {self.placement.device_type}",
            )

    def _output_shapes(self, feed: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        """Each output's shape from this call's inputs: its named dims are sizes of input dims of the same name."""
        sizes = {dim: tuple(feed[name].shape)[axis] for dim, (name, axis) in self._dims.items()}
        return {
            tensor.name: tuple(dim if isinstance(dim, int) else sizes[dim] for dim in tensor.shape)  # type: ignore[index]
            for tensor in self.manifest.outputs
        }

    def _execute(self, slot: _Slot, feed: Mapping[str, Any], in_place: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        """Bind this call's shapes (the slot's buffers, or the tensors of `in_place` by name) and run; the output
        shapes."""
        import onnxruntime as ort

        where = (self.placement.device_type, self.placement.device_id)
        shapes = self._output_shapes(feed)
        bound = {**{spec.name: tuple(feed[spec.name].shape) for spec in self.inputs}, **shapes}
        addresses = {name: self._memory.address(in_place.get(name, buffer)) for name, buffer in slot.buffers.items()}
        for spec in self.inputs:
            slot.binding.bind_input(spec.name, *where, spec.dtype.type, bound[spec.name], addresses[spec.name])
        for spec in self.outputs:
            slot.binding.bind_output(spec.name, *where, spec.dtype.type, bound[spec.name], addresses[spec.name])
        self._memory.wait()
        options = ort.RunOptions()
        if self.cuda_graph:
            key = tuple(bound[spec.name] for spec in self.inputs)
            graph_id = slot.graph_ids.setdefault(key, len(slot.graph_ids))
            options.add_run_config_entry("gpu_graph_id", str(graph_id))
        try:
            slot.session.run_with_iobinding(slot.binding, options)
        except Exception as error:  # names and shapes were checked: what is left is in the values (ORT's types)
            raise PipelineError(
                f"ONNX Runtime could not run {self.graph} on these inputs: {type(error).__name__}: {error}",
                "check the input values: integer inputs such as token ids must lie within the range the model "
                "was built for (an embedding's rows)",
            ) from None
        return shapes

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Wait for in-flight calls, then drop every session and buffer."""
        if self._closed:
            return
        self._closed = True
        for _ in self._slots:
            self._idle.get()  # each slot comes back when its call finishes
        self._slots.clear()


def _dim_sources(inputs: Sequence[GraphTensor], outputs: Sequence[GraphTensor]) -> dict[str, tuple[str, int]]:
    """Named dim -> (input name, axis) where its size is read at each call (the first input that has it).  An output
    dim no input names has a data-dependent size: its buffer could not be bound ahead, so it is refused at load."""
    sources: dict[str, tuple[str, int]] = {}
    for tensor in inputs:
        for axis, dim in enumerate(tensor.shape):
            if isinstance(dim, str):
                sources.setdefault(dim, (tensor.name, axis))
    for tensor in outputs:
        if any(not isinstance(dim, int) and dim not in sources for dim in tensor.shape):
            raise PipelineError(
                f"output {tensor.name!r} has a data-dependent shape {list(tensor.shape)}, which IO binding to buffers "
                "allocated ahead does not support",
                "use backend='onnxruntime', or export the model with outputs whose shape follows from the inputs'",
            )
    return sources
