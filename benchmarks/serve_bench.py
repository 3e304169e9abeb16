"""Service benchmark: requests/s and p50/p99 latency of `python -m trt_pipeline serve` at several client counts, for
each way a request can travel: the inference protocol's REST with JSON tensors (v2-json), REST with Triton's
binary tensor data (v2-binary), gRPC with raw contents (grpc), and, given a checkout of the service from before
the protocol (--baseline), its /v1 `.npy` path (npy-before); and, where the nvidia-pytriton wheel's tritonserver
starts (pipeline/triton/server.py), Triton Inference Server serving the same folder in the scale-out repository
form (`python -m trt_pipeline triton --backend python`: our runner inside Triton's Python backend), over binary REST
(triton-binary) and gRPC (triton-grpc).  Writes <out>.json and <out>.md.

    .venv/bin/python benchmarks/serve_bench.py engines/<model>-<precision> --out docs/benchmarks/serve-<name>-v2 \\
        [--baseline <dir with the old pipeline/, models/, calibration/>]

Two server processes run side by side on 127.0.0.1 (free ports): this repository's, which serves the three
protocol modes at once (they are its front ends), and, with --baseline, the old one.  For each client count the
modes take turns, round after round (--rounds), so the measurements compared are seconds apart; the report gives
each figure's median over the rounds with every round's requests/s beside it.  On a machine other jobs share, a
burst of theirs then lands on all modes alike rather than on whichever ran at that moment.
The clients are raw keep-alive connections on asyncio (HTTP/1.1 for REST and .npy, one gRPC channel each for
gRPC), sending prebuilt bodies, each client its next request when the previous answer is in: the client side
costs little next to the server, but on a small machine both share its cores, which the report states.  Every
request carries random items; every answer must be a success with one output row per item.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from trt_pipeline.pipeline.core.cpu import cpu_instruction_sets, cpu_model, instruction_sets_text
from trt_pipeline.pipeline.folder.reader import open_folder
from trt_pipeline.pipeline.runners import load_runner
from trt_pipeline.pipeline.runners.base import max_batch
from trt_pipeline.pipeline.serve.protocol import DATATYPES
from trt_pipeline.pipeline.triton.repository import model_name, write_repository
from trt_pipeline.pipeline.triton.server import running_triton, startup_problem

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
MODES = ("v2-json", "v2-binary", "grpc", "npy-before", "triton-binary", "triton-grpc")
# Triton's modes travel as ours do; only the server differs.
TRITON_MODES = {"triton-binary": "v2-binary", "triton-grpc": "grpc"}
DISTINCT_BODIES = 16  # per mode and client count; a JSON body of a 224x224 image is some 3 MB


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="report path without suffix (.json and .md written)")
    parser.add_argument("--clients", default="1,8,32", help="concurrent client counts")
    parser.add_argument("--requests", type=int, default=200, help="requests per (mode, client count, round)")
    parser.add_argument("--rounds", type=int, default=3, help="times every mode is measured, in turns")
    parser.add_argument("--items", type=int, default=1, help="items per request")
    parser.add_argument("--max-wait-ms", type=float, default=2.0, help="batch window")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--modes", default=",".join(MODES), help="which of " + ", ".join(MODES))
    parser.add_argument(
        "--baseline",
        type=Path,
        help="a checkout of the service before the inference protocol, for npy-before, e.g. "
        "`git archive c81759e pipeline models calibration | tar -x -C DIR`",
    )
    args = parser.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    modes = [m for m in args.modes.split(",") if m != "npy-before" or args.baseline is not None]
    problem = startup_problem()
    if problem is not None and any(mode in TRITON_MODES for mode in modes):
        print(f"no Triton modes: {problem}", flush=True)
        modes = [mode for mode in modes if mode not in TRITON_MODES]
    model = describe_model(args.folder, args.backend)
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    load_before = os.getloadavg()
    rows: list[dict] = []
    options = ["--backend", args.backend, "--max-wait-ms", str(args.max_wait_ms)]
    with contextlib.ExitStack() as running:
        current = running.enter_context(Server(args.folder, options, None))
        old = running.enter_context(Server(args.folder, options, args.baseline)) if args.baseline else None
        triton = None
        if any(mode in TRITON_MODES for mode in modes):
            triton = running.enter_context(TritonTarget(args.folder, args.backend, args.max_wait_ms))
        for count in clients:
            for round_number in range(1, args.rounds + 1):
                for mode in modes:
                    server = old if mode == "npy-before" and old is not None else current
                    server = triton if mode in TRITON_MODES and triton is not None else server
                    measured = server.measure(mode, model, count, args)
                    rows.append({"round": round_number, "mode": mode, "clients": count, **measured})
                    print(json.dumps(rows[-1]), flush=True)
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started": started,
        "machine": {
            "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "instruction_sets": instruction_sets_text(cpu_instruction_sets()),
            "platform": platform.platform(),
            "loadavg_before": load_before,
        },
        "model": model,
        "requests_per_point": args.requests,
        "items_per_request": args.items,
        "max_wait_ms": args.max_wait_ms,
        "baseline": str(args.baseline) if args.baseline else None,
        "rounds": args.rounds,
        "summary": summarize(rows),
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    print(f"wrote {args.out.with_suffix('.md')} and .json")
    return 0


def describe_model(folder: Path, backend: str) -> dict:
    """The model as served: its name, single input and first output, and the runner the server will pick
    (load_runner is the function the server calls, on the same machine)."""
    opened = open_folder(folder)
    manifest = opened.manifest
    [given] = manifest.inputs  # the .npy body of the old service carries one array: single-input models
    with load_runner(opened, backend) as runner:
        description = runner.description
    return {
        "name": model_name(manifest),
        "old_name": opened.model,  # what the service before the protocol called it
        "input": given.as_record(),
        "output": manifest.outputs[0].name,
        "max_items": max_batch(manifest),
        "runner": description,
    }


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


class Server:
    """A `python -m trt_pipeline serve` process (from `checkout`, else this repository) on free loopback ports;
    stopped (SIGTERM, then kill) on exit."""

    def __init__(self, folder: Path, options: list[str], checkout: Path | None):
        self.port, self.grpc_port = free_port(), free_port()
        self.ready_path = "/ready" if checkout else "/v2/health/ready"
        command = [sys.executable, "-m", "trt_pipeline", "serve", str(Path(folder).resolve()), "--host", HOST]
        command += ["--port", str(self.port), "--log-level", "warning", *options]
        command += [] if checkout else ["--grpc-port", str(self.grpc_port)]
        # `python -m` puts the working directory first on sys.path, so a checkout's own `pipeline` runs.
        self.process = subprocess.Popen(command, cwd=checkout or ROOT)

    def __enter__(self) -> Server:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"the server exited with {self.process.returncode}")
            try:
                if asyncio.run(get(self.port, self.ready_path))[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        raise SystemExit("the server was not ready within 120 s")

    def __exit__(self, *exc_info: object) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def measure(self, mode: str, model: dict, clients: int, args: argparse.Namespace) -> dict:
        shape = [args.items, *model["input"]["shape"][1:]]
        dtype = np.dtype(model["input"]["dtype"])
        arrays = [np.random.default_rng(n).standard_normal(shape).astype(dtype) for n in range(DISTINCT_BODIES)]
        send = self.sender(mode, model, arrays)
        asyncio.run(drive(send, clients, min(args.requests, 4 * clients)))  # warm-up
        calls_before, rows_before = self.batch_counts()
        began = time.perf_counter()
        latencies = asyncio.run(drive(send, clients, args.requests))
        seconds = time.perf_counter() - began
        calls_after, rows_after = self.batch_counts()
        calls, rows = calls_after - calls_before, rows_after - rows_before
        ms = np.array(latencies) * 1000
        return {
            "requests_per_s": round(args.requests / seconds, 1),
            "p50_ms": round(float(np.percentile(ms, 50)), 2),
            "p99_ms": round(float(np.percentile(ms, 99)), 2),
            "items_per_runner_call": round(rows / calls, 2) if calls else None,
            "request_bytes": int(np.mean(send.body_sizes)),
            "loadavg_1min_after": round(os.getloadavg()[0], 2),
        }

    def batch_counts(self) -> tuple[float, float]:
        """(runner calls, items run) so far, from the service's /metrics."""
        text = asyncio.run(get(self.port, "/metrics"))[2].decode()
        return metric(text, "serve_batch_items_count"), metric(text, "serve_batch_items_sum")

    def sender(self, mode: str, model: dict, arrays: list[np.ndarray]) -> Sender:
        mode = TRITON_MODES.get(mode, mode)
        if mode == "grpc":
            return GrpcSender(f"{HOST}:{self.grpc_port}", model, arrays)
        return HttpSender(self.port, mode, model, arrays)


class TritonTarget(Server):
    """tritonserver serving `folder` in the python repository form (written to a temporary repository), with
    Triton's dynamic batching at the same window; stopped on exit."""

    def __init__(self, folder: Path, backend: str, max_wait_ms: float):
        self.scratch = tempfile.TemporaryDirectory(prefix="serve-bench-triton-")
        repository = Path(self.scratch.name)
        write_repository(
            folder, repository, backend="python", runner_backend=backend, max_queue_delay_us=round(max_wait_ms * 1000)
        )
        self.running = running_triton(repository)

    def __enter__(self) -> TritonTarget:
        server = self.running.__enter__()
        self.port, self.grpc_port, self.metrics_port = (
            int(a.split(":")[1]) for a in (server.http, server.grpc, server.metrics)
        )
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.running.__exit__(None, None, None)
        self.scratch.cleanup()

    def batch_counts(self) -> tuple[float, float]:
        """(model executions, inferences, i.e. items) so far, from Triton's metrics."""
        text = asyncio.run(get(self.metrics_port, "/metrics"))[2].decode()
        return metric(text, "nv_inference_exec_count"), metric(text, "nv_inference_count")


# --------------------------------------------------------------------------- clients


class Sender:
    """Opens one client's connection and sends one request on it; checks the answer, returns nothing."""

    body_sizes: list[int]

    async def connect(self) -> Callable[[int], Awaitable[None]]:
        raise NotImplementedError


class HttpSender(Sender):
    def __init__(self, port: int, mode: str, model: dict, arrays: list[np.ndarray]):
        self.port = port
        self.rows = arrays[0].shape[0]
        self.requests = [http_request(mode, model, array) for array in arrays]
        self.body_sizes = [len(body) for _, body in self.requests]
        self.check = {"v2-json": json_rows, "v2-binary": binary_rows, "npy-before": npy_rows}[mode]

    async def connect(self) -> Callable[[int], Awaitable[None]]:
        reader, writer = await asyncio.open_connection(HOST, self.port)

        async def send(number: int) -> None:
            head, body = self.requests[number % len(self.requests)]
            writer.write(head + body)
            status, headers, answer = await read_response(reader)
            if status != 200 or self.check(headers, answer) != self.rows:
                raise SystemExit(f"request {number} answered {status} with the wrong rows: {answer[:300]!r}")

        return send


def http_request(mode: str, model: dict, array: np.ndarray) -> tuple[bytes, bytes]:
    """(request line and headers, body) for one prebuilt request."""
    given, output = model["input"], model["output"]
    tensor = {"name": given["name"], "datatype": DATATYPES[array.dtype.name], "shape": list(array.shape)}
    headers = {}
    if mode == "v2-json":
        document = {"inputs": [{**tensor, "data": array.ravel().tolist()}], "outputs": [{"name": output}]}
        body = json.dumps(document).encode()
    elif mode == "v2-binary":
        tensor["parameters"] = {"binary_data_size": array.nbytes}
        document = {"inputs": [tensor], "outputs": [{"name": output, "parameters": {"binary_data": True}}]}
        header = json.dumps(document).encode()
        body, headers = header + array.tobytes(), {"Inference-Header-Content-Length": str(len(header))}
    else:
        body, headers = npy(array), {"Content-Type": "application/x-npy"}
    name = model["old_name"] if mode == "npy-before" else model["name"]
    path = f"/v1/models/{name}/infer" if mode == "npy-before" else f"/v2/models/{name}/infer"
    lines = [f"POST {path} HTTP/1.1", f"Host: {HOST}", f"Content-Length: {len(body)}"]
    lines += [f"{key}: {value}" for key, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode(), body


def json_rows(headers: dict, answer: bytes) -> int:
    [output] = json.loads(answer)["outputs"]
    return output["shape"][0] if len(output["data"]) == np.prod(output["shape"]) else -1


def binary_rows(headers: dict, answer: bytes) -> int:
    length = int(headers["inference-header-content-length"])
    [output] = json.loads(answer[:length])["outputs"]
    size = np.dtype(np.float32).itemsize * int(np.prod(output["shape"]))
    return output["shape"][0] if output["parameters"]["binary_data_size"] == size == len(answer) - length else -1


def npy_rows(headers: dict, answer: bytes) -> int:
    return np.load(io.BytesIO(answer), allow_pickle=False).shape[0]


class GrpcSender(Sender):
    def __init__(self, address: str, model: dict, arrays: list[np.ndarray]):
        self.address = address
        self.rows = arrays[0].shape[0]
        given = model["input"]
        self.requests = []
        for array in arrays:
            tensor = service_pb2.ModelInferRequest.InferInputTensor(
                name=given["name"], datatype=DATATYPES[array.dtype.name], shape=list(array.shape)
            )
            self.requests.append(
                service_pb2.ModelInferRequest(
                    model_name=model["name"], inputs=[tensor], raw_input_contents=[array.tobytes()]
                )
            )
        self.body_sizes = [request.ByteSize() for request in self.requests]

    async def connect(self) -> Callable[[int], Awaitable[None]]:
        # One channel (one HTTP/2 connection) per client, as one tritonclient.grpc client holds.
        channel = grpc.aio.insecure_channel(self.address, options=[("grpc.max_receive_message_length", -1)])
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

        async def send(number: int) -> None:
            response = await stub.ModelInfer(self.requests[number % len(self.requests)])
            if response.outputs[0].shape[0] != self.rows or not response.raw_output_contents:
                raise SystemExit(f"request {number} got the wrong rows")

        return send


async def drive(sender: Sender, clients: int, requests: int) -> list[float]:
    """`requests` requests over `clients` connections; the latency of each, in seconds."""
    latencies: list[float] = []
    remaining = iter(range(requests))

    async def client() -> None:
        send = await sender.connect()
        for number in remaining:
            sent = time.perf_counter()
            await send(number)
            latencies.append(time.perf_counter() - sent)

    await asyncio.wait_for(asyncio.gather(*(client() for _ in range(clients))), timeout=600)
    return latencies


async def get(port: int, path: str) -> tuple[int, dict, bytes]:
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
        return await read_response(reader)
    finally:
        writer.close()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {
        key.strip().lower(): value.strip() for key, _, value in (line.partition(":") for line in lines[1:] if line)
    }
    return status, headers, await reader.readexactly(int(headers.get("content-length", "0")))


def npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def metric(text: str, family: str) -> float:
    """The sum of a family's samples, whatever their labels (the old service had none, the new one a model)."""
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.split("{")[0].split(" ")[0] == family)


def summarize(rows: list[dict]) -> list[dict]:
    """Per (mode, clients), by client count then mode: the median of each figure over the rounds."""
    points: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        points.setdefault((row["mode"], row["clients"]), []).append(row)
    summary = []
    for (mode, clients), measured in points.items():
        median = {key: round(float(np.median([m[key] for m in measured])), 2) for key in MEDIAN_KEYS}
        by_round = [m["requests_per_s"] for m in measured]
        summary.append({"mode": mode, "clients": clients, **median, "requests_per_s_by_round": by_round})
    return summary


MEDIAN_KEYS = ("requests_per_s", "p50_ms", "p99_ms", "items_per_runner_call")


def markdown(report: dict) -> str:
    model, machine = report["model"], report["machine"]
    lines = [
        f"# Service benchmark: {model['name']}, by protocol",
        "",
        f"Command: `{report['command']}`  ",
        f"Started {report['started']} on {machine['cpus']} CPUs ({machine['cpu']}; {machine['instruction_sets']}; "
        f"{machine['platform']}), load average before {', '.join(f'{x:.2f}' for x in machine['loadavg_before'])}; "
        "server and clients share the machine.  ",
        f"Runner: {model['runner']}  ",
        f"{report['requests_per_point']} requests per point and round (after a warm-up), {report['rounds']} rounds "
        "with the modes in turn at each client count; each figure is the median over the rounds.  "
        f"{report['items_per_request']} item(s) "
        f"of {model['input']['shape'][1:]} {model['input']['dtype']} per request, batching on with a "
        f"{report['max_wait_ms']} ms window, max {model['max_items']} items per runner call.  ",
        "Modes: `v2-json` REST with JSON tensors in and out; `v2-binary` REST with Triton's binary tensor data in "
        "and out; `grpc` ModelInfer with raw contents; `npy-before` the service before the inference protocol "
        f"(`{report['baseline']}`), `.npy` in and out of `/v1/models/<name>/infer`; `triton-binary` and "
        "`triton-grpc` the same requests as `v2-binary` and `grpc` to Triton Inference Server 2.51 (the "
        "nvidia-pytriton wheel's tritonserver) serving the folder in the python repository form: our runner "
        "inside Triton's Python backend, Triton's dynamic batcher with the same window (items per runner call "
        "from its metrics).",
        "",
        "| mode | clients | requests/s | p50 ms | p99 ms | items per runner call | requests/s by round |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in report["summary"]:
        lines.append(
            f"| {row['mode']} | {row['clients']} | {row['requests_per_s']} | {row['p50_ms']} | {row['p99_ms']} "
            f"| {row['items_per_runner_call']} | {', '.join(str(r) for r in row['requests_per_s_by_round'])} |"
        )
    sizes = {row["mode"]: row["request_bytes"] for row in report["results"]}
    loads = [row["loadavg_1min_after"] for row in report["results"]]
    lines += [
        "",
        "Request body bytes: " + ", ".join(f"{mode} {size}" for mode, size in sizes.items()) + ".  ",
        f"1-minute load average after each measurement: {min(loads)} to {max(loads)}.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
