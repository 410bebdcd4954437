"""Runs the `EngineCore` on its own thread, so Triton's execute() returns at once and request processing never
waits for a step, nor a step for request processing.

The loop thread owns the core, and builds it too (`start`): every torch op of the process then runs on this one
thread. A second thread that ever ran a parallel op (e.g. loading the model) keeps an OpenMP team of its own,
and with more OpenMP threads than cores libgomp throttles its spin-waits, so this thread's workers sleep
between the hundreds of parallel ops of a step and each op waits for them to wake (measured: +8-10 ms a
decode step on 2 cores). Nothing else reads or changes the core. `submit` and `abort` may be called from any
thread: they only enqueue messages that the loop applies between steps. Each step's outputs go to one sink
(`on_outputs`, called on the loop thread). Other threads see the core through `stats`, an immutable snapshot
the loop publishes after each step."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

from backend.engine.engine_core import EngineCore, EngineStats
from backend.engine.sequence import CoreOutput, CoreRequest
from backend.interface.errors import Overloaded

log = logging.getLogger(__name__)

_STATS_LOG_INTERVAL_S = 10.0


class CoreLoop:
    def __init__(self, on_outputs: Callable[[list[CoreOutput]], None]):
        self._on_outputs = on_outputs
        # ("add", CoreRequest) | ("abort", (request_id, sequence indices or None)) | ("abort_all", None)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._num_queued = 0  # submitted, not yet handed to the core; guarded by _lock
        self.stats: EngineStats | None = None  # replaced (never mutated) by the loop thread, under _lock
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, build_core: Callable[[], EngineCore]) -> EngineCore:
        """Build the core on the loop's thread and start looping; returns the core once built (for its immutable
        `limits`: the core itself belongs to the loop). Raises what the build raised."""
        built: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._build_and_run, args=(build_core, built), name="tritonllm-core",
                                        daemon=True)
        self._thread.start()
        core = built.get()
        if isinstance(core, BaseException):
            raise core
        return core

    def _build_and_run(self, build_core: Callable[[], EngineCore], built: queue.SimpleQueue) -> None:
        try:
            self.core = build_core()
            self.max_queue_len = self.core.config.max_queue_len
            self.core.on_grammar_ready = self._wakeup.set
            self._publish_stats()
        except BaseException as exc:  # handed to start(), which raises it on the caller's thread
            built.put(exc)
            return
        built.put(self.core)
        self._run()

    def submit(self, request: CoreRequest) -> None:
        """Queue a request; its outputs reach on_outputs. Raises Overloaded when max_queue_len requests wait."""
        with self._lock:
            waiting = self._num_queued + self.stats.waiting
            if waiting >= self.max_queue_len:
                raise Overloaded(f"the server is at capacity ({waiting} requests waiting); retry later")
            self._num_queued += 1
        self._inbox.put(("add", request))
        self._wakeup.set()

    def abort(self, request_id: str, indices: list[int] | None = None) -> None:
        """Stop a request's sequences (those of `indices`, else all); the core frees their blocks."""
        self._inbox.put(("abort", (request_id, indices)))
        self._wakeup.set()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Let in-flight requests finish for up to `timeout` seconds, abort the rest (their clients get a final
        response), then stop the thread."""
        if not self._wait_idle(timeout):
            log.warning("shutting down: aborting the requests still in flight")
            self._inbox.put(("abort_all", None))
            self._wakeup.set()
            self._wait_idle(2.0)
        self._stopping.set()
        self._wakeup.set()
        self._thread.join(timeout=5.0)

    def _wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                idle = self._num_queued == 0 and self.stats.unfinished_requests == 0
            if idle:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                self.core.abort_request(*item)
            elif kind == "abort_all":
                for request_id in list(self.core.requests):
                    self.core.abort_request(request_id)
            else:
                try:
                    self.core.add_request(item)
                except Exception as exc:  # e.g. a duplicate request id: this request fails, the loop goes on
                    log.exception("request %s could not be added", item.request_id)
                    self.core.ready_outputs.append(
                        CoreOutput(item.request_id, [], len(item.prompt_token_ids), 0, True, error=exc))
                self._publish_stats(queued=-1)

    def _publish_stats(self, queued: int = 0) -> None:
        with self._lock:  # one update, so submit never sees a request in neither count
            self._num_queued += queued
            self.stats = self.core.stats()

    def _run(self) -> None:
        last_stats_log = time.monotonic()
        while not self._stopping.is_set():
            self._drain_inbox()
            if not self.core.has_work():
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            try:
                outputs = self.core.step()
            except Exception as exc:  # a failed step must not kill the loop: fail what was in flight
                log.exception("engine step failed; failing the requests in flight")
                outputs = self._fail_in_flight(exc)
            self._publish_stats()
            if outputs:
                try:
                    self._on_outputs(outputs)
                except Exception:  # a failing consumer must not stop the engine
                    log.exception("the output sink failed")
            if time.monotonic() - last_stats_log > _STATS_LOG_INTERVAL_S:
                last_stats_log = time.monotonic()
                log.info("engine: %s", self.stats)

    def _fail_in_flight(self, exc: Exception) -> list[CoreOutput]:
        self.core.ready_outputs.clear()
        return [self.core.fail_request(request_id, exc) for request_id in list(self.core.requests)]
