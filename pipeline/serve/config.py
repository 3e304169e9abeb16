"""The service's settings: one dataclass with defaults and a check(), like pipeline.core.settings.Settings."""

from __future__ import annotations

from dataclasses import dataclass

from ..core.errors import PipelineError


@dataclass
class ServeConfig:
    """How requests are batched, bounded and timed out.

    max_batch: most items per runner call (None: the profile's max batch from the manifest).
    max_wait_ms: how long the first request of a batch waits for others before the runner is called.
    batching: False sends every request to the runner alone (for comparisons; max_wait_ms is then unused).
    queue_size: requests admitted but not yet handed to the runner; past it the service answers 503.
    timeout_s: from arrival to answer; past it 504, and the request's rows are dropped.
    max_body_mib: the largest request body read; past it 413.
    max_json_mib: the largest JSON a request may carry (all of a JSON body, or the JSON header before binary data);
      past it 413.  Lower than max_body_mib because decoding JSON costs many times its size in Python objects
      and holds the interpreter meanwhile; binary data is viewed in place.
    read_timeout_s: a request's head, and then its body, must each arrive within this time, or the connection is
      closed (head) or answered 408 (body): a client sending a byte now and then cannot hold a connection forever.
    workers: runner calls in flight at once (threads); one suits ONNX Runtime on a CPU, which uses every core.
    max_connections: REST connections, and gRPC calls, held at once; past it REST answers 503 (uvicorn's
      limit_concurrency) and gRPC RESOURCE_EXHAUSTED (grpc's maximum_concurrent_rpcs): what many clients, slow or
      hostile, can hold is bounded, beyond the queue that bounds admitted requests.
    connection_age_s: the longest a gRPC connection lives; the server then asks the client to reconnect (GOAWAY,
      which tritonclient and grpc channels do by themselves) and gives the calls on it read_timeout_s + timeout_s
      to finish before it closes the connection: a call whose message trickles in cannot hold one forever (gRPC
      has no per-message read timeout).
    """

    name: str | None = None
    max_batch: int | None = None
    max_wait_ms: float = 2.0
    batching: bool = True
    queue_size: int = 256
    timeout_s: float = 10.0
    max_body_mib: float = 64.0
    max_json_mib: float = 8.0
    read_timeout_s: float = 30.0
    workers: int = 1
    max_connections: int = 1000
    connection_age_s: float = 300.0

    def check(self) -> ServeConfig:
        """Reject impossible values with the fix; returns self so calls can chain."""
        if self.max_batch is not None and self.max_batch < 1:
            raise PipelineError(f"max batch {self.max_batch} is below 1", "give --max-batch 1 or more, or leave it out")
        if self.max_wait_ms < 0:
            raise PipelineError(f"max wait {self.max_wait_ms} ms is negative", "give --max-wait-ms 0 or more")
        for label, value in (
            ("queue size", self.queue_size),
            ("workers", self.workers),
            ("max connections", self.max_connections),
        ):
            if value < 1:
                raise PipelineError(f"{label} {value} is below 1", f"give a {label} of 1 or more")
        numbers = (
            ("timeout", self.timeout_s),
            ("max body", self.max_body_mib),
            ("max JSON", self.max_json_mib),
            ("read timeout", self.read_timeout_s),
            ("connection age", self.connection_age_s),
        )
        for label, number in numbers:
            if number <= 0:
                raise PipelineError(f"{label} {number} is not positive", f"give a positive {label}")
        return self

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mib * 1024 * 1024)

    @property
    def max_json_bytes(self) -> int:
        return int(min(self.max_json_mib, self.max_body_mib) * 1024 * 1024)
