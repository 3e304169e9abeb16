"""The backends the benchmark compares, each opened from one artifact folder.

Every backend answers `infer(host feed) -> host outputs` (the end-to-end mode, what a service
sees), and, where its data can live on a device, `stage(feed)` returns a call that runs on
inputs already copied there (the device-resident mode).  Backends that cannot run on this
machine raise `Unavailable` with the reason; the harness lists them as skipped.
"""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ...models.spec import call_module
from ..core.errors import PipelineError
from ..core.mentions import render
from ..core.precision import Precision
from ..core.trt_module import gpu_present
from ..folder.layout import MANIFEST, graph_record
from ..folder.reader import ArtifactFolder
from ..folder.rebuild import make_engine_command
from ..runners import Runner, load_runner
from ..runners.onnxruntime import choose_providers

if TYPE_CHECKING:
    from ..runners.torch import TorchRunner

REFERENCE = "torch"  # PyTorch eager FP32: the baseline for speed-ups and the reference for agreement
SERVED = "served"  # what `serve` runs on this machine: load_runner(folder, backend="auto")
CPU_DEVICE_NOTE = "not measured separately: it runs on the CPU, whose inputs already live in host memory"


class Unavailable(Exception):
    """This backend cannot run on this machine (no GPU, no engine, no INT8 graph); the message says why."""


@dataclass(frozen=True)
class Context:
    """What every backend is opened from."""

    folder: ArtifactFolder
    threads: int
    cuda: bool  # torch sees a CUDA device


class Backend:
    """One way of running the model, wrapped so the harness times every backend the same way."""

    def __init__(self, name: str, label: str, precision: Precision, description: str, threads: str):
        self.name = name
        self.label = label
        self.precision = precision  # of the arithmetic, for the agreement tolerance
        self.description = description
        self.threads = threads
        self.device_note = CPU_DEVICE_NOTE
        self.memory_note = "n/a: runs on the CPU (no device memory); process RSS cannot be split per backend"

    def infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """End to end: host arrays in, host arrays out."""
        raise NotImplementedError

    def stage(self, feed: dict[str, np.ndarray]) -> Callable[[], object] | None:
        """A call on inputs already on the device, or None where that mode is not measured (device_note says why)."""
        return None

    def sync(self) -> None:
        """Wait for queued device work; host-only backends have none."""

    def reset_peak_memory(self) -> None:
        """Start a fresh peak-memory window (where measurable)."""

    def peak_memory_bytes(self) -> int | None:
        """Peak device memory since reset_peak_memory, or None (memory_note says why)."""
        return None

    def close(self) -> None:
        """Free what the backend holds."""


class RunnerBackend(Backend):
    """A runner from pipeline.runners, timed through `infer`: exactly what a service calls."""

    def __init__(self, name: str, label: str, precision: Precision, runner: Runner, threads: str):
        super().__init__(name, label, precision, runner.description, threads)
        self.runner = runner

    def infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.runner.infer(feed)

    def close(self) -> None:
        self.runner.close()


class TorchBackend(RunnerBackend):
    """The PyTorch runner; on CUDA also device-resident, with torch.cuda's peak-memory counter."""

    def __init__(self, name: str, label: str, precision: Precision, runner: TorchRunner, threads: str):
        super().__init__(name, label, precision, runner, threads)
        self.device = runner.device
        self.on_cuda = runner.device.type == "cuda"
        self.torch_runner = runner
        if self.on_cuda:
            self.device_note = ""
            self.memory_note = (
                "this module's weights + torch.cuda.max_memory_allocated above what was allocated before one call "
                "(other backends' weights excluded)"
            )
        self._allocated_before = 0

    def stage(self, feed: dict[str, np.ndarray]) -> Callable[[], object] | None:
        if not self.on_cuda:
            return None
        runner = self.torch_runner
        tensors = {spec.name: torch.from_numpy(feed[spec.name]).to(self.device) for spec in runner.inputs}
        module, amp = runner.module, runner.amp

        def call() -> object:
            autocast = torch.autocast("cuda", dtype=torch.float16) if amp else contextlib.nullcontext()
            with torch.inference_mode(), autocast:
                return call_module(module, tensors)

        return call

    def sync(self) -> None:
        if self.on_cuda:
            torch.cuda.synchronize(self.device)

    def reset_peak_memory(self) -> None:
        if self.on_cuda:
            torch.cuda.synchronize(self.device)
            self._allocated_before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_memory_bytes(self) -> int | None:
        """Weights + activations of this backend: the allocator is shared by every torch backend in the process."""
        if not self.on_cuda:
            return None

        module = self.torch_runner.module
        weights = sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
        return int(weights + torch.cuda.max_memory_allocated(self.device) - self._allocated_before)


class SessionBackend(Backend):
    """A bare onnxruntime.InferenceSession with explicit options, beside the runner to expose its overhead."""

    def __init__(self, name: str, label: str, folder: ArtifactFolder, graph: str, threads: int):
        import onnxruntime as ort

        providers, why = choose_providers(None)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        with folder.private_graph(graph) as private:  # checked, its data file with it (pipeline.folder.reader)
            self.session = ort.InferenceSession(str(private), options, providers=providers)
        self.output_names = [o.name for o in self.session.get_outputs()]
        used = ", ".join(self.session.get_providers())
        description = f"onnxruntime {ort.__version__} bare InferenceSession on {graph}, {used} ({why}), "
        description += "ORT_ENABLE_ALL, sequential"
        super().__init__(
            name, label, Precision.FP32, description, f"intra_op_num_threads={threads}, inter_op_num_threads=1"
        )

    def infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.output_names, self.session.run(self.output_names, feed), strict=True))


# --------------------------------------------------------------------------- opening each backend


def _require_cuda(context: Context) -> None:
    if not context.cuda:
        raise Unavailable("needs a CUDA GPU: torch.cuda.is_available() is False on this machine")


def open_torch(context: Context) -> Backend:
    runner: Any = load_runner(context.folder, backend="torch", amp=False)
    return TorchBackend(REFERENCE, "PyTorch eager FP32", Precision.FP32, runner, _torch_threads(context))


def open_torch_amp(context: Context) -> Backend:
    _require_cuda(context)
    runner: Any = load_runner(context.folder, backend="torch", device="cuda", amp=True)
    return TorchBackend("torch-amp", "PyTorch eager AMP FP16", Precision.FP16, runner, _torch_threads(context))


def open_torch_compile(context: Context, mode: str | None = None) -> Backend:
    """torch.compile, default backend (inductor): AMP FP16 on a GPU; FP32 on a CPU, where inductor writes C++.
    mode="reduce-overhead" (GPU only): inductor's code replayed as CUDA graphs, what users reach for at low batch."""
    if mode is not None:
        _require_cuda(context)
    if context.cuda:
        runner: Any = load_runner(context.folder, backend="torch", device="cuda", amp=True)
        label, precision = "PyTorch torch.compile AMP FP16", Precision.FP16
    else:
        compiler = _inductor_cpp_compiler()
        runner = load_runner(context.folder, backend="torch", device="cpu", amp=False)
        label, precision = "PyTorch torch.compile FP32 (CPU)", Precision.FP32
        runner.description += f"; inductor compiles with {compiler}"
    # The runner calls `self.module`; compiling it in place keeps the runner's own host-copy path, so this row
    # differs from eager by the compiler alone.  Compilation happens in each batch's first (untimed) call,
    # whose time the report gives separately.
    runner.module = torch.compile(runner.module, mode=mode)
    runner.description += f"; module wrapped in torch.compile ({mode or 'default'} mode, inductor)"
    name = "torch-compile" + (f"-{mode}" if mode else "")
    label += f" (mode={mode!r})" if mode else ""
    return TorchBackend(name, label, precision, runner, _torch_threads(context))


def open_torch_compile_reduce_overhead(context: Context) -> Backend:
    return open_torch_compile(context, "reduce-overhead")


def _inductor_cpp_compiler() -> str:
    """The C++ compiler inductor will call on a CPU ("g++ (gcc 12.2.0)"); Unavailable where it finds none."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        compiler = get_cpp_compiler()  # inductor's own search: $CXX, else g++
    except Exception as error:  # torch raises its InvalidCxxCompiler, or an import fails on an older torch
        raise Unavailable(
            f"torch.compile's inductor backend needs a C++ compiler on a CPU and found none ({error}); "
            "install g++ (e.g. apt-get install g++) or set CXX"
        ) from None
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    return f"{compiler} ({version.splitlines()[0]})" if version else compiler


def open_served(context: Context) -> Backend:
    """Exactly what `serve` runs on this machine: load_runner(folder, backend="auto"), with its default options."""
    runner: Any = load_runner(context.folder, backend="auto")
    precision = context.folder.precision
    if runner.backend == "tensorrt":
        label = f"served here: the TensorRT engine {context.folder.engine}"
        return DeviceRunnerBackend(SERVED, label, precision, runner)
    graph = context.folder.path / runner.graph
    if runner.backend == "onnxruntime-cuda":
        label = f"served here: ONNX Runtime CUDA (IO binding runner) on {graph}"
        return DeviceRunnerBackend(SERVED, label, _precision_of(context.folder, runner.graph), runner)
    label = f"served here: ONNX Runtime (runner) on {graph}"
    threads = "ORT default: one intra-op thread per physical core"
    # auto may serve a graph more accurate than the folder's precision (FP32 where it runs faster): report that one.
    return _onnxruntime_backend(SERVED, label, _precision_of(context.folder, runner.graph), runner, graph, threads)


def _fp32_graph(folder: ArtifactFolder) -> str:
    """The folder's FP32 graph as it serves: model.onnx, or with POSTPROCESS=nms its NMS graph (model.nms.onnx)."""
    return graph_record(Precision.FP32, postprocess=folder.postprocess).file


def open_onnxruntime(context: Context) -> Backend:
    graph = _fp32_graph(context.folder)
    runner = _onnxruntime_runner(context.folder, graph)
    threads = "ORT default: one intra-op thread per physical core"
    return RunnerBackend("onnxruntime", f"ONNX Runtime FP32 (runner) on {graph}", Precision.FP32, runner, threads)


def open_onnxruntime_session(context: Context) -> Backend:
    graph = _fp32_graph(context.folder)
    if not context.folder.has(graph):
        raise Unavailable(f"{context.folder.path / graph} does not exist")
    label = "ONNX Runtime FP32 (bare session)"
    return SessionBackend("onnxruntime-session", label, context.folder, graph, context.threads)


def open_onnxruntime_int8(context: Context) -> Backend:
    folder = _int8_folder(context.folder)
    # No graph=: the runner picks as it would in a service (on a CPU, the graph shaped for ORT's CPU kernels).
    runner: Any = load_runner(folder, backend="onnxruntime")  # an OnnxRuntimeRunner: it names its .graph
    graph = folder / runner.graph
    threads = "ORT default: one intra-op thread per physical core"
    label = f"ONNX Runtime INT8 (runner) on {graph}"
    return _onnxruntime_backend("onnxruntime-int8", label, Precision.INT8, runner, graph, threads)


def _precision_of(folder: ArtifactFolder, graph: str) -> Precision:
    """The precision the folder's graph `graph` computes in, as its manifest records it."""
    record = folder.record(graph)
    assert record is not None  # a runner serves one of the folder's graphs (runners/onnxruntime.py choose_graph)
    return record.precision


def _onnxruntime_backend(
    name: str, label: str, precision: Precision, runner: Any, graph: Path, threads: str
) -> Backend:
    """The runner as a backend; an INT8 graph on the CPU provider also says how much of it really runs in int8."""
    backend = RunnerBackend(name, label, precision, runner, threads)
    on_cpu = "CPUExecutionProvider" in runner.description and "CUDAExecutionProvider" not in runner.description
    if precision is Precision.INT8 and on_cpu:
        backend.description += f"; {int8_execution_note(graph)}"
    return backend


def int8_execution_note(graph: Path) -> str:
    """How many Conv/MatMul/Gemm ONNX Runtime's CPU provider really runs in int8 after its graph optimizations.

    ORT fuses DequantizeLinear -> Conv -> QuantizeLinear into QLinearConv only when every Conv input
    (bias included, as int32) comes from a DequantizeLinear and the output goes straight into a
    QuantizeLinear.  A graph with Q/DQ on the inputs only (TensorRT's placement: Conv -> Relu -> Q,
    float bias) keeps every Conv in FP32 between Q/DQ nodes, and then runs slower than the FP32 graph;
    the CPU-shaped graph (calibration/qdq_cpu.py) is built to fuse.
    """
    from ...calibration.qdq_cpu import int8_kernel_counts

    counts = int8_kernel_counts(graph, scratch=Path(tempfile.gettempdir()))  # never written into the folder read
    in_int8, in_float = counts["int8_kernels"], counts["float_kernels"]
    return (
        f"after ORT's graph optimizations {in_int8} of {in_int8 + in_float} Conv/MatMul/Gemm run as int8 kernels, "
        f"{in_float} in FP32 between Q/DQ nodes"
    )


class DeviceRunnerBackend(RunnerBackend):
    """A GPU runner with infer_on_device (the engine's, onnxruntime-cuda's); device-resident through it (torch CUDA
    tensors in and out)."""

    def __init__(self, name: str, label: str, precision: Precision, runner: Any):
        super().__init__(name, label, precision, runner, "n/a (GPU)")
        self.device_note = ""
        self.memory_note = f"n/a: the {runner.backend} runner does not report its device allocations"

    def stage(self, feed: dict[str, np.ndarray]) -> Callable[[], object] | None:
        runner: Any = self.runner  # a TensorRTRunner or an OnnxRuntimeCudaRunner
        inputs = {name: torch.from_numpy(value).cuda() for name, value in feed.items()}
        # One call on the host path gives the output shapes; the timed calls then write into these tensors.
        shapes = {name: value.shape for name, value in runner.infer(feed).items()}
        dtypes = {spec.name: getattr(torch, str(spec.dtype)) for spec in runner.outputs}
        outputs = {name: torch.empty(shape, dtype=dtypes[name], device="cuda") for name, shape in shapes.items()}
        return lambda: runner.infer_on_device(inputs, outputs)


def _tensorrt_opener(name: str, label: str, **options: Any) -> Callable[[Context], Backend]:
    """Open the engine through the runner with `options` (execution=, cuda_graphs=)."""

    def open_tensorrt(context: Context) -> Backend:
        folder = context.folder
        if not folder.has(folder.engine):
            raise Unavailable(f"{folder.path} has no {folder.engine}")
        if not gpu_present():
            raise Unavailable(f"running {folder.engine} needs an NVIDIA GPU and driver; none is usable here")
        try:
            runner = load_runner(folder, backend="tensorrt", **options)
        except PipelineError as error:
            raise Unavailable(f"{error.problem} ({error.fix})") from None
        return DeviceRunnerBackend(name, label, folder.precision, runner)

    return open_tensorrt


def _onnxruntime_cuda_opener(name: str, label: str, **options: Any) -> Callable[[Context], Backend]:
    """Open the folder's graph on ONNX Runtime's CUDA provider through the onnxruntime-cuda runner with `options`
    (cuda_graph=): end to end through infer, device-resident through infer_on_device."""

    def open_onnxruntime_cuda(context: Context) -> Backend:
        try:
            runner: Any = load_runner(context.folder, backend="onnxruntime-cuda", **options)
        except PipelineError as error:  # no CUDA provider or GPU here, or a graph the CUDA graph cannot capture
            raise Unavailable(f"{error.problem} ({error.fix})") from None
        precision = _precision_of(context.folder, runner.graph)
        return DeviceRunnerBackend(name, f"{label} on {runner.graph}", precision, runner)

    return open_onnxruntime_cuda


@dataclass(frozen=True)
class Choice:
    name: str
    label: str
    open: Callable[[Context], Backend]


# In run order; PyTorch eager FP32 first, because every other row is compared with it.
CHOICES = (
    Choice(REFERENCE, "PyTorch eager FP32 (always runs: the reference)", open_torch),
    Choice(SERVED, "what `serve` runs here: load_runner(folder, backend='auto'), engine or ONNX Runtime", open_served),
    Choice("torch-amp", "PyTorch eager, AMP autocast to FP16 (GPU)", open_torch_amp),
    Choice(
        "torch-compile",
        "PyTorch torch.compile (inductor): AMP FP16 on a GPU, FP32 on a CPU (needs a C++ compiler)",
        open_torch_compile,
    ),
    Choice(
        "torch-compile-reduce-overhead",
        "PyTorch torch.compile(mode='reduce-overhead'): AMP FP16, replayed as CUDA graphs (GPU)",
        open_torch_compile_reduce_overhead,
    ),
    Choice("onnxruntime", "ONNX Runtime on model.onnx (FP32) through the runner, best provider", open_onnxruntime),
    Choice("onnxruntime-session", "model.onnx in a bare InferenceSession (runner overhead)", open_onnxruntime_session),
    Choice(
        "onnxruntime-int8",
        "ONNX Runtime on the INT8 graph shaped for its CPU kernels (here or in <model>-int8/)",
        open_onnxruntime_int8,
    ),
    Choice(
        "onnxruntime-cuda",
        "the engine's graph on ONNX Runtime's CUDA provider, IO binding (GPU; end to end and device-resident)",
        _onnxruntime_cuda_opener("onnxruntime-cuda", "ONNX Runtime CUDA, IO binding (runner)"),
    ),
    Choice(
        "onnxruntime-cuda-graphs",
        "the same with a CUDA graph captured per input shape (GPU)",
        _onnxruntime_cuda_opener(
            "onnxruntime-cuda-graphs", "ONNX Runtime CUDA, IO binding + CUDA graphs (runner)", cuda_graph=True
        ),
    ),
    Choice(
        "tensorrt",
        "the TensorRT engine through the runner, its default execution (GPU)",
        _tensorrt_opener("tensorrt", "TensorRT engine (runner)"),
    ),
    Choice(
        "tensorrt-v2",
        "the engine through the runner with execute_v2 (GPU)",
        _tensorrt_opener("tensorrt-v2", "TensorRT engine, execute_v2", execution="v2"),
    ),
    Choice(
        "tensorrt-graphs",
        "the engine through the runner with TensorRT-RTX's CUDA graphs (GPU)",
        _tensorrt_opener("tensorrt-graphs", "TensorRT engine, execute_async_v3 + CUDA graphs", cuda_graphs=True),
    ),
)
NAMES = tuple(choice.name for choice in CHOICES)


def choices_for(names: list[str] | None) -> list[Choice]:
    """The chosen backends in run order, always starting with the reference; unknown names are refused."""
    if names is None:
        return list(CHOICES)
    unknown = [name for name in names if name not in NAMES]
    if unknown:
        raise PipelineError(f"unknown backend(s) {unknown}", f"choose from {', '.join(NAMES)}")
    wanted = {REFERENCE, *names}
    return [choice for choice in CHOICES if choice.name in wanted]


# --------------------------------------------------------------------------- helpers


def _int8_folder(folder: ArtifactFolder) -> Path:
    """This folder if it was built for int8, else the sibling engines/<model>-int8/ (load_runner checks it)."""
    if folder.precision is Precision.INT8:
        return folder.path
    sibling = folder.path.parent / f"{folder.model}-int8"
    if not (sibling / MANIFEST).is_file():
        settings = {**(folder.manifest.settings or {}), "precision": Precision.INT8, "calib": "<data>"}
        raise Unavailable(  # a reason the report writes down: worded here
            render(
                f"no INT8 graph: {folder.path} is built for {folder.precision} and {sibling} does not exist "
                f"({make_engine_command(settings)} writes it)"
            )
        )
    return sibling


def _onnxruntime_runner(folder: ArtifactFolder, graph: str) -> Runner:
    """The ONNX Runtime runner on the named graph of the folder (the runner's graph= option)."""
    if not folder.has(graph):
        raise Unavailable(f"{folder.path / graph} does not exist")
    return load_runner(folder, backend="onnxruntime", graph=graph)


def _torch_threads(context: Context) -> str:
    return f"torch.set_num_threads({context.threads})"
