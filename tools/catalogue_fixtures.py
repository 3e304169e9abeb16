"""What the catalogue's cases run against, made once per run with the checkout under test.

Two finished artifact folders (tiny_cnn, an image model; text_classifier, token ids and a mask) built by that
checkout's own command line, bad files of every kind a user could pass, a full and a read-only file system
(tiny tmpfs mounts where this process may mount; otherwise the cases that need them use RLIMIT_FSIZE or say
n/a), and the two servers the service cases talk to.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

IMAGE_MODEL = "tests.helpers.toy_models:tiny_cnn"
TEXT_MODEL = "tests.helpers.toy_models:text_classifier"
BUILD_LIMIT_S = 600
SERVER_START_S = 120
FULL_DISK_BYTES = 64 * 1024  # room for a manifest, not for a graph and its engine
BAD_FACTORIES = Path(__file__).resolve().parents[1] / "tests" / "helpers" / "bad_factories.py"


class _RunsShell:
    """Unpickling this touches $CATALOGUE_MARKER: what a crafted model file can do."""

    def __reduce__(self):
        return (os.system, ('touch "$CATALOGUE_MARKER"',))


@dataclass
class Fixtures:
    files: Path
    image: Path
    text: Path
    full_disk: Path | None
    read_only: Path | None
    mounts: list[Path] = field(default_factory=list)

    @classmethod
    def build(cls, code: Path, work: Path, env: dict[str, str]) -> Fixtures:
        files = work / "files"
        files.mkdir(parents=True, exist_ok=True)
        _bad_files(files)
        engines = work / "engines"
        image = _engine(code, env, engines, IMAGE_MODEL, "1:8:32")
        text = _engine(code, env, engines, TEXT_MODEL, "1:4:16")
        full, read_only = work / "full", work / "read-only"
        mounts = [
            path for path, options in ((full, f"size={FULL_DISK_BYTES}"), (read_only, "ro")) if _mount(path, options)
        ]
        return cls(
            files, image, text, full if full in mounts else None, read_only if read_only in mounts else None, mounts
        )

    def release(self) -> None:
        for path in self.mounts:
            subprocess.run(["umount", str(path)], check=False)

    @contextlib.contextmanager
    def servers(self, env: dict[str, str]) -> Iterator[dict[str, Server]]:
        with Server.start(self.image, env) as image, Server.start(self.text, env) as text:
            yield {"image": image, "text": text}


def _engine(code: Path, env: dict[str, str], engines: Path, model: str, batch: str) -> Path:
    argv = [sys.executable, "-m", "trt_pipeline", "all", "--model", model, "--precision", "fp32", "--batch", batch]
    subprocess.run([*argv, "--out", str(engines)], cwd=code, env=env, check=True, timeout=BUILD_LIMIT_S)
    return engines / f"toy_models-{model.split(':')[1]}-fp32"


def _mount(path: Path, options: str) -> bool:
    """A small tmpfs at `path` (needs the right to mount, e.g. root in a container); False where refused."""
    path.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
        return done.returncode == 0
    return False


def _bad_files(files: Path) -> None:
    import numpy as np
    import torch

    # The factories come from this tool's own tree, under a name of their own: the checkout measured may predate them.
    shutil.copyfile(BAD_FACTORIES, files / "catalogue_factories.py")
    (files / "text.pth").write_text("hello\n")
    (files / "empty.pth").write_bytes(b"")
    (files / "dir.pth").mkdir(exist_ok=True)
    other = torch.nn.Linear(4, 2).state_dict()
    torch.save(other, files / "wrong_model.pth")
    resnet_like = {"conv1.weight": torch.zeros(64, 3, 7, 7)}
    torch.save(resnet_like, files / "partial.pth")
    whole = (files / "wrong_model.pth").read_bytes()
    (files / "truncated.pth").write_bytes(whole[: len(whole) // 2])
    np.save(files / "array.pth.npy", np.zeros(3))
    with (files / "crafted.pt").open("wb") as crafted:
        pickle.dump(_RunsShell(), crafted)
    torch.save(_RunsShell(), files / "crafted_torch.pt")
    # A module first: weights_only=True refuses its class ("Unsupported global"), the refusal the old loader
    # answered by unpickling the whole file again with weights_only=False, which then ran the shell command.
    torch.save([torch.nn.Linear(2, 2), _RunsShell()], files / "crafted_module.pt")
    scripted = torch.jit.script(torch.nn.Linear(4, 2))
    scripted.save(str(files / "scripted.pt"))
    script_bytes = (files / "scripted.pt").read_bytes()
    (files / "truncated_script.pt").write_bytes(script_bytes[: len(script_bytes) // 2])
    (files / "text.pt").write_text("not a model\n")
    (files / "empty.pt").write_bytes(b"")
    (files / "corrupt.pt2").write_bytes(b"PK\x03\x04" + b"\x00" * 64)
    (files / "model.onnx").write_bytes(b"\x08\x07")  # a graph file where a model is expected
    _calibration_files(files)


def _calibration_files(files: Path) -> None:
    import numpy as np

    (files / "calib-empty").mkdir(exist_ok=True)
    not_images = files / "calib-not-images"
    not_images.mkdir(exist_ok=True)
    for index in range(4):
        (not_images / f"{index}.jpg").write_text("not a picture\n")
    np.save(files / "calib-wrong-shape.npy", np.zeros((8, 5), np.float32))
    np.save(files / "calib-nan.npy", np.full((8, 3, 16, 16), np.nan, np.float32))
    np.save(files / "calib-int.npy", np.zeros((8, 3, 16, 16), np.int64))
    np.savez(files / "calib-no-arrays.npz")
    (files / "calib-corrupt.npy").write_bytes(b"\x93NUMPY\x01\x00garbage")
    np.save(files / "calib-object.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)


@dataclass
class Server:
    """A `python -m trt_pipeline serve` process of the checkout under test, REST and gRPC, on free loopback ports."""

    port: int
    process: subprocess.Popen
    model: str
    grpc_port: int

    @classmethod
    @contextlib.contextmanager
    def start(cls, folder: Path, env: dict[str, str]) -> Iterator[Server]:
        port, grpc_port = _free_port(), _free_port()
        argv = [sys.executable, "-m", "trt_pipeline", "serve", str(folder), "--port", str(port)]
        argv += ["--grpc-port", str(grpc_port)]
        argv += ["--log-level", "warning", *_guard_options(env)]
        process = subprocess.Popen(argv, cwd=env["CATALOGUE_CODE"], env=env, stderr=subprocess.DEVNULL)
        server = cls(port, process, folder.name, grpc_port)
        try:
            server.wait_ready()
            yield server
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline and self.alive:
            ready = f"http://127.0.0.1:{self.port}/v2/health/ready"
            with contextlib.suppress(OSError), urllib.request.urlopen(ready, timeout=2) as answer:
                if answer.status == 200:
                    return
            time.sleep(0.3)
        raise RuntimeError(f"the server for {self.model} did not become ready")


def _guard_options(env: dict[str, str]) -> list[str]:
    """A short read timeout where the checkout has the option (the slow-client case waits for it)."""
    help_text = subprocess.run(
        [sys.executable, "-m", "trt_pipeline", "serve", "--help"],
        cwd=env["CATALOGUE_CODE"],
        env=env,
        capture_output=True,
        text=True,
    ).stdout
    return ["--read-timeout-s", "3"] if "--read-timeout-s" in help_text else []


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
