"""`python -m pipeline serve engines/<model>-<precision>`: the HTTP service on uvicorn.

`make serve MODEL=resnet` passes --model/--precision/--out instead of a folder, and the folder is
found the way `make engine` names it.  The web stack is imported in main(), not at module level,
so the command line's other commands do not pay for it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.manifest import require_manifest
from pipeline.runners import BACKENDS
from pipeline.serve.config import ServeConfig
from pipeline.settings import PRECISIONS, Settings

COMMAND = "serve"
HELP = "serve an artifact folder over HTTP (FastAPI on uvicorn) with dynamic batching"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ServeConfig()
    parser.add_argument("folder", nargs="?", type=Path, help="artifact folder, e.g. engines/resnet50-fp16")
    parser.add_argument("--model", help="instead of a folder: the MODEL it was built from (with --precision, --out)")
    parser.add_argument("--precision", default="fp16", choices=PRECISIONS, help="with --model [PRECISION]")
    parser.add_argument("--out", type=Path, default=Path("engines"), help="with --model: the artifact root [OUT]")
    parser.add_argument(
        "--backend", default="auto", choices=BACKENDS, help="runner backend (auto: the engine if it runs here)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--name", help="model name in the URL (default: the manifest's model name)")
    parser.add_argument("--max-batch", type=int, help="most items per runner call (default: the profile's max)")
    parser.add_argument("--max-wait-ms", type=float, default=defaults.max_wait_ms, help="batch window")
    parser.add_argument("--no-batching", dest="batching", action="store_false", help="one runner call per request")
    parser.add_argument("--queue-size", type=int, default=defaults.queue_size, help="waiting requests before 503")
    parser.add_argument("--timeout-s", type=float, default=defaults.timeout_s, help="per request, before 504")
    parser.add_argument("--max-body-mib", type=float, default=defaults.max_body_mib, help="largest body before 413")
    parser.add_argument("--workers", type=int, default=defaults.workers, help="runner calls in flight at once")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def resolve_folder(args: argparse.Namespace) -> Path:
    """The folder given, or the one `make engine` writes for --model/--precision/--out."""
    if args.folder is not None:
        folder = args.folder
    elif args.model:
        import models

        settings = Settings(model=args.model, precision=args.precision, out_root=args.out)
        folder = settings.artifact_dir(models.canonical_name(args.model))
    else:
        raise PipelineError("no artifact folder given", "python -m pipeline serve engines/<model>-<precision>")
    require_manifest(folder)
    return folder


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from pipeline.serve.app import create_app

    folder = resolve_folder(args)
    config = ServeConfig(
        name=args.name,
        max_batch=args.max_batch,
        max_wait_ms=args.max_wait_ms,
        batching=args.batching,
        queue_size=args.queue_size,
        timeout_s=args.timeout_s,
        max_body_mib=args.max_body_mib,
        workers=args.workers,
    ).check()
    app = create_app(folder, config, backend=args.backend)
    # Requests carry their own timeout, so a graceful shutdown never needs to wait much longer than it.
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=int(config.timeout_s) + 5,
    )
    return 0
