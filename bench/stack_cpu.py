"""Where the stack's CPU goes while it streams: CPU seconds per output token of each process (the Triton stub, its
busiest threads, tritonserver, the OpenAI adapter, this load generator) over one run of N streams.

    .venv/bin/python bench/stack_cpu.py [--streams 32] [--weight-format auto] [--stream-interval 1]

On a small CPU host every process of the stack shares the cores with the engine's thread team: what the others
spend per token is what the engine loses (bench/peers.py measures the rates; this says where the rest goes)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from tritonllm.model_files import prepare_default_model  # noqa: E402
from stack_helpers import running_stack  # noqa: E402
from throughput import median_ms, streaming_run  # noqa: E402

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def thread_ticks() -> dict[tuple[int, int], int]:
    """CPU ticks (user + system) of every thread on the machine, by (process, thread)."""
    ticks = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                fields = stat[stat.rindex(")") + 2:].split()
                ticks[int(pid), int(tid)] = int(fields[11]) + int(fields[12])
        except (OSError, ValueError):  # gone meanwhile
            continue
    return ticks


def process_name(pid: int) -> str:
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    command = " ".join(word.decode(errors="replace") for word in words if word)
    for marker, name in (("triton_python_backend_stub", "Triton Python-backend stub (the engine)"),
                         ("bin/tritonserver", "tritonserver"), ("tritonllm serve", "tritonllm serve (OpenAI adapter)")):
        if marker in command:
            return name
    return "this load generator" if pid == os.getpid() else command[:60]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--weight-format", default="auto")
    parser.add_argument("--stream-interval", type=int, default=1, help="the stack's --stream-interval")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as state, running_stack(
            prepare_default_model(), Path(state), "--weight-format", args.weight_format,
            "--max-num-seqs", str(args.streams), "--kv-cache-memory", "1GiB", "--stream-interval",
            str(args.stream_interval)) as process:
        url, model = process.stack.base_url, process.stack.model_name
        asyncio.run(streaming_run(url, model, 1, 1, 8))  # warm-up
        before, started = thread_ticks(), time.monotonic()
        run = asyncio.run(streaming_run(url, model, args.streams, args.requests_per_stream, args.tokens))
        wall, after = time.monotonic() - started, thread_ticks()
        names = {pid: process_name(pid) for pid, _ in after}  # while the stack still runs
    used = {key: ticks - before.get(key, 0) for key, ticks in after.items() if ticks > before.get(key, 0)}
    by_process: dict[int, int] = {}
    for (pid, _), ticks in used.items():
        by_process[pid] = by_process.get(pid, 0) + ticks
    print(f"{args.streams} streams: {run.tokens} tokens in {wall:.1f} s ({run.rate:.1f} tok/s, ITL p50 "
          f"{median_ms(run.itl):.1f} ms, {run.errors} errors)\n")
    print(f"{'process':<42} {'CPU s':>7} {'ms/token':>9} {'% of a core':>12}")
    for pid, ticks in sorted(by_process.items(), key=lambda item: -item[1])[:6]:
        seconds = ticks / TICKS_PER_S
        print(f"{names[pid]:<42} {seconds:>7.2f} {seconds / run.tokens * 1e3:>9.3f} {seconds / wall:>12.0%}")
        if names[pid].startswith("Triton Python-backend stub"):
            threads = sorted((t for (p, _), t in used.items() if p == pid), reverse=True)[:3]
            print("  its busiest threads (the core and its OpenMP worker, then the responder): "
                  + ", ".join(f"{t / TICKS_PER_S / run.tokens * 1e3:.3f}" for t in threads) + " ms/token")


if __name__ == "__main__":
    main()
