"""On the GPU machine: our graphs on ONNX Runtime's CUDA provider (onnxruntime-gpu), for issues 23 and 36.

    python tools/device/ort_cuda.py build ENGINES CALIB [NAME...]  # FOLDERS (ResNet-50 FP16 + INT8, an encoder, ...)
    python tools/device/ort_cuda.py speed ENGINES OUT [NAME...]   # bench rows: served, the CUDA runner, variants
    python tools/device/ort_cuda.py fp16 ENGINES OUT               # the faithful FP16 check (CPU) vs real float16 (GPU)
    python tools/device/ort_cuda.py int8 ENGINES OUT               # the Q/DQ graph on CUDA vs its CPU simulation
    python tools/device/ort_cuda.py profile ENGINES OUT            # ResNet-50 FP16 at batch 32: each row's kernels
    python tools/device/ort_cuda.py graph_memory ENGINES OUT       # device memory per captured CUDA graph

The speed rows are the bench's own (`served`, which is auto with its host check; the onnxruntime-cuda runner with
and without CUDA graphs) and the same runner with one of its defaults changed back or varied through its options
(runner_choice), every row timed by the bench harness, alternating rounds, in one process.  Served against torch
(AMP, torch.compile, reduce-overhead) on a sweep of models is benchmarks/gpu_models.py's.
The accuracy checks use bare sessions (cuda_session); FP32 sessions run with use_tf32=0, so FP32 stays FP32.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile

from trt_pipeline.calibration.int8 import calibration_sample
from trt_pipeline.models.spec import ModelSpec
from trt_pipeline.pipeline.bench.backends import (
    Backend,
    Choice,
    Context,
    DeviceRunnerBackend,
    RunnerBackend,
    Unavailable,
    choices_for,
)
from trt_pipeline.pipeline.bench.harness import IntegerDraws, integer_draws, make_inputs, run_benchmark, torch_settings
from trt_pipeline.pipeline.bench.report import write_reports
from trt_pipeline.pipeline.bench.timing import TimingPolicy
from trt_pipeline.pipeline.core.compare import compare, cosine
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.precision import Precision
from trt_pipeline.pipeline.core.sessions import onnxruntime_session
from trt_pipeline.pipeline.core.settings import Settings
from trt_pipeline.pipeline.evaluation.float16 import faithful_session
from trt_pipeline.pipeline.folder.graph_io import load_reference
from trt_pipeline.pipeline.folder.layout import FP32_GRAPH, REFERENCE, SERVED_CHOICE
from trt_pipeline.pipeline.folder.reader import ArtifactFolder, open_folder
from trt_pipeline.pipeline.runners import load_runner
from trt_pipeline.pipeline.runners import onnxruntime_cuda as cuda_runner
from trt_pipeline.pipeline.runners.conv_bias import KEEP_BIAS_ADD, split_conv_bias
from trt_pipeline.pipeline.stages.fp16 import convert_fp16
from trt_pipeline.pipeline.stages.sequence import make_engine

# ORT_CUDA_DRY_RUN=1 runs every step here on the CPU provider, to check the script without a GPU.
CUDA = "CPUExecutionProvider" if os.environ.get("ORT_CUDA_DRY_RUN") else "CUDAExecutionProvider"
DEVICE = "cpu" if os.environ.get("ORT_CUDA_DRY_RUN") else "cuda"
RUNNER_DEVICE = {} if DEVICE == "cuda" else {"device": "cpu"}  # load_runner's placement: its default on the GPU
ENCODER = "tools.device.ort_cuda:encoder"
FOLDERS = {
    "resnet50-fp16": dict(model="resnet50", precision="fp16"),
    "resnet50-int8": dict(model="resnet50", precision="int8"),
    "encoder-fp16": dict(model=ENCODER, precision="fp16"),
    "overflow_ffn-fp16": dict(model="tests.helpers.toy_models:overflow_ffn", precision="fp16"),
    "resnet18-int8": dict(model="resnet18", precision="int8"),  # the dry run's INT8 folder
    "resnet-tiny-fp16": dict(model="tests.helpers.toy_models:tiny_cnn", precision="fp16"),  # the dry run's speed folder
}
TORCH_TYPES = {"tensor(float)": torch.float32, "tensor(float16)": torch.float16, "tensor(int64)": torch.int64}


class _Encoder(nn.Module):
    """MiniLM-sized (6 layers, width 384, 12 heads), randomly initialised: token ids in, hidden states out."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30522, 384)
        layer = nn.TransformerEncoderLayer(d_model=384, nhead=12, dim_feedforward=1536, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=6)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.embed(input_ids))


def encoder() -> ModelSpec:
    torch.manual_seed(0)
    example = {"input_ids": torch.randint(0, 30522, (2, 128))}
    return ModelSpec(name="encoder", module=_Encoder(), example_inputs=example, output_names=["last_hidden_state"])


def named(engines: Path, name: str) -> Path:
    """The folder built for FOLDERS[name], by that name (the build links it there)."""
    return engines / "named" / name


def build(engines: Path, calib: Path, names: list[str]) -> None:
    """FOLDERS[names] (every one by default); on a Hopper machine, with no TensorRT, each without an engine (its
    graphs, which auto serves through ONNX Runtime)."""
    for name in names or FOLDERS:
        options = FOLDERS[name]
        started = time.perf_counter()
        extra = {"calib": calib} if options["precision"] == "int8" else {}
        try:
            folder = make_engine(Settings(**options, out_root=engines, **extra))
            named(engines, name).parent.mkdir(exist_ok=True)
            named(engines, name).unlink(missing_ok=True)
            named(engines, name).symlink_to(folder.resolve())
            print(f"BUILT {name}: {folder} in {time.perf_counter() - started:.1f} s", flush=True)
        except BaseException as error:  # one folder's failure must not stop the others
            print(f"FAILED {name}: {type(error).__name__}: {error}", flush=True)
            traceback.print_exc()


# --------------------------------------------------------------------------- ONNX Runtime CUDA sessions


def cuda_session(
    path: Path,
    *,
    cuda_graph: bool = False,
    nhwc: bool = False,
    cuda_only: bool = False,
    verbose: bool = False,
    disabled: Sequence[str] = (),
) -> Any:
    """A session on ONNX Runtime's CUDA provider (the CPU provider in a dry run)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 0 if verbose else 3  # verbose: the log names each node placed on the CPU
    if cuda_only and DEVICE == "cuda":  # no node may fall back to the CPU: does the whole graph have CUDA kernels?
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    provider = {
        "device_id": "0",
        "use_tf32": "0",
        "enable_cuda_graph": str(int(cuda_graph)),
        "prefer_nhwc": str(int(nhwc)),
    }
    if DEVICE == "cpu":
        provider = {}
    fallback = [] if cuda_only or CUDA == "CPUExecutionProvider" else ["CPUExecutionProvider"]
    providers = [(CUDA, provider), *fallback]
    session = ort.InferenceSession(str(path), options, providers=providers, disabled_optimizers=list(disabled))
    if session.get_providers()[0] != CUDA:
        raise RuntimeError(f"the CUDA provider did not load: {session.get_providers()}")
    return session


def smoke() -> None:
    """One Relu on the CUDA provider with no CPU fallback: the provider and its CUDA libraries load."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "smoke",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
    )
    path = Path("/tmp/smoke.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    session = cuda_session(path, cuda_only=True)
    print("smoke:", session.get_providers(), session.run(None, {"x": np.array([-1, 0, 1, 2], np.float32)})[0])


class Bound:
    """A session with its inputs and outputs bound to torch CUDA tensors of one shape (fixed addresses)."""

    def __init__(self, session: Any, feed: dict[str, np.ndarray], shapes: list[tuple[int, ...]]):
        self.session = session
        self.inputs = {k: torch.from_numpy(v).to(DEVICE) for k, v in feed.items()}
        types = [TORCH_TYPES[output.type] for output in session.get_outputs()]
        names = [output.name for output in session.get_outputs()]
        self.outputs = {n: torch.empty(s, dtype=t, device=DEVICE) for n, s, t in zip(names, shapes, types, strict=True)}
        self.binding = session.io_binding()
        for name, tensor in self.inputs.items():
            self._bind(self.binding.bind_input, name, tensor)
        for name, tensor in self.outputs.items():
            self._bind(self.binding.bind_output, name, tensor)
        if DEVICE == "cuda":
            torch.cuda.synchronize()

    @staticmethod
    def _bind(bind: Any, name: str, tensor: torch.Tensor) -> None:
        dtype = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64}[tensor.dtype]
        bind(name, DEVICE, 0, dtype, list(tensor.shape), tensor.data_ptr())

    def run(self) -> None:
        self.session.run_with_iobinding(self.binding)


def _float16_inputs(path: Path) -> list[Any]:
    import onnx
    from onnx import TensorProto

    graph = onnx.load(str(path), load_external_data=False).graph
    return [value for value in graph.input if value.type.tensor_type.elem_type == TensorProto.FLOAT16]


class OrtCuda(Backend):
    """One graph of the folder on ORT's CUDA provider: bare session end to end, IO binding device-resident."""

    def __init__(
        self,
        name: str,
        path: Path,
        precision: Precision,
        cuda_graph: bool,
        nhwc: bool = False,
        copies: bool = False,
        disabled: Sequence[str] = (),
    ):
        how = "IO binding + captured CUDA graph" if cuda_graph else "bare session; IO binding device-resident"
        how += "; prefer_nhwc=1 (convolutions in NHWC)" if nhwc else ""
        how += "; device-resident, the caller's tensors copied in and out each call" if copies else ""
        super().__init__(name, f"ONNX Runtime CUDA on {path.name} ({how})", precision, how, "n/a (GPU)")
        self.device_note = ""
        self.memory_note = "n/a: ONNX Runtime's arena is not counted"
        self.path, self.cuda_graph, self.nhwc, self.disabled, self.copies = path, cuda_graph, nhwc, disabled, copies
        self.input_types = {value.name: np.float16 for value in _float16_inputs(path)}
        # Uncaptured: it runs the calls without a CUDA graph, and tells a captured session's output shapes (a
        # captured session's own first plain run would capture a graph writing to buffers of its choosing).
        self.session = cuda_session(path, nhwc=nhwc, disabled=disabled)
        self.bound: dict[tuple, Bound] = {}

    def _bound(self, feed: dict[str, np.ndarray]) -> Bound:
        key = tuple((k, v.shape) for k, v in sorted(feed.items()))
        if key not in self.bound:  # a captured CUDA graph holds one shape: one session per shape
            session = self.session
            if self.cuda_graph:
                session = cuda_session(self.path, cuda_graph=True, nhwc=self.nhwc, disabled=self.disabled)
            shapes = [value.shape for value in self.session.run(None, feed)]
            self.bound[key] = Bound(session, feed, shapes)
        return self.bound[key]

    def _typed(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The feed in the graph's input types (float16 for a graph without edge Casts)."""
        return {name: value.astype(self.input_types.get(name, value.dtype)) for name, value in feed.items()}

    def infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = self._typed(feed)
        if not self.cuda_graph:
            names = [output.name for output in self.session.get_outputs()]
            return {n: v.astype(np.float32) for n, v in zip(names, self.session.run(None, feed), strict=True)}
        bound = self._bound(feed)
        for name, value in feed.items():
            bound.inputs[name].copy_(torch.from_numpy(value))
        bound.run()
        return {name: tensor.float().cpu().numpy() for name, tensor in bound.outputs.items()}

    def stage(self, feed: dict[str, np.ndarray]):
        """Device-resident: the replay alone on the tensors bound at staging; with `copies`, what a caller of a
        captured graph does each call, as the runner does: its input tensors copied into the bound ones, the replay,
        its output tensors written from the bound ones."""
        bound = self._bound(self._typed(feed))
        if not self.copies:
            return bound.run
        callers = {name: tensor.clone() for name, tensor in bound.inputs.items()}
        written = {name: torch.empty_like(tensor) for name, tensor in bound.outputs.items()}

        def call() -> None:
            for name, tensor in callers.items():
                bound.inputs[name].copy_(tensor)
            if DEVICE == "cuda":  # ONNX Runtime runs on a stream of its own
                torch.cuda.current_stream().synchronize()
            bound.run()
            for name, tensor in written.items():
                tensor.copy_(bound.outputs[name])

        return call

    def sync(self) -> None:
        if DEVICE == "cuda":
            torch.cuda.synchronize()

    def close(self) -> None:
        self.bound.clear()
        self.session = None


def runner_choice(
    name: str, options: dict[str, str], cuda_graph: bool = False, straight: bool = True, split: bool = True
) -> Choice:
    """The onnxruntime-cuda runner itself (what auto serves) on the folder's engine graph, `options` over its
    provider options; straight=False, numpy inputs and outputs through a page-locked copy; split=False, each
    convolution adding its bias in cuDNN (as before pipeline.runners.conv_bias): the runner's own options, as a user
    gives them."""
    how = ", ".join(f"{key}={value}" for key, value in options.items())
    how += ", CUDA graphs" if cuda_graph else ""
    how += "" if straight else ", inputs and outputs through a page-locked copy"
    how += "" if split else ", cuDNN adding each convolution's bias"
    how = how or "its defaults"

    def open_it(context: Context) -> Backend:
        varied = {"provider_options": options, "split_conv_bias": split, "pinned_copies": not straight}
        try:
            runner = load_runner(context.folder, "onnxruntime-cuda", cuda_graph=cuda_graph, **varied, **RUNNER_DEVICE)
        except PipelineError as error:  # e.g. an INT8 graph with nodes on the CPU, which no CUDA graph captures
            raise Unavailable(f"{error.problem} ({error.fix})") from None
        label = f"onnxruntime-cuda runner on {runner.graph} ({how.lstrip(', ')})"
        precision = context.folder.record(runner.graph).precision
        if DEVICE == "cpu":
            return RunnerBackend(name, label, precision, runner, "n/a")
        return DeviceRunnerBackend(name, label, precision, runner)

    return Choice(name, f"the runner with {how}", open_it)


def without_edge_casts(source: Path, target: Path) -> Path:
    """The FP16 graph with float16 inputs and outputs: the Casts at its edges (float32 <-> float16) removed, so a
    caller binds float16 buffers directly."""
    import onnx
    from onnx import TensorProto

    model = onnx.load(str(source))
    graph = model.graph
    inputs = {value.name for value in graph.input if value.type.tensor_type.elem_type == TensorProto.FLOAT}
    outputs = {value.name for value in graph.output if value.type.tensor_type.elem_type == TensorProto.FLOAT}
    rename: dict[str, str] = {}
    kept = []
    for node in graph.node:
        if node.op_type == "Cast" and node.input[0] in inputs:
            rename[node.output[0]] = node.input[0]  # its readers read the (now float16) input itself
        elif node.op_type == "Cast" and node.output[0] in outputs:
            rename[node.input[0]] = node.output[0]  # the float16 value takes the output's name
        else:
            kept.append(node)
    for node in kept:
        node.input[:] = [rename.get(name, name) for name in node.input]
        node.output[:] = [rename.get(name, name) for name in node.output]
    del graph.node[:]
    graph.node.extend(kept)
    for value in (*graph.input, *graph.output):
        if value.name in inputs | outputs:
            value.type.tensor_type.elem_type = TensorProto.FLOAT16
    onnx.save(model, str(target))
    return target


def fp16_io_choice(name: str, cuda_graph: bool, nhwc: bool, engines: Path) -> Choice:
    """ONNX Runtime CUDA on the FP16 graph without its edge Casts: float16 in and out (converted from and to float32
    on the host end to end, as a caller holding float32 would; bound as float16 tensors device-resident)."""

    def open_it(context: Context) -> Backend:
        graph = without_edge_casts(context.folder.path / "model.fp16.onnx", engines / "model.fp16-io.onnx")
        return OrtCuda(name, graph, Precision.FP16, cuda_graph, nhwc)

    return Choice(name, "ONNX Runtime CUDA on the FP16 graph with float16 inputs and outputs", open_it)


def bare_choice(name: str, engines: Path, copies: bool = False) -> Choice:
    """A bare session with IO binding and a CUDA graph per shape on the FP16 graph as the runner opens it (NHWC,
    each convolution's bias an Add: pipeline.runners.conv_bias): the runner's work around each replay left out; with
    `copies`, all of it but the copies in and out that serving the caller's tensors through a captured graph takes
    (OrtCuda.stage)."""

    def open_it(context: Context) -> Backend:
        split = engines / f"{context.folder.path.name}.bias-split.onnx"
        if not split.exists():
            shutil.copy(context.folder.path / "model.fp16.onnx", split)
            split_conv_bias(split)
        captured = DEVICE == "cuda"
        return OrtCuda(name, split, Precision.FP16, captured, nhwc=True, copies=copies, disabled=KEEP_BIAS_ADD)

    return Choice(name, "a bare ONNX Runtime CUDA session on the FP16 graph", open_it)


def beside_runner(engines: Path) -> list[Choice]:
    """What the runner with CUDA graphs is measured against beside torch: itself with cuDNN adding each
    convolution's bias (the default before pipeline.runners.conv_bias), and a bare session with IO binding and a CUDA
    graph on the FP16 graph as the runner opens it: the replay alone (`ort-graph`, the fastest row at batch 1, which
    reads no new input), and with the copies of the caller's tensors in and out that the runner makes
    (`ort-graph-copies`: the same work, without the runner's checks and Python)."""
    return [
        runner_choice("rt-cudnn-bias-graphs", {}, cuda_graph=True, split=False),
        bare_choice("ort-graph", engines),
        bare_choice("ort-graph-copies", engines, copies=True),
    ]


def speed(engines: Path, out: Path, folder_name: str, budget_s: float) -> None:
    """`served` (auto: its multi-batch pick and host check; the bench's torch eager FP32 is the reference), the
    onnxruntime-cuda runner with and without CUDA graphs, and beside them, on the same machine, what the runner did
    before (inputs through a page-locked copy; for convolutions, NCHW and
    beside_runner's rows), in one run_benchmark.  ROWS=all adds the variants tried first (cuDNN's HEURISTIC search,
    float16 inputs and outputs)."""
    names = ["served", "onnxruntime-cuda", "onnxruntime-cuda-graphs"]
    ours = [runner_choice("rt-pinned-graphs", {}, cuda_graph=True, straight=False)]
    if folder_name.startswith("resnet"):
        ours += [runner_choice("rt-nchw-graphs", {"prefer_nhwc": "0"}, cuda_graph=True), *beside_runner(engines)]
        if os.environ.get("ROWS") == "all":
            ours += [runner_choice(f"rt-heuristic{'-graphs' * g}", HEURISTIC, g) for g in (False, True)]
            ours += [fp16_io_choice(f"ort-fp16-io-nhwc{'-graph' * g}", g, True, engines) for g in (False, True)]
    policy = TimingPolicy(budget_s=budget_s, iterations=200, rounds=5)
    folder = named(engines, folder_name)
    (folder / SERVED_CHOICE).unlink(missing_ok=True)  # auto measures and checks on this host, in this run
    report = run_benchmark(folder, backends=names, batches=[1, 8, 32], policy=policy, threads=16, extra=ours)
    write_reports(report, out / f"speed-{folder_name}")
    shutil.copy(folder / SERVED_CHOICE, out / f"served-{folder_name}.json")


HEURISTIC = {"cudnn_conv_algo_search": "HEURISTIC"}


# --------------------------------------------------------------------------- where the time and memory go


def profiled(engines: Path) -> list[Choice]:
    """What `profile` traces: the runner auto serves (with and without CUDA graphs), torch.compile AMP, and
    beside_runner's rows."""
    runners = [runner_choice("onnxruntime-cuda", {}), runner_choice("onnxruntime-cuda-graphs", {}, cuda_graph=True)]
    return [*runners, *choices_for(["torch-compile"])[1:], *beside_runner(engines)]  # [0]: the bench's reference


KERNEL = "cpu_op" if DEVICE == "cpu" else "kernel"  # a dry run's trace has no kernels: its CPU ops stand in


def kernel_summary(trace: Path, calls: int) -> dict:
    """The kernels of a torch.profiler chrome trace, per call: their summed time, the span from the first kernel's
    start to the last one's end (kernel time short of it is the GPU waiting on the host), and the 12 kernels taking
    the most time.  CUPTI traces every library's kernels in the process: ONNX Runtime's as well as torch's."""
    events = [event for event in json.loads(trace.read_text())["traceEvents"] if event.get("cat") == KERNEL]
    if not events:
        return {"kernels": 0}
    by_name: dict[str, list[float]] = {}
    for event in events:
        by_name.setdefault(event["name"], []).append(event["dur"])
    top = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:12]
    span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    return {
        "kernels_per_call": len(events) / calls,
        "kernel_us_per_call": sum(e["dur"] for e in events) / calls,
        "span_us_per_call": span / calls,
        "top": [
            {"name": name[:160], "per_call": len(times) / calls, "us_per_call": sum(times) / calls}
            for name, times in top
        ],
    }


def profile(engines: Path, out: Path, folder_name: str = "resnet50-fp16", batch: int = 32) -> dict:
    """Device-resident at one batch, each of profiled() in turn (traced): where its GPU time goes."""
    folder = open_folder(named(engines, folder_name))
    feed = make_inputs(folder.manifest, _integer_draws(folder), batch, 0)
    context = Context(folder=folder, threads=16, cuda=DEVICE == "cuda")
    rows: dict = {}
    with torch_settings(16):  # the bench's: TF32 off
        for choice in profiled(engines):
            try:
                backend = choice.open(context)
            except Unavailable as why:
                rows[choice.name] = {"unavailable": str(why)}
                continue
            try:
                rows[choice.name] = {"label": backend.label, **traced(backend, feed, out / f"trace-{choice.name}.json")}
            finally:
                backend.close()
    return {"folder": folder_name, "batch": batch, "rows": rows}


def traced(backend: Backend, feed: dict[str, np.ndarray], trace: Path, calls: int = 20) -> dict:
    """The backend's wall time per call (`calls` back to back, then one sync), then as many calls traced by
    torch.profiler (kernel_summary); the trace is removed once read."""
    staged = backend.stage(feed)
    call = staged if staged is not None else lambda: backend.infer(feed)  # a dry run stages nothing
    for _ in range(10):  # torch.compile compiles, CUDA graphs capture
        call()
    backend.sync()
    started = time.perf_counter()
    for _ in range(calls):
        call()
    backend.sync()
    wall_us = (time.perf_counter() - started) / calls * 1e6
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with torch_profile(activities=activities) as profiler:
        for _ in range(calls):
            call()
        backend.sync()
    profiler.export_chrome_trace(str(trace))
    summary = kernel_summary(trace, calls)
    trace.unlink()
    return {"wall_us_per_call": wall_us, **summary}


def _integer_draws(folder: ArtifactFolder) -> IntegerDraws:
    """How the bench draws the folder's integer inputs."""
    return integer_draws(folder.manifest, folder.path / REFERENCE)


def _device_used() -> int:
    """Bytes in use on the GPU, every library's allocations counted (cudaMemGetInfo); 0 in a dry run."""
    if DEVICE == "cpu":
        return 0
    free, total = torch.cuda.mem_get_info()
    return total - free


def graph_memory(engines: Path, out: Path, folder_name: str = "resnet50-fp16") -> dict:
    """Device memory the onnxruntime-cuda runner (one slot) holds after its first call at each new batch, with and
    without CUDA graphs: what each captured graph keeps beyond the uncaptured runner's arena (MAX_GRAPHS's cost)."""
    folder = open_folder(named(engines, folder_name))
    draws = _integer_draws(folder)
    result: dict = {"folder": folder_name, "max_graphs": cuda_runner.MAX_GRAPHS}
    for cuda_graph in (False, True) if DEVICE == "cuda" else (False,):  # no CUDA graphs in a dry run
        before = _device_used()
        runner = load_runner(folder, "onnxruntime-cuda", cuda_graph=cuda_graph, sessions=1, **RUNNER_DEVICE)
        steps = [{"after": "load", "mb": (_device_used() - before) / 2**20}]
        for batch in (1, 8, 32, 16, 4, 2):
            feed = make_inputs(folder.manifest, draws, batch, 0)
            runner.infer(feed)  # the first call at a shape captures its graph
            runner.infer(feed)
            steps.append({"after": f"batch {batch}", "mb": (_device_used() - before) / 2**20})
        runner.close()
        result["captured" if cuda_graph else "uncaptured"] = steps
    return result


# --------------------------------------------------------------------------- accuracy checks


def _versus(reference: np.ndarray, actual: np.ndarray) -> dict:
    result = compare(reference, actual, rtol=1.0)
    return {
        "max_abs": result.max_abs,
        "max_rel": result.max_rel,
        "cosine": cosine({"output": reference}, {"output": actual}),
        "nonfinite": int((~np.isfinite(actual)).sum()),
    }


def _run(session: Any, feed: dict[str, np.ndarray]) -> np.ndarray:
    return session.run(None, feed)[0]


def fp16_check(engines: Path, out: Path, *names: str) -> dict:
    """Each FP16 graph (as built, and converted with no FP32 fallback) on the folder's reference inputs: the
    faithful CPU copy (what the build's gate ran) and the CUDA provider in real float16, each against FP32."""
    report: dict = {}
    for name in names or ("resnet50-fp16", "encoder-fp16", "overflow_ffn-fp16"):
        folder = open_folder(named(engines, name))
        path = folder.path
        no_fallback = engines / f"{name}-no-fallback.fp16.onnx"
        convert_fp16(path / FP32_GRAPH, no_fallback, auto_fp32=False)
        fp32_gpu, fp32_cpu = cuda_session(path / FP32_GRAPH), onnxruntime_session(path / FP32_GRAPH)
        rows = []
        for variant, graph in (("as built", path / "model.fp16.onnx"), ("no FP32 fallback", no_fallback)):
            faithful, real = faithful_session(graph), cuda_session(graph)
            for index, (feed, _) in enumerate(load_reference(path / "reference.npz")):
                reference = _run(fp32_gpu, feed)
                rows.append(
                    {
                        "graph": variant,
                        "case": index,
                        "batch": int(next(iter(feed.values())).shape[0]),
                        "fp32_gpu_vs_cpu_max_rel": compare(_run(fp32_cpu, feed), reference, rtol=1).max_rel,
                        "faithful_cpu": _versus(reference, _run(faithful, feed)),
                        "real_gpu": _versus(reference, _run(real, feed)),
                        "faithful_vs_real_max_rel": compare(_run(real, feed), _run(faithful, feed), rtol=1).max_rel,
                    }
                )
        manifest = json.loads((path / "manifest.json").read_text())
        report[name] = {"manifest": {k: manifest.get(k) for k in ("parity_fp16", "fp16")}, "rows": rows}
    return report


def int8_check(engines: Path, out: Path, name: str = "resnet50-int8") -> dict:
    """model.int8.onnx on the CUDA provider vs the CPU simulation of its Q/DQ (the build's gate), each vs FP32, on
    the reference inputs and the held-out calibration rows (sample.npz)."""
    path = named(engines, name)
    graph = path / "model.int8.onnx"
    result: dict = {}
    try:
        cuda_session(graph, cuda_only=True)
        result["all_nodes_on_cuda"] = True
    except Exception as error:
        result["all_nodes_on_cuda"] = f"no: {type(error).__name__}: {str(error)[:600]}"
    gpu, simulated = cuda_session(graph, verbose=True), onnxruntime_session(graph, simulate_qdq=True)
    fp32 = cuda_session(path / FP32_GRAPH)
    feeds = [feed for feed, _ in load_reference(path / "reference.npz")]
    sample = calibration_sample(path)
    if sample is not None:
        feeds.append(sample)
    rows = []
    for index, feed in enumerate(feeds):
        reference, on_gpu, on_cpu = _run(fp32, feed), _run(gpu, feed), _run(simulated, feed)
        rows.append(
            {
                "inputs": "held-out calibration rows (sample.npz)" if sample is feed else f"reference case {index}",
                "batch": int(next(iter(feed.values())).shape[0]),
                "gpu_vs_fp32": _versus(reference, on_gpu),
                "simulated_cpu_vs_fp32": _versus(reference, on_cpu),
                "gpu_vs_simulated": _versus(on_cpu, on_gpu),
                "top1_gpu_vs_simulated": float((on_gpu.argmax(-1) == on_cpu.argmax(-1)).mean()),
            }
        )
    manifest = json.loads((path / "manifest.json").read_text())
    result.update({"manifest_agreement_int8": manifest.get("agreement_int8"), "rows": rows})
    return result


def main(argv: list[str]) -> None:
    command, engines = argv[0], Path(argv[1])
    if command == "build":
        build(engines, Path(argv[2]), argv[3:])
        return
    out = Path(argv[2])
    out.mkdir(parents=True, exist_ok=True)
    if command == "speed":
        for name in argv[3:] or ("resnet50-fp16", "encoder-fp16", "resnet50-int8"):
            try:
                speed(engines, out, name, float(os.environ.get("BUDGET_S", "3")))
            except Exception:
                traceback.print_exc()
    elif command in ("fp16", "int8", "profile", "graph_memory"):
        steps = {"fp16": fp16_check, "int8": int8_check, "profile": profile, "graph_memory": graph_memory}
        report = steps[command](engines, out, *argv[3:])
        (out / f"{command}-check.json").write_text(json.dumps(report, indent=1, default=str))
        print(json.dumps(report, default=str)[:6000])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
