"""Deadlines that fit streaming (an idle timeout by default, a total deadline from the settings or the request's
X-Request-Timeout header) and HEAD on the GET routes, against a stand-in Triton on a real gRPC stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from fake_triton import FakeTriton, Script
from tritonllm.adapter import AdapterSettings, create_app
from tritonllm.adapter.concurrency import merge
from tritonllm.adapter.deadlines import REQUEST_TIMEOUT_HEADER
from tritonllm.adapter.errors import AdapterError, service_unavailable
from tritonllm.adapter.triton_client import GenerateRequest, TritonClient

MODEL = "fake-model"


@pytest.fixture(scope="module")
def triton() -> Iterator[FakeTriton]:
    fake = FakeTriton()
    yield fake
    fake.stop()


def _client(triton: FakeTriton, **settings) -> TestClient:
    return TestClient(create_app(AdapterSettings(served_model_name=MODEL, triton_url=triton.url, **settings)))


def _body(script: Script, stream: bool = False) -> dict:
    return {"model": MODEL, "prompt": script.prompt(), "max_tokens": 64, "stream": stream}


def _events(client: TestClient, script: Script, headers: dict | None = None) -> list:
    """The data of a streamed completion's events: parsed JSON, then "[DONE]"."""
    with client.stream("POST", "/v1/completions", json=_body(script, stream=True), headers=headers) as response:
        assert response.status_code == 200, response.read()
        data = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    return [item if item == "[DONE]" else json.loads(item) for item in data]


def _outcome_of_next_call(triton: FakeTriton, before: int) -> str:
    return triton.wait_for_outcomes(before + 1)[before]


# --- the idle timeout ---------------------------------------------------------------------------------------------

def test_a_generation_that_keeps_producing_outlives_the_idle_timeout(triton):
    """8 tokens 0.2 s apart take 1.6 s: three times the idle timeout, and not one gap reaches it."""
    script = Script(count=8, interval_s=0.2)
    with _client(triton, idle_timeout_s=0.5) as client:
        response = client.post("/v1/completions", json=_body(script))
        assert response.status_code == 200, response.text
        [choice] = response.json()["choices"]
        assert choice["text"] == "".join(f" t{i}" for i in range(8)) and choice["finish_reason"] == "length"
        events = _events(client, script)
    assert events[-1] == "[DONE]"
    assert [event["choices"][0]["finish_reason"] for event in events[:-1]][-1] == "length"


def test_silence_longer_than_the_idle_timeout_is_a_504_and_cancels_the_call(triton):
    script = Script(count=5, interval_s=0.05, stall_after=2)
    with _client(triton, idle_timeout_s=0.5) as client:
        before = len(triton.outcomes())
        response = client.post("/v1/completions", json=_body(script))
        assert response.status_code == 504, response.text
        assert response.json()["error"]["type"] == "timeout_error"
        assert "idle timeout" in response.json()["error"]["message"]
        assert _outcome_of_next_call(triton, before) == "cancelled"

        events = _events(client, script)  # streamed: the tokens so far, then an error event
        assert "".join(event["choices"][0]["text"] for event in events[:-2]) == " t0 t1"
        assert events[-2]["error"]["type"] == "timeout_error" and events[-1] == "[DONE]"
        assert _outcome_of_next_call(triton, before + 1) == "cancelled"


# --- a deadline on the whole request: the server's and the request's own --------------------------------------

SLOW = Script(count=10, interval_s=0.2)  # 2 s, producing all along


def test_the_total_deadline_setting_ends_a_generation_that_is_still_producing(triton):
    with _client(triton, idle_timeout_s=5, request_timeout_s=0.6) as client:
        before = len(triton.outcomes())
        response = client.post("/v1/completions", json=_body(SLOW))
        assert response.status_code == 504, response.text
        assert "deadline of 0.6 s" in response.json()["error"]["message"]
        assert _outcome_of_next_call(triton, before) == "cancelled"
        events = _events(client, SLOW)
        assert 1 <= len(events) - 2 < SLOW.count  # some tokens, then the error event
        assert events[-2]["error"]["type"] == "timeout_error"


def test_a_request_may_shorten_the_deadline_with_its_header_never_lengthen_it(triton):
    with _client(triton, idle_timeout_s=5) as client:
        assert client.post("/v1/completions", json=_body(SLOW)).status_code == 200  # no deadline by default
        short = client.post("/v1/completions", json=_body(SLOW), headers={REQUEST_TIMEOUT_HEADER: "0.6"})
        assert short.status_code == 504 and "deadline of 0.6 s" in short.json()["error"]["message"]
        events = _events(client, SLOW, headers={REQUEST_TIMEOUT_HEADER: "0.6"})
        assert events[-2]["error"]["type"] == "timeout_error"
        fast = client.post("/v1/completions", json=_body(Script(count=2)), headers={REQUEST_TIMEOUT_HEADER: "30"})
        assert fast.status_code == 200, fast.text
    with _client(triton, idle_timeout_s=5, request_timeout_s=0.6) as client:
        longer = client.post("/v1/completions", json=_body(SLOW), headers={REQUEST_TIMEOUT_HEADER: "30"})
        assert longer.status_code == 504 and "deadline of 0.6 s" in longer.json()["error"]["message"]


@pytest.mark.parametrize("value", ["soon", "0", "-1", "inf", "nan"])
def test_a_malformed_request_timeout_header_is_a_400(triton, value):
    with _client(triton) as client:
        response = client.post("/v1/completions", json=_body(Script(count=1)), headers={REQUEST_TIMEOUT_HEADER: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == REQUEST_TIMEOUT_HEADER


# --- HEAD -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/health", "/v1/models", f"/v1/models/{MODEL}", "/metrics"])
def test_head_answers_like_get_without_the_body(triton, path):
    with _client(triton) as client:
        get, head = client.get(path), client.head(path)
    assert get.status_code == head.status_code == 200 and get.content
    assert head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]


def test_head_on_a_post_route_is_still_refused(triton):
    with _client(triton) as client:
        response = client.head("/v1/completions")
    assert response.status_code == 405 and response.content == b""


# --- cancel_all (the drain's end) ---------------------------------------------------------------------------------

@pytest.mark.parametrize("prompts", [1, 2])  # one call waits in its caller's task, two in a task each
def test_cancel_all_fails_every_waiting_call_with_its_error_and_cancels_them(triton, prompts):
    async def run() -> tuple[list, list]:
        client = TritonClient(AdapterSettings(served_model_name=MODEL, triton_url=triton.url, idle_timeout_s=30))
        stalled = Script(count=5, interval_s=0.01, stall_after=1)
        calls = [client.generate(GenerateRequest(stalled.prompt(), {}, stream=True), request_id=f"cancel-all-{prompts}-{i}")
                 for i in range(prompts)]
        received = []

        async def consume():
            async for item in merge(calls):
                received.append(item)

        consumer = asyncio.ensure_future(consume())
        while len(received) < prompts:  # each has its first token and waits for the next
            await asyncio.sleep(0.01)
        client.cancel_all(service_unavailable("the server is shutting down"))
        results = await asyncio.wait_for(asyncio.gather(consumer, return_exceptions=True), 5)
        with pytest.raises(AdapterError, match="shutting down"):  # and every later call
            await anext(client.generate(GenerateRequest(stalled.prompt(), {}, stream=True), request_id=f"cancel-all-{prompts}-late"))
        await client.close()
        return results, received

    before = len(triton.outcomes())
    [error], received = asyncio.run(run())
    assert isinstance(error, AdapterError) and error.status_code == 503 and "shutting down" in str(error)
    assert len(received) == prompts
    assert triton.wait_for_outcomes(before + prompts)[before:] == ["cancelled"] * prompts


def test_while_an_instance_is_dead_only_its_silent_calls_fail(triton):
    """A call's first response names its engine instance: while llm_0_0 is dead, its silent call gets the
    retryable 503, and llm_0_1's call, silent as long (a long prefill on a busy host), goes on."""
    async def run() -> tuple[object, bool]:
        client = TritonClient(AdapterSettings(served_model_name=MODEL, triton_url=triton.url, idle_timeout_s=30))
        calls = {instance: client.generate(GenerateRequest(Script(count=5, stall_after=1, instance=instance).prompt(),
                                                           {}, stream=True), request_id=f"dead-{instance}")
                 for instance in ("llm_0_0", "llm_0_1")}
        for call in calls.values():
            await anext(call)  # each has its first token and waits for the next
        waits = {instance: asyncio.ensure_future(anext(call)) for instance, call in calls.items()}
        client.health.mark_dead("llm_0_0", "killed by SIGKILL")
        watch = asyncio.ensure_future(client.watch_engines())
        await asyncio.wait(waits.values(), timeout=6)
        alive_waiting = not waits["llm_0_1"].done()
        dead_error = waits["llm_0_0"].exception() if waits["llm_0_0"].done() else None
        watch.cancel()
        waits["llm_0_1"].cancel()
        await asyncio.gather(*waits.values(), return_exceptions=True)
        for call in calls.values():
            await call.aclose()
        await client.close()
        return dead_error, alive_waiting

    dead_error, alive_waiting = asyncio.run(run())
    assert isinstance(dead_error, AdapterError) and dead_error.status_code == 503 and "llm_0_0" in str(dead_error)
    assert alive_waiting


async def _generate_all(client: TritonClient, script: Script, request_id: str) -> str:
    return "".join(choice.text for chunk in [chunk async for chunk in client.generate(
        GenerateRequest(script.prompt(), {}, stream=True), request_id=request_id)] for choice in chunk.choices)


def test_a_call_a_dead_instance_held_before_any_response_goes_again(triton):
    """llm_0_0 took the request and died before its first token: the call is taken back after its silence and sent
    again, and the live instance answers it, as if the dead one had refused it at once."""
    async def run() -> str:
        client = TritonClient(AdapterSettings(served_model_name=MODEL, triton_url=triton.url, idle_timeout_s=30))
        call = asyncio.ensure_future(_generate_all(
            client, Script(count=3, interval_s=0.2, stall_after=0, instance="llm_0_0", again_by="llm_0_1"), "held-then-died"))
        await asyncio.sleep(0.3)
        client.health.mark_dead("llm_0_0", "killed by SIGKILL")
        watch = asyncio.ensure_future(client.watch_engines())
        try:
            return await asyncio.wait_for(call, 10)
        finally:
            watch.cancel()
            await client.close()

    assert asyncio.run(run()) == " t0 t1 t2"


def test_a_call_sent_after_an_instance_died_is_not_taken_for_one_it_holds(triton):
    """A dead instance answers at once, so a call sent after the death was seen cannot be one it holds: silent in
    Triton's queue for longer than the dead instance's calls may be (a busy live instance), it still runs, once."""
    async def run() -> str:
        client = TritonClient(AdapterSettings(served_model_name=MODEL, triton_url=triton.url, idle_timeout_s=30))
        client.health.mark_dead("llm_0_0", "killed by SIGKILL")
        watch = asyncio.ensure_future(client.watch_engines())
        try:
            return await asyncio.wait_for(_generate_all(client, Script(count=2, interval_s=3.2, instance=None),
                                                        "queued-after-the-death"), 15)
        finally:
            watch.cancel()
            await client.close()

    before = len(triton.outcomes())
    assert asyncio.run(run()) == " t0 t1"
    assert triton.wait_for_outcomes(before + 1)[before:] == ["completed"]
