"""What the REST and gRPC front ends share: one runner, one batcher, one set of metrics, one model description.

A front end parses its wire form into a feed (pipeline.serve.protocol), calls `Service.infer`, and writes the
outputs back in its own form; every status it answers is counted by `Service.count`.  The runner loads on a
background task after startup, so liveness answers at once and readiness turns true only when the model has
really run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from ..folder.graph_files import INLINE_TENSOR_BYTES
from ..folder.onnx_wire import without_weights
from ..folder.reader import ArtifactFolder, open_folder
from ..runners import Runner, load_runner
from ..runners.base import DYNAMIC, TensorSpec
from ..triton.repository import PLATFORMS, model_config
from .batcher import Batcher, QueueFull
from .config import ServeConfig
from .metrics import ServiceMetrics
from .protocol import (
    RETRY_AFTER,
    VERSION,
    ModelIO,
    OutputChoice,
    ServeError,
    tensor_metadata,
)

log = logging.getLogger(__name__)

SERVER_NAME = "trt-pipeline"
# The protocol's extensions this server implements (reported by GET /v2 and ServerMetadata).
EXTENSIONS = ["binary_tensor_data", "model_configuration", "parameters"]


@dataclass(frozen=True)
class InferRequest:
    """A decoded, checked request: the feed, its item count, the outputs wanted, and its own timeout if any."""

    feed: dict[str, np.ndarray]
    items: int
    outputs: list[OutputChoice]
    id: str = ""
    timeout_s: float | None = None


class Service:
    """The model's I/O (from the manifest), the runner once loaded, the batcher and the metrics."""

    def __init__(self, folder: Path, config: ServeConfig, backend: str):
        # Opened (and refused, with the reason, if unfinished or of another layout) before the server starts.
        self.folder = open_folder(folder)
        self.config = config.check()
        self.backend = backend
        self.model = ModelIO.from_manifest(self.folder.manifest, config.name, config.max_batch)
        self.metrics = ServiceMetrics(self.model.name)
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
            vocabularies = await asyncio.to_thread(embedding_rows, self.folder)
            self.model = dataclasses.replace(self.model, vocabularies=vocabularies)
            for items in sorted({1, self.model.max_items}):
                await asyncio.to_thread(self.runner.infer, warm_up_feed(self.model, items))
        except Exception as error:  # a PipelineError or a bug: either way this process cannot serve
            log.exception("loading the runner for %s failed", self.folder.path)
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

    def not_ready(self) -> ServeError:
        """503 saying why: still loading (retry), or loading failed (restart the process)."""
        return ServeError(503, f"not ready: {self.failure or 'the runner is still loading'}", RETRY_AFTER)

    async def infer(self, request: InferRequest, arrived: float) -> dict[str, np.ndarray]:
        """The requested outputs of one checked request, batched with concurrent ones; ServeError otherwise."""
        if self.batcher is None:
            raise self.not_ready()
        timeout_s, whose = self.config.timeout_s, "the service's"
        if request.timeout_s is not None and request.timeout_s < timeout_s:
            timeout_s, whose = request.timeout_s, "the request's"
        remaining = timeout_s - (time.perf_counter() - arrived)
        try:
            outputs = await self.batcher.submit(request.feed, request.items, remaining)
        except QueueFull as full:
            raise ServeError(503, f"busy: {full}; retry later", RETRY_AFTER) from None
        except asyncio.TimeoutError:
            raise ServeError(504, f"no answer within {whose} {timeout_s:g} s timeout") from None
        except Exception as error:  # the runner failed on this request (alone, see Batcher._run_batch)
            log.warning("runner failed on a request: %s", error)
            raise ServeError(500, f"the runner failed on this request: {error}") from None
        return {choice.name: outputs[choice.name] for choice in request.outputs}

    def count(self, protocol: str, status: int, arrived: float) -> None:
        """One answered inference request in the metrics: its protocol, HTTP status and latency."""
        self.metrics.requests.labels(self.model.name, protocol, str(status)).inc()
        self.metrics.latency.observe(time.perf_counter() - arrived)

    # ----------------------------------------------------------------------- descriptions

    def server_metadata(self) -> dict[str, Any]:
        return {"name": SERVER_NAME, "version": _package_version(), "extensions": EXTENSIONS}

    def model_metadata(self) -> dict[str, Any]:
        """The protocol's model metadata: shapes with -1 for dynamic dims, the batch dim first."""
        return {
            "name": self.model.name,
            "versions": [VERSION],
            "platform": PLATFORMS[self._triton_backend()][0],
            "inputs": tensor_metadata(self.model.inputs),
            "outputs": tensor_metadata(self.model.outputs),
        }

    def model_config(self) -> Any:
        """Triton's ModelConfig message, built as `trt-pipeline triton` builds it for this folder, with the
        service's own limits: max items per runner call, batch window, runner calls in flight."""
        io = [_io_record(spec, "input") for spec in self.model.inputs]
        io += [_io_record(spec, "output") for spec in self.model.outputs]
        backend = self._triton_backend()
        config = model_config(
            self.model.name,
            backend,
            io,
            max_batch=self.model.max_items,
            instances=self.config.workers,
            instance_kind="gpu" if backend == "tensorrt_plan" else "cpu",
            max_queue_delay_us=round(self.config.max_wait_ms * 1000),
        )
        if not self.config.batching:  # --no-batching: every request is its own runner call, as without the field
            config.ClearField("dynamic_batching")
        return config

    def _triton_backend(self) -> str:
        """The Triton backend matching the runner: the engine's tensorrt_plan, else the ONNX graph's onnxruntime."""
        return "tensorrt_plan" if self.runner is not None and self.runner.backend == "tensorrt" else "onnxruntime"


def _io_record(spec: TensorSpec, mode: str) -> dict:
    return {"name": spec.name, "mode": mode, "dtype": spec.dtype.name, "shape": list(spec.shape)}


def _package_version() -> str:
    try:
        return metadata.version(SERVER_NAME)
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def embedding_rows(folder: ArtifactFolder) -> dict[str, int]:
    """{integer input: rows of the table} for each graph input that feeds a Gather of an initializer (an embedding
    lookup) directly, the smallest table where it feeds several.  Ids reaching a Gather through other nodes (a Cast,
    an Add, an int8 graph's DequantizeLinear of the table) are not traced: their range is left unchecked."""
    import onnx

    # The graph's bytes as checked, parsed without its weights: the tables' sizes are their dims.
    graph = onnx.load_model_from_string(without_weights(folder.read(folder.graph), INLINE_TENSOR_BYTES)).graph
    tables = {initializer.name: initializer.dims[0] for initializer in graph.initializer if initializer.dims}
    integer_inputs = {
        value.name
        for value in graph.input
        if onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type).kind in "iu"
    }
    rows: dict[str, int] = {}
    for node in graph.node:
        if (
            node.op_type != "Gather"
            or len(node.input) != 2
            or any(a.name == "axis" and a.i != 0 for a in node.attribute)
        ):
            continue
        table, ids = node.input
        if ids in integer_inputs and table in tables:
            rows[ids] = min(rows.get(ids, tables[table]), tables[table])
    return rows


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
