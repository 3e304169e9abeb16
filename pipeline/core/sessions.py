"""ONNX Runtime sessions with this project's options, shared by the runner (runtime) and the parity stages (build).

Kept apart from pipeline/stages/parity.py so that serving an ONNX graph imports onnxruntime and nothing of the build.

A crash inside ONNX Runtime (a segfault while it optimizes a graph: seen on a TransformerEncoder's FP16 graph at
full optimization) would kill the pipeline with no message.  So a graph on disk, which the build stages open, is
first opened in a forked child, and run there once when the caller gives a feed (the parity stages give their
first reference case): a child killed by a signal means ONNX Runtime crashed on that graph, and the session is
opened at the next lower optimization level (its results are the same; only its speed differs), or, when every
level crashes, the stage stops with a PipelineError naming the graph.  The level each graph of a folder needed
is recorded in its manifest (pipeline.stages.sequence), so the runner opens the graph at that level without probing
again.  Only the first run is probed: containing every run would compute each twice.  The build's sessions map
their weights from disk and pack none (pipeline.evaluation.graph_session), so a probe costs the optimizer's time and
little memory: what is probed is the level, which is the optimizer's choice.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import pickle
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import PipelineError
from .extras import import_onnxruntime
from .precision import Precision
from .settings import mention

# Highest first: the order a crashing graph is retried in.  Names as in onnxruntime.GraphOptimizationLevel.
OPTIMIZATION_LEVELS = ("ORT_ENABLE_ALL", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_BASIC", "ORT_DISABLE_ALL")
# A probe that has neither crashed nor finished by then is stopped (crash_in_child): opening and running the largest
# graphs measured here takes well under a minute.
PROBE_TIMEOUT_S = 600
# No graph optimization: each node runs its own kernel on its inputs, and there is no optimizer to crash, so a
# session at this level needs no probe (ONNX Runtime's calibrators open theirs so, unprobed).
UNOPTIMIZED = OPTIMIZATION_LEVELS[-1]
# Graphs already probed in this process, by (path, size, mtime, probed with a run): the level that worked.
_PROBED: dict[tuple[str, int, int, bool], str] = {}


def onnxruntime_session(
    graph: Path | str | bytes,
    providers: list[Any] | None = None,
    *,
    intra_op_threads: int | None = None,
    allow_spinning: bool = True,
    simulate_qdq: bool = False,
    level: str | None = None,
    probe_feed: dict | None = None,
    pack_weights: bool = True,
    arena: bool = True,
    disabled_optimizers: Sequence[str] = (),
):
    """An ONNX Runtime session on a graph file or a graph's bytes; the CPU provider unless told otherwise (providers:
    names, or (name, provider options) pairs, as InferenceSession takes them).

    intra_op_threads: None keeps ORT's default (one per physical core).  allow_spinning=False makes idle
    intra-op threads sleep instead of spinning, which frees the cores for other requests' threads.
    simulate_qdq: run every QuantizeLinear/DequantizeLinear as itself, in float, as TensorRT's Q/DQ semantics
    say, instead of letting ORT fuse DQ -> Conv -> Q into its own int8 kernels (which compute something else:
    on CPUs without VNNI their u8/s8 products saturate, issue 17).  For judging the TensorRT-shaped INT8 graph.
    level: the optimization level to open at (a folder's recorded one); None: the highest, and for a graph
    file the highest at which opening it (and running `probe_feed` once, when given) does not crash ONNX
    Runtime (module doc).
    pack_weights=False: ONNX Runtime computes with the weights where it loaded them instead of packing a copy of
    them for its kernels (session.disable_prepacking): with external data, which it maps from disk, a session then
    holds no copy of the weights at all (pipeline.evaluation.graph_session, for the build's few runs; the runner
    packs, for speed).
    arena=False: the memory a run allocates is freed with the values it holds, instead of kept in the session's
    arena for its next runs (a session exposing intermediate tensors: pipeline/evaluation/tensors.py, whose parts'
    sessions' arenas held 6.9 GB of ViT-L/16's pass, where the tensors a part exposes are 0.5 GB).
    disabled_optimizers: ONNX Runtime's graph rewrites to leave out, by name (e.g. one that would undo a rewrite of
    our own: pipeline.runners.conv_bias).
    """

    def open_at(chosen: str):
        return _open(
            graph,
            providers,
            chosen,
            intra_op_threads=intra_op_threads,
            allow_spinning=allow_spinning,
            simulate_qdq=simulate_qdq,
            pack_weights=pack_weights,
            arena=arena,
            disabled_optimizers=disabled_optimizers,
        )

    if level is None:
        level = OPTIMIZATION_LEVELS[0] if isinstance(graph, bytes) else level_that_opens(graph, open_at, probe_feed)
    return open_at(level)


def _open(
    graph: Path | str | bytes,
    providers: list[Any] | None,
    level: str,
    *,
    intra_op_threads: int | None = None,
    allow_spinning: bool = True,
    simulate_qdq: bool = False,
    pack_weights: bool = True,
    arena: bool = True,
    disabled_optimizers: Sequence[str] = (),
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
    if not pack_weights:
        options.add_session_config_entry("session.disable_prepacking", "1")
    options.enable_cpu_mem_arena = arena
    model = graph if isinstance(graph, bytes) else str(graph)
    providers = providers or ["CPUExecutionProvider"]
    return ort.InferenceSession(model, options, providers=providers, disabled_optimizers=list(disabled_optimizers))


def return_freed_memory() -> None:
    """Give the pages of the memory freed so far back to the system (glibc's malloc_trim; elsewhere nothing).  glibc
    keeps freed blocks in its heaps, where the process's RSS counts them: ONNX Runtime's and numpy's tensors under
    its mmap threshold (which rises to 32 MB) are freed there.  After ViT-L/16's ranges pass 1.5 GB of them stayed,
    beside the 1.2 GB of weights the next pass mapped: 3.5 GB at peak, 2.4 GB with them returned first.  Called
    between a stage's phases, not per run: a returned page is faulted in again when used (returned before each
    part of a pass, ViT-L/16's passes took 5 s longer each)."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None) if sys.platform.startswith("linux") else None
    if trim is not None:  # musl has none
        trim(0)


def level_that_opens(path: Path | str, open_at: Callable[[str], Any], feed: dict | None = None) -> str:
    """The highest optimization level at which `open_at(level)` (a session on `path`), and its run on `feed`
    when given, do not crash ONNX Runtime; probed once per file (a probe with a run stands for one without).

    A Python exception in the child is not a crash: the parent opens the graph itself and reports that error
    as it always does.
    """
    if not hasattr(os, "fork"):
        return OPTIMIZATION_LEVELS[0]  # no fork (Windows): nothing to contain with
    path = Path(path)
    file = file_key(path)
    for probed_run in (True, False) if feed is None else (True,):
        if (*file, probed_run) in _PROBED:
            return _PROBED[(*file, probed_run)]
    crashes: list[str] = []
    for level in OPTIMIZATION_LEVELS:
        crash = crash_in_child(_open_and_run, open_at, level, feed)
        if crash is None:
            if crashes:
                print(
                    f"warning: ONNX Runtime crashed on {path.name} ({'; '.join(crashes)}); "
                    f"opened it at {level} instead (same results, slower; recorded for the runner)",
                    flush=True,
                )
            _PROBED[(*file, feed is not None)] = level
            return level
        crashes.append(f"{crash} at {level}")
    doing = "opening or running" if feed is not None else "opening"
    raise PipelineError(
        f"ONNX Runtime crashed {doing} {path} at every optimization level ({'; '.join(crashes)}): a bug in ONNX "
        "Runtime on this graph, not in your model",
        f"try another onnxruntime version (pip install -U onnxruntime, or onnxruntime-gpu), or "
        f"{mention(precision=Precision.FP32)} if only the FP16 or INT8 graph crashes; "
        f"{mention(keep_fp32='<op type>')} keeps the ops around the crash in FP32",
    )


def graph_level(path: Path | str, *, simulate_qdq: bool = False) -> str:
    """The level the graph file `path` opens at (simulate_qdq: as onnxruntime_session's): found earlier in this
    process, else probed now in a child, with no session opened here.  For a caller that opens copies of the graph
    with more of its tensors as outputs (pipeline/evaluation/tensors.py): the level is then recorded for the file
    itself, and the next copy of it needs no probe of its own."""
    return level_that_opens(
        path, lambda chosen: _open(path, None, chosen, simulate_qdq=simulate_qdq, pack_weights=False)
    )


def probed_level(path: Path | str) -> str | None:
    """The level this process found the graph file `path` opens at (probed with a run or without), None where it has
    not probed it: a copy of that graph with more of its tensors as outputs (pipeline/evaluation/tensors.py) opens
    there with no probe of its own."""
    file = file_key(Path(path))
    return _PROBED.get((*file, True), _PROBED.get((*file, False)))


def opens_like(path: Path | str, probed: Path | str) -> None:
    """Record that the graph file `path` opens at the level found for `probed` (where that was probed), a graph it
    equals but for the values of some constants (a Q/DQ graph with its biases corrected): the same ops for the same
    optimizers, so no probe of its own."""
    level = probed_level(probed)
    if level is not None:
        opens_at(path, level)


def ran_like(path: Path | str, ran: Path | str) -> None:
    """Record that the graph file `path`, a copy of `ran`, opens and runs at the level `ran` was found to open at,
    where this process then opened and ran `ran` (the INT8 stage's judge: its kept candidate, copied to
    model.int8.onnx for the gate): those bytes ran here, so no probe, with a run or without, is needed for them."""
    level = probed_level(ran)
    if level is not None:
        for probed_run in (True, False):
            _PROBED[(*file_key(Path(path)), probed_run)] = level


def opens_at(path: Path | str, level: str) -> None:
    """Record that the graph file `path` opens at `level`, found for a graph it equals but for the values of some
    constants (opens_like, where that graph's file is gone)."""
    _PROBED[(*file_key(Path(path)), False)] = level


def file_key(path: Path) -> tuple[str, int, int]:
    """What identifies a graph file's contents in this process (among the probed ones, calibration/bias.py's
    shifts): its path, size and modification time."""
    stat = path.stat()
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns


def levels_below_full(folder: Path) -> dict[str, str]:
    """{graph file: level} for the graphs of `folder` this process had to open below the highest level."""
    folder = folder.resolve()
    return {
        Path(key[0]).name: level
        for key, level in _PROBED.items()
        if Path(key[0]).parent == folder and level != OPTIMIZATION_LEVELS[0]
    }


def _open_and_run(open_at: Callable[[str], Any], level: str, feed: dict | None) -> None:
    session = open_at(level)
    if feed is not None:
        session.run(None, feed)


@dataclass(frozen=True)
class ChildRun:
    """How a function run in a forked child ended (run_in_child).

    crash: the signal that killed the child ("SIGFPE"), None where none did.  returned: the function returned, and
    `value` is what it returned (pickled back); False where it raised, was killed, or hung and was stopped."""

    crash: str | None = None
    returned: bool = False
    value: Any = None


def run_in_child(function: Callable[..., object], *args: object) -> ChildRun:
    """Run `function(*args)` in a forked child, and say how it ended: killed by a signal, or returned (with its
    value), or neither (it raised, or hung).

    The child shares nothing back but its exit and the pickled value: it leaves with os._exit, so no atexit handler or
    buffered output of the parent runs twice.  A child still running after PROBE_TIMEOUT_S is killed and counts as
    no crash and no value: a fork copies the locks other threads of the parent held at that moment (ONNX Runtime's
    pools of a process with other sessions open), and a child can wait on one of them forever (seen once in the test
    suite); the parent then does the work itself, as when the child raises.
    """
    reader, writer = os.pipe()  # the value comes back through a pipe: nothing is written to disk
    pid = os.fork()
    if pid == 0:  # the child
        faulthandler.disable()  # the crash is reported by the parent; no Python stack dump from the child
        os.close(reader)
        code = 0
        try:
            value = pickle.dumps(function(*args))
            with os.fdopen(writer, "wb") as pipe:
                pipe.write(value)
        except BaseException:  # a Python error is not a crash; the parent meets it again and reports it
            code = 1
        os._exit(code)
    os.close(writer)
    try:
        status, value = _wait_reading(pid, reader, PROBE_TIMEOUT_S)
    finally:
        os.close(reader)
    if status is None:
        print(f"note: a child process checking ONNX Runtime hung for {PROBE_TIMEOUT_S} s; stopped it", flush=True)
        return ChildRun()
    if os.WIFSIGNALED(status):
        return ChildRun(crash=signal.Signals(os.WTERMSIG(status)).name)
    if os.WEXITSTATUS(status) != 0 or not value:
        return ChildRun()
    return ChildRun(returned=True, value=pickle.loads(value))  # noqa: S301 (our own child's)


def _wait_reading(pid: int, reader: int, timeout_s: float) -> tuple[int | None, bytes]:
    """The child's exit status and what it wrote to `reader`, read while it runs (a value past the pipe's buffer
    would otherwise block the child's write); the status None where it still runs after `timeout_s` (it is then
    killed)."""
    os.set_blocking(reader, False)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        chunk = _read_ready(reader)
        if chunk:
            chunks.append(chunk)
            continue
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            while chunk := _read_ready(reader):  # what it wrote just before it exited
                chunks.append(chunk)
            return status, b"".join(chunks)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None, b""


def _read_ready(reader: int) -> bytes:
    """What the pipe holds now (b"" where nothing, or the writer closed it)."""
    try:
        return os.read(reader, 1 << 16)
    except BlockingIOError:
        return b""


def crash_in_child(function: Callable[..., object], *args: object) -> str | None:
    """Run `function(*args)` in a forked child (run_in_child); the signal that killed it ("SIGSEGV"), or None."""
    return run_in_child(function, *args).crash
