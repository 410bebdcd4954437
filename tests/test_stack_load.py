"""Engine-core behaviour seen through the whole stack: prefix caching in usage, admission control (503),
and many client disconnects leaving no KV block behind."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import openai

from stack_helpers import STACK_MAX_NUM_SEQS, STACK_MAX_QUEUE_LEN, wait_until_idle

SHARED_PREFIX = " ".join(f"Rule {i}: answer politely and cite the rule number." for i in range(22))


def test_shared_prefix_is_served_from_the_cache(stack):
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    first = client.completions.create(model=stack.model_name, prompt=SHARED_PREFIX + " Question: what is 1+1?",
                                      max_tokens=8, temperature=0)
    assert first.usage.prompt_tokens >= 200
    second = client.completions.create(model=stack.model_name, prompt=SHARED_PREFIX + " Question: what is 2+3?",
                                       max_tokens=8, temperature=0,
                                       extra_body={"return_cached_tokens_details": True})
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 192
    assert second.model_extra["sglext"]["cached_tokens_details"] == {
        "device": cached, "host": 0, "storage": 0, "storage_backend": None}
    assert "sglext" not in first.model_extra
    again = client.completions.create(model=stack.model_name, prompt=SHARED_PREFIX + " Question: what is 1+1?",
                                      max_tokens=8, temperature=0)
    assert again.choices[0].text == first.choices[0].text  # cached prefix, same greedy output


async def _stream(client: httpx.AsyncClient, stack, max_tokens: int, drop_after: int | None = None) -> tuple:
    """Start a streaming completion; returns (status, seconds to the status, Retry-After, outcome): the error
    body, "dropped", or the finish reasons seen."""
    body = {"model": stack.model_name, "prompt": "Tell me about the ocean.", "max_tokens": max_tokens,
            "temperature": 0.8, "ignore_eos": True, "stream": True}
    start = time.monotonic()
    async with client.stream("POST", f"{stack.base_url}/completions", json=body) as response:
        answered = time.monotonic() - start
        if response.status_code != 200:
            await response.aread()
            return response.status_code, answered, response.headers.get("retry-after"), response.json()
        chunks, finish_reasons = 0, []
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += 1
                finish_reasons += [c["finish_reason"] for c in json.loads(line[6:])["choices"] if c["finish_reason"]]
                if drop_after is not None and chunks >= drop_after:
                    return 200, answered, None, "dropped"  # leaving the block closes the connection
        return 200, answered, None, finish_reasons


def test_over_the_queue_limit_requests_get_503_at_once_and_earlier_ones_finish(stack):
    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(_stream(client, stack, 24) for _ in range(40)))

    results = asyncio.run(burst())
    refused = [r for r in results if r[0] == 503]
    served = [r for r in results if r[0] == 200]
    assert refused and len(served) >= STACK_MAX_NUM_SEQS
    assert len(served) <= 40 - len(refused)
    for _, seconds, retry_after, body in refused:
        assert seconds < 3 and retry_after is not None
        assert body["error"]["type"] and "capacity" in body["error"]["message"]
    assert all(finish_reasons == ["length"] for _, _, _, finish_reasons in served)
    wait_until_idle(stack)


def test_two_hundred_dropped_streams_leave_no_blocks_behind(stack):
    rng = random.Random(7)

    async def drops():
        async with httpx.AsyncClient(timeout=120) as client:
            outcomes = []
            for _ in range(200 // STACK_MAX_QUEUE_LEN):
                wave = [_stream(client, stack, 200, drop_after=rng.randint(1, 6)) for _ in range(STACK_MAX_QUEUE_LEN)]
                outcomes += await asyncio.gather(*wave)
            return outcomes

    outcomes = asyncio.run(drops())
    assert sum(1 for status, *_ in outcomes if status == 200) >= 190  # a rare 503 when a wave outruns aborts
    wait_until_idle(stack)
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    after = client.completions.create(model=stack.model_name, prompt="The capital of France is", max_tokens=4,
                                      temperature=0)
    assert after.choices[0].text.startswith(" Paris")
