"""Runs `LLMEngine` on its own thread so Triton's execute() returns at once.

`submit` and `abort` may be called from any thread: they only enqueue. The loop thread owns the engine:
it applies queued submissions/aborts between steps and hands every output to its request's callback."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

from backend.config import EngineConfig
from backend.engine.llm_engine import LLMEngine
from backend.engine.sampling_params import SamplingParams
from backend.engine.sequence import Request, RequestOutput
from backend.errors import Overloaded, RequestError

log = logging.getLogger(__name__)

_STATS_LOG_INTERVAL_S = 10.0


class EngineLoop:
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(config)
        self.max_queue_len = config.max_queue_len
        # ("add", Request) | ("abort", request_id) | ("abort_all", None)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._num_queued = 0  # submitted, not yet handed to the engine
        self._num_waiting = 0  # in the engine, waiting for admission; written by the engine thread only
        self._callbacks: dict[str, Callable[[RequestOutput], None]] = {}
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self.engine.on_grammar_ready = self._wakeup.set
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tritonllm-engine", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, prompt: str | list[int] | list[dict], params: SamplingParams,
               on_output: Callable[[RequestOutput], None]) -> None:
        """Queue a request; outputs (or an error output) arrive through on_output on the engine thread.

        Raises Overloaded when the waiting queue is full."""
        with self._lock:
            waiting = self._num_queued + self._num_waiting
            if waiting >= self.max_queue_len:
                raise Overloaded(f"the server is at capacity ({waiting} requests waiting); retry later")
            self._num_queued += 1
            self._callbacks[request_id] = on_output
        self._inbox.put(("add", Request(request_id, prompt, params)))
        self._wakeup.set()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wakeup.set()

    def stats(self) -> dict:
        return self.engine.stats()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Let in-flight requests finish for up to `timeout` seconds, abort the rest (their clients get a final
        response), then stop the thread."""
        if not self._wait_idle(timeout):
            log.warning("shutting down: aborting the requests still in flight")
            self._inbox.put(("abort_all", None))
            self._wakeup.set()
            self._wait_idle(2.0)
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout=5.0)
        self.engine.grammars.shutdown()

    def _wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self._num_queued or self.engine.has_unfinished_requests():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                self._num_waiting = self.engine.num_waiting_requests()
                return
            if kind in ("abort", "abort_all"):
                for request_id in [item] if kind == "abort" else list(self.engine.requests):
                    self.engine.abort_request(request_id)
                continue
            with self._lock:
                self._num_queued -= 1
            try:
                self.engine.add_request(item)
            except RequestError as exc:  # bad input or an unknown adapter: a message for the client
                self._deliver(RequestOutput(item.request_id, [], 0, 0, True, error=exc))
            except Exception as exc:  # e.g. the tokenizer choking: this request fails, the loop goes on
                log.exception("request %s could not be added", item.request_id)
                self._deliver(RequestOutput(item.request_id, [], 0, 0, True, error=exc))

    def _run(self) -> None:
        last_stats = time.monotonic()
        while not self._stopping:
            self._drain_inbox()
            if not self.engine.has_work():
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a failed step must not kill the loop: fail what was in flight
                log.exception("engine step failed; failing the requests in flight")
                outputs = self._fail_in_flight(exc)
            self._num_waiting = self.engine.num_waiting_requests()
            for output in outputs:
                self._deliver(output)
            if time.monotonic() - last_stats > _STATS_LOG_INTERVAL_S:
                last_stats = time.monotonic()
                log.info("engine: %s", self.engine.stats())

    def _fail_in_flight(self, exc: Exception) -> list[RequestOutput]:
        self.engine.ready_outputs.clear()
        return [self.engine.fail_request(request_id, exc) for request_id in list(self.engine.requests)]

    def _deliver(self, output: RequestOutput) -> None:
        with self._lock:
            callback = (self._callbacks.pop if output.finished else self._callbacks.get)(output.request_id, None)
        if callback is None:
            return
        try:
            callback(output)
        except Exception:  # a failing consumer must not stop the engine
            log.exception("output callback of request %s failed", output.request_id)
