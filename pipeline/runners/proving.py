"""A risky candidate of `auto` proves itself in a child process before the serving process touches it.

A CUDA error inside ONNX Runtime's kernels is sticky: on an H200 a ConvNeXt's captured CUDA graph failed with
"misaligned address" during auto's host check, closing the runner then raised, no other candidate was tried, and
nothing in that process could use the GPU again.  So a candidate whose fault can outlive it (Candidate.risky: the
onnxruntime-cuda runner's) is first opened in a child process (`python -m` this module), run once at each batch auto
times it at (the profile's opt, max and min), and held to the host check there.  The verdict comes back as a
HostCheck (the check's, passed or not) or a Failure (it raised, the child died of a signal or an exit code, or it
did not finish within the timeout); auto (runners/fastest.py) caches it in served.json under the host key, so a
later load with that key proves nothing again, and it opens in the serving process only what passed.

A child, not a thread or a fork: a fork would inherit the parent's CUDA context, and multiprocessing's "spawn"
re-runs a user's script that calls load_runner without a `__main__` guard.  The child imports this same package
(PYTHONPATH leads to it) and reports through a file, so nothing it or its libraries print can be taken for the
verdict; what it printed last is quoted when it dies.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..evaluation.host import HostCheck
from ..folder.reader import ArtifactFolder, open_folder
from .candidate import Candidate, Failure, profile_batches, timing_feed

# A GPU candidate's first load (cuDNN's algorithm search, a CUDA graph per batch, a 2 GB model's weights) takes
# seconds to a minute; a child still at it after this long is stuck, and is killed.
PROOF_TIMEOUT_S = 600.0
# The fix for a candidate whose child died or hung: nothing in the serving process saw why.
DIED_FIX = (
    "the other candidates serve without it; to see why it fails, load it alone in a new process "
    "(load_runner(folder, backend='onnxruntime-cuda', graph=...)), and report it with the folder's manifest.json"
)
WORDS_QUOTED, LINE_QUOTED = 3, 400  # the child's last lines of output quoted when it dies, and their length


def risky(candidate: Candidate) -> bool:
    return candidate.risky


@dataclass(frozen=True)
class Isolation:
    """Which of auto's candidates prove themselves in a child process, and how.

    isolate: by default the risky ones (Candidate.risky; none on a host without a GPU).  timeout_s: how long a child
    may take.  entry: the module the child runs with `python -m`; its `main` takes the request this module writes.
    The tests isolate CPU candidates, and name an entry that dies or hangs for one of them
    (tests/helpers/proof_faults.py), to see auto go on without it."""

    isolate: Callable[[Candidate], bool] = risky
    timeout_s: float = PROOF_TIMEOUT_S
    entry: str = __name__


RISKY_IN_A_CHILD = Isolation()  # what auto does: each risky candidate proved in a child process


def prove_in_child(
    folder: ArtifactFolder, candidate: Candidate, options: dict[str, Any], *, verify: bool, isolation: Isolation
) -> HostCheck | Failure:
    """The candidate opened, run and (to `verify`) checked in a child process: the check's verdict, or why the child
    gave none."""
    with tempfile.TemporaryDirectory(prefix="trt-pipeline-proof-") as scratch:
        stage, verdict = Path(scratch) / "stage", Path(scratch) / "verdict.json"
        request = {
            "folder": str(folder.path.resolve()),
            "graph": candidate.graph,
            "providers": list(candidate.providers),
            "tuned": candidate.tuned,
            "options": options,
            "verify": verify,
            "stage": str(stage),
            "verdict": str(verdict),
        }
        stage.write_text("starting Python and importing the pipeline")
        command = [sys.executable, "-m", isolation.entry, json.dumps(request)]
        try:
            child = subprocess.run(
                command,
                env=_child_environment(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                timeout=isolation.timeout_s,
            )
        except subprocess.TimeoutExpired as expired:  # run() has killed it
            return Failure(
                f"its proof in a child process did not finish within {isolation.timeout_s:g} s (killed while "
                f"{stage.read_text()}){_last_words(expired.output)}",
                DIED_FIX,
            )
        return _verdict(child, stage.read_text(), verdict)


def _verdict(child: subprocess.CompletedProcess, stage: str, path: Path) -> HostCheck | Failure:
    """What the child wrote, where it exited as a finished child does (0), else how it died and while doing what."""
    if child.returncode != 0:
        how = (
            f"signal {-child.returncode} ({signal.Signals(-child.returncode).name})"
            if child.returncode < 0 and -child.returncode in signal.valid_signals()
            else f"exit code {child.returncode}"
        )
        return Failure(f"the candidate's process died with {how} while {stage}{_last_words(child.stdout)}", DIED_FIX)
    try:
        written = json.loads(path.read_text())
    except (OSError, ValueError):
        return Failure(f"its child process exited without a verdict{_last_words(child.stdout)}", DIED_FIX)
    if "failure" in written:
        return Failure(**written["failure"])
    check = HostCheck.from_json(written.get("check"))
    if check is None:
        return Failure(f"its child process wrote no verdict it could have written ({written!r})", DIED_FIX)
    return check


def _last_words(output: bytes | None) -> str:
    """The child's last lines of output, each cut to LINE_QUOTED characters: the reason goes in served.json, which
    a load reads only while it is small (fastest.SERVED_MAX_BYTES)."""
    lines = [line[:LINE_QUOTED] for line in (output or b"").decode(errors="replace").splitlines() if line.strip()]
    return f"; its last output: {' | '.join(lines[-WORDS_QUOTED:])}" if lines else ""


def _child_environment() -> dict[str, str]:
    """This environment, with the folder that holds this package first on PYTHONPATH: the child runs this code."""
    package = Path(sys.modules[__name__.partition(".")[0]].__file__ or ".").parent
    paths = [str(package.parent), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def main(argv: list[str]) -> int:
    """The child: prove the candidate the request names, and write the verdict where it says."""
    request = json.loads(argv[1])
    stage = Path(request["stage"])
    started = time.perf_counter()
    try:
        verdict: dict[str, Any] = {"check": _prove(request, stage.write_text).as_json()}
    except Exception as error:  # any error at all is the verdict: the parent goes on to the next candidate
        failure = Failure.of(error, f"in a child process, {stage.read_text()}")
        verdict = {"failure": {"reason": failure.reason, "fix": failure.fix}}
    Path(request["verdict"]).write_text(json.dumps(verdict))
    stage.write_text(f"exiting after its verdict ({time.perf_counter() - started:.2f} s)")
    return 0


def _prove(request: dict[str, Any], stage: Callable[[str], Any]) -> HostCheck:
    stage("opening the folder")
    folder = open_folder(request["folder"])
    record = folder.record(request["graph"])
    if record is None:
        raise ValueError(f"{request['graph']} is no longer a graph of {folder.path}")
    candidate = Candidate(record, tuple(request["providers"]), request["tuned"])
    started = time.perf_counter()
    stage("opening it")
    runner = candidate.open(folder, request["options"])
    try:
        batches = profile_batches(folder)
        for batch in batches:
            stage(f"running it at batch {batch}")
            runner.infer(timing_feed(folder, batch))
        if not request["verify"]:
            ran = f"opened and ran at batch {', '.join(map(str, batches))} in a child process (not checked)"
            return HostCheck(True, ran, round(time.perf_counter() - started, 3))
        stage("running the host check")
        check = candidate.check(folder, runner)
    finally:
        stage("closing it")
        runner.close()
    return HostCheck(check.passed, f"in a child process: {check.verdict}", check.seconds)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
