"""Which engine instances are dead: their process ended (SIGKILLed by the OOM killer, a crash) while tritonserver
still calls the model ready. tritonserver 2.51 answers every request such an instance gets with "Stub process
'llm_0_0' is not healthy" and leaves the requests it held without another response, so the adapter learns of a death
three ways: that answer to a request, the same answer to its own probe (TritonClient.watch_engines, while calls are
waiting or an instance is dead), and, under `tritonllm serve`, the supervisor that watches the processes and reloads
the model (tritonllm/engine_supervisor.py, on its own thread: hence the lock). While an instance is dead, /health
answers 503 naming it, the relayed tritonllm:engine_dead gauge says 1 for it, new requests that meet it get 503 +
Retry-After, and calls that wait in silence are failed (TritonClient.watch_engines)."""

from __future__ import annotations

import re
import threading
import time

from tritonllm.adapter.errors import AdapterError, service_unavailable

_STUB_NOT_HEALTHY = re.compile(r"Stub process '([^']+)' is not healthy")


def dead_stub(message: str) -> str | None:
    """The engine instance named by Triton's answer for a request that met a dead engine process, else None."""
    match = _STUB_NOT_HEALTHY.search(message)
    return match.group(1) if match else None


def engine_died(instance: str) -> AdapterError:
    """What a request that met (or waited on) a dead engine instance gets: 503 with Retry-After."""
    return service_unavailable(f"The engine instance {instance} died (its process ended) and is being restarted; "
                               "retry the request.")


class EngineHealth:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dead: dict[str, str] = {}  # instance → what happened to it
        self._dead_since: dict[str, float] = {}  # instance → time.monotonic() when it was marked dead
        self._renewed_at = float("-inf")  # time.monotonic() of the last (re)load: its instances are new

    def mark_dead(self, instance: str, what: str = "its process ended", asked_at: float | None = None) -> None:
        """`asked_at`: when the request that met the dead instance was sent; one sent before the last reload met an
        instance that is gone now, and says nothing about the new ones."""
        with self._lock:
            if (asked_at is None or asked_at >= self._renewed_at) and instance not in self._dead:
                self._dead[instance] = what
                self._dead_since[instance] = time.monotonic()

    def mark_all_alive(self) -> None:
        """The model was (re)loaded, or tritonserver restarted: its instances are new."""
        with self._lock:
            self._dead.clear()
            self._dead_since.clear()
            self._renewed_at = time.monotonic()

    def dead(self) -> dict[str, str]:
        with self._lock:
            return dict(self._dead)

    def dead_since(self) -> dict[str, float]:
        """instance → when it was marked dead. A dead instance answers a request at once, so only a call sent
        before then can be one it holds in silence."""
        with self._lock:
            return dict(self._dead_since)
