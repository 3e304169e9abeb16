"""`trt-pipeline serve engines/<model>-<precision>`: the inference protocol over REST and gRPC.

`make serve MODEL=resnet` passes --model/--precision/--out instead of a folder, and the folder is
found the way `make engine` names it.  The web and gRPC stacks are imported in main(), not at module
level, so the command line's other commands do not pay for them.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
from pathlib import Path

from ..core.arguments import FOLDER_SETTINGS, add_settings_arguments, given_settings
from ..core.errors import PipelineError
from ..core.settings import Settings
from ..runners import BACKENDS
from .config import ServeConfig

# Shown by --help: Triton's own clients call this server unchanged (pip install 'tritonclient[http,grpc]').
CLIENTS = """\
clients (tritonclient, as for Triton Inference Server; the model is named <model>-<precision>):

  import numpy as np, tritonclient.http as http
  client = http.InferenceServerClient("127.0.0.1:8000")
  batch = np.zeros((1, 3, 224, 224), np.float32)
  given = http.InferInput("input", batch.shape, "FP32")
  given.set_data_from_numpy(batch)                      # binary_data=False sends JSON
  logits = client.infer("resnet50-fp16", [given]).as_numpy("output")

  import tritonclient.grpc as grpc
  client = grpc.InferenceServerClient("127.0.0.1:8001")
  given = grpc.InferInput("input", batch.shape, "FP32")
  given.set_data_from_numpy(batch)
  logits = client.infer("resnet50-fp16", [given]).as_numpy("output")

REST: GET /v2/health/live, /v2/health/ready, /v2, /v2/models/<name>[/ready|/config];
POST /v2/models/<name>/infer; GET /metrics (Prometheus).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = CLIENTS
    defaults = ServeConfig()
    parser.add_argument("folder", nargs="?", type=Path, help="artifact folder, e.g. engines/resnet50-fp16 (or --model)")
    # Instead of a folder, the settings it was built with, as `make engine` takes them; no MODEL by default: a folder
    # or MODEL must be given.
    add_settings_arguments(parser, FOLDER_SETTINGS, {"model": None})
    parser.add_argument(
        "--backend", default="auto", choices=BACKENDS, help="runner backend (auto: the engine if it runs here)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on, REST and gRPC (default: loopback)")
    parser.add_argument("--port", type=int, default=8000, help="REST (HTTP) port")
    parser.add_argument("--grpc-port", type=int, default=8001, help="gRPC port; 0: no gRPC")
    parser.add_argument("--name", help="model name clients use (default: <model>-<precision>, as the Triton writer)")
    parser.add_argument("--max-batch", type=int, help="most items per runner call (default: the profile's max)")
    parser.add_argument("--max-wait-ms", type=float, default=defaults.max_wait_ms, help="batch window")
    parser.add_argument("--no-batching", dest="batching", action="store_false", help="one runner call per request")
    parser.add_argument("--queue-size", type=int, default=defaults.queue_size, help="waiting requests before 503")
    parser.add_argument("--timeout-s", type=float, default=defaults.timeout_s, help="per request, before 504")
    parser.add_argument("--max-body-mib", type=float, default=defaults.max_body_mib, help="largest body before 413")
    parser.add_argument(
        "--max-json-mib", type=float, default=defaults.max_json_mib, help="largest JSON in a request before 413"
    )
    parser.add_argument(
        "--read-timeout-s", type=float, default=defaults.read_timeout_s, help="to receive a request's head, its body"
    )
    parser.add_argument("--workers", type=int, default=defaults.workers, help="runner calls in flight at once")
    parser.add_argument(
        "--max-connections",
        type=int,
        default=defaults.max_connections,
        help="REST connections and gRPC calls at once, before 503 / RESOURCE_EXHAUSTED",
    )
    parser.add_argument(
        "--connection-age-s",
        type=float,
        default=defaults.connection_age_s,
        help="longest a gRPC connection lives before the client is asked to reconnect",
    )
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def resolve_folder(args: argparse.Namespace) -> Path:
    """The folder given, or the one `make engine` writes for --model/--precision/--out."""
    given = given_settings(args)
    if args.folder is not None:
        folder = args.folder
    elif given.get("model"):
        from ... import models

        settings = Settings(**given)
        folder = settings.artifact_dir(models.canonical_name(settings.model))
    else:
        raise PipelineError("no artifact folder given", "trt-pipeline serve engines/<model>-<precision>")
    return folder


def check_ports(args: argparse.Namespace) -> None:
    if not 0 < args.port < 65536 or not 0 <= args.grpc_port < 65536:
        raise PipelineError(
            f"port {args.port} / gRPC port {args.grpc_port} is not a TCP port",
            "give --port 1-65535, --grpc-port 0-65535",
        )
    if args.grpc_port == args.port:
        raise PipelineError(f"REST and gRPC both asked for port {args.port}", "give --grpc-port another port (or 0)")
    try:
        socket.getaddrinfo(args.host, args.port)
    except (socket.gaierror, UnicodeError) as error:  # else uvicorn logs it and exits 3 after loading the model
        raise PipelineError(
            f"--host {args.host!r} is not an address ({error})", "give e.g. 127.0.0.1 (loopback) or 0.0.0.0 (every one)"
        ) from None


def main(args: argparse.Namespace) -> int:
    from .app import create_app
    from .server import serve

    check_ports(args)
    folder = resolve_folder(args)  # opened, and refused with the reason, by create_app
    config = ServeConfig(
        name=args.name,
        max_batch=args.max_batch,
        max_wait_ms=args.max_wait_ms,
        batching=args.batching,
        queue_size=args.queue_size,
        timeout_s=args.timeout_s,
        max_body_mib=args.max_body_mib,
        max_json_mib=args.max_json_mib,
        read_timeout_s=args.read_timeout_s,
        workers=args.workers,
        max_connections=args.max_connections,
        connection_age_s=args.connection_age_s,
    ).check()
    app = create_app(folder, config, backend=args.backend)
    grpc_port = args.grpc_port or None
    asyncio.run(serve(app, host=args.host, port=args.port, grpc_port=grpc_port, log_level=args.log_level))
    return 0
