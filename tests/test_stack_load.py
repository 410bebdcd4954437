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
    """Start a streaming completion; returns (status, when it ended (time.monotonic()), Retry-After, outcome): the
    error body, "dropped", or the finish reasons seen."""
    body = {"model": stack.model_name, "prompt": "Tell me about the ocean.", "max_tokens": max_tokens,
            "temperature": 0.8, "ignore_eos": True, "stream": True}
    async with client.stream("POST", f"{stack.base_url}/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, time.monotonic(), response.headers.get("retry-after"), response.json()
        chunks, finish_reasons = 0, []
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += 1
                finish_reasons += [c["finish_reason"] for c in json.loads(line[6:])["choices"] if c["finish_reason"]]
                if drop_after is not None and chunks >= drop_after:
                    return 200, time.monotonic(), None, "dropped"  # leaving the block closes the connection
        return 200, time.monotonic(), None, finish_reasons


def _is_capacity_refusal(status: int, retry_after: str | None, body) -> bool:
    return (status == 503 and retry_after is not None and isinstance(body, dict)
            and "capacity" in body["error"]["message"])


def test_over_the_queue_limit_requests_get_503_at_once_and_earlier_ones_finish(stack):
    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(_stream(client, stack, 24) for _ in range(40)))

    results = asyncio.run(burst())
    refused = [r for r in results if r[0] == 503]
    served = [r for r in results if r[0] == 200]
    assert len(refused) + len(served) == len(results), [r for r in results if r[0] not in (200, 503)]
    assert refused and len(served) >= STACK_MAX_NUM_SEQS
    assert all(_is_capacity_refusal(status, retry_after, body) for status, _, retry_after, body in refused)
    assert all(finish_reasons == ["length"] for _, _, _, finish_reasons in served)
    # at once: every refusal came before the first admitted stream had its 24 tokens (not after waiting for room)
    assert max(ended for _, ended, _, _ in refused) < min(ended for _, ended, _, _ in served)
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
    dropped = [outcome for status, _, _, outcome in outcomes if status == 200]
    # a wave can outrun the aborts of the one before and meet a full engine: those few are refused, nothing else
    assert all(status == 200 or _is_capacity_refusal(status, retry_after, body)
               for status, _, retry_after, body in outcomes)
    assert dropped == ["dropped"] * len(dropped) and len(dropped) >= len(outcomes) // 2
    wait_until_idle(stack)
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    after = client.completions.create(model=stack.model_name, prompt="The capital of France is", max_tokens=4,
                                      temperature=0)
    assert after.choices[0].text.startswith(" Paris")
