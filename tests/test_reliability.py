"""Reliability against real processes: schemathesis fuzzing of the live stack, and the adapter riding out a
tritonserver crash and restart (the engine's process must not outlive the server)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from stack_helpers import REPO_ROOT, child_pids, free_ports, running_stack

from tritonllm import launcher
from tritonllm.model_files import served_model_name

sys.path.insert(0, str(REPO_ROOT))  # bench/ is scripts, not an installed package
from bench.fuzz import run_campaign  # noqa: E402

FUZZ_EXAMPLES = 130  # per operation; the GET operations have no inputs and stop after a few
FUZZ_SEED = 20240601
MODEL_LOAD_TIMEOUT_S = 180


def _completion(base_url: str, model: str, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{base_url}/completions", timeout=timeout,
                      json={"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})


@pytest.fixture(scope="module")
def fuzz_stack(default_model_dir, tmp_path_factory):
    """A stack of its own with the default batch and queue limits: the shared one's 8-request queue (small on
    purpose, for the overload tests) could be filled by earlier tests' generations, and the campaign measures the
    server's answers to its own requests."""
    with running_stack(default_model_dir, tmp_path_factory.mktemp("fuzz-stack"),
                       "--kv-cache-memory", "256MiB") as process:
        yield process.stack


def test_fuzzed_requests_never_get_a_server_error_and_match_the_schema(fuzz_stack):
    stack = fuzz_stack
    root_url = stack.base_url.removesuffix("/v1")
    started = time.monotonic()
    sent = run_campaign(root_url, stack.model_name, examples=FUZZ_EXAMPLES, seed=FUZZ_SEED)
    print(f"fuzz: {sent} requests in {time.monotonic() - started:.0f} s")
    assert sent >= 100
    assert httpx.get(f"{root_url}/health", timeout=5).status_code == 200
    response = _completion(stack.base_url, stack.model_name)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"


# --- tritonserver going away and coming back -------------------------------------------------------------------


# Generous deadlines: on a loaded 2-core box a restart or a kill takes its time. Only outcomes are asserted.
DEADLINE_S = 60


def _wait_for_status(url: str, status: int) -> None:
    """Until GET `url` answers `status`; fails after DEADLINE_S."""
    started = time.monotonic()
    while True:
        try:
            if httpx.get(url, timeout=DEADLINE_S).status_code == status:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() - started < DEADLINE_S, f"{url} did not answer {status} within {DEADLINE_S} s"
        time.sleep(0.1)


@pytest.fixture
def triton_and_adapter(default_model_dir: Path, tmp_path: Path) -> Iterator[tuple[launcher.TritonServer, str, str]]:
    """A tritonserver with the real model and, as its own process, an adapter in front of it."""
    repository = launcher.write_model_repository(
        tmp_path / "repo", {"model_path": str(default_model_dir), "kv_cache_memory": "64MiB"})
    http_port, grpc_port, metrics_port, adapter_port = free_ports(4)
    server = launcher.TritonServer(repository, tmp_path / "state", http_port=http_port, grpc_port=grpc_port,
                                   metrics_port=metrics_port)
    model = served_model_name(default_model_dir)
    with open(tmp_path / "adapter.log", "wb") as log:
        adapter = subprocess.Popen(
            [sys.executable, "-m", "tritonllm.adapter", "--triton-url", server.grpc_url, "--served-model-name", model,
             "--port", str(adapter_port), "--health-timeout", "1"],
            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        server.start()
        server.wait_ready(MODEL_LOAD_TIMEOUT_S)
        yield server, f"http://127.0.0.1:{adapter_port}", model
    finally:
        adapter.terminate()
        adapter.wait(10)
        server.stop()


def _wait_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while any(Path(f"/proc/{pid}").exists() for pid in pids):
        assert time.monotonic() < deadline, "the backend stub outlived tritonserver"
        time.sleep(0.1)


def test_adapter_answers_503_while_triton_is_down_and_recovers_without_restart(triton_and_adapter):
    server, root_url, model = triton_and_adapter
    _wait_for_status(f"{root_url}/health", 200)
    assert _completion(f"{root_url}/v1", model).status_code == 200

    stubs = child_pids(server.process.pid)  # the Python backend stub running our engine
    assert stubs
    server.process.kill()  # tritonserver dies hard, idle; its stub must not outlive it
    server.process.wait()
    _wait_gone(stubs)
    _wait_for_status(f"{root_url}/health", 503)
    response = _completion(f"{root_url}/v1", model, timeout=DEADLINE_S)  # a 503, not a hang until the timeout
    assert response.status_code == 503, response.text
    assert response.json()["error"]["type"] == "service_unavailable_error"
    assert "retry-after" in response.headers

    server.start()  # same ports
    server.wait_ready(MODEL_LOAD_TIMEOUT_S)
    _wait_for_status(f"{root_url}/health", 200)
    response = _completion(f"{root_url}/v1", model)
    assert response.status_code == 200, response.text


def test_the_engine_process_dies_with_tritonserver_killed_mid_generation(triton_and_adapter):
    server, root_url, model = triton_and_adapter
    _wait_for_status(f"{root_url}/health", 200)
    stubs = child_pids(server.process.pid)
    assert stubs

    async def long_streams(started: asyncio.Event) -> list:
        body = {"model": model, "prompt": "Tell me a long story.", "max_tokens": 1000, "ignore_eos": True,
                "stream": True}

        async def one(client: httpx.AsyncClient) -> str:
            try:
                async with client.stream("POST", f"{root_url}/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        started.set()
                        return f"HTTP {response.status_code}: {(await response.aread())[:200]}"
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            started.set()
                            if '"error"' in line:
                                return "error event"
                return "ended"
            except httpx.HTTPError as error:
                return type(error).__name__

        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(one(client) for _ in range(4)))

    async def kill_while_generating() -> list:
        started = asyncio.Event()
        streams = asyncio.create_task(long_streams(started))
        await asyncio.wait_for(started.wait(), 60)
        server.process.kill()  # mid-generation: the stub's threads are busy or blocked on the server
        return await streams

    outcomes = asyncio.run(kill_while_generating())
    server.process.wait()
    _wait_gone(stubs)
    # each client sees an error (an error event, or a 503 before its first token); none sees a completed stream
    assert all(outcome == "error event" or outcome.startswith("HTTP 503") for outcome in outcomes), outcomes
