"""`serve`'s engine supervisor without tritonserver: the restart budget, how a process ended, and the supervisor's
answers to an engine process that disappears (tell the adapter, reload, give up past the budget). The real thing,
through the stack: tests/test_stack_engine_death.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tritonllm import engine_supervisor
from tritonllm.adapter.engine_health import EngineHealth
from tritonllm.engine_supervisor import EngineSupervisor, RestartBudget, RestartSettings, exit_status


def test_the_budget_allows_max_restarts_in_any_window():
    now = [0.0]
    budget = RestartBudget(RestartSettings(engine_max_restarts=2, engine_restart_window_s=60), clock=lambda: now[0])
    assert budget.take()
    now[0] = 30.0
    assert budget.take()
    now[0] = 59.0
    assert not budget.take()
    now[0] = 61.0  # the first restart left the window, not the second
    assert budget.take()
    assert not budget.take()


def test_exit_status_reads_a_zombie_and_knows_when_it_cannot():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    os.kill(child.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while "unknown" in (status := exit_status(child.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)  # until it is a zombie
    assert status == "killed by SIGKILL"
    child.wait()
    assert "unknown" in exit_status(child.pid)


class _FakeServer:
    """Engine processes played by `sleep`s (real processes: the supervisor stops the replaced ones)."""

    def __init__(self):
        self.children: list[subprocess.Popen] = []
        self.processes = {self._spawn(): "llm_0_0", self._spawn(): "llm_0_1"}
        self.loads = 0
        self.starts = 0
        self.aborts_on_load = False
        self.hangs_on_load = False
        self.unhung = threading.Event()
        self.process = subprocess.Popen(["sleep", "60"])  # tritonserver
        self.children.append(self.process)

    def _spawn(self) -> int:
        self.children.append(subprocess.Popen(["sleep", "60"]))
        return self.children[-1].pid

    def engine_processes(self):
        for child in self.children:
            child.poll()  # reaped once ended, as tritonserver would not
        return {pid: instance for pid, instance in self.processes.items()
                if any(child.pid == pid and child.returncode is None for child in self.children)}

    def is_running(self):
        return self.process.poll() is None

    def is_live(self):
        return self.is_running() and not self.hangs_on_load

    def kill(self):  # tritonserver, hung
        self.process.kill()
        self.process.wait()
        self.unhung.set()

    def start(self):  # tritonserver again, with new engines
        self.starts += 1
        self.process = subprocess.Popen(["sleep", "60"])
        self.children.append(self.process)
        self.processes = {self._spawn(): "llm_0_0", self._spawn(): "llm_0_1"}

    def wait_ready(self, timeout):
        pass

    def log_tail(self):
        return "terminate called after throwing an instance of 'boost::interprocess::lock_exception'"

    def model_control(self, action):
        assert action == "load"
        if self.hangs_on_load:  # aborted, then hung in its exit: the call's connection stays open
            self.unhung.wait(60)
            self.hangs_on_load = False
            raise RuntimeError("Remote end closed connection without response")
        if self.aborts_on_load:  # its Python backend aborted on the dead engine's lock, as the reload began
            self.aborts_on_load = False
            self.process.kill()
            raise RuntimeError("<urlopen error [Errno 111] Connection refused>")
        self.loads += 1
        self.processes.update({self._spawn(): "llm_0_0", self._spawn(): "llm_0_1"})

    def kill_engine(self, instance):
        [pid] = [pid for pid, name in self.engine_processes().items() if name == instance]
        os.kill(pid, signal.SIGKILL)
        return pid

    def close(self):
        for child in self.children:
            child.kill()
            child.wait()


def _wait(condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.02)


@contextmanager
def _supervised() -> Iterator[tuple[_FakeServer, list, list, threading.Event]]:
    """A supervisor with a budget of one restart over a fake server: (server, deaths, recoveries, gave_up)."""
    server = _FakeServer()
    deaths, recoveries, gave_up = [], [], threading.Event()
    supervisor = EngineSupervisor(server, RestartBudget(RestartSettings(engine_max_restarts=1)),
                                  on_death=lambda instance, how: deaths.append((instance, how)),
                                  on_recovered=lambda: recoveries.append(True), on_give_up=lambda why: gave_up.set())
    supervisor.start()
    try:
        time.sleep(0.3)
        yield server, deaths, recoveries, gave_up
    finally:
        supervisor.stop()
        server.close()


def test_a_dead_engine_is_reported_and_reloaded_until_the_budget_is_spent():
    with _supervised() as (server, deaths, recoveries, gave_up):
        survivor = next(pid for pid, name in server.engine_processes().items() if name == "llm_0_0")
        server.kill_engine("llm_0_1")
        _wait(lambda: recoveries)
        # the dead one, then the old generation's survivor, stopped: the adapter fails its silent calls too
        assert [instance for instance, _ in deaths] == ["llm_0_1", "llm_0_0"] and server.loads == 1
        assert deaths[1][1] == "replaced by the reloaded model" and not gave_up.is_set()
        # the old generation's survivor was stopped (Triton no longer uses it); the new generation runs
        assert survivor not in server.engine_processes()
        assert sorted(server.engine_processes().values()) == ["llm_0_0", "llm_0_1"]
        server.kill_engine("llm_0_0")
        _wait(gave_up.is_set)
        assert [instance for instance, _ in deaths] == ["llm_0_1", "llm_0_0", "llm_0_0"] and server.loads == 1


def test_a_dead_tritonserver_is_started_again_within_the_same_budget():
    """tritonserver itself can abort when an engine process dies in the middle of a response: serve starts it
    again (its engines are new), and a death past the budget, engine or server, ends serve."""
    with _supervised() as (server, deaths, recoveries, gave_up):
        server.process.kill()
        _wait(lambda: recoveries)
        assert deaths == [("tritonserver", "tritonserver exited with code -9")] and server.starts == 1
        assert not gave_up.is_set()
        server.kill_engine("llm_0_1")  # one of the new engines: the budget is spent
        _wait(gave_up.is_set)
        assert server.loads == 0 and server.starts == 1


def test_tritonserver_ending_during_an_engines_reload_is_started_again_as_one_death():
    """The engine's death is seen first, then tritonserver aborts (the dead engine held its lock) and the reload
    fails: serve starts tritonserver again, counting the one event once against the budget."""
    with _supervised() as (server, deaths, recoveries, gave_up):
        server.aborts_on_load = True
        server.kill_engine("llm_0_1")
        _wait(lambda: recoveries)
        assert [instance for instance, _ in deaths] == ["llm_0_1", "tritonserver"] and server.starts == 1
        assert not gave_up.is_set() and sorted(server.engine_processes().values()) == ["llm_0_0", "llm_0_1"]
        server.kill_engine("llm_0_0")  # the budget (one restart) is spent
        _wait(gave_up.is_set)


def test_tritonserver_hanging_during_an_engines_reload_is_killed_and_started_again(monkeypatch):
    """tritonserver aborts while it reloads and hangs in its exit, the reload's call unanswered: once it answers no
    liveness probe for _SERVER_HUNG_S, serve kills it and starts it again, one death against the budget."""
    monkeypatch.setattr(engine_supervisor, "_SERVER_HUNG_S", 1.0)
    with _supervised() as (server, deaths, recoveries, gave_up):
        server.hangs_on_load = True
        server.kill_engine("llm_0_1")
        _wait(lambda: recoveries, timeout=10)
        assert [instance for instance, _ in deaths] == ["llm_0_1", "tritonserver"] and server.starts == 1
        assert not gave_up.is_set() and sorted(server.engine_processes().values()) == ["llm_0_0", "llm_0_1"]


def test_a_request_sent_before_the_reload_does_not_mark_the_new_instances_dead():
    """A probe that left before the reload finished meets the old, dead instance; its answer, arriving after the
    supervisor called the new instances healthy, must not turn /health red again for good."""
    health = EngineHealth()
    asked_at = time.monotonic()
    health.mark_dead("llm_0_0", "killed by SIGKILL")  # the supervisor saw the process end
    health.mark_all_alive()  # reloaded
    health.mark_dead("llm_0_0", "Triton says its process is not healthy", asked_at)  # the stale answer
    assert health.dead() == {}
    health.mark_dead("llm_0_0", "Triton says its process is not healthy", time.monotonic())  # a new death
    assert health.dead() == {"llm_0_0": "Triton says its process is not healthy"}
