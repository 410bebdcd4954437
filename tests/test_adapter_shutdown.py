"""The adapter's graceful shutdown, as a process of its own sent SIGTERM with streams in flight (a stand-in Triton
behind it): new requests get 503 + Retry-After while the ones in flight finish within the grace period; the rest
end with an error event that says why, their Triton calls cancelled; then it exits."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tritonllm.launcher import answers_ok
from fake_triton import FakeTriton, Script
from stack_helpers import REPO_ROOT, free_ports

MODEL = "fake-model"
GRACE_S = 2.0
SHORT = Script(count=6, interval_s=0.2)  # done 1.2 s after it starts: within the grace period
LONG = Script(count=200, interval_s=0.2)  # 40 s: outlasts it
EXIT_MARGIN_S = 8.0  # after the grace period: the cancelled ones' error events, uvicorn's exit, a busy host


@pytest.fixture
def adapter(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, str, FakeTriton]]:
    triton = FakeTriton()
    [port] = free_ports(1)
    with open(tmp_path / "adapter.log", "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tritonllm.adapter", "--triton-url", triton.url, "--served-model-name", MODEL,
             "--port", str(port), "--shutdown-grace", str(GRACE_S)],
            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    root = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not answers_ok(root + "/health"):
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "adapter.log").read_text()
            time.sleep(0.1)
        yield process, root, triton
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        triton.stop()
        print((tmp_path / "adapter.log").read_text())


async def _stream(client: httpx.AsyncClient, root: str, script: Script, first_token: asyncio.Event) -> list:
    body = {"model": MODEL, "prompt": script.prompt(), "max_tokens": 500, "stream": True}
    async with client.stream("POST", f"{root}/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = []
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                first_token.set()
                events.append(line.removeprefix("data: "))
    return [event if event == "[DONE]" else json.loads(event) for event in events]


def test_sigterm_refuses_new_requests_lets_the_running_finish_and_cancels_the_rest(adapter):
    process, root, triton = adapter

    async def scenario() -> tuple[list, list, dict]:
        async with httpx.AsyncClient(timeout=30) as client:
            started = [asyncio.Event(), asyncio.Event()]
            streams = [asyncio.create_task(_stream(client, root, script, event))
                       for script, event in zip((SHORT, LONG), started)]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 20)
            process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            refused = {
                "completion": await client.post(f"{root}/v1/completions", json={"model": MODEL, "prompt": "x"}),
                "health": await client.get(f"{root}/health"),
                "metrics": await client.get(f"{root}/metrics"),
            }
            short, long = await asyncio.gather(*streams)
            return short, long, refused

    signalled = time.monotonic()
    short, long, during = asyncio.run(scenario())

    for name in ("completion", "health"):
        assert during[name].status_code == 503, during[name].text
        assert during[name].headers["retry-after"]
        assert "shutting down" in during[name].json()["error"]["message"]
    assert during["metrics"].status_code == 200  # scrapes go on while it drains

    assert short[-1] == "[DONE]" and short[-2]["choices"][0]["finish_reason"] == "length"
    assert "".join(event["choices"][0]["text"] for event in short[:-1]) == "".join(f" t{i}" for i in range(6))
    assert long[-1] == "[DONE]" and "error" in long[-2], long[-3:]
    assert long[-2]["error"]["type"] == "service_unavailable_error" and "shutting down" in long[-2]["error"]["message"]
    assert 0 < len(long) - 2 < LONG.count
    assert sorted(triton.wait_for_outcomes(2)) == ["cancelled", "completed"]

    process.wait(GRACE_S + EXIT_MARGIN_S)
    assert time.monotonic() - signalled < GRACE_S + EXIT_MARGIN_S
    # uvicorn re-raises the signal once it has stopped: the process ends by SIGTERM, as without a drain
    assert process.returncode == -signal.SIGTERM


def test_an_idle_adapter_exits_at_once(adapter):
    process, _, _ = adapter
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    process.wait(EXIT_MARGIN_S)
    assert time.monotonic() - signalled < GRACE_S  # nothing in flight: no wait for the grace period
