"""ONNX Runtime sessions with this project's options, shared by the runner (runtime) and the parity stages (build).

Kept apart from pipeline/parity.py so that serving an ONNX graph imports onnxruntime and nothing of the build.

A crash inside ONNX Runtime (a segfault while it optimizes a graph: seen on a TransformerEncoder's FP16 graph at
full optimization) would kill the pipeline with no message.  So a graph on disk, which the build stages open, is
first opened in a forked child: a child killed by a signal means ONNX Runtime crashed on that graph, and the
session is opened at the next lower optimization level (its results are the same; only its speed differs),
or, when every level crashes, the stage stops with a PipelineError naming the graph.  A graph given as bytes
(the runner, on a graph the build already opened) is not probed.  Only session creation is contained, not
session.run: containing runs would compute every run twice.
"""

from __future__ import annotations

import faulthandler
import os
import signal
from collections.abc import Callable
from pathlib import Path

from trt_pipeline.pipeline.errors import PipelineError
from trt_pipeline.pipeline.extras import import_onnxruntime

# Highest first: the order a crashing graph is retried in.  Names as in onnxruntime.GraphOptimizationLevel.
OPTIMIZATION_LEVELS = ("ORT_ENABLE_ALL", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_BASIC", "ORT_DISABLE_ALL")
# Graphs already probed in this process, by (path, size, mtime): the level that opened each.
_PROBED: dict[tuple[str, int, int], str] = {}


def onnxruntime_session(
    graph: Path | bytes,
    providers: list[str] | None = None,
    *,
    intra_op_threads: int | None = None,
    allow_spinning: bool = True,
    simulate_qdq: bool = False,
):
    """An ONNX Runtime session on a graph file or a graph's bytes; the CPU provider unless told otherwise.

    intra_op_threads: None keeps ORT's default (one per physical core).  allow_spinning=False makes idle
    intra-op threads sleep instead of spinning, which frees the cores for other requests' threads.
    A graph file is opened at the highest optimization level that does not crash ONNX Runtime (module doc).
    simulate_qdq: run every QuantizeLinear/DequantizeLinear as itself, in float, as TensorRT's Q/DQ semantics
    say, instead of letting ORT fuse DQ -> Conv -> Q into its own int8 kernels (which compute something else:
    on CPUs without VNNI their u8/s8 products saturate, issue 17).  For judging the TensorRT-shaped INT8 graph.
    """
    level = OPTIMIZATION_LEVELS[0] if isinstance(graph, bytes) else level_that_opens(Path(graph), providers)
    return _open(
        graph,
        providers,
        level,
        intra_op_threads=intra_op_threads,
        allow_spinning=allow_spinning,
        simulate_qdq=simulate_qdq,
    )


def _open(
    graph: Path | bytes,
    providers: list[str] | None,
    level: str,
    *,
    intra_op_threads: int | None = None,
    allow_spinning: bool = True,
    simulate_qdq: bool = False,
):
    ort = import_onnxruntime()
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: ORT warns about every unused initializer
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    if intra_op_threads is not None:
        options.intra_op_num_threads = intra_op_threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
    if simulate_qdq:
        options.add_session_config_entry("session.disable_quant_qdq", "1")
    model = graph if isinstance(graph, bytes) else str(graph)
    return ort.InferenceSession(model, options, providers=providers or ["CPUExecutionProvider"])


def level_that_opens(
    path: Path, providers: list[str] | None = None, *, opener: Callable[[Path, str], object] | None = None
) -> str:
    """The highest optimization level at which opening `path` does not crash ONNX Runtime (probed once per file).

    `opener(path, level)` opens the graph in the child (default: an ONNX Runtime session).  A Python exception
    there is not a crash: the parent opens the graph itself and reports that error as it always does.
    """
    if not hasattr(os, "fork"):
        return OPTIMIZATION_LEVELS[0]  # no fork (Windows): nothing to contain with
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key in _PROBED:
        return _PROBED[key]
    open_graph = opener or (lambda graph, level: _open(graph, providers, level))
    crashes: list[str] = []
    for level in OPTIMIZATION_LEVELS:
        crash = crash_in_child(open_graph, path, level)
        if crash is None:
            if crashes:
                print(
                    f"warning: ONNX Runtime crashed opening {path.name} ({'; '.join(crashes)}); "
                    f"opened it at {level} instead (same results, slower)",
                    flush=True,
                )
            _PROBED[key] = level
            return level
        crashes.append(f"{crash} at {level}")
    raise PipelineError(
        f"ONNX Runtime crashed opening {path} at every optimization level ({'; '.join(crashes)}): a bug in ONNX "
        "Runtime on this graph, not in your model",
        "try another onnxruntime version (pip install -U onnxruntime-gpu), or PRECISION=fp32 if only the FP16 or "
        "INT8 graph crashes; KEEP_FP32=<op type> keeps the ops around the crash in FP32",
    )


def crash_in_child(function: Callable[..., object], *args: object) -> str | None:
    """Run `function(*args)` in a forked child; the signal that killed it ("SIGSEGV"), or None if it exited.

    The child shares nothing back but its exit: it leaves with os._exit, so no atexit handler or buffered output
    of the parent runs twice.
    """
    pid = os.fork()
    if pid == 0:  # the child
        faulthandler.disable()  # the crash is reported by the parent; no Python stack dump from the child
        code = 0
        try:
            function(*args)
        except BaseException:  # a Python error is not a crash; the parent meets it again and reports it
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return signal.Signals(os.WTERMSIG(status)).name
    return None
