"""Graceful shutdown. On the first SIGINT or SIGTERM the adapter keeps listening but takes no new request (503 with
Retry-After; /health too, so a load balancer or Kubernetes' readiness probe takes it out), while the requests in
flight get shutdown_grace_s to finish; then the rest are cancelled with an error that says why (a 503, or an error
event in a stream that has begun) and uvicorn exits. A second signal exits at once."""

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from tritonllm.adapter.errors import AdapterError, service_unavailable

log = logging.getLogger(__name__)

CANCELLED_EXIT_S = 5.0
"""Once the rest are cancelled, how long they get to send their error before uvicorn closes their connections."""
_STILL_SERVED_WHILE_DRAINING = ("/metrics",)  # scrapes watch the drain


def shutting_down() -> AdapterError:
    return service_unavailable("The server is shutting down; retry the request (on another replica).")


class Drain:
    """Counts the HTTP requests in flight and, once draining, refuses new ones."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.draining = False
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def run(self, cancel_rest: Callable[[], None]) -> None:
        """Refuse new requests, wait up to grace_s for those in flight, then `cancel_rest()` and wait a little."""
        self.draining = True
        log.info("shutting down: %d requests in flight get %g s to finish; new ones are refused", self._in_flight,
                 self.grace_s)
        if await self._wait_idle(self.grace_s):
            return
        log.warning("shutting down: cancelling the %d requests still in flight after %g s", self._in_flight,
                    self.grace_s)
        cancel_rest()
        await self._wait_idle(CANCELLED_EXIT_S)

    async def _wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def middleware(self, app: ASGIApp) -> ASGIApp:
        async def drained(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            if self.draining and scope["path"] not in _STILL_SERVED_WHILE_DRAINING:
                await shutting_down().response(scope["path"])(scope, receive, send)
                return
            self._in_flight += 1
            self._idle.clear()
            try:
                await app(scope, receive, send)  # a streamed response counts until its last chunk
            finally:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._idle.set()

        return drained


class DrainingServer(uvicorn.Server):
    """uvicorn, whose first SIGINT/SIGTERM runs `drain` before uvicorn's own shutdown (which then finds the
    connections idle); uvicorn still re-raises the signal once it has stopped, for the caller to see."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._drain = drain
        self._drain_started = False
        self._drain_task: asyncio.Task | None = None  # (held: the loop keeps only a weak reference)
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or self._drain_started or self.should_exit:
            super().handle_exit(sig, frame)  # not serving yet, or a second signal: uvicorn's way
            return
        log.info("%s received", signal.Signals(sig).name)
        self._drain_started = True
        self._loop.call_soon_threadsafe(self._start_draining, sig)

    def _start_draining(self, sig: int) -> None:
        async def drain_then_exit() -> None:
            try:
                await self._drain()
            finally:
                super(DrainingServer, self).handle_exit(sig, None)

        self._drain_task = self._loop.create_task(drain_then_exit())
