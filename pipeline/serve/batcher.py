"""Dynamic batching: concurrent requests gathered into one runner call, then split back by rows.

A request (a "job") with several items is one unit: it is never split across runner calls.  A batch
starts with the oldest waiting job and takes later jobs of the same per-item shapes while they fit in
`max_items`; it goes to the runner when full or when its oldest job has waited `max_wait_s`.  Runner
calls run on worker threads, so the event loop keeps accepting and answering requests meanwhile.

Each job's rows are the slice [offset, offset + items) of every output, in the order the batch was
concatenated, so a caller only ever receives its own rows.  A job that times out is removed from the
queue, and if its batch is already running its slice is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from .metrics import ServiceMetrics

Infer = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The bounded queue is full: the caller should answer 503 and ask the client to retry."""


@dataclass(eq=False)  # identity equality: deque.remove must find this very job
class Job:
    feed: dict[str, np.ndarray]
    items: int
    future: asyncio.Future[dict[str, np.ndarray]]
    queued_at: float
    # Only jobs whose inputs agree on every dim after the batch axis can be concatenated.
    key: tuple = field(init=False)

    def __post_init__(self) -> None:
        self.key = tuple((name, array.shape[1:]) for name, array in sorted(self.feed.items()))


class Batcher:
    """Queue, gather, run on a worker thread, split.  start() and stop() run on the event loop."""

    def __init__(
        self,
        infer: Infer,
        metrics: ServiceMetrics,
        *,
        max_items: int,
        max_wait_s: float,
        batching: bool,
        queue_size: int,
        workers: int,
    ):
        self._infer = infer
        self._metrics = metrics
        self.max_items = max_items
        self.max_wait_s = max_wait_s
        self.batching = batching
        self.queue_size = queue_size
        self._queue: deque[Job] = deque()
        self._arrived = asyncio.Event()
        self._free_workers = asyncio.Semaphore(workers)
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="runner")
        self._running: set[asyncio.Task] = set()
        self._stopping = False
        self._loop_task: asyncio.Task | None = None

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._dispatch_loop(), name="batcher")

    async def stop(self) -> None:
        """Run what is queued, wait for the runner calls in flight, then release the worker threads."""
        self._stopping = True
        self._arrived.set()
        if self._loop_task is not None:
            await self._loop_task
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        self._executor.shutdown(wait=True)

    async def submit(self, feed: dict[str, np.ndarray], items: int, timeout_s: float) -> dict[str, np.ndarray]:
        """This job's outputs; QueueFull when the queue is full, asyncio.TimeoutError past timeout_s."""
        if self._stopping:
            raise QueueFull("the service is shutting down")
        if len(self._queue) >= self.queue_size:
            raise QueueFull(f"{len(self._queue)} requests are already waiting (the queue holds {self.queue_size})")
        loop = asyncio.get_running_loop()
        job = Job(feed, items, loop.create_future(), loop.time())
        self._queue.append(job)
        self._queue_changed()
        self._arrived.set()
        try:
            # On timeout wait_for cancels job.future, which tells a running batch to drop this job's rows.
            return await asyncio.wait_for(job.future, timeout_s)
        finally:
            if job.future.cancelled() and job in self._queue:
                self._queue.remove(job)
                self._queue_changed()

    def _queue_changed(self) -> None:
        self._metrics.queue_depth.set(len(self._queue))

    async def _dispatch_loop(self) -> None:
        while True:
            await self._free_workers.acquire()
            batch = await self._gather()
            if batch is None:
                self._free_workers.release()
                return
            task = asyncio.create_task(self._run(batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _gather(self) -> list[Job] | None:
        """The next batch, taken off the queue; None once stopping with nothing left."""
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                if self._stopping:
                    return None
                self._arrived.clear()
                await self._arrived.wait()
                continue
            batch = self._select()
            # The window counts from the oldest job's arrival: a job that queued while every worker
            # was busy has already waited, and goes with the next free worker at once.
            remaining = self._queue[0].queued_at + self.max_wait_s - loop.time()
            full = not self.batching or sum(job.items for job in batch) >= self.max_items
            if full or remaining <= 0 or self._stopping:
                for job in batch:
                    self._queue.remove(job)
                self._queue_changed()
                return batch
            self._arrived.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), remaining)

    def _select(self) -> list[Job]:
        """The oldest job and the later ones that can join it, in queue order."""
        first = self._queue[0]
        if not self.batching:
            return [first]
        batch, items = [first], first.items
        for job in list(self._queue)[1:]:
            if job.key == first.key and items + job.items <= self.max_items:
                batch.append(job)
                items += job.items
        return batch

    async def _run(self, batch: list[Job]) -> None:
        try:
            batch = [job for job in batch if not job.future.done()]  # timed out while waiting to start
            if batch:
                await self._run_batch(batch)
        finally:
            self._free_workers.release()

    async def _run_batch(self, batch: list[Job]) -> None:
        try:
            outputs = await self._call_runner(_concatenate(batch), len(batch))
        except Exception as error:
            if len(batch) == 1:
                _fail(batch[0], error)
                return
            # One job's data can make the runner fail (say, a token id beyond the vocabulary); run each
            # job alone so only that job gets the error and the others still get their answers.
            log.warning("a batch of %d requests failed (%s); running them one by one", len(batch), error)
            for job in batch:
                try:
                    _deliver(job, await self._call_runner(job.feed, 1))
                except Exception as single_error:
                    _fail(job, single_error)
            return
        offset = 0
        for job in batch:
            _deliver(job, {name: array[offset : offset + job.items] for name, array in outputs.items()})
            offset += job.items

    async def _call_runner(self, feed: dict[str, np.ndarray], requests: int) -> dict[str, np.ndarray]:
        items = next(iter(feed.values())).shape[0]
        started = time.perf_counter()
        outputs = await asyncio.get_running_loop().run_in_executor(self._executor, self._infer, feed)
        self._metrics.runner_seconds.observe(time.perf_counter() - started)
        self._metrics.batch_items.observe(items)
        self._metrics.batch_requests.observe(requests)
        wrong = {name: array.shape for name, array in outputs.items() if array.ndim == 0 or array.shape[0] != items}
        if wrong:
            raise RuntimeError(f"outputs {wrong} do not have the batch's {items} rows on axis 0, so cannot be split")
        return outputs


def _concatenate(batch: list[Job]) -> dict[str, np.ndarray]:
    if len(batch) == 1:
        return batch[0].feed
    return {name: np.concatenate([job.feed[name] for job in batch]) for name in batch[0].feed}


# A job whose future is done was cancelled (it timed out): its rows go to no one.


def _deliver(job: Job, outputs: dict[str, np.ndarray]) -> None:
    if not job.future.done():
        job.future.set_result(outputs)


def _fail(job: Job, error: Exception) -> None:
    if not job.future.done():
        job.future.set_exception(error)
