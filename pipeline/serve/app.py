"""The FastAPI app: one artifact folder, one runner, dynamic batching in front of it.

    GET  /health                       the process is up (503 only once loading the runner has failed)
    GET  /ready                        the runner is loaded and answered a warm-up request
    GET  /metrics                      Prometheus text: requests by status, latency, batch sizes, queue depth
    GET  /v1/models/<name>             inputs, outputs, max items per request, the runner's description
    POST /v1/models/<name>/infer       JSON, .npy or .npz in; the same form out (see pipeline.serve.codec)

The runner loads on a background task after startup, so /health answers at once and /ready turns
200 only when the model has really run.  On SIGTERM uvicorn stops accepting connections, lets the
requests in flight finish, then the lifespan's exit stops the batcher and closes the runner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from pipeline.manifest import require_manifest
from pipeline.runners import Runner, load_runner
from pipeline.runners.base import DYNAMIC
from pipeline.serve.batcher import Batcher, QueueFull
from pipeline.serve.codec import ModelIO, ServeError, check_items, decode_request, encode_response, media_type
from pipeline.serve.config import ServeConfig
from pipeline.serve.metrics import ServiceMetrics
from pipeline.serve.schema import ERROR, infer_openapi

log = logging.getLogger(__name__)

RETRY_AFTER = {"Retry-After": "1"}


class Service:
    """The app's state: the model's I/O (from the manifest), the runner once loaded, the batcher, metrics."""

    def __init__(self, folder: Path, config: ServeConfig, backend: str):
        self.folder = Path(folder)
        self.config = config.check()
        self.backend = backend
        self.model = ModelIO.from_manifest(require_manifest(self.folder), config.name, config.max_batch)
        self.metrics = ServiceMetrics()
        self.runner: Runner | None = None
        self.batcher: Batcher | None = None
        self.failure: str | None = None

    @property
    def ready(self) -> bool:
        return self.batcher is not None

    async def load(self) -> None:
        """Load the runner, run a warm-up request at one item and at max items, then start batching."""
        try:
            self.runner = await asyncio.to_thread(load_runner, self.folder, self.backend)
            for items in sorted({1, self.model.max_items}):
                await asyncio.to_thread(self.runner.infer, warm_up_feed(self.model, items))
        except Exception as error:  # a PipelineError or a bug: either way this process cannot serve
            log.exception("loading the runner for %s failed", self.folder)
            self.failure = f"loading the runner failed: {error}"
            return
        batcher = Batcher(
            self.runner.infer,
            self.metrics,
            max_items=self.model.max_items,
            max_wait_s=self.config.max_wait_ms / 1000,
            batching=self.config.batching,
            queue_size=self.config.queue_size,
            workers=self.config.workers,
        )
        batcher.start()
        self.batcher = batcher
        log.info("ready: %s served by %s", self.model.name, self.runner.description)

    async def close(self) -> None:
        if self.batcher is not None:
            await self.batcher.stop()
        if self.runner is not None:
            await asyncio.to_thread(self.runner.close)

    async def infer(self, request: Request, arrived: float) -> Response:
        if self.batcher is None:
            raise ServeError(503, f"not ready: {self.failure or 'the runner is still loading'}", RETRY_AFTER)
        kind = media_type(request.headers.get("content-type"))
        body = await read_body(request, self.config.max_body_bytes)
        feed = decode_request(body, kind, self.model, self.config.max_body_bytes)
        items = check_items(feed, self.model)
        remaining = self.config.timeout_s - (time.perf_counter() - arrived)
        try:
            outputs = await self.batcher.submit(feed, items, remaining)
        except QueueFull as full:
            raise ServeError(503, f"busy: {full}; retry later", RETRY_AFTER) from None
        except asyncio.TimeoutError:
            raise ServeError(504, f"no answer within the service's {self.config.timeout_s} s timeout") from None
        except Exception as error:  # the runner failed on this request (alone, see Batcher._run_batch)
            log.warning("runner failed on a request: %s", error)
            raise ServeError(500, f"the runner failed on this request: {error}") from None
        content, returned = encode_response(outputs, kind, self.model)
        return Response(content, media_type=returned)

    def describe(self) -> dict:
        def tensors(specs):
            return [{"name": s.name, "dtype": s.dtype.name, "shape": list(s.shape)} for s in specs]

        return {
            "name": self.model.name,
            "inputs": tensors(self.model.inputs),
            "outputs": tensors(self.model.outputs),
            "max_items": self.model.max_items,
            "runner": self.runner.description if self.runner is not None else None,
            "ready": self.ready,
        }


def warm_up_feed(model: ModelIO, items: int) -> dict[str, np.ndarray]:
    """Zeros shaped like a request of `items` items; a named dynamic dim takes the smallest size it allows."""
    feed = {}
    for spec in model.inputs:
        smallest = {axis: low for axis, low, _ in spec.ranges}
        dims = [items] + [
            d if d != DYNAMIC else smallest.get(axis, 1) for axis, d in enumerate(spec.shape) if axis != 0
        ]
        feed[spec.name] = np.zeros(dims, dtype=spec.dtype)
    return feed


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to pass `limit` bytes (never read beyond it)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ServeError(413, f"the body is {declared} bytes; the limit is {limit} (send fewer items per request)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ServeError(413, f"the body is over the limit of {limit} bytes (send fewer items per request)")
        chunks.append(chunk)
    return b"".join(chunks)


def error_response(error: ServeError) -> JSONResponse:
    return JSONResponse({"detail": error.message}, status_code=error.status, headers=error.headers)


def create_app(folder: Path, config: ServeConfig | None = None, backend: str = "auto") -> FastAPI:
    """The app serving the artifact folder `folder`; reads only the manifest until startup."""
    service = Service(folder, config or ServeConfig(), backend)
    model_path = f"/v1/models/{service.model.name}"

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(service.load(), name="load-runner")
        try:
            yield
        finally:
            await loading  # a load in a worker thread cannot be cancelled; let it finish, then close
            await service.close()

    app = FastAPI(
        title=f"{service.model.name} inference",
        description="Dynamic-batching inference over one artifact folder (pipeline.serve).",
        lifespan=lifespan,
    )
    app.state.service = service
    status_responses: dict[int | str, dict[str, Any]] = {
        503: {"description": "see detail", "content": {"application/json": {"schema": ERROR}}}
    }

    @app.get("/health", responses=status_responses)
    async def health() -> JSONResponse:
        """The process is up; 503 once loading the runner has failed (restart it)."""
        if service.failure:
            return JSONResponse({"detail": service.failure}, status_code=503)
        return JSONResponse({"status": "up"})

    @app.get("/ready", responses=status_responses)
    async def ready() -> JSONResponse:
        """200 once the runner is loaded and answered a warm-up request."""
        if not service.ready:
            detail = service.failure or "the runner is still loading"
            return JSONResponse({"detail": detail}, status_code=503, headers=RETRY_AFTER)
        return JSONResponse({"status": "ready", "model": service.model.name})

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def metrics() -> Response:
        """Prometheus text exposition."""
        content, content_type = service.metrics.render()
        return Response(content, media_type=content_type)

    @app.get(model_path)
    async def describe() -> JSONResponse:
        """The model's inputs and outputs (-1 for a dynamic dim), max items per request, the runner."""
        return JSONResponse(service.describe())

    @app.post(f"{model_path}/infer", openapi_extra=infer_openapi(service.model), response_class=Response)
    async def infer(request: Request) -> Response:
        """Run the model on the request's items; batched with concurrent requests."""
        arrived = time.perf_counter()
        status = 500  # an unexpected exception propagates and is answered 500
        try:
            try:
                response = await service.infer(request, arrived)
            except ServeError as error:
                response = error_response(error)
            status = response.status_code
            return response
        finally:
            service.metrics.requests.labels(str(status)).inc()
            service.metrics.latency.observe(time.perf_counter() - arrived)

    @app.api_route("/v1/models/{name}/infer", methods=["POST"], include_in_schema=False)
    @app.api_route("/v1/models/{name}", methods=["GET"], include_in_schema=False)
    async def unknown_model(name: str) -> JSONResponse:
        message = f"no model {name!r} is served here; this server serves {service.model.name!r} at {model_path}"
        return error_response(ServeError(404, message))

    return app
