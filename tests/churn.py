"""A churn workload through the OpenAI API: many short requests at high concurrency, mixed streamed and not,
n = 1 or 2, and a share of the streams dropped after their first chunk. Used by tests/test_stack_churn.py and
bench/churn.py.

Every request ends in exactly one outcome: ok, dropped (on purpose), shed (503 from admission control) or
failed (anything else: a 5xx, an error event in the stream, a connection error, a malformed stream)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


@dataclass
class ChurnResult:
    outcomes: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)  # what went wrong, one line per failed request
    seconds: float = 0.0

    def summary(self) -> str:
        counts = ", ".join(f"{name} {self.outcomes[name]}" for name in ("ok", "dropped", "shed", "failed"))
        return f"{sum(self.outcomes.values())} requests in {self.seconds:.1f} s: {counts}"


def _body(rng: random.Random, model: str, stream_share: float) -> dict:
    return {
        "model": model,
        "prompt": " ".join(rng.choices(WORDS, k=rng.randint(1, 40))),
        "max_tokens": rng.randint(1, 8),
        "n": rng.choice([1, 2]),
        "temperature": rng.choice([0.0, 0.8]),
        "stream": rng.random() < stream_share,
    }


async def _one(client: httpx.AsyncClient, body: dict, drop: bool) -> tuple[str, str | None]:
    """(outcome, failure description or None)."""
    if not body["stream"]:
        response = await client.post("/completions", json=body)
        if response.status_code == 200:
            choices = response.json()["choices"]
            if len(choices) != body["n"] or any(c["finish_reason"] is None for c in choices):
                return "failed", f"malformed response {response.text[:200]}"
            return "ok", None
        return _refused(response.status_code, response.text)
    async with client.stream("POST", "/completions", json=body) as response:
        if response.status_code != 200:
            return _refused(response.status_code, (await response.aread()).decode(errors="replace"))
        finished, done = set(), False
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return "failed", f"error event {line[:200]}"
            if drop:
                return "dropped", None  # leaving the block closes the connection mid-stream
            finished.update(c["index"] for c in chunk["choices"] if c.get("finish_reason"))
        if not done or len(finished) != body["n"]:
            return "failed", f"stream ended early: done={done}, finished choices {sorted(finished)}"
        return "ok", None


def _refused(status: int, text: str) -> tuple[str, str | None]:
    if status == 503 and "capacity" in text:
        return "shed", None
    return "failed", f"HTTP {status}: {text[:200]}"


async def run_churn(base_url: str, model: str, *, requests: int = 1000, concurrency: int = 64,
                    stream_share: float = 0.6, drop_share: float = 1 / 3, seed: int = 0,
                    timeout_s: float = 120) -> ChurnResult:
    """Send `requests` requests, `concurrency` at a time, through the OpenAI API at base_url (…/v1)."""
    rng = random.Random(seed)
    plan = []
    for _ in range(requests):
        body = _body(rng, model, stream_share)
        plan.append((body, body["stream"] and rng.random() < drop_share))
    result = ChurnResult()
    queue: asyncio.Queue = asyncio.Queue()
    for item in plan:
        queue.put_nowait(item)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            body, drop = queue.get_nowait()
            try:
                outcome, failure = await _one(client, body, drop)
            except (httpx.HTTPError, json.JSONDecodeError, KeyError) as error:
                outcome, failure = "failed", f"{type(error).__name__}: {error}"
            result.outcomes[outcome] += 1
            if failure:
                result.failures.append(failure)

    started = time.monotonic()
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    result.seconds = time.monotonic() - started
    return result
