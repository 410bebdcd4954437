"""Shared by the tests (a module, not conftest.py: tests/kernels has a conftest of its own, so `conftest` is
ambiguous as a module name): ports, the test stack's limits, and its engine state read from the metrics."""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
STACK_MAX_NUM_SEQS = 8  # small limits so the overload test reaches them with few clients
STACK_MAX_QUEUE_LEN = 8
STACK_LORA_ADAPTERS = ("alpha", "beta")  # served with --max-loras 1: using both evicts one


def free_ports(count: int) -> list[int]:
    """Distinct ports free right now (all sockets held until each is picked, so no duplicates)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


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
