"""Runs `LLMEngine` on its own thread so Triton's execute() returns at once.

The loop thread owns the engine: nothing else reads or changes it. `submit` and `abort` may be called from any
thread: they only enqueue messages that the loop applies between steps. Every output goes to one sink
(`on_output`, called on the loop thread). Other threads see the engine through `stats`, an immutable snapshot
the loop publishes after each step."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

from backend.config import EngineConfig
from backend.engine.llm_engine import EngineStats, LLMEngine
from backend.engine.sampling_params import SamplingParams
from backend.engine.sequence import Request, RequestOutput
from backend.errors import Overloaded, RequestError

log = logging.getLogger(__name__)

_STATS_LOG_INTERVAL_S = 10.0


class EngineLoop:
    def __init__(self, config: EngineConfig, on_output: Callable[[RequestOutput], None],
                 engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(config)
        self.max_queue_len = config.max_queue_len
        self._on_output = on_output
        # ("add", Request) | ("abort", request_id) | ("abort_all", None)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._num_queued = 0  # submitted, not yet handed to the engine; guarded by _lock
        self.stats: EngineStats = self.engine.stats()  # replaced (never mutated) by the loop thread
        self._wakeup = threading.Event()
        self.engine.on_grammar_ready = self._wakeup.set
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tritonllm-engine", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, prompt: str | list[int] | list[dict], params: SamplingParams) -> None:
        """Queue a request; its outputs (or an error output) reach on_output.

        Raises Overloaded when max_queue_len requests already wait."""
        with self._lock:
            waiting = self._num_queued + self.stats.waiting
            if waiting >= self.max_queue_len:
                raise Overloaded(f"the server is at capacity ({waiting} requests waiting); retry later")
            self._num_queued += 1
        self._inbox.put(("add", Request(request_id, prompt, params)))
        self._wakeup.set()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
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
        self.engine.grammars.shutdown()

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
            if kind in ("abort", "abort_all"):
                for request_id in [item] if kind == "abort" else list(self.engine.requests):
                    self.engine.abort_request(request_id)
                continue
            try:
                self.engine.add_request(item)
            except RequestError as exc:  # bad input or an unknown adapter: a message for the client
                self._deliver(RequestOutput(item.request_id, [], 0, 0, True, error=exc))
            except Exception as exc:  # e.g. the tokenizer choking: this request fails, the loop goes on
                log.exception("request %s could not be added", item.request_id)
                self._deliver(RequestOutput(item.request_id, [], 0, 0, True, error=exc))
            finally:
                self._publish_stats(queued=-1)

    def _publish_stats(self, queued: int = 0) -> None:
        with self._lock:  # one update, so submit never sees a request in neither count
            self._num_queued += queued
            self.stats = self.engine.stats()

    def _run(self) -> None:
        last_stats_log = time.monotonic()
        while not self._stopping.is_set():
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
            self._publish_stats()
            for output in outputs:
                self._deliver(output)
            if time.monotonic() - last_stats_log > _STATS_LOG_INTERVAL_S:
                last_stats_log = time.monotonic()
                log.info("engine: %s", self.stats)

    def _fail_in_flight(self, exc: Exception) -> list[RequestOutput]:
        self.engine.ready_outputs.clear()
        return [self.engine.fail_request(request_id, exc) for request_id in list(self.engine.requests)]

    def _deliver(self, output: RequestOutput) -> None:
        try:
            self._on_output(output)
        except Exception:  # a failing consumer must not stop the engine
            log.exception("output sink failed on request %s", output.request_id)
