"""A bounded soak of a running tritonllm stack on loopback: many concurrent clients for a fixed time.

Start the stack first (`make serve`), then:  .venv/bin/python bench/soak.py [--duration 300] [--clients 64]

Each client loops: a random prompt length, streaming or not, and sometimes a disconnect part-way (a stream
dropped after a few chunks, or a non-streamed request abandoned before its answer). At the end it reports
requests by outcome and status, TTFT and inter-token latency (p50/p99, streamed requests), the RSS of the
Triton Python-backend stub at start and end (a leak shows as growth), and once the engine is idle again its
free and total KV cache blocks (a leaked sequence shows as free < total).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

STUB_NAME = "triton_python_backend_stub"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()
DISCONNECT_PROBABILITY = 0.15
STREAM_PROBABILITY = 0.5
IDLE_TIMEOUT_S = 60


@dataclass
class Results:
    outcomes: Counter = field(default_factory=Counter)
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)


def stub_rss_kib(metrics_port: int) -> dict[int, int]:
    """PID → resident set size (KiB) of the Triton Python-backend stubs of the tritonserver on `metrics_port`
    (other stacks, or stubs orphaned by them, may run on the same host)."""
    sizes = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if STUB_NAME not in _cmdline(proc):
                continue
            status = (proc / "status").read_text()
            parent = re.search(r"^PPid:\s+(\d+)", status, re.MULTILINE).group(1)
            if f"--metrics-port={metrics_port}" not in _cmdline(Path("/proc", parent)).split():
                continue
        except OSError:  # the process ended while we looked
            continue
        match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
        if match:
            sizes[int(proc.name)] = int(match.group(1))
    return sizes


def _cmdline(proc: Path) -> str:
    return (proc / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ")


def metrics(metrics_url: str) -> dict[str, float]:
    text = httpx.get(metrics_url, timeout=5).text
    return {name: float(value) for name, value in re.findall(r"^(tritonllm:\w+)\{[^}]*\} (\S+)$", text, re.MULTILINE)}


def wait_for_idle(metrics_url: str) -> dict[str, float]:
    """The engine's metrics once nothing runs or waits and the KV pool is whole again, or after IDLE_TIMEOUT_S."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        values = metrics(metrics_url)
        idle = values.get("tritonllm:num_requests_running") == 0 and values.get("tritonllm:num_requests_waiting") == 0
        whole = values.get("tritonllm:kv_cache_free_blocks") == values.get("tritonllm:kv_cache_total_blocks")
        if (idle and whole) or time.monotonic() > deadline:
            return values
        time.sleep(0.5)


def random_request(rng: random.Random, model: str) -> dict:
    return {
        "model": model,
        "prompt": " ".join(rng.choices(WORDS, k=rng.randint(1, 200))),
        "max_tokens": rng.randint(1, 64),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "stream": rng.random() < STREAM_PROBABILITY,
    }


async def one_request(client: httpx.AsyncClient, rng: random.Random, model: str, results: Results) -> None:
    body = random_request(rng, model)
    disconnect = rng.random() < DISCONNECT_PROBABILITY
    if body["stream"]:
        await streamed(client, body, rng.randint(1, 4) if disconnect else None, results)
    elif disconnect:
        try:  # abandon it part-way: the adapter must cancel the Triton request
            await asyncio.wait_for(client.post("/completions", json=body), rng.uniform(0.05, 1.0))
            results.outcomes["ok 200"] += 1
        except asyncio.TimeoutError:
            results.outcomes["disconnected"] += 1
    else:
        response = await client.post("/completions", json=body)
        results.outcomes[f"{'ok' if response.status_code == 200 else 'failed'} {response.status_code}"] += 1


async def streamed(client: httpx.AsyncClient, body: dict, drop_after: int | None, results: Results) -> None:
    started = time.monotonic()
    async with client.stream("POST", "/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            results.outcomes[f"failed {response.status_code}"] += 1
            return
        last, chunks = None, 0
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if "error" in json.loads(line[6:]):
                results.outcomes["failed error event"] += 1
                return
            now = time.monotonic()
            if last is None:
                results.ttft_s.append(now - started)
            else:
                results.itl_s.append(now - last)
            last, chunks = now, chunks + 1
            if drop_after is not None and chunks >= drop_after:
                results.outcomes["disconnected"] += 1
                return  # leaving the block closes the connection mid-stream
    results.outcomes["ok 200"] += 1


async def client_loop(base_url: str, model: str, seed: int, deadline: float, results: Results) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        while time.monotonic() < deadline:
            try:
                await one_request(client, rng, model, results)
            except httpx.HTTPError as error:
                results.outcomes[f"failed {type(error).__name__}"] += 1


def percentiles(values: list[float]) -> str:
    if len(values) < 2:
        return "n/a"
    cuts = statistics.quantiles(values, n=100)
    return f"p50 {cuts[49] * 1000:.0f} ms, p99 {cuts[98] * 1000:.0f} ms ({len(values)} samples)"


async def soak(args: argparse.Namespace) -> None:
    model = httpx.get(f"{args.url}/models", timeout=10).json()["data"][0]["id"]
    metrics_port = urlsplit(args.metrics_url).port
    rss_start = stub_rss_kib(metrics_port)
    results = Results()
    deadline = time.monotonic() + args.duration
    await asyncio.gather(*(client_loop(args.url, model, args.seed + index, deadline, results)
                           for index in range(args.clients)))
    final = wait_for_idle(args.metrics_url)
    rss_end = stub_rss_kib(metrics_port)

    total = sum(results.outcomes.values())
    print(f"{total} requests in {args.duration:.0f} s with {args.clients} clients ({model})")
    for outcome, count in sorted(results.outcomes.items()):
        print(f"  {outcome}: {count}")
    print(f"TTFT: {percentiles(results.ttft_s)}")
    print(f"ITL:  {percentiles(results.itl_s)}")
    for pid in sorted(rss_start.keys() | rss_end.keys()):
        start, end = rss_start.get(pid), rss_end.get(pid)
        print(f"stub {pid} RSS: start {start and start // 1024} MiB, end {end and end // 1024} MiB")
    if not rss_start:
        print(f"stub RSS: no {STUB_NAME} process of the tritonserver on metrics port {metrics_port} found")
    print("engine after idle: " + ", ".join(
        f"{name.removeprefix('tritonllm:')} {final.get(name, float('nan')):.0f}"
        for name in ("tritonllm:num_requests_running", "tritonllm:num_requests_waiting",
                     "tritonllm:kv_cache_free_blocks", "tritonllm:kv_cache_total_blocks")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:9000/v1", help="the OpenAI API root (loopback only)")
    parser.add_argument("--metrics-url", default="http://127.0.0.1:8002/metrics", help="tritonserver's metrics")
    parser.add_argument("--duration", type=float, default=300, help="seconds of load")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for url in (args.url, args.metrics_url):
        if urlsplit(url).hostname not in LOOPBACK:
            parser.error(f"refusing a non-loopback URL: {url}")  # a soak is a load attack on anything else
    asyncio.run(soak(args))


if __name__ == "__main__":
    main()
