"""The stack under churn: a thousand short requests at 64 concurrent, streamed and not, n = 1 or 2, a third of
the streams dropped after their first chunk. Nothing may fail but the dropped requests and admission-control
503s; afterwards the server still answers and every KV block is free again.

This is the load that crashed tritonserver (a response sender used by two threads, or after its final
response) and left the engine's process behind."""

from __future__ import annotations

import asyncio

import openai
import pytest

from churn import run_churn
from stack_helpers import running_stack, wait_until_idle

CHURN_REQUESTS = 1000
CHURN_CONCURRENCY = 64


@pytest.fixture(scope="module")
def churn_stack(default_model_dir, tmp_path_factory):
    """A stack with the default batch and queue limits (the shared one's are small on purpose)."""
    with running_stack(default_model_dir, tmp_path_factory.mktemp("churn-stack"),
                       "--kv-cache-memory", "256MiB") as process:
        yield process


def test_a_thousand_requests_with_dropouts_fail_none_and_leave_nothing_behind(churn_stack):
    stack = churn_stack.stack
    result = asyncio.run(run_churn(stack.base_url, stack.model_name, requests=CHURN_REQUESTS,
                                   concurrency=CHURN_CONCURRENCY, seed=13))
    print(result.summary())
    assert churn_stack.alive(), f"the stack died under churn; {churn_stack.logs()}"
    assert result.outcomes["failed"] == 0, "\n".join(result.failures[:20])
    assert result.outcomes["ok"] >= CHURN_REQUESTS // 2 and result.outcomes["dropped"] > 0
    wait_until_idle(stack)
    after = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0).completions.create(
        model=stack.model_name, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert after.choices[0].text.startswith(" Paris")
    log = (stack.state_dir / "tritonserver.log").read_text(errors="replace")
    cancelled = [line.split("request ")[1].split()[0] for line in log.splitlines() if "cancelled by the client" in line]
    assert len(cancelled) == len(set(cancelled)), "a cancelled request was aborted (and logged) more than once"
