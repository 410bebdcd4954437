"""The KV cache's tiers in the engine (in-process, one request at a time, so TTFT is the prefill's time):

1. one long prompt's TTFT: cold, device hit (the same prompt again), storage hit after a restart (a new engine
   on the same storage directory);
2. a multi-turn workload whose working set is `--working-set` times the device pool (each conversation its own
   document, turns round-robin): the cached fraction of prompt tokens and TTFT p50/p90 with no tier, a host tier
   and a storage tier.

    .venv/bin/python bench/kv_tiers.py [--long-prompt 4000] [--conversations 6 --turns 3 --document 1000]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from tritonllm.engine.config import EngineConfig  # noqa: E402
from tritonllm.engine.llm_engine import LLMEngine, Request  # noqa: E402
from tritonllm.interface.parameters import SamplingParams  # noqa: E402
from tritonllm.model_files import prepare_default_model  # noqa: E402

_ids = itertools.count()
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def ask(engine: LLMEngine, prompt: list[int]) -> tuple[float, int, tuple[int, int, int], list[int]]:
    """(TTFT seconds, cached tokens, cached by tier, output tokens) of one request run alone."""
    request = Request(f"bench-{next(_ids)}", prompt, PARAMS)
    started = time.perf_counter()
    engine.add_request(request)
    first, tokens, last = None, [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens += [t for choice in output.choices for t in choice.token_ids]
            if first is None and tokens:
                first = time.perf_counter() - started
            last = output
    return first, last.num_cached_tokens, last.cached_by_tier, tokens


def engine_of(model_dir: Path, args, kv_cache_memory: int, **tiers) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=str(model_dir), weight_format=args.weight_format,
                                  kv_cache_memory=kv_cache_memory, **tiers))


def long_prompt(model_dir: Path, args, storage: Path) -> None:
    engine = engine_of(model_dir, args, args.long_kv_cache_memory, kv_storage_dir=str(storage))
    vocab = engine.vocab_size
    prompt = [(7919 * i) % (vocab - 1000) + 500 for i in range(args.long_prompt)]
    cold = ask(engine, prompt)
    device = ask(engine, prompt)
    engine.shutdown()  # lets the queued writes land
    del engine
    restarted = engine_of(model_dir, args, args.long_kv_cache_memory, kv_storage_dir=str(storage))
    stored = ask(restarted, prompt)
    restarted.shutdown()
    print(f"one {args.long_prompt}-token prompt (TTFT; cached tokens by tier device/host/storage):")
    for name, (ttft, cached, tiers, tokens) in (("cold", cold), ("device hit", device),
                                                ("storage hit after restart", stored)):
        print(f"  {name:26s} {ttft * 1e3:9.1f} ms  ({ttft / cold[0]:.2f}x cold)  cached {cached} {tiers}"
              f"{'' if tokens == cold[3] else '  OUTPUT DIFFERS'}")


def multi_turn(model_dir: Path, args, storage: Path) -> None:
    probe = engine_of(model_dir, args, args.kv_cache_memory)
    pool_tokens = probe.core.block_manager.num_blocks * probe.config.block_size
    bytes_per_block = probe.core.runner.bytes_per_block
    vocab = probe.vocab_size
    probe.shutdown()
    del probe
    document = max(args.document, args.working_set * pool_tokens // args.conversations)
    print(f"\nmulti-turn: {args.conversations} conversations x {args.turns} turns over a {document}-token document "
          f"each; device pool {pool_tokens} tokens (working set {args.conversations * document / pool_tokens:.1f}x)")
    host_bytes = (args.working_set + 1) * args.kv_cache_memory
    for name, tiers in (("no tiers", {}), ("host tier", {"kv_host_memory": host_bytes}),
                        ("storage tier", {"kv_storage_dir": str(storage / "multi-turn")})):
        engine = engine_of(model_dir, args, args.kv_cache_memory, **tiers)
        conversations = [[(997 * (c + 1) * i) % (vocab - 1000) + 500 for i in range(document)]
                         for c in range(args.conversations)]
        ttfts, cached, prompts = [], 0, 0
        for turn in range(args.turns):
            for c, history in enumerate(conversations):
                history += [(31 * (turn + 3) * (c + 5) * i) % (vocab - 1000) + 500 for i in range(24)]  # question
                ttft, hit, _, answer = ask(engine, history)
                if turn > 0:  # the first turn of each conversation is cold whatever the tiers
                    ttfts.append(ttft)
                    cached += hit
                    prompts += len(history)
                history += answer
        engine.shutdown()
        quantiles = statistics.quantiles(ttfts, n=10)
        print(f"  {name:12s} cached fraction {cached / prompts:.2f}  TTFT p50 {statistics.median(ttfts) * 1e3:8.1f} ms"
              f"  p90 {quantiles[8] * 1e3:8.1f} ms  (turns 2..{args.turns}; {bytes_per_block} bytes a block)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weight-format", default="int4")
    parser.add_argument("--kv-cache-memory", type=int, default=96 << 20, help="the multi-turn workload's pool")
    parser.add_argument("--long-kv-cache-memory", type=int, default=320 << 20, help="the long prompt's pool")
    parser.add_argument("--long-prompt", type=int, default=4000)
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--document", type=int, default=1000)
    parser.add_argument("--working-set", type=int, default=3, help="conversations' tokens / device pool's")
    parser.add_argument("--skip-long", action="store_true")
    parser.add_argument("--skip-multi-turn", action="store_true")
    args = parser.parse_args()
    model_dir = prepare_default_model()
    with tempfile.TemporaryDirectory() as folder:
        if not args.skip_long:
            long_prompt(model_dir, args, Path(folder) / "long")
        if not args.skip_multi_turn:
            multi_turn(model_dir, args, Path(folder))


if __name__ == "__main__":
    main()
