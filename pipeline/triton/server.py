"""A real Triton Inference Server on this machine, from the `nvidia-pytriton` wheel (`pip install nvidia-pytriton`).

The wheel ships Triton's own `tritonserver` binary (pytriton/tritonserver/bin), its Python backend
(backends/python), one Python-backend stub per Python version (python_backend_stubs/3.X) and the shared
libraries they link (nvidia_pytriton.libs, beside the package).  It runs on a CPU: the server starts with
no GPU (it logs that NVML and DCGM are absent) and serves Python-backend models over v2 HTTP and gRPC.

What starting it takes, found by reading how the wheel is laid out (pytriton does the same in its
Triton._prepare_triton_inference_server):
  - a backend directory whose python/ holds the stub built for *this* Python, next to libtriton_python.so:
    the stub embeds libpython3.X, so it must match the interpreter whose packages the models import;
  - LD_LIBRARY_PATH with the wheel's libraries: the copied stub loses the RPATH that finds them;
  - this interpreter's bin/ first on PATH: the stub's embedded Python finds its prefix from the `python3` on
    PATH, so a virtual environment's site-packages are seen there (PYTHONPATH is not passed to the stub).

Used by the tests (Triton as the reference for the protocol, and the scale-out repository end to end) and by
anyone who wants to try a repository from `trt-pipeline triton` without Docker.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import util as importlib_util
from pathlib import Path

from ..core.errors import PipelineError

INSTALL = "pip install --no-deps nvidia-pytriton (it ships tritonserver; --no-deps: it pins numpy<2, unused here)"


@dataclass(frozen=True)
class TritonDistribution:
    """Where the wheel put the server: the binary, the Python backend, the stub for this Python, the libraries."""

    binary: Path
    python_backend: Path
    stub: Path
    libraries: Path


@dataclass
class TritonServer:
    """A running tritonserver: its addresses as tritonclient takes them (host:port), and its log so far."""

    http: str
    grpc: str
    metrics: str
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def find_distribution() -> TritonDistribution:
    """The tritonserver of the installed nvidia-pytriton wheel, or a PipelineError saying what is missing."""
    spec = importlib_util.find_spec("pytriton")
    if spec is None or spec.origin is None:
        raise PipelineError("Triton Inference Server is not installed (the nvidia-pytriton wheel)", INSTALL)
    package = Path(spec.origin).parent
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    found = TritonDistribution(
        binary=package / "tritonserver" / "bin" / "tritonserver",
        python_backend=package / "tritonserver" / "backends" / "python",
        stub=package / "tritonserver" / "python_backend_stubs" / version / "triton_python_backend_stub",
        libraries=package.parent / "nvidia_pytriton.libs",
    )
    for path in (found.binary, found.python_backend, found.libraries):
        if not path.exists():
            raise PipelineError(f"the nvidia-pytriton wheel has no {path}", f"reinstall it: {INSTALL}")
    if not found.stub.is_file():
        raise PipelineError(
            f"the nvidia-pytriton wheel has no Python-backend stub for Python {version} ({found.stub})",
            "run under a Python the wheel ships a stub for (3.8 to 3.13)",
        )
    return found


def startup_problem() -> str | None:
    """Why tritonserver cannot start on this machine, or None: the wheel is missing, or the binary or this
    Python's stub cannot load its libraries (the wheel targets glibc 2.35+ and links libpython3.X.so)."""
    try:
        distribution = find_distribution()
    except PipelineError as error:
        return error.problem
    if shutil.which("ldd") is None:
        return None  # nothing to ask: starting it will tell
    for program in (distribution.binary, distribution.stub):
        linked = subprocess.run(
            ["ldd", str(program)], capture_output=True, text=True, env=_environment(distribution), check=False
        )
        missing = [line.strip() for line in linked.stdout.splitlines() if "not found" in line]
        if linked.returncode != 0 or missing:
            return f"{program.name} cannot load here: {'; '.join(missing) or linked.stderr.strip()}"
    return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def running_triton(repository: Path, *, timeout_s: float = 120, host: str = "127.0.0.1") -> Iterator[TritonServer]:
    """tritonserver serving `repository` on free ports of `host`, ready (every model loaded); always stopped.

    A server that exits or is not ready within timeout_s is a PipelineError carrying the end of its log.
    """
    distribution = find_distribution()
    with tempfile.TemporaryDirectory(prefix="tritonserver-") as scratch:
        backends = _backend_directory(distribution, Path(scratch))
        ports = {"http": free_port(host), "grpc": free_port(host), "metrics": free_port(host)}
        command = [
            str(distribution.binary),
            f"--model-repository={Path(repository).resolve()}",
            f"--backend-directory={backends}",
            f"--http-address={host}",
            f"--grpc-address={host}",
            f"--metrics-address={host}",
            f"--http-port={ports['http']}",
            f"--grpc-port={ports['grpc']}",
            f"--metrics-port={ports['metrics']}",
            "--exit-on-error=true",
            "--exit-timeout-secs=10",
        ]
        log_path = Path(scratch) / "tritonserver.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=_environment(distribution), start_new_session=True
            )
        server = TritonServer(
            f"{host}:{ports['http']}", f"{host}:{ports['grpc']}", f"{host}:{ports['metrics']}", process, log_path
        )
        try:
            _wait_ready(server, timeout_s)
            yield server
        finally:
            _stop(process)


def _backend_directory(distribution: TritonDistribution, scratch: Path) -> Path:
    """backends/python with the wheel's backend and this Python's stub side by side (links, not copies)."""
    python = scratch / "backends" / "python"
    python.mkdir(parents=True)
    for entry in distribution.python_backend.iterdir():
        if entry.name != "__pycache__":
            (python / entry.name).symlink_to(entry)
    # A copy, not a link: the backend starts the stub from its own directory's path.
    shutil.copy2(distribution.stub, python / "triton_python_backend_stub")
    return python.parent


def _environment(distribution: TritonDistribution) -> dict[str, str]:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(distribution.libraries), env.get("LD_LIBRARY_PATH")]))
    # The stub's embedded Python takes its prefix (and so its site-packages) from the python3 found on PATH.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _wait_ready(server: TritonServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise PipelineError(
                f"tritonserver exited with {server.process.returncode} before it was ready:\n{_tail(server.log())}",
                "read its log above (a model that failed to load is named there)",
            )
        url = f"http://{server.http}/v2/health/ready"
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as answer:
            if answer.status == 200:
                return
        time.sleep(0.25)
    raise PipelineError(
        f"tritonserver was not ready within {timeout_s:.0f} s:\n{_tail(server.log())}", "read its log above"
    )


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 20 s; the server's own process group (its stubs) goes with it."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, 9)
            process.wait(timeout=10)


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])
