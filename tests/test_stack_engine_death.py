"""The engine's process (the model's Python-backend stub) SIGKILLed under load, as the OOM killer would, through the
whole stack: every stream in flight ends within seconds with an error event and [DONE], /health turns 503 naming the
instance, the relayed tritonllm:engine_dead gauge says 1, requests meanwhile get 503 + Retry-After (not 500), and
`serve` reloads the model: it serves again, with nothing left of the dead engine (its KV blocks, threads, processes).
Killed once more than --engine-max-restarts allows, `serve` gives up and exits non-zero for its supervisor."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from stack_helpers import StackProcess, command_line, descendant_pids, program_name, wait_until_idle

STREAM_END_S = 10  # a stream of the dead engine ends this soon after the kill
RECOVERY_S = 60  # serving again: the model's reload, weights and all; on a host too busy to load the model in 40 s,
# twice what the stack's start took
STOP_AFTER_GIVING_UP_S = 8  # the kill noticed, the adapter stopped, tritonserver ended (its exit timeout is 10 s)
INSTANCE = "llm_0_0"
# int4 named (not auto, which times every format at load): a reload takes seconds, not a minute
OPTIONS = ("--kv-cache-memory", "64MiB", "--weight-format", "int4", "--engine-max-restarts", "1")


@pytest.fixture(scope="module")
def dying(default_model_dir, tmp_path_factory):
    process = StackProcess(default_model_dir, tmp_path_factory.mktemp("engine-death"), OPTIONS, None)
    started = time.monotonic()
    process.start()
    process.recovery_s = max(RECOVERY_S, 2 * (time.monotonic() - started))
    yield process
    process.stop()


def _stubs(process: StackProcess) -> dict[int, str]:
    """The engine processes under serve: pid → instance name."""
    return {pid: argv[argv.index(INSTANCE)] for pid in descendant_pids(process.process.pid)
            if INSTANCE in (argv := command_line(pid)) and Path(argv[0]).name == "triton_python_backend_stub"}


def _threads(pid: int) -> int:
    return int(re.search(r"^Threads:\s+(\d+)$", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE).group(1))


def _running(pid: int) -> bool:
    """Alive, not a zombie: tritonserver 2.51 never finishes unloading the dead engine's model version, so it never
    reaps its process (one entry per restart, bounded by the restart budget, gone when tritonserver exits)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _process_names(process: StackProcess) -> list[str]:
    return sorted(program_name(pid) for pid in descendant_pids(process.process.pid) if _running(pid))


async def _stream(client: httpx.AsyncClient, base_url: str, model: str, first_token: asyncio.Event) -> tuple:
    """(how the stream ended, when): "completed", "error event: …" (then [DONE] must follow), "HTTP …"."""
    body = {"model": model, "prompt": "Tell me a long story.", "max_tokens": 1000, "ignore_eos": True,
            "stream": True}
    async with client.stream("POST", f"{base_url}/completions", json=body) as response:
        if response.status_code != 200:
            return f"HTTP {response.status_code}", time.monotonic()
        error = None
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            first_token.set()
            if '"error"' in line:
                error = line
            elif line == "data: [DONE]":
                return (f"error event: {error}" if error else "completed"), time.monotonic()
    return f"ended without [DONE] (error {error})", time.monotonic()


def _paris(base_url: str, model: str) -> None:
    answer = httpx.post(f"{base_url}/completions", timeout=60,
                        json={"model": model, "prompt": "The capital of France is", "max_tokens": 4,
                              "temperature": 0})
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"].startswith(" Paris"), answer.text


def _wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.2)
    return result


async def _watch_the_dead_window(client: httpx.AsyncClient, base_url: str, model: str, deadline: float) -> dict:
    """What the stack answers while the engine is dead, read as soon as it says so (the reload of an int4 model takes
    only seconds, often less than the dead engine's streams take to end): the first /health that is not 200, the
    relayed metrics once they say the engine is dead, and a request sent while /health is red."""
    root_url = base_url.removesuffix("/v1")
    seen: dict = {"health": None, "metrics": None, "refused": None}
    dead_gauge = re.compile(rf'^tritonllm:engine_dead{{[^}}]*instance="{INSTANCE}"[^}}]*}} 1\.0$', re.MULTILINE)
    while time.monotonic() < deadline:
        health = await client.get(f"{root_url}/health")
        if health.status_code == 200 and seen["health"] is not None:
            return seen  # served again
        if seen["metrics"] is None and dead_gauge.search(metrics := (await client.get(f"{root_url}/metrics")).text):
            seen["metrics"] = metrics
        if health.status_code != 200 and seen["health"] is None:
            seen["health"] = health
            seen["refused"] = await client.post(f"{base_url}/completions",
                                                json={"model": model, "prompt": "Hi", "max_tokens": 2})
        if seen["health"] is not None and seen["metrics"] is not None:
            return seen
        await asyncio.sleep(0.05)
    return seen


def test_a_killed_engine_fails_its_streams_turns_health_red_and_is_reloaded(dying):
    base_url, model = dying.stack.base_url, dying.stack.model_name
    root_url = base_url.removesuffix("/v1")
    [(stub, _)] = _stubs(dying).items()
    _paris(base_url, model)  # (the engine's threads, OpenMP's included, all started)
    processes_before = _process_names(dying)
    threads_before = _threads(stub)

    async def scenario() -> tuple[list, dict, float]:
        async with httpx.AsyncClient(timeout=120) as client:
            started = [asyncio.Event() for _ in range(4)]
            streams = [asyncio.create_task(_stream(client, base_url, model, event)) for event in started]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 120)
            killed = time.monotonic()
            os.kill(stub, signal.SIGKILL)
            seen = asyncio.create_task(_watch_the_dead_window(client, base_url, model, killed + dying.recovery_s))
            return await asyncio.gather(*streams), await seen, killed

    outcomes, seen, killed = asyncio.run(scenario())
    health, metrics, refused = seen["health"], seen["metrics"], seen["refused"]
    _wait_for(lambda: httpx.get(f"{root_url}/health", timeout=10).status_code == 200, dying.recovery_s - (
        time.monotonic() - killed), f"serving again after the kill; {dying.logs()}")
    _paris(base_url, model)
    serve_log = (dying.state_dir / "serve.log").read_text()

    assert max(ended for _, ended in outcomes) - killed < STREAM_END_S, outcomes
    assert health is not None and health.status_code == 503, f"/health never turned red; {dying.logs()}"
    if refused.status_code != 200:  # (unless the reload was done between the two)
        assert refused.status_code == 503 and "retry-after" in refused.headers, refused.text
    if "tritonserver exited" in serve_log:
        # tritonserver 2.51's Python backend can abort on the lock the engine held when it was killed in the middle
        # of a response (boost::interprocess::lock_exception): then Triton is gone too, its streams end as Triton
        # unavailable, its metrics cannot be read, and serve starts it again (one restart of the budget)
        assert all(outcome.startswith("error event") and (INSTANCE in outcome or "unavailable" in outcome)
                   for outcome, _ in outcomes), outcomes
        assert INSTANCE in health.text or "tritonserver" in health.text, health.text
        assert "tritonserver started again" in serve_log, serve_log
    else:
        assert all(outcome.startswith("error event") and INSTANCE in outcome for outcome, _ in outcomes), outcomes
        assert INSTANCE in health.text, health.text
        assert metrics is not None, "the relayed engine_dead gauge never said 1"
        assert f"engine instance {INSTANCE} (pid {stub}) died" in serve_log and "model reloaded" in serve_log

    # nothing of the dead engine is left: its KV blocks (a new engine, all free), threads, processes
    wait_until_idle(dying.stack)
    [(new_stub, _)] = _stubs(dying).items()
    assert new_stub != stub and not _running(stub)
    assert _process_names(dying) == processes_before
    assert _threads(new_stub) <= threads_before


def test_killed_past_the_restart_budget_serve_exits_non_zero(dying):
    """One restart allowed: the second death (the first when the test above ran) ends serve with exit code 1, in
    seconds: tritonserver, which cannot unload a model version whose engine process died, is not waited for."""
    for _ in range(2):
        [(stub, _)] = _stubs(dying).items()
        os.kill(stub, signal.SIGKILL)
        killed = time.monotonic()
        _wait_for(lambda: dying.process.poll() is not None or set(_stubs(dying)) - {stub}, dying.recovery_s,
                  f"serve's answer to the kill; {dying.logs()}")
        if dying.process.poll() is not None:
            break
    dying.process.wait(60)
    assert dying.process.returncode == 1, dying.logs()
    assert time.monotonic() - killed < STOP_AFTER_GIVING_UP_S, dying.logs()
    assert "engine processes died more than 1 times" in (dying.state_dir / "serve.log").read_text()
    assert "Exit timeout expired" not in (dying.state_dir / "tritonserver.log").read_text(), dying.logs()


def test_a_killed_tritonserver_is_started_again(default_model_dir, tmp_path):
    """tritonserver itself can die with its engine (its Python backend aborts on a dead stub's shared-memory lock):
    serve starts it again on the same ports, and the service comes back."""
    process = StackProcess(default_model_dir, tmp_path, OPTIONS, None)
    started = time.monotonic()
    process.start()
    recovery_s = max(RECOVERY_S, 2 * (time.monotonic() - started))
    try:
        root_url = process.stack.base_url.removesuffix("/v1")
        [tritonserver] = [pid for pid in descendant_pids(process.process.pid)
                          if program_name(pid) == "tritonserver"]
        os.kill(tritonserver, signal.SIGKILL)
        killed = time.monotonic()
        _wait_for(lambda: httpx.get(f"{root_url}/health", timeout=10).status_code == 503, 30, "health red")
        _wait_for(lambda: httpx.get(f"{root_url}/health", timeout=10).status_code == 200,
                  recovery_s - (time.monotonic() - killed), f"serving again; {process.logs()}")
        _paris(process.stack.base_url, process.stack.model_name)
        assert process.process.poll() is None
        # serve's own readiness poll (every 0.5 s) may log it a moment after the adapter's /health turned green
        _wait_for(lambda: "tritonserver started again" in (process.state_dir / "serve.log").read_text(), 10,
                  "serve's log of the restart")
    finally:
        process.stop()
