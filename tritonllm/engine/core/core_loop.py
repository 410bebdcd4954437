"""Runs the `EngineCore` on its own thread, so Triton's execute() returns at once and request processing never
waits for a step, nor a step for request processing.

The loop thread owns the core, and builds it too (`start`): every torch op of the process then runs on this one
thread. A second thread that ever ran a parallel op (e.g. loading the model) keeps an OpenMP team of its own,
and with more OpenMP threads than cores libgomp throttles its spin-waits, so this thread's workers sleep
between the hundreds of parallel ops of a step and each op waits for them to wake (measured: +8-10 ms a
decode step on 2 cores). Nothing else reads or changes the core: `submit` and `abort` may be called from any
thread and only queue typed messages (tritonllm/engine/core/core_messages.py) that the loop applies between steps.
Each step's outputs go to one sink (`on_outputs`, called on the loop thread). Other threads see the core
through `stats`, an immutable snapshot the loop publishes after each step.

A step that raises fails the requests it was running and the loop goes on; after `max_step_failures` failed
steps in a row the fault is taken as persistent (e.g. a poisoned CUDA context): the engine is dead, every
request in flight and every new one fails at once with `EngineDead`, and `stats.dead` says why (the metrics
publish it, and the adapter's /health turns red)."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Callable

from tritonllm.engine.core.core_messages import AbortAll, AbortRequest, AddRequest, CoreMessage
from tritonllm.engine.core.engine_core import EngineCore, EngineStats, ModelLimits
from tritonllm.engine.core.sequence import CoreOutput, CoreRequest
from tritonllm.interface.errors import EngineDead, Overloaded

log = logging.getLogger(__name__)

_STATS_LOG_INTERVAL_S = 10.0


class CoreLoop:
    def __init__(self, on_outputs: Callable[[list[CoreOutput]], None]):
        self._on_outputs = on_outputs
        self._inbox: queue.SimpleQueue[CoreMessage] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._num_queued = 0  # submitted, not yet handed to the core; guarded by _lock
        self.stats: EngineStats | None = None  # replaced (never mutated) by the loop thread, under _lock
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._core: EngineCore | None = None  # the loop thread's
        self._failed_steps = 0  # in a row; the loop thread's
        self._dead: EngineDead | None = None  # set once by the loop thread; read by submit

    def start(self, build_core: Callable[[], EngineCore]) -> ModelLimits:
        """Build the core on the loop's thread and start looping; returns the model's limits once the core is
        built (the core itself belongs to the loop). Raises what the build raised."""
        built: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._build_and_run, args=(build_core, built), name="tritonllm-core",
                                        daemon=True)
        self._thread.start()
        limits = built.get()
        if isinstance(limits, BaseException):
            raise limits
        return limits

    def _build_and_run(self, build_core: Callable[[], EngineCore], built: queue.SimpleQueue) -> None:
        try:
            self._core = build_core()
            self._max_queue_len = self._core.config.max_queue_len
            self._max_step_failures = self._core.config.max_step_failures
            self._core.wake = self._wakeup.set
            self._publish_stats()
        except BaseException as exc:  # handed to start(), which raises it on the caller's thread
            built.put(exc)
            return
        built.put(self._core.limits)
        self._run()

    def submit(self, request: CoreRequest) -> None:
        """Queue a request; its outputs reach on_outputs. Raises Overloaded when max_queue_len requests wait,
        EngineDead once the engine is dead."""
        with self._lock:
            if self._dead is not None:
                raise self._dead
            waiting = self._num_queued + self.stats.waiting
            if waiting >= self._max_queue_len:
                raise Overloaded(f"the server is at capacity ({waiting} requests waiting); retry later")
            self._num_queued += 1
        self._send(AddRequest(request))

    def abort(self, request_id: str, indices: list[int] | None = None) -> None:
        """Stop a request's sequences (those of `indices`, else all); the core frees their blocks."""
        self._send(AbortRequest(request_id, None if indices is None else tuple(indices)))

    def _send(self, message: CoreMessage) -> None:
        self._inbox.put(message)
        self._wakeup.set()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Let in-flight requests finish for up to `timeout` seconds, abort the rest (their clients get a final
        response), then stop the thread."""
        if not self._wait_idle(timeout):
            log.warning("shutting down: aborting the requests still in flight")
            self._send(AbortAll())
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

    # --- the loop thread ------------------------------------------------------------------------------------

    def _drain_inbox(self) -> list[CoreOutput]:
        """Apply the queued messages; a dead engine fails the requests it is handed instead."""
        refused = []
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return refused
            if isinstance(message, AddRequest) and self._dead is not None:
                request = message.request
                refused.append(CoreOutput(request.request_id, [], len(request.prompt_token_ids), 0, True,
                                          error=self._dead))
            else:
                self._core.apply(message)
            if isinstance(message, AddRequest):
                self._publish_stats(queued=-1)

    def _publish_stats(self, queued: int = 0) -> None:
        stats = self._core.stats()
        if self._dead is not None:
            stats = dataclasses.replace(stats, dead=self._dead.message)
        with self._lock:  # one update, so submit never sees a request in neither count
            self._num_queued += queued
            self.stats = stats

    def _run(self) -> None:
        last_stats_log = time.monotonic()
        while not self._stopping.is_set():
            outputs = self._drain_inbox()
            if self._core.has_work() and self._dead is None:
                outputs += self._step()
                self._publish_stats()
            elif not outputs:
                self._wakeup.wait(timeout=self._core.idle_wait(1.0))
                self._wakeup.clear()
                continue
            if outputs:
                try:
                    self._on_outputs(outputs)
                except Exception:  # a failing consumer must not stop the engine
                    log.exception("the output sink failed")
            if time.monotonic() - last_stats_log > _STATS_LOG_INTERVAL_S:
                last_stats_log = time.monotonic()
                log.info("engine: %s", self.stats)
        self._core.close()

    def _step(self) -> list[CoreOutput]:
        """One core step; a failed one fails what was in flight, and enough of them in a row kill the engine."""
        try:
            outputs = self._core.step()
        except Exception as exc:
            self._failed_steps += 1
            log.exception("engine step failed (%d in a row; the engine gives up at %d); failing the requests in "
                          "flight. The step ran: %s", self._failed_steps, self._max_step_failures,
                          self._core.last_batch())
            if self._failed_steps >= self._max_step_failures:
                self._dead = EngineDead(f"the engine is dead: {self._failed_steps} steps failed in a row, the "
                                        f"last with {type(exc).__name__}: {exc}")
                log.critical("%s; it refuses every request from now on (restart the server)", self._dead.message)
                return self._core.fail_in_flight(self._dead)
            return self._core.fail_in_flight(exc)
        self._failed_steps = 0
        return outputs
