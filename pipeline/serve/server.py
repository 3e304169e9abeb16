"""Both front ends on one event loop: uvicorn for REST, grpc.aio for gRPC, feeding one Service.

They share the loop because they share the batcher, whose queue and futures belong to it.  Shutdown is one
sequence: on SIGTERM (or Ctrl+C) uvicorn stops accepting HTTP connections and, at the same moment, the gRPC
server stops accepting calls; the requests in flight on both finish, then the app's lifespan stops the batcher
and closes the runner.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import grpc
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from .grpc_service import start_grpc_server

log = logging.getLogger(__name__)


class _HeadDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection whose request head has not all arrived within
    `head_timeout_s` of its first byte (or of the connection).  uvicorn bounds only the idle time between requests
    (timeout_keep_alive) and the head's size (h11_max_incomplete_event_size): a client sending a byte every few
    seconds would hold its connection forever.  The body's deadline is app.read_body's."""

    head_timeout_s = 30.0  # set per server by serve()
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_head_timer()

    def data_received(self, data: bytes) -> None:
        if self.cycle is None or self.cycle.response_complete:  # between requests: this byte begins a head
            self._start_head_timer()
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:  # the head is in: a request is running
            self._stop_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def _start_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()


class _Server(uvicorn.Server):
    """uvicorn's server, whose shutdown also stops the gRPC front end, giving its calls `grace_s` to finish."""

    def __init__(self, config: uvicorn.Config, grpc_server: grpc.aio.Server | None, grace_s: float):
        super().__init__(config)
        self.grpc_server = grpc_server
        self.grace_s = grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.grpc_server is None:
            await super().shutdown(sockets)
            return
        # stop() refuses new calls at once and waits for those in flight; the HTTP drain runs meanwhile.
        grpc_stopped = asyncio.ensure_future(self.grpc_server.stop(self.grace_s))
        await super().shutdown(sockets)
        await grpc_stopped


async def serve(app: FastAPI, *, host: str, port: int, grpc_port: int | None, log_level: str) -> None:
    """Serve REST on host:port and (unless grpc_port is None) gRPC on host:grpc_port, until a signal."""
    service = app.state.service
    # Requests carry their own timeout, so a graceful shutdown never needs to wait much longer than it.
    grace_s = service.config.timeout_s + 5
    grpc_server = None
    if grpc_port is not None:
        grpc_server = await start_grpc_server(service, host, grpc_port)
        log.info("gRPC (inference.GRPCInferenceService) on %s:%d", host, grpc_port)
    protocol = type("HeadDeadline", (_HeadDeadline,), {"head_timeout_s": service.config.read_timeout_s})
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=int(grace_s),
        http=protocol,
        # Connections (idle keep-alive ones too) or requests past it are answered 503 at once.
        limit_concurrency=service.config.max_connections,
    )
    try:
        await _Server(config, grpc_server, grace_s).serve()
    finally:
        if grpc_server is not None:
            await grpc_server.stop(0)  # already stopped after a signal; here for a failed HTTP startup
