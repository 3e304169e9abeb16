"""A warm interpreter that runs each catalogue case in a forked child: `python -m trt_pipeline ...` or a case script.

A fresh interpreter spends seconds importing torch before a case can fail in milliseconds; on a shared 2-core
machine that made the catalogue take an hour.  This process imports torch, numpy, onnx and onnxruntime once
(not the pipeline itself, so each case imports the checkout's code as a fresh interpreter would), then reads
one JSON request a line on stdin and answers one JSON line on stdout when the child has ended:

    {"module": "pipeline" | "path": script, "argv": [...], "cwd": ..., "env": {...}, "stdout": file,
     "stderr": file, "limit": seconds, "fsize": bytes or null}  ->  {"rc": int, "timed_out": bool}

The child is its own session (killed as a group at the time limit) and exits as `python -m` would: the
SystemExit's status, 1 with the traceback printed for any other exception, a negative status for a signal.
"""

from __future__ import annotations

import json
import os
import resource
import runpy
import signal
import sys
import time
import traceback

import numpy  # noqa: F401  (warm imports: what every case would otherwise import itself)
import onnx  # noqa: F401
import onnxruntime  # noqa: F401
import torch  # noqa: F401

POLL_S = 0.02


def child(request: dict) -> int:
    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, name in ((1, "stdout"), (2, "stderr")):
        target = os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    if request.get("fsize"):
        resource.setrlimit(resource.RLIMIT_FSIZE, (request["fsize"], request["fsize"]))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if "module" in request:
            sys.argv = [request["module"], *request["argv"]]
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [request["path"], *request["argv"]]
            runpy.run_path(request["path"], run_name="__main__")
        return 0
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            return done.code or 0
        print(done.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def serve_one(request: dict) -> dict:
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            status = child(request)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    deadline = time.monotonic() + request["limit"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"rc": os.waitstatus_to_exitcode(status), "timed_out": False}
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)  # the child's own session: the case and what it started
            os.waitpid(pid, 0)
            return {"rc": -9, "timed_out": True}
        time.sleep(POLL_S)


def main() -> None:
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin:
        sys.stdout.write(json.dumps(serve_one(json.loads(line))) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
