"""The ONNX Runtime CUDA runner: the folder's graph on ONNX Runtime's CUDA provider through IO binding.

Where no engine runs (a Hopper GPU, whose TensorRT-RTX refuses it, with no full TensorRT), this is the GPU path:
the folder's graph as it is (an FP16 graph computes in real float16 on the GPU, unlike on the CPU provider), its
inputs and outputs bound to buffers allocated once at the profile's max shapes, so a call allocates nothing.

The check stage names every output dim that follows from the inputs' after them, or by an expression of them
("2*seq", a strided convolution's "floor(height/2 - 1/2) + 1": stages/output_dims.py); the runner sizes such a buffer
by the expression's largest value over the inputs' ranges.  An output with a dim the inputs do not give (a count
only the data decides, as NonZero's) has no max shape: it is bound to the device alone, ONNX Runtime allocates it at
each run at the size the run finds, and the runner copies it out.  Such a graph runs without a CUDA graph, whose
replay needs every address fixed: cuda_graph=True is refused for it (CaptureRefused, which auto's candidate then
opens uncaptured).

Every float32 op stays float32: the CUDA provider's `use_tf32` is 0 (its default, 1, lets cuBLAS/cuDNN round FP32
matmuls and convolutions to TF32's 10-bit mantissa, which the gates never judged).

Threads: a small pool of slots (default 2), each one session with its own IO binding and buffers, handed out
through a queue like the engine runner's execution contexts.  Each slot has its own session because a captured CUDA
graph belongs to its session and replays that session's fixed addresses.

cuda_graph=True turns on the provider's CUDA graph (`enable_cuda_graph`): one graph captured per input shape
(`gpu_graph_id`, a new id per shape seen), replayed on the slot's fixed buffers, which removes the per-kernel launch
cost at small batches.  Each captured graph keeps its own memory, so a slot captures its first MAX_GRAPHS shapes and
runs any other shape uncaptured (gpu_graph_id -1), with the same results.  ONNX Runtime captures only a session
whose every compute node runs on CUDA; it refuses the others at load, and the runner says so.

The binding code takes its placement as a parameter: device="cpu" runs the same IO binding, pool and checks on
ONNX Runtime's CPU provider (numpy buffers), which is how they are tested on machines without a GPU.
"""

from __future__ import annotations

import itertools
import queue
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..core.errors import PipelineError
from ..core.settings import mention_name
from ..core.trt_module import gpu_present
from ..folder.graph_io import Dim, GraphTensor, dim_size
from ..folder.reader import ArtifactFolder
from ..folder.rebuild import rebuild_hint
from .attention import fuse_attention
from .base import BATCH_AXIS, Runner, TensorSpec, _dtype_and_shape, check_feed
from .conv_bias import KEEP_BIAS_ADD, split_conv_bias
from .device_memory import DeviceMemory, open_device_memory
from .onnxruntime import CPU, CUDA, choose_graph, load_session, run_error
from .shape_values import make_on_device
from .tensorrt import _numpy_or_torch_cuda

DEFAULT_SESSIONS = 2
# The CUDA provider's options that decide speed (one owner; the runner's provider_options= changes them per runner,
# as tools/device/ort_cuda.py does to measure variants of them on a GPU).  use_tf32=0 keeps float32 ops float32, as
# the gates judged them.  prefer_nhwc=1: convolutions in NHWC, which cuDNN's tensor-core kernels take without
# transposes; on an H100, ResNet-50's FP16 graph with CUDA graphs ran
# device-resident at 2.80 against 3.48 ms in NCHW at batch 32, 0.60 against 0.85 at 1 (run 1)
# (docs/benchmarks/resnet50-h100-cuda.md; cuDNN's HEURISTIC search changed nothing in an earlier run of it).  A graph
# without convolutions runs as before.  fuse_conv_bias stays off: there it made ResNet-50 slower (4.65 vs 3.47 ms at
# 32 with CUDA graphs).
TUNING = {"use_tf32": "0", "prefer_nhwc": "1"}
# Each convolution's bias added by ONNX Runtime's Add, not cuDNN's (pipeline.runners.conv_bias: ResNet-50 at batch 32
# 2.79 against 3.45 ms with CUDA graphs on an H100).  On the CPU placement too, so that the tests there run the graph
# the GPU runs.
SPLIT_CONV_BIAS = True
# Each one-element shape value a CUDA kernel reads as data made on the device by a Range
# (pipeline.runners.shape_values), so that ONNX Runtime adds no Memcpy node and captures the graph: BERT and DistilBERT
# folders ran uncaptured on an H200 for one such value, their padding mask's sequence length.  The outputs stay the
# same bit for bit; on the CPU placement too, so that the tests there run the graph the GPU runs.
SHAPE_VALUES_ON_DEVICE = True
# A transformer's attention, LayerNorms and GELU as ONNX Runtime's fused kernels (pipeline.runners.attention), where
# its rules find an attention; other graphs open as they are.  Not yet measured on a GPU: auto times the runner as it
# opens, and its host check in a child process proves the fused graph within the precision's gate before it serves.
FUSE_ATTENTION = True
# The runner without its tuning: NCHW convolutions, each bias added by cuDNN, a transformer's graph as exported (the
# shape values stay on the device, which changes no output bit and keeps the graph capturable).  The tuning was
# measured on ResNet-50 and two encoders only, so auto times each CUDA graph this way too and serves what wins on
# the model; where a rewrite fails on the GPU (a kernel of its own, a fused graph), the graph still serves untuned.
UNTUNED: dict[str, Any] = {"provider_options": {"prefer_nhwc": "0"}, "split_conv_bias": False, "fuse_attention": False}
# Input shapes a slot captures a CUDA graph for (cuda_graph=True); other shapes run uncaptured.  On the H100 each
# graph captured after the largest batch's added under 1 MiB to a ResNet-50 slot's 598 MiB: the arena, sized by the
# largest batch, is the cost, not the number of graphs.
MAX_GRAPHS = 8
UNCAPTURED = "-1"  # ONNX Runtime's gpu_graph_id for a run that neither captures nor replays
# A contiguous numpy input goes to the GPU straight from the caller's array, not through a page-locked copy: on an
# H100, ResNet-50's 19 MB batch of 32 took 4.76 ms end to end against 5.70 (tools/device/ort_cuda.py measures both,
# the second with the runner's pinned_copies=True).  Each output comes back the same way, straight into the array
# returned (the driver stages it in chunks too), not through the twin and a second whole copy out of it: a DistilBERT's
# output at batch 32 is 12.6 MB; not yet timed on a GPU.
STRAIGHT_FROM_PAGEABLE = True
# The provider options the runner sets from its own keywords (device=, cuda_graph=), not from provider_options=.
OWN_PROVIDER_OPTIONS = {"device_id": "device", "enable_cuda_graph": "cuda_graph"}


def what_the_runner_computes() -> dict[str, Any]:
    """The settings that change what the runner computes on a graph (a cached host check of it holds only while
    they stay as they were: pipeline.runners.fastest.host_key)."""
    return {
        **TUNING,
        "split_conv_bias": SPLIT_CONV_BIAS,
        "shape_values_on_device": SHAPE_VALUES_ON_DEVICE,
        "fuse_attention": FUSE_ATTENTION,
        "untuned": UNTUNED,
    }


class CaptureRefused(PipelineError):
    """cuda_graph=True on a graph with nodes ONNX Runtime places on the CPU, which it cannot capture."""


def require_cuda_provider() -> None:
    """Refuse, with the fix, a host where ONNX Runtime's CUDA provider cannot run: not compiled in (the `cpu`
    extra's onnxruntime), or compiled in without a GPU (onnxruntime-gpu lists it as available even then)."""
    import onnxruntime as ort

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


def _nbytes(dtype: np.dtype, shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


class HostBuffers:
    """Buffers in host memory for the CPU provider; values "on the device" are contiguous numpy arrays.

    The interface the runner binds through, whatever the placement: a slot's stream, buffers at fixed addresses,
    copies into and out of them, and the waits that order those copies around ONNX Runtime's run.
    """

    def __init__(self, placement: Placement):
        self.placement = placement

    def enter(self) -> None:
        """Make the device current on the calling thread (a host has nothing to make current)."""

    def leave(self) -> None:
        """Undo enter()."""

    def stream(self) -> Any:
        return None

    def alloc(self, nbytes: int) -> Any:
        return np.empty(nbytes, dtype=np.uint8)

    def address(self, value: Any) -> int:
        return int(value.ctypes.data)

    def describe(self, name: str, value: Any) -> tuple[np.dtype, tuple[int, ...]]:
        """(dtype, shape) of an input to infer() that is not exactly an np.ndarray (check_feed)."""
        return _dtype_and_shape(name, value)

    def on_device(self, name: str, value: Any) -> tuple[np.dtype, tuple[int, ...]]:
        """(dtype, shape) of a value infer_on_device binds in place: a contiguous numpy array here."""
        dtype, shape = _dtype_and_shape(name, value)
        if not value.flags.c_contiguous:
            raise PipelineError(f"tensor {name!r} is not contiguous", f"pass np.ascontiguousarray({name})")
        return dtype, shape

    def write(self, buffer: Any, value: Any, stream: Any) -> None:
        """The rows of `value` into the start of `buffer` (a strided array made contiguous on the way)."""
        np.copyto(buffer[: value.nbytes].view(value.dtype).reshape(value.shape), value)

    def copy_out(self, value: Any, buffer: Any, stream: Any) -> None:
        """The start of `buffer` into the caller's `value` (as large as the rows this call wrote)."""
        np.copyto(value, buffer[: value.nbytes].view(value.dtype).reshape(value.shape))

    def read(self, buffer: Any, dtype: np.dtype, shape: tuple[int, ...], stream: Any) -> np.ndarray:
        return buffer[: _nbytes(dtype, shape)].view(dtype).reshape(shape).copy()  # the next call reuses the buffer

    def copy_from_run(self, value: Any, allocated: Any, stream: Any) -> None:
        """An output ONNX Runtime allocated in the run (an OrtValue of `value`'s size) into the caller's `value`."""
        np.copyto(value, allocated.numpy())

    def written(self, values: list[Any]) -> None:
        """The caller's own writes to `values` have landed: nothing is queued on a host."""

    def ready(self, stream: Any) -> None:
        """The copies queued on `stream` for the run have landed: nothing is queued here."""

    def finish(self, stream: Any) -> None:
        """The copies queued on `stream` have landed: nothing is queued here."""

    def close(self) -> None:
        """Free what was allocated (numpy's buffers go with the slots)."""


class DeviceBuffers(HostBuffers):
    """Buffers in GPU memory through the engine runner's device-memory layer (pycuda or cuda-python: the gpu extra),
    each with a page-locked twin for asynchronous copies on its slot's stream.  Values "on the device" are
    contiguous torch CUDA tensors on this GPU, used in place (torch works on the same primary context)."""

    def __init__(self, placement: Placement, layer: str = "auto", straight: bool = STRAIGHT_FROM_PAGEABLE):
        super().__init__(placement)
        self.memory: DeviceMemory = open_device_memory(layer, placement.device_id)
        self.straight = straight
        self._buffers: list[_DeviceBuffer] = []
        self._streams: list[Any] = []

    def enter(self) -> None:
        self.memory.push()

    def leave(self) -> None:
        self.memory.pop()

    def stream(self) -> Any:
        self._streams.append(self.memory.stream())
        return self._streams[-1]

    def alloc(self, nbytes: int) -> Any:
        buffer = _DeviceBuffer(self.memory.alloc(nbytes), self.memory.pinned(nbytes))
        self._buffers.append(buffer)
        return buffer

    def address(self, value: Any) -> int:
        return value.address if isinstance(value, _DeviceBuffer) else int(value.data_ptr())

    def describe(self, name: str, value: Any) -> tuple[np.dtype, tuple[int, ...]]:
        dtype, shape = _numpy_or_torch_cuda(name, value)
        if not isinstance(value, np.ndarray) and value.device.index != self.placement.device_id:
            raise PipelineError(
                f"tensor {name!r} is on cuda:{value.device.index}, the runner on cuda:{self.placement.device_id}",
                f"move it first: {name}.to('cuda:{self.placement.device_id}')",
            )
        return dtype, shape

    def on_device(self, name: str, value: Any) -> tuple[np.dtype, tuple[int, ...]]:
        if isinstance(value, np.ndarray):
            raise PipelineError("infer_on_device takes torch CUDA tensors only", "use infer() for numpy arrays")
        return self.describe(name, value)

    def write(self, buffer: Any, value: Any, stream: Any) -> None:
        if isinstance(value, np.ndarray) and value.flags.c_contiguous and self.straight:
            # The driver stages pageable memory itself, in chunks that overlap the host copy with the transfer; a
            # whole copy into the twin first put the two one after the other.
            self.memory.h2d_async(buffer.address, value.reshape(-1).view(np.uint8), value.nbytes, stream)
        elif isinstance(value, np.ndarray):  # through the page-locked twin: np.copyto makes a strided input contiguous
            np.copyto(buffer.host[: value.nbytes].view(value.dtype).reshape(value.shape), value)
            self.memory.h2d_async(buffer.address, buffer.host, value.nbytes, stream)
        else:
            self.memory.d2d_async(buffer.address, int(value.data_ptr()), value.numel() * value.element_size(), stream)

    def copy_out(self, value: Any, buffer: Any, stream: Any) -> None:
        self.memory.d2d_async(int(value.data_ptr()), buffer.address, value.numel() * value.element_size(), stream)

    def copy_from_run(self, value: Any, allocated: Any, stream: Any) -> None:
        # The run has synchronized its stream (ONNX Runtime's default), so the value is complete on the device.
        self.memory.d2d_async(int(value.data_ptr()), allocated.data_ptr(), value.numel() * value.element_size(), stream)

    def read(self, buffer: Any, dtype: np.dtype, shape: tuple[int, ...], stream: Any) -> np.ndarray:
        nbytes = _nbytes(dtype, shape)
        if self.straight:
            value = np.empty(shape, dtype)
            self.memory.d2h_async(value.reshape(-1).view(np.uint8), buffer.address, nbytes, stream)
            self.memory.sync(stream)
            return value
        self.memory.d2h_async(buffer.host, buffer.address, nbytes, stream)
        self.memory.sync(stream)
        return buffer.host[:nbytes].view(dtype).reshape(shape).copy()  # the next call reuses the twin

    def written(self, values: list[Any]) -> None:
        """A torch tensor may still be being written on torch's stream (as in the engine runner): wait for it before
        a copy or ONNX Runtime, on streams of their own, read it."""
        tensors = [value for value in values if not isinstance(value, (np.ndarray, _DeviceBuffer))]
        if tensors:
            import torch

            torch.cuda.current_stream(tensors[0].device).synchronize()

    def ready(self, stream: Any) -> None:
        """ONNX Runtime runs on a stream of its own: the copies in must have landed."""
        self.memory.sync(stream)

    def finish(self, stream: Any) -> None:
        self.memory.sync(stream)

    def close(self) -> None:
        self.memory.push()
        try:
            for buffer in self._buffers:
                self.memory.free(buffer.address)
                self.memory.free_pinned(buffer.host)
            for stream in self._streams:
                self.memory.destroy_stream(stream)
        finally:
            self.memory.pop()
        self.memory.close()


@dataclass(frozen=True)
class _DeviceBuffer:
    address: int  # device memory, sized for the tensor's max shape
    host: np.ndarray  # its page-locked twin, the same size


@dataclass
class _Slot:
    """One session with its IO binding and its buffers at the max shapes, at fixed addresses."""

    session: Any
    binding: Any
    buffers: dict[str, Any]  # tensor name -> buffer
    stream: Any  # the copies into and out of the buffers (None on a host)
    graph_ids: dict[tuple[tuple[int, ...], ...], int] = field(default_factory=dict)  # input shapes -> gpu_graph_id
    bound: tuple = ()  # the (name, shape, address) of each tensor its binding holds now
    run_options: dict[str, Any] = field(default_factory=dict)  # gpu_graph_id -> the RunOptions that name it


class OnnxRuntimeCudaRunner(Runner):
    """The folder's graph on ONNX Runtime's CUDA provider with IO binding (module doc).

    graph: a file name of the folder; by default the engine's graph (model.fp16.onnx for an FP16 folder, computed in
    float16).  device: "cuda", "cuda:<n>", or "cpu" (the same binding on the CPU provider).  sessions: the pool's
    size.  cuda_graph: capture and replay one CUDA graph per input shape.  device_memory: the device-memory layer
    of the GPU buffers ("auto", "pycuda", "cuda-python"; pipeline.runners.device_memory).

    What the defaults were measured against, to measure again (auto times each graph with the defaults and with
    UNTUNED, the first three of these): provider_options, the CUDA provider's options over TUNING's (e.g.
    {"prefer_nhwc": "0"}); split_conv_bias=False, each convolution adding its bias in cuDNN; fuse_attention=False, a
    transformer's graph as exported; pinned_copies=True, numpy inputs and outputs copied through a page-locked buffer.
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
        device_memory: str = "auto",
        split_large_batches: bool = True,
        provider_options: dict[str, str] | None = None,
        split_conv_bias: bool = SPLIT_CONV_BIAS,
        fuse_attention: bool = FUSE_ATTENTION,
        pinned_copies: bool = not STRAIGHT_FROM_PAGEABLE,
    ):
        import onnxruntime as ort

        super().__init__(folder, split_large_batches=split_large_batches)
        self.placement = Placement.parse(device)
        self.provider_options = {**TUNING, **_checked_provider_options(provider_options or {})}
        self.split_conv_bias = split_conv_bias
        self.fuse_attention = fuse_attention
        on_cuda = self.placement.device_type == "cuda"
        if cuda_graph and not on_cuda:
            raise PipelineError("cuda_graph=True captures CUDA graphs, which need device='cuda'", "load on a GPU")
        if on_cuda:
            require_cuda_provider()
        record, which = choose_graph(folder, graph, on_cpu=not on_cuda)
        self.graph = record.file
        self.cuda_graph = cuda_graph
        self.bias_adds = 0  # convolutions whose bias an Add of its own adds (_rewrite)
        self.values_on_device = 0  # shape values a Range makes on the device (_rewrite)
        self.fused: dict[str, int] = {}  # ONNX Runtime's fused transformer kernels by op type (_rewrite)
        self._rewritten: tuple[bytes | None, list[str]] | None = None  # the first session's rewrite, for the others
        self._dims = _dim_sources(self.manifest.inputs)
        ranges = self._dim_ranges()
        self._sized_by_run = _sized_by_run(self.manifest.outputs, ranges, self.graph, cuda_graph)
        # Outputs with a dim computed from the inputs' ("2*seq"): _output_shapes checks that a call fits their buffers.
        self._computed = [
            tensor.name
            for tensor in self.manifest.outputs
            if tensor.name not in self._sized_by_run
            and any(isinstance(dim, str) and dim not in ranges for dim in tensor.shape)
        ]
        self._max_shapes = {spec.name: self._max_shape(spec) for spec in self.inputs}
        self._max_shapes.update(
            {
                tensor.name: tuple(_largest(dim, ranges) for dim in tensor.shape)  # type: ignore[misc]
                for tensor in self.manifest.outputs
                if tensor.name not in self._sized_by_run
            }
        )
        self._memory = (
            DeviceBuffers(self.placement, device_memory, straight=not pinned_copies)
            if on_cuda
            else HostBuffers(self.placement)
        )
        self._slots: list[_Slot] = []
        self._idle: queue.Queue[_Slot] = queue.Queue()
        loaded = False
        self._memory.enter()
        try:
            for _ in range(sessions):
                self._slots.append(self._slot())
            loaded = True
        finally:
            self._rewritten = None
            self._memory.leave()
            if not loaded:  # nothing half-allocated stays behind a failed load
                self._release()
        for slot in self._slots:
            self._idle.put(slot)
        self.description = f"onnxruntime {ort.__version__} running {self.graph} ({which}) " + self._described(
            device, provider_options
        )

    def _described(self, device: str, provider_options: dict[str, str] | None) -> str:
        """What the description says after the graph: the providers, buffers, captures and rewrites."""
        used = self._slots[0].session.get_providers()
        by_run = (
            f", outputs {sorted(self._sized_by_run)} allocated by ONNX Runtime at each run (sizes no input dim gives) "
            "and copied out, so no CUDA graph"
            if self._sized_by_run
            else ""
        )
        graphs = f", a CUDA graph captured per input shape (the first {MAX_GRAPHS})" if self.cuda_graph else ""
        on_cuda = isinstance(self._memory, DeviceBuffers)
        tf32 = ", TF32 off (float32 ops stay float32)" if on_cuda and self.provider_options["use_tf32"] == "0" else ""
        adds = f", {self.bias_adds} convolutions' biases added by an Add of their own" if self.bias_adds else ""
        if self.fused:
            kernels = ", ".join(f"{op} {count}" for op, count in sorted(self.fused.items()))
            adds += f", transformer layers fused into ONNX Runtime's kernels ({kernels}; the raw attention mask)"
        if self.values_on_device:
            made = self.values_on_device
            adds += f", {made} one-element shape value(s) made on the device by a Range (no Memcpy node)"
        given = f", provider options {provider_options}" if provider_options and on_cuda else ""
        pinned = (
            ", numpy inputs and outputs through a page-locked copy"
            if isinstance(self._memory, DeviceBuffers) and not self._memory.straight
            else ""
        )
        return (
            f"on {', '.join(used)} with IO binding to buffers pre-allocated on {device} at the max shapes{by_run}"
            f"{graphs}{tf32}{adds}{given}{pinned}, {len(self._slots)} session(s)"
            + (f", device memory via {self._memory.memory.name}" if isinstance(self._memory, DeviceBuffers) else "")
        )

    # ------------------------------------------------------------------ loading

    def _dim_ranges(self) -> dict[str, tuple[int, int]]:
        """(min, max) of each named input dim: the batch's from the profile, the others' from their DYNAMIC range."""
        ranges: dict[str, tuple[int, int]] = {}
        for tensor in self.manifest.inputs:
            for axis, dim in enumerate(tensor.shape):
                if isinstance(dim, str) and axis == BATCH_AXIS:
                    # From 1, not the profile's min: a wider range only widens _largest's search.
                    ranges.setdefault(dim, (1, self.max_batch))
                elif isinstance(dim, str) and dim in self.manifest.axis_ranges:
                    ranges.setdefault(dim, (self.manifest.axis_ranges[dim][0], self.manifest.axis_ranges[dim][2]))
        return ranges

    def _max_shape(self, spec: TensorSpec) -> tuple[int, ...]:
        """The largest shape of an input: the profile's max batch, each named dim at the top of its range."""
        dims = next(tensor.shape for tensor in self.manifest.inputs if tensor.name == spec.name)
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
                    f"use backend='onnxruntime', or rebuild with a {mention_name('dynamic')} range for that axis: "
                    f"{rebuild_hint(self.manifest)}",
                )
        return tuple(shape)

    def _provider(self) -> list[Any]:
        if self.placement.device_type == "cpu":
            return [CPU]
        options = {
            **self.provider_options,
            "device_id": str(self.placement.device_id),
            "enable_cuda_graph": "1" if self.cuda_graph else "0",
        }
        # The CPU provider serves the nodes the CUDA one has no kernel for; with a CUDA graph no compute node may.
        return [(CUDA, options), CPU]

    def _rewrite(self, graph: Path) -> list[str]:
        """load_session's rewrite: a transformer's layers fused, the convolutions' biases as Adds (and ConvAddFusion
        off where there are any), the shape values CUDA kernels read as data made on the device.  Done once: the
        next sessions' copies get the first's bytes (the fusion took 5 s on BERT's FP16 graph, 15 on its FP32 one,
        on two cores)."""
        if self._rewritten is not None:
            rewritten, undo = self._rewritten
            if rewritten is not None:
                graph.write_bytes(rewritten)
            return undo
        if self.fuse_attention:
            self.fused = fuse_attention(graph)
        if SHAPE_VALUES_ON_DEVICE:
            self.values_on_device = make_on_device(graph)
        if self.split_conv_bias:
            self.bias_adds = split_conv_bias(graph)
        undo = KEEP_BIAS_ADD if self.bias_adds else []
        changed = self.fused or self.values_on_device or self.bias_adds  # else the next copies are already the same
        self._rewritten = (graph.read_bytes() if changed else None, undo)
        return undo

    def _slot(self) -> _Slot:
        try:
            session = load_session(self.folder, self.graph, self._provider(), rewrite=self._rewrite)
        except PipelineError as error:
            # ONNX Runtime refuses to open a session for graph capture where a compute node is placed on the CPU
            # ("cannot use the graph capture feature ... all compute graph nodes have not been partitioned to the
            # CUDAExecutionProvider": the INT8 Q/DQ ResNet-50 on an H100, docs/benchmarks/resnet50-h100-cuda.md).
            if self.cuda_graph and "graph capture" in error.problem:
                raise CaptureRefused(
                    f"cuda_graph=True: ONNX Runtime captures a CUDA graph only where every compute node of "
                    f"{self.graph} runs on {CUDA}, and some do not here ({error.problem})",
                    "load without cuda_graph (the nodes left on the CPU then run between the CUDA kernels)",
                ) from None
            raise
        buffers = {
            spec.name: self._memory.alloc(_nbytes(spec.dtype, self._max_shapes[spec.name]))
            for spec in (*self.inputs, *self.outputs)
            if spec.name in self._max_shapes  # not the outputs ONNX Runtime allocates
        }
        return _Slot(session, session.io_binding(), buffers, self._memory.stream())

    # ------------------------------------------------------------------ inference

    def _check(self, feed: Mapping[str, Any]) -> int:
        return check_feed(feed, self.inputs, describe=self._memory.describe)

    def _run(self, feed: Mapping[str, Any]) -> dict[str, np.ndarray]:
        slot = self._idle.get()  # blocks while every session is busy
        self._memory.enter()  # this thread's current context, whichever thread created the runner
        try:
            self._stage_inputs(slot, feed)
            shapes = self._output_shapes(feed)
            by_run = self._execute(slot, feed, shapes, {})
            return {
                spec.name: by_run[spec.name].numpy()  # a copy to the host (onnxruntime-gpu copies from the device)
                if spec.name in by_run
                else self._memory.read(slot.buffers[spec.name], spec.dtype, shapes[spec.name], slot.stream)
                for spec in self.outputs
            }
        finally:
            self._memory.leave()
            self._idle.put(slot)

    def _stage_inputs(self, slot: _Slot, feed: Mapping[str, Any]) -> None:
        self._memory.written(list(feed.values()))
        for spec in self.inputs:
            self._memory.write(slot.buffers[spec.name], feed[spec.name], slot.stream)

    def infer_on_device(self, feed: Mapping[str, Any], outputs: Mapping[str, Any]) -> Mapping[str, Any]:
        """Device-resident inference, as the engine runner's: inputs already on the device (torch CUDA tensors; numpy
        arrays on device='cpu'), results written into the caller's `outputs` (contiguous, of the output's dtype and
        exact shape), no host copy, at most max_batch rows.  Returns `outputs` once written.  The caller's tensors
        are bound in place; with a CUDA graph, whose addresses are fixed, they are copied into and out of its
        buffers on the device.  An output whose size the run decides (a data-dependent dim) is allocated by ONNX
        Runtime and copied into the caller's tensor on the device, which must have the size this call writes (an
        infer() on the same inputs returns it), else the call is refused after the run."""
        self._refuse_if_closed()
        batch = self._check(feed)
        if batch > self.max_batch:
            raise PipelineError(
                f"infer_on_device got {batch} rows, more than the profile's max batch {self.max_batch}",
                f"send at most {self.max_batch} rows per call",
            )
        for spec in self.inputs:
            self._memory.on_device(spec.name, feed[spec.name])
        shapes = self._output_shapes(feed)
        for spec in self.outputs:
            self._check_output(spec, shapes.get(spec.name), outputs)
        slot = self._idle.get()
        self._memory.enter()
        try:
            if not self.cuda_graph:
                by_run = self._execute(slot, feed, shapes, {**feed, **outputs})
                self._take(by_run, outputs, slot.stream)
                return outputs
            self._stage_inputs(slot, feed)
            self._execute(slot, feed, shapes, {})
            for spec in self.outputs:
                self._memory.copy_out(outputs[spec.name], slot.buffers[spec.name], slot.stream)
            self._memory.finish(slot.stream)
            return outputs
        finally:
            self._memory.leave()
            self._idle.put(slot)

    def _check_output(self, spec: TensorSpec, shape: tuple[int, ...] | None, outputs: Mapping[str, Any]) -> None:
        """The caller's tensor for an output: its dtype, and its shape where the inputs give it (`shape`; None for
        an output whose size the run decides, checked after the run by _take)."""
        if spec.name not in outputs:
            raise PipelineError(f"no tensor given for output {spec.name!r}", f"pass outputs={{{spec.name!r}: tensor}}")
        dtype, given = self._memory.on_device(spec.name, outputs[spec.name])
        if dtype != spec.dtype or (shape is not None and tuple(given) != shape):
            raise PipelineError(
                f"output tensor {spec.name!r} is {dtype} {tuple(given)}, this call writes {spec.dtype} {shape}",
                f"allocate it with dtype {spec.dtype} and shape {shape} on {self.placement.device_type}",
            )

    def _take(self, by_run: Mapping[str, Any], outputs: Mapping[str, Any], stream: Any) -> None:
        """The outputs ONNX Runtime allocated in this run (OrtValues) into the caller's tensors of the same size."""
        for name, value in by_run.items():
            shape = tuple(value.shape())
            if tuple(outputs[name].shape) != shape:
                raise PipelineError(
                    f"output {name!r} of this call is {shape} (a size its data decides), the tensor given is "
                    f"{tuple(outputs[name].shape)}",
                    "allocate it at the size this call writes: infer() on the same inputs returns the output",
                )
            self._memory.copy_from_run(outputs[name], value, stream)
        self._memory.finish(stream)

    def _output_shapes(self, feed: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        """The shape of each output the inputs size, from this call's inputs: its named dims are sizes of input dims
        of the same name or expressions of them (not the outputs ONNX Runtime allocates: _sized_by_run)."""
        sizes = {dim: tuple(feed[name].shape)[axis] for dim, (name, axis) in self._dims.items()}
        shapes = {
            tensor.name: tuple(
                dim if isinstance(dim, int) else sizes[dim] if dim in sizes else _size(dim, sizes)  # type: ignore[index]
                for dim in tensor.shape
            )
            for tensor in self.manifest.outputs
            if tensor.name not in self._sized_by_run
        }
        for name in self._computed:
            shape = shapes[name]
            if any(size > largest for size, largest in zip(shape, self._max_shapes[name], strict=True)):
                # Only an expression not largest at its range's ends gets here (_largest); never past the buffer.
                raise PipelineError(
                    f"output {name!r} of this call is {shape}, past the {self._max_shapes[name]} its buffer holds "
                    "(a dim whose expression is largest inside its inputs' range)",
                    "use backend='onnxruntime', which allocates each output at each call",
                )
        return shapes

    def _execute(
        self, slot: _Slot, feed: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], in_place: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Bind this call's inputs and its output `shapes` (the slot's buffers, or the tensors of `in_place` by
        name) and run; returns the outputs ONNX Runtime allocated (_sized_by_run), as OrtValues by name."""
        import onnxruntime as ort

        where = (self.placement.device_type, self.placement.device_id)
        bound = {**{spec.name: tuple(feed[spec.name].shape) for spec in self.inputs}, **shapes}
        addresses = {name: self._memory.address(in_place.get(name, buffer)) for name, buffer in slot.buffers.items()}
        # The binding keeps what was bound until it is bound again: a call of the shapes and addresses the last one
        # bound (every call of one batch size into the slot's buffers) binds nothing.
        binding = tuple((name, bound[name], addresses[name]) for name in slot.buffers)
        if binding != slot.bound:
            for spec in self.inputs:
                slot.binding.bind_input(spec.name, *where, spec.dtype.type, bound[spec.name], addresses[spec.name])
            for spec in self.outputs:  # in this order always: get_outputs() lists them so
                if spec.name in self._sized_by_run:
                    slot.binding.bind_output(spec.name, *where)
                else:
                    slot.binding.bind_output(spec.name, *where, spec.dtype.type, bound[spec.name], addresses[spec.name])
            slot.bound = binding
        else:
            # A run leaves the value it allocated bound, which the next run would take as given and refuse at another
            # size: bound to the device again, each run allocates its own.
            for name in self._sized_by_run:
                slot.binding.bind_output(name, *where)
        self._memory.written(list(in_place.values()))
        self._memory.ready(slot.stream)
        # RunOptions only to name a CUDA graph: ONNX Runtime's Python reads gpu_graph_id from any RunOptions it is
        # given, and one without it costs an exception inside, ~25 us a call (tiny_cnn on the CPU provider: 41.5 ->
        # 16 us a call).
        options = None
        if self.cuda_graph:
            graph_id = _graph_id(slot, tuple(bound[spec.name] for spec in self.inputs))
            if graph_id not in slot.run_options:
                slot.run_options[graph_id] = ort.RunOptions()
                slot.run_options[graph_id].add_run_config_entry("gpu_graph_id", graph_id)
            options = slot.run_options[graph_id]
        try:
            slot.session.run_with_iobinding(slot.binding, options)
        except Exception as error:  # names and shapes were checked: what is left is in the values (ORT's types)
            raise run_error(self.graph, error, self.inputs) from None
        if not self._sized_by_run:
            return {}
        values = slot.binding.get_outputs()  # in the order bound: self.outputs'
        return {
            spec.name: value
            for spec, value in zip(self.outputs, values, strict=True)
            if spec.name in self._sized_by_run
        }

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Wait for in-flight calls, then drop every session and free every buffer and stream."""
        if self._closed:
            return
        self._closed = True
        for _ in self._slots:
            self._idle.get()  # each slot comes back when its call finishes
        self._release()

    def _release(self) -> None:
        """Sessions first (they hold ONNX Runtime's own device memory), then the buffers and streams, then the
        context; also used when loading fails halfway."""
        self._slots.clear()
        self._memory.close()


def _checked_provider_options(options: dict[str, str]) -> dict[str, str]:
    """provider_options= less the ones the runner's own keywords set (refused, with the keyword to use)."""
    owned = sorted(set(options) & set(OWN_PROVIDER_OPTIONS))
    if owned:
        keywords = ", ".join(f"{OWN_PROVIDER_OPTIONS[name]}=" for name in owned)
        raise PipelineError(
            f"provider_options sets {', '.join(owned)}, which the runner sets from its own keywords",
            f"give {keywords} instead",
        )
    return options


def _graph_id(slot: _Slot, shapes: tuple[tuple[int, ...], ...]) -> str:
    """The slot's graph for these input shapes: the one captured for them, a new one while fewer than MAX_GRAPHS are,
    else none (UNCAPTURED)."""
    if shapes not in slot.graph_ids and len(slot.graph_ids) >= MAX_GRAPHS:
        return UNCAPTURED
    return str(slot.graph_ids.setdefault(shapes, len(slot.graph_ids)))


def _dim_sources(inputs: Sequence[GraphTensor]) -> dict[str, tuple[str, int]]:
    """Named dim -> (input name, axis) where its size is read at each call (the first input that has it)."""
    sources: dict[str, tuple[str, int]] = {}
    for tensor in inputs:
        for axis, dim in enumerate(tensor.shape):
            if isinstance(dim, str):
                sources.setdefault(dim, (tensor.name, axis))
    return sources


def _size(dim: Dim, sizes: dict[str, int]) -> int:
    """The size of an output dim the inputs' dims give (_sized_by_run: fixed, an input's dim, or an expression of
    them) at a call's input dim `sizes`."""
    if isinstance(dim, int):
        return dim
    size = (sizes[dim] if dim in sizes else dim_size(dim, sizes)) if isinstance(dim, str) else None
    if size is None:  # a bug, not a caller's mistake: _sized_by_run leaves such outputs to ONNX Runtime
        raise ValueError(f"output dim {dim!r} is not given by the input dims {sizes}")
    return size


def _largest(dim: Dim, ranges: dict[str, tuple[int, int]]) -> int | None:
    """The largest size of an output dim over its inputs' ranges, None where the inputs' dims do not give it.  An
    expression (a convolution's "floor(height/2 - 1/2) + 1", "2*seq") is taken at every corner of the ranges: its
    largest where it grows or shrinks with each dim, as such sizes do (_output_shapes refuses any other)."""
    if isinstance(dim, int):
        return dim
    if dim is None:
        return None
    names = list(ranges)
    corners = itertools.product(*(ranges[name] for name in names))
    sizes = [dim_size(dim, dict(zip(names, corner, strict=True))) for corner in corners]
    return None if any(size is None for size in sizes) else max(sizes)  # type: ignore[type-var]


def _sized_by_run(
    outputs: Sequence[GraphTensor], ranges: dict[str, tuple[int, int]], graph: str, cuda_graph: bool
) -> frozenset[str]:
    """The outputs with a dim the inputs' dims do not give: a size only the data decides (NonZero's count), or one
    the check stage could not tie to the inputs (stages/output_dims.py names every dim it can after them).  Their
    buffers cannot be sized ahead: ONNX Runtime allocates them at each run, which a CUDA graph cannot replay
    (CaptureRefused)."""
    sized_by_run = frozenset(
        tensor.name for tensor in outputs if any(_largest(dim, ranges) is None for dim in tensor.shape)
    )
    if cuda_graph and sized_by_run:
        raise CaptureRefused(
            f"cuda_graph=True: outputs {sorted(sized_by_run)} of {graph} have sizes the inputs' dims do not give (a "
            "data-dependent dim, or one the check stage could not tie to them), which ONNX Runtime allocates at each "
            "run; a captured CUDA graph replays fixed addresses",
            "load without cuda_graph (each run then allocates those outputs on the device and copies them out)",
        )
    return sized_by_run
