"""The service's Prometheus metrics, on a registry of its own (two apps in one process never collide).

Every family carries the model's name (the name clients address, as in Triton's `model` label), so the
metrics of several servers aggregate by model.  Requests are counted by protocol (http, grpc) and HTTP
status; a gRPC answer is counted under the HTTP status its code corresponds to (UNAVAILABLE as 503, ...).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds: sub-millisecond for tiny models on a GPU up to the default 10 s timeout.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
# Items per runner call: powers of two, as batch profiles usually are.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServiceMetrics:
    """Request counts by protocol and status, request latency, items per runner call, runner time, queue depth."""

    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "serve_requests",
            "Inference requests answered, by protocol and HTTP status",
            ["model", "protocol", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "serve_request_seconds",
            "Inference request latency, from arrival to the answer",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(model)
        self.batch_items = Histogram(
            "serve_batch_items",
            "Items (rows) per runner call",
            ["model"],
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        ).labels(model)
        self.batch_requests = Histogram(
            "serve_batch_requests", "Requests per runner call", ["model"], buckets=BATCH_BUCKETS, registry=self.registry
        ).labels(model)
        self.runner_seconds = Histogram(
            "serve_runner_seconds",
            "Time in one runner call",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(model)
        self.queue_depth = Gauge(
            "serve_queue_depth", "Requests admitted and waiting for a runner call", ["model"], registry=self.registry
        ).labels(model)

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text exposition."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
