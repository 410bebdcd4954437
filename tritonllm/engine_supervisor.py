"""`serve`'s watch over the engine processes (the model's Python-backend stubs, children of its tritonserver).

tritonserver 2.51 neither notices a stub that died (SIGKILLed by the OOM killer, a crash) nor restarts it: the model
stays "ready" and every request gets "Stub process 'llm_0_0' is not healthy". `serve` owns tritonserver and sees its
children, so it watches them: when one ends, it tells the adapter (which fails what that engine held and answers 503
meanwhile) and reloads the model through the model-repository API, within a budget of restarts per window; past it,
`serve` gives up and exits non-zero for its supervisor (Compose, Kubernetes) to take over. Where tritonserver runs
apart from the adapter, the adapter's own detection (tritonllm/adapter/engine_health.py) still answers 503 and turns
/health red, for the orchestrator to restart the container."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tritonllm.interface.settings import setting
from tritonllm.launcher import MODEL_NAME, TritonServer, TritonStartError

log = logging.getLogger(__name__)

_POLL_INTERVAL_S = 0.2
_SERVER = "tritonserver"  # what /health names when tritonserver itself died
_SERVER_EXIT_S = 5.0  # a reload that failed: how long tritonserver may take to finish aborting
_SERVER_HUNG_S = 10.0  # a reload during which tritonserver answers no liveness probe this long: it hangs
_SURVIVORS_SILENT_S = 4.0  # the adapter fails calls silent for 2 s while an engine is dead (TritonClient._SILENT_S)


@dataclass(frozen=True)
class RestartSettings:
    engine_max_restarts: int = setting(3, "engine processes that may die and be reloaded within "
                                          "--engine-restart-window; one more and serve exits non-zero")
    engine_restart_window_s: float = setting(600.0, "seconds over which engine restarts are counted",
                                             option="engine-restart-window")


class RestartBudget:
    """At most `max_restarts` restarts in any `window_s` seconds."""

    def __init__(self, settings: RestartSettings, clock: Callable[[], float] = time.monotonic):
        self.max_restarts = settings.engine_max_restarts
        self.window_s = settings.engine_restart_window_s
        self._clock = clock
        self._restarts: deque[float] = deque()

    def take(self) -> bool:
        """Count a restart; False when it would exceed the budget."""
        now = self._clock()
        while self._restarts and now - self._restarts[0] > self.window_s:
            self._restarts.popleft()
        if len(self._restarts) >= self.max_restarts:
            return False
        self._restarts.append(now)
        return True


def exit_status(pid: int) -> str:
    """How a process ended, while it is a zombie not yet reaped by its parent (Linux keeps its wait status in
    /proc/<pid>/stat); once reaped, unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return "exit status unknown: already reaped by tritonserver (the kernel log may say more)"
    if fields[0] != "Z" or len(fields) < 50:
        return "exit status unknown"
    status = int(fields[49])  # the 52nd field, exit_code: the wait status
    if status & 0x7F:
        return f"killed by {signal.Signals(status & 0x7F).name}"
    return f"exited with code {status >> 8}"


class EngineSupervisor:
    """A thread that notices an engine process ending (within _POLL_INTERVAL_S) and reloads the model."""

    def __init__(self, server: TritonServer, budget: RestartBudget, *, on_death: Callable[[str, str], None],
                 on_recovered: Callable[[], None], on_give_up: Callable[[str], None], ready_timeout_s: float = 600):
        self.server = server
        self.budget = budget
        self.ready_timeout_s = ready_timeout_s  # for tritonserver started again
        self.on_death = on_death  # (instance, what happened)
        self.on_recovered = on_recovered
        self.on_give_up = on_give_up  # (why): serve stops, exit code 1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        known = self.server.engine_processes()  # pid → instance
        while not self._stop.wait(_POLL_INTERVAL_S):
            if not self.server.is_running():
                if not self._restart_server():
                    return
                known = self.server.engine_processes()
                continue
            running = self.server.engine_processes()
            ended = {pid: instance for pid, instance in known.items() if pid not in running}
            if not ended or self._stop.is_set():
                continue
            for pid, instance in ended.items():
                how = exit_status(pid)
                log.error("engine instance %s (pid %d) died: %s; its requests fail with 503", instance, pid, how)
                self.on_death(instance, how)
            if not self.budget.take():
                self.on_give_up(f"engine processes died more than {self.budget.max_restarts} times in "
                                f"{self.budget.window_s:.0f} s")
                return
            if not self._reload(known, ended):
                return
            known = {pid: instance for pid, instance in self.server.engine_processes().items() if pid not in known}
            self.on_recovered()

    def _restart_server(self, counted: bool = False) -> bool:
        """tritonserver itself ended (its Python backend can abort when an engine process dies in the middle of a
        response: boost::interprocess::lock_exception on the dead process's mutex). Start it again, within the same
        budget (`counted`: the engine death that took it down was counted already); False (after giving up) when
        that is spent or the start fails."""
        if self._stop.is_set():
            return False
        code = self.server.process.returncode
        log.error("tritonserver exited with code %s; its requests fail with 503. Its last log lines:\n%s", code,
                  self.server.log_tail())
        self.on_death(_SERVER, f"tritonserver exited with code {code}")
        if not counted and not self.budget.take():
            self.on_give_up(f"tritonserver and engine processes died more than {self.budget.max_restarts} times in "
                            f"{self.budget.window_s:.0f} s")
            return False
        started = time.monotonic()
        log.warning("starting tritonserver again")
        try:
            self.server.start()
            self.server.wait_ready(self.ready_timeout_s)
        except TritonStartError as error:
            if not self._stop.is_set():
                self.on_give_up(f"starting tritonserver again failed: {error}")
            return False
        log.warning("tritonserver started again in %.1f s", time.monotonic() - started)
        self.on_recovered()
        return True

    def _load(self, failure: list[RuntimeError]) -> None:
        """The reload's call (on its own thread: its answer may never come)."""
        try:
            self.server.model_control("load")
        except RuntimeError as error:
            failure.append(error)

    def _watch(self, loader: threading.Thread) -> bool:
        """Wait for the reload's call; False when tritonserver ends first, or answers no liveness probe for
        _SERVER_HUNG_S (it is then killed): aborting on the dead engine's lock, it can hang in its exit while a stub
        it started holds the call's connection open, so the call never returns."""
        answered = time.monotonic()
        while loader.is_alive() and not self._stop.is_set():
            loader.join(_POLL_INTERVAL_S)
            if not self.server.is_running():
                return False
            if self.server.is_live():
                answered = time.monotonic()
            elif time.monotonic() - answered > _SERVER_HUNG_S:
                log.error("tritonserver answered no liveness probe for %.0f s while reloading the model: killing it",
                          _SERVER_HUNG_S)
                self.server.kill()
                return False
        return True

    def _server_ended(self) -> bool:
        """Whether tritonserver has ended, or ends within _SERVER_EXIT_S (an abort takes a moment to finish)."""
        try:
            self.server.process.wait(_SERVER_EXIT_S)
        except subprocess.TimeoutExpired:
            return False
        return True

    def _reload(self, known: dict[int, str], ended: dict[int, str]) -> bool:
        """Reload the model; False (after giving up) when that fails."""
        started = time.monotonic()
        log.warning("reloading model %s (engine instance(s) %s died)", MODEL_NAME, ", ".join(sorted(ended.values())))
        failure: list[RuntimeError] = []
        loader = threading.Thread(target=self._load, args=(failure,), name="tritonllm-reload", daemon=True)
        loader.start()
        if not self._watch(loader):
            return self._restart_server(counted=True)
        if self._stop.is_set():
            return False
        if failure:
            if self._server_ended():  # it aborted on the dead engine's lock, after the engine's death was seen
                return self._restart_server(counted=True)
            self.on_give_up(f"reloading the model failed: {failure[0]}")
            return False
        log.warning("model reloaded in %.1f s", time.monotonic() - started)
        # Triton now sends every request to the new instances, but never finishes unloading the old version (the
        # dead process held some of its requests), so the old instances that survived would keep their memory.
        survivors = {pid: instance for pid, instance in known.items() if pid not in ended}
        for pid, instance in survivors.items():
            log.warning("stopping the replaced engine instance %s (pid %d)", instance, pid)
            self.on_death(instance, "replaced by the reloaded model")  # the adapter fails its silent calls
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
        if survivors:  # the adapter fails their calls, silent from now on, before it calls the engines healthy
            self._stop.wait(_SURVIVORS_SILENT_S)
        return True
