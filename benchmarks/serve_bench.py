"""Service benchmark: requests/s and p50/p99 latency of `python -m pipeline serve` at several client counts,
with dynamic batching on and off.  Writes <out>.json and <out>.md.

    .venv/bin/python benchmarks/serve_bench.py engines/<model>-<precision> --out docs/benchmarks/serve-<name>

Each mode starts its own server process on 127.0.0.1 (a free port), waits for /ready, and stops it after.
The clients are raw HTTP/1.1 keep-alive connections on asyncio (one per client, each sending its next
request when the previous answer is in), so the client side costs little next to the server; on a small
machine they still share its cores, which the report states.  Every request carries its own random items
(.npy bodies) and every answer must be 200 with one output row per item.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="report path without suffix (.json and .md written)")
    parser.add_argument("--clients", default="1,8,32", help="concurrent client counts")
    parser.add_argument("--requests", type=int, default=2000, help="requests per (mode, client count)")
    parser.add_argument("--items", type=int, default=1, help="items per request")
    parser.add_argument("--max-wait-ms", type=float, default=2.0, help="batch window when batching is on")
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    load_before = os.getloadavg()
    rows: list[dict] = []
    description: dict = {}
    for batching in (True, False):
        options = ["--backend", args.backend, "--max-wait-ms", str(args.max_wait_ms)]
        options += [] if batching else ["--no-batching"]
        with Server(args.folder, options) as server:
            description = server.describe()
            for count in clients:
                rows.append(
                    {"batching": batching, "clients": count, **server.measure(count, args.requests, args.items)}
                )
                print(json.dumps(rows[-1]), flush=True)
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started": started,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_before": load_before},
        "model": description,
        "requests_per_point": args.requests,
        "items_per_request": args.items,
        "max_wait_ms": args.max_wait_ms,
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    print(f"wrote {args.out.with_suffix('.md')} and .json")
    return 0


class Server:
    """A `python -m pipeline serve` process on a free loopback port; stopped (SIGTERM, then kill) on exit."""

    def __init__(self, folder: Path, options: list[str]):
        with socket.socket() as probe:
            probe.bind((HOST, 0))
            self.port = probe.getsockname()[1]
        command = [sys.executable, "-m", "pipeline", "serve", str(folder), "--host", HOST, "--port", str(self.port)]
        self.process = subprocess.Popen([*command, "--log-level", "warning", *options], cwd=ROOT)
        self.path = ""

    def __enter__(self) -> Server:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"the server exited with {self.process.returncode}")
            try:
                if asyncio.run(get(self.port, "/ready"))[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        else:
            raise SystemExit("the server was not ready within 120 s")
        self.model = json.loads(asyncio.run(get(self.port, "/openapi.json"))[1])
        self.path = next(p for p in self.model["paths"] if p.endswith("/infer"))
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def describe(self) -> dict:
        info = json.loads(asyncio.run(get(self.port, self.path.removesuffix("/infer")))[1])
        return {
            "name": info["name"],
            "inputs": info["inputs"],
            "max_items": info["max_items"],
            "runner": info["runner"],
        }

    def measure(self, clients: int, requests: int, items: int) -> dict:
        info = self.describe()
        [spec] = info["inputs"]  # the benchmark sends .npy bodies: single-input models
        shape = [items, *spec["shape"][1:]]
        asyncio.run(drive(self.port, self.path, shape, spec["dtype"], clients, min(requests, 10 * clients)))  # warm
        middle = asyncio.run(get(self.port, "/metrics"))[1].decode()
        began = time.perf_counter()
        latencies = asyncio.run(drive(self.port, self.path, shape, spec["dtype"], clients, requests))
        seconds = time.perf_counter() - began
        after = asyncio.run(get(self.port, "/metrics"))[1].decode()
        calls = metric(after, "serve_batch_items_count") - metric(middle, "serve_batch_items_count")
        rows = metric(after, "serve_batch_items_sum") - metric(middle, "serve_batch_items_sum")
        ms = np.array(latencies) * 1000
        return {
            "requests_per_s": round(requests / seconds, 1),
            "p50_ms": round(float(np.percentile(ms, 50)), 2),
            "p99_ms": round(float(np.percentile(ms, 99)), 2),
            "items_per_runner_call": round(rows / calls, 2) if calls else None,
        }


async def get(port: int, path: str) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
        return await read_response(reader)
    finally:
        writer.close()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = dict(line.split(":", 1) for line in lines[1:] if ":" in line)
    length = int({k.lower(): v for k, v in headers.items()}.get("content-length", "0"))
    return status, await reader.readexactly(length)


async def drive(port: int, path: str, shape: list[int], dtype: str, clients: int, requests: int) -> list[float]:
    """`requests` requests over `clients` keep-alive connections; the latency of each, in seconds."""
    bodies = [npy(np.random.default_rng(n).standard_normal(shape).astype(dtype)) for n in range(min(requests, 256))]
    latencies: list[float] = []
    remaining = iter(range(requests))

    async def client() -> None:
        reader, writer = await asyncio.open_connection(HOST, port)
        try:
            for number in remaining:
                body = bodies[number % len(bodies)]
                head = f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/x-npy\r\n"
                sent = time.perf_counter()
                writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
                status, answer = await read_response(reader)
                latencies.append(time.perf_counter() - sent)
                if status != 200:
                    raise SystemExit(f"request {number} answered {status}: {answer[:300]!r}")
                if np.load(io.BytesIO(answer), allow_pickle=False).shape[0] != shape[0]:
                    raise SystemExit(f"request {number} got the wrong number of rows")
        finally:
            writer.close()

    await asyncio.wait_for(asyncio.gather(*(client() for _ in range(clients))), timeout=600)
    return latencies


def npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def markdown(report: dict) -> str:
    model = report["model"]
    lines = [
        f"# Service benchmark: {model['name']}",
        "",
        f"Command: `{report['command']}`  ",
        f"Started {report['started']} on {report['machine']['cpus']} CPUs ({report['machine']['platform']}), "
        f"load average before {', '.join(f'{x:.2f}' for x in report['machine']['loadavg_before'])}; "
        "server and clients share the machine.  ",
        f"Runner: {model['runner']}  ",
        f"{report['requests_per_point']} requests per row (after a warm-up), {report['items_per_request']} item(s) "
        f"per request as .npy, batch window {report['max_wait_ms']} ms, "
        f"max {model['max_items']} items per runner call.",
        "",
        "| batching | clients | requests/s | p50 ms | p99 ms | items per runner call |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in report["results"]:
        lines.append(
            f"| {'on' if row['batching'] else 'off'} | {row['clients']} | {row['requests_per_s']} | {row['p50_ms']} "
            f"| {row['p99_ms']} | {row['items_per_runner_call']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
