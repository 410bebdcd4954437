"""Reading the running stack's engine state from tritonserver's metrics endpoint."""

from __future__ import annotations

import re
import time

import httpx


def metric(stack, name: str) -> float:
    text = httpx.get(stack.metrics_url, timeout=5).text
    match = re.search(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{name} not exported"
    return float(match.group(1))


def wait_until_idle(stack, timeout: float = 20.0) -> None:
    """The engine has nothing running or waiting and every KV block is free again."""
    deadline = time.monotonic() + timeout
    while True:
        values = [metric(stack, f"tritonllm:{n}") for n in
                  ("num_requests_running", "num_requests_waiting", "kv_cache_free_blocks", "kv_cache_total_blocks")]
        if values[0] == 0 and values[1] == 0 and values[2] == values[3] > 0:
            return
        assert time.monotonic() < deadline, f"engine not idle: running, waiting, free, total = {values}"
        time.sleep(0.25)
