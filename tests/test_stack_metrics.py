"""The per-request metrics through the whole stack, read where a dashboard reads them (the adapter's /metrics,
which relays the engine's): after requests that end by length, by a completed constraint (stop) and by the client
leaving (abort), each histogram counted each request once, with plausible sums, and the finish counter split them
by reason."""

from __future__ import annotations

import re
import time

import httpx
import openai

from tritonllm.interface.metric_names import COUNTERS, FINISHED, FINISH_REASONS, GAUGES, HISTOGRAMS
from stack_helpers import metric, wait_until_idle

PROMPT = "The capital of France is"


def _adapter_metrics(stack) -> dict[str, float]:
    """The engine's per-request series on the adapter's /metrics: name (+ finished_reason) → value."""
    text = httpx.get(stack.base_url.removesuffix("/v1") + "/metrics", timeout=5).text
    values = {}
    for name, _, _ in HISTOGRAMS.values():
        for suffix in ("_count", "_sum"):
            match = re.search(rf"^{re.escape(name + suffix)}{{[^}}]*}} (\S+)$", text, re.MULTILINE)
            assert match, f"{name + suffix} is not on the adapter's /metrics"
            values[name + suffix] = float(match.group(1))
    for reason in FINISH_REASONS:
        match = re.search(rf'^{re.escape(FINISHED[0])}{{[^}}]*finished_reason="{reason}"[^}}]*}} (\S+)$', text,
                          re.MULTILINE)
        assert match, f"{FINISHED[0]} has no {reason} series"
        values[reason] = float(match.group(1))
    return values


def test_per_request_histograms_and_finish_reasons(stack, client):
    wait_until_idle(stack)  # nothing of earlier tests still counting
    before = _adapter_metrics(stack)
    lengths = [client.completions.create(model=stack.model_name, prompt=PROMPT, max_tokens=tokens, temperature=0,
                                         extra_body={"ignore_eos": True}) for tokens in (3, 6)]
    stopped = client.completions.create(model=stack.model_name, prompt=PROMPT, max_tokens=20,
                                        extra_body={"regex": "ab"})  # a complete constraint: stop
    with httpx.stream("POST", f"{stack.base_url}/completions", timeout=60, json={
            "model": stack.model_name, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
            "stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # it runs; leaving the block drops the connection: abort
    assert [answer.choices[0].finish_reason for answer in (*lengths, stopped)] == ["length", "length", "stop"]
    prompt_tokens = lengths[0].usage.prompt_tokens
    completed_tokens = sum(answer.usage.completion_tokens for answer in (*lengths, stopped))

    expected = {**dict.fromkeys(FINISH_REASONS, 0), "stop": 1, "length": 2, "abort": 1}
    deadline = time.monotonic() + 30  # cancellation is polled and observations are published every 0.5 s

    def moved() -> dict[str, float]:
        now = _adapter_metrics(stack)
        return {name: now[name] - before[name] for name in now}

    while {reason: moved()[reason] for reason in FINISH_REASONS} != expected:
        assert time.monotonic() < deadline, moved()
        time.sleep(0.25)
    delta = moved()
    for name, _, _ in HISTOGRAMS.values():
        if not name.startswith("tritonllm:"):  # (TTFT and ITL count outputs, not requests)
            assert delta[name + "_count"] == 4, name
    assert delta["vllm:request_prompt_tokens_sum"] == 4 * prompt_tokens
    generated = delta["vllm:request_generation_tokens_sum"] - completed_tokens  # the aborted stream's share
    assert 1 <= generated < 400
    seconds = {name: delta[f"vllm:{name}_sum"] for name in ("e2e_request_latency_seconds", "request_queue_time_seconds",
                                                            "request_prefill_time_seconds",
                                                            "request_decode_time_seconds")}
    assert all(value >= 0 for value in seconds.values()), seconds
    assert seconds["e2e_request_latency_seconds"] >= sum(value for name, value in seconds.items()
                                                         if name != "e2e_request_latency_seconds"), seconds
    assert seconds["request_decode_time_seconds"] > 0 and seconds["request_prefill_time_seconds"] > 0


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _gauges_and_counters(stack) -> dict[str, float]:
    return {name: metric(stack, name) for name, _ in (*GAUGES.values(), *COUNTERS.values())}


def test_tool_calls_leave_every_gauge_counter_and_the_loads_moving(stack):
    """A finish reason the metrics once did not know (tool_calls) froze every engine metric and /v1/loads: after
    tool calls, streamed and not, each is counted under its reason, and a later request still moves the gauges (up
    while it runs, back once it is done), the counters and /v1/loads."""
    root_url = stack.base_url.removesuffix("/v1")
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=600)  # a busy CPU
    wait_until_idle(stack)
    before_tools = _adapter_metrics(stack)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    answer = client.chat.completions.create(model=stack.model_name, messages=ask, tools=[WEATHER],
                                            tool_choice="required", max_tokens=80, temperature=0)
    chunks = list(client.chat.completions.create(model=stack.model_name, messages=ask, tools=[WEATHER],
                                                 tool_choice="required", max_tokens=80, temperature=0, stream=True))
    finishes = [answer.choices[0].finish_reason] + [c.choices[0].finish_reason for c in chunks
                                                    if c.choices and c.choices[0].finish_reason]
    assert finishes == ["tool_calls", "tool_calls"]
    deadline = time.monotonic() + 30
    while _adapter_metrics(stack)["tool_calls"] - before_tools["tool_calls"] != 2:
        assert time.monotonic() < deadline, "the tool calls were not counted"
        time.sleep(0.25)
    wait_until_idle(stack)  # the running gauge went back to 0
    idle = _gauges_and_counters(stack)

    with httpx.stream("POST", f"{stack.base_url}/completions", timeout=120, json={
            "model": stack.model_name, "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True,
            "stream": True}) as response:
        events = (line for line in response.iter_lines() if line.startswith("data: "))
        for _ in range(3):
            next(events)  # it runs
        running = _wait_for_metric(stack, "tritonllm:num_requests_running", 1)
        loads = httpx.get(f"{root_url}/v1/loads", timeout=10).json()
        assert loads["loads"][0]["num_running_reqs"] == 1, loads
        assert metric(stack, "tritonllm:kv_cache_free_blocks") < idle["tritonllm:kv_cache_free_blocks"]
    assert running == 1
    wait_until_idle(stack)
    after = _gauges_and_counters(stack)
    assert after["tritonllm:prompt_tokens_total"] > idle["tritonllm:prompt_tokens_total"]
    assert after["tritonllm:generation_tokens_total"] >= idle["tritonllm:generation_tokens_total"] + 3
    loads = httpx.get(f"{root_url}/v1/loads", timeout=10).json()
    assert loads["loads"][0]["num_running_reqs"] == 0, loads
    assert not re.search(r'^tritonllm:internal_errors_total{[^}]*} [1-9]', httpx.get(
        f"{root_url}/metrics", timeout=10).text, re.MULTILINE), "the engine reported internal errors"


def _wait_for_metric(stack, name: str, value: float, timeout: float = 30) -> float:
    deadline = time.monotonic() + timeout
    while (now := metric(stack, name)) != value:
        assert time.monotonic() < deadline, f"{name} is {now}, not {value}"
        time.sleep(0.1)
    return now
