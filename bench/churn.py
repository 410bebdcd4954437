"""Churn against a running stack: short requests at high concurrency, mixed streamed / not, n = 1 or 2, a third
of the streams dropped after their first chunk (the workload of tests/test_stack_churn.py).

    .venv/bin/python bench/churn.py [--url http://127.0.0.1:9000/v1] [--requests 1500] [--concurrency 64]

Prints requests by outcome (ok, dropped, shed = 503 from admission control, failed) and the seconds taken."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from churn import run_churn  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:9000/v1", help="the OpenAI API root")
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = httpx.get(f"{args.url}/models", timeout=10).json()["data"][0]["id"]
    result = asyncio.run(run_churn(args.url, model, requests=args.requests, concurrency=args.concurrency,
                                   seed=args.seed))
    print(result.summary())
    for failure in result.failures[:10]:
        print("  failed:", failure)


if __name__ == "__main__":
    main()
