"""The README runs as written: its first lines give the two commands, and its Python blocks run, in a fresh
interpreter each, against what they describe (the API example builds the folder the runner example opens,
and the client example talks to `trt-pipeline serve` on that folder)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def block(marker: str) -> str:
    """The one Python block of the README that contains `marker`."""
    found = [text for text in BLOCKS if marker in text]
    assert len(found) == 1, f"{len(found)} README blocks contain {marker!r}"
    return found[0]


def run_block(text: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", text], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"README block failed:\n{text}\n{result.stderr[-3000:]}"
    return result


def test_the_first_lines_give_the_two_commands():
    first_block = README.split("```sh\n", 1)[1].split("```", 1)[0]
    assert [line.split()[:3] for line in first_block.splitlines()] == [
        ["make", "engine", "MODEL=resnet"],
        ["make", "test", "#"],
    ]


def test_every_python_block_is_run_here():
    runs = ["make_engine(", "load_runner(", "tritonclient.http"]
    assert len(BLOCKS) == len(runs) and all(any(marker in text for text in BLOCKS) for marker in runs)


@pytest.mark.slow
def test_the_python_blocks_run_as_written(tmp_path):
    run_block(block("make_engine("), tmp_path)  # builds engines/resnet18-fp16 here
    shown = run_block(block("load_runner("), tmp_path).stdout
    assert "input float32 (-1, 3, 224, 224)" in shown and "(8, 1000)" in shown
    http_port, grpc_port = _free_port(), _free_port()
    client = block("tritonclient.http").replace("127.0.0.1:8000", f"127.0.0.1:{http_port}")
    client = client.replace("127.0.0.1:8001", f"127.0.0.1:{grpc_port}")
    command = [sys.executable, "-m", "trt_pipeline", "serve", "engines/resnet18-fp16"]
    command += ["--port", str(http_port), "--grpc-port", str(grpc_port)]
    this_checkout = {**os.environ, "PYTHONPATH": str(ROOT)}  # the code under test, as the blocks run it
    output = {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE}
    server = subprocess.Popen(command, cwd=tmp_path, env=this_checkout, **output)
    try:
        _wait_ready(f"http://127.0.0.1:{http_port}/v2/health/ready", server)
        run_block(client, tmp_path)
    finally:
        server.terminate()
        server.wait(timeout=60)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_ready(url: str, server: subprocess.Popen, limit_s: float = 180) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        assert server.poll() is None, server.stderr.read().decode() if server.stderr else "the server exited"
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"the server was not ready within {limit_s} s")
