"""The KV cache's tiers through the whole stack, with the official openai SDK: a stack whose device pool holds 24
blocks, with a host tier of 4 and a storage directory. A prompt pushed out of the device pool by another comes
back from all three tiers, and `sglext.cached_tokens_details` says how many tokens each gave (completions and
chat, streamed and not); /metrics counts them by tier."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from stack_helpers import Stack, running_stack, wait_until_idle

BLOCK = 16
# SmolLM2-135M's K/V of one block in float32: 2 (K, V) x 30 layers x 16 tokens x 3 heads x 64 dims x 4 bytes
BLOCK_BYTES = 2 * 30 * BLOCK * 3 * 64 * 4
DEVICE_BLOCKS, HOST_BLOCKS = 24, 4
DETAILS = {"return_cached_tokens_details": True}


@pytest.fixture(scope="module")
def tiered_stack(default_model_dir, tmp_path_factory) -> Iterator[Stack]:
    storage = tmp_path_factory.mktemp("kv-storage")
    with running_stack(default_model_dir, tmp_path_factory.mktemp("tiered-stack"), "--dtype", "float32",
                       "--weight-format", "int4", "--kv-cache-memory", str(DEVICE_BLOCKS * BLOCK_BYTES),
                       "--kv-host-memory", str(HOST_BLOCKS * BLOCK_BYTES),
                       "--kv-storage-dir", str(storage)) as started:
        yield started.stack


def _sdk(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=600)


def _text(topic: str, sentences: int) -> str:
    return " ".join(f"Fact {i} about {topic}: it is number {i} of the list." for i in range(sentences))


def _hits_by_tier(stack: Stack) -> dict[str, float]:
    text = httpx.get(stack.metrics_url, timeout=5).text
    return {tier: sum(float(value) for value in re.findall(
        rf'^tritonllm:prefix_cache_hits_total{{[^}}]*tier="{tier}"[^}}]*}} ([0-9.e+-]+)$', text, re.MULTILINE))
        for tier in ("device", "host", "storage")}


def _assert_every_tier_served(details: dict, cached: int, prompt_tokens: int) -> None:
    """The prompt's first blocks stayed in the device pool, the ones evicted last are in host memory, the ones
    evicted first (dropped by the host tier) come from storage; together, its whole cached prefix."""
    assert details["device"] + details["host"] + details["storage"] == cached
    assert cached == BLOCK * ((prompt_tokens - 1) // BLOCK)
    assert details["device"] > 0 and details["host"] == HOST_BLOCKS * BLOCK and details["storage"] > 0, details
    assert details["storage_backend"] == "file"


def test_a_completion_evicted_from_the_device_pool_is_served_by_host_memory_and_storage(tiered_stack):
    client = _sdk(tiered_stack)
    prompt = _text("the sea", 12)  # 196 tokens: 12 full blocks
    first = client.completions.create(model=tiered_stack.model_name, prompt=prompt, max_tokens=4, temperature=0,
                                      extra_body=DETAILS)
    assert first.model_extra["sglext"]["cached_tokens_details"] == {
        "device": 0, "host": 0, "storage": 0, "storage_backend": None}
    before = _hits_by_tier(tiered_stack)
    # 19 blocks: the pool's 12 free ones and the prompt's last 7, deepest first; host memory keeps the last 4
    client.completions.create(model=tiered_stack.model_name, prompt=_text("mountains", 18), max_tokens=4)
    again = client.completions.create(model=tiered_stack.model_name, prompt=prompt, max_tokens=4, temperature=0,
                                      extra_body=DETAILS)
    cached = again.usage.prompt_tokens_details.cached_tokens
    details = again.model_extra["sglext"]["cached_tokens_details"]
    _assert_every_tier_served(details, cached, again.usage.prompt_tokens)
    assert again.choices[0].text == first.choices[0].text  # greedy: the same continuation
    wait_until_idle(tiered_stack)
    expected = {tier: details[tier] for tier in ("device", "host", "storage")}
    deadline = time.monotonic() + 10  # the engine publishes its metrics every 0.5 s, the gauges maybe first
    while (moved := {tier: value - before[tier] for tier, value in _hits_by_tier(tiered_stack).items()}) != expected:
        assert time.monotonic() < deadline, (moved, expected)
        time.sleep(0.2)


def test_a_streamed_chat_evicted_from_the_device_pool_reports_every_tier(tiered_stack):
    client = _sdk(tiered_stack)
    messages = [{"role": "user", "content": _text("rivers", 11)}]
    client.chat.completions.create(model=tiered_stack.model_name, messages=messages, max_tokens=4)
    client.chat.completions.create(model=tiered_stack.model_name, max_tokens=4,
                                   messages=[{"role": "user", "content": _text("forests", 18)}])
    chunks = list(client.chat.completions.create(model=tiered_stack.model_name, messages=messages, max_tokens=4,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=DETAILS))
    usage_chunk = chunks[-1]
    details = json.loads(usage_chunk.model_dump_json())["sglext"]["cached_tokens_details"]
    _assert_every_tier_served(details, usage_chunk.usage.prompt_tokens_details.cached_tokens,
                              usage_chunk.usage.prompt_tokens)
