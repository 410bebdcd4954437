"""The KV cache's tiers in the engine (in-process):

1. one long prompt's TTFT, run alone (TTFT is the prefill's time): cold, device hit (the same prompt again), host
   hit (evicted from the device pool to host memory by another prompt as long) and storage hit after a restart
   (a new engine on the same storage directory);
2. a multi-turn workload whose working set is `--working-set` times the device pool (each conversation its own
   document, turns round-robin): the cached fraction of prompt tokens, TTFT p50/p90 and step time p50/p99 with no
   tier, a host tier and a storage tier; `--concurrent` runs each turn's requests of all conversations at once
   (a storage read then overlaps the other requests' steps: the step time says whether they waited for it);
3. `--gateway`: two stacks behind the SMG gateway (`tritonllm scale-out`, real processes, chat through the openai
   SDK), multi-turn conversations: the cached fraction of prompt tokens (turns 2..) with random routing and no
   storage tier, random routing and one storage directory shared by the stacks, and cache-aware routing.

    .venv/bin/python bench/kv_tiers.py [--long-prompt 4000] [--conversations 6 --turns 3 --document 1000]
    .venv/bin/python bench/kv_tiers.py --gateway [--conversations 6 --turns 3 --document 300]
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from tritonllm.engine.config import EngineConfig  # noqa: E402
from tritonllm.engine.core import kv_tiers  # noqa: E402
from tritonllm.engine.llm_engine import LLMEngine, Request  # noqa: E402
from tritonllm.interface.parameters import SamplingParams  # noqa: E402
from tritonllm.model_files import prepare_default_model  # noqa: E402

_ids = itertools.count()
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@dataclass
class Answer:
    ttft: float  # seconds from submission
    cached: int
    tiers: tuple[int, int, int]  # cached tokens by tier: device, host, storage
    tokens: list[int]


def serve(engine: LLMEngine, prompts: list[list[int]], step_times: list[float] | None = None) -> list[Answer]:
    """Submit the prompts at once and step until every one is answered; each step's time goes to step_times."""
    started = time.perf_counter()
    answers = {}
    for prompt in prompts:
        request_id = f"bench-{next(_ids)}"
        engine.add_request(Request(request_id, prompt, PARAMS))
        answers[request_id] = Answer(0.0, 0, (0, 0, 0), [])
    while engine.has_unfinished_requests():
        if not engine.has_work():  # only storage reads to wait for (the core loop sleeps then too)
            time.sleep(0.001)
            continue
        step_started = time.perf_counter()
        outputs = engine.step()
        if step_times is not None:
            step_times.append(time.perf_counter() - step_started)
        for output in outputs:
            answer = answers[output.request_id]
            tokens = [t for choice in output.choices for t in choice.token_ids]
            if tokens and not answer.tokens:
                answer.ttft = time.perf_counter() - started
            answer.tokens += tokens
            answer.cached, answer.tiers = output.num_cached_tokens, output.cached_by_tier
    return list(answers.values())


def engine_of(model_dir: Path, args, kv_cache_memory: int, **tiers) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=str(model_dir), weight_format=args.weight_format,
                                  kv_cache_memory=kv_cache_memory, **tiers))


def pool_geometry(model_dir: Path, args) -> tuple[int, int, int]:
    """(block size, bytes a block, vocabulary size) of the engine the settings make."""
    probe = engine_of(model_dir, args, args.kv_cache_memory)
    geometry = probe.config.block_size, probe.core.runner.bytes_per_block, probe.vocab_size
    probe.shutdown()
    return geometry


def long_prompt(model_dir: Path, args, storage: Path) -> None:
    block_size, bytes_per_block, vocab = pool_geometry(model_dir, args)
    # a device pool that holds one long prompt (and its answer): the next one evicts it whole, to host memory
    pool = -(-(args.long_prompt + PARAMS.max_tokens) // block_size) * bytes_per_block
    engine = engine_of(model_dir, args, pool, kv_host_memory=2 * pool, kv_storage_dir=str(storage))
    prompt = [(7919 * i) % (vocab - 1000) + 500 for i in range(args.long_prompt)]
    other = [(7907 * i + 13) % (vocab - 1000) + 500 for i in range(args.long_prompt)]
    serve(engine, [other])  # (warms up too)
    [cold] = serve(engine, [prompt])
    [device] = serve(engine, [prompt])
    serve(engine, [other])  # from host memory into the device pool: the prompt's blocks go to host memory
    [host] = serve(engine, [prompt])
    engine.shutdown()  # lets the queued writes land
    del engine
    restarted = engine_of(model_dir, args, pool, kv_storage_dir=str(storage))
    serve(restarted, [prompt[:block_size][::-1]])  # warms up (a prompt storage does not hold)
    [stored] = serve(restarted, [prompt])
    restarted.shutdown()
    print(f"one {args.long_prompt}-token prompt (TTFT; cached tokens by tier device/host/storage):")
    for name, answer in (("cold", cold), ("device hit", device), ("host hit", host),
                         ("storage hit after restart", stored)):
        print(f"  {name:26s} {answer.ttft * 1e3:9.1f} ms  ({answer.ttft / cold.ttft:.2f}x cold)  cached "
              f"{answer.cached} {answer.tiers}{'' if answer.tokens == cold.tokens else '  OUTPUT DIFFERS'}")


def multi_turn(model_dir: Path, args, storage: Path) -> None:
    block_size, bytes_per_block, vocab = pool_geometry(model_dir, args)
    pool_tokens = args.kv_cache_memory // bytes_per_block * block_size
    document = max(args.document, args.working_set * pool_tokens // args.conversations)
    print(f"\nmulti-turn: {args.conversations} conversations x {args.turns} turns over a {document}-token document "
          f"each, {'all conversations at once' if args.concurrent else 'one request at a time'}; device pool "
          f"{pool_tokens} tokens (working set {args.conversations * document / pool_tokens:.1f}x)")
    host_bytes = (args.working_set + 1) * args.kv_cache_memory
    for name, tiers in (("no tiers", {}), ("host tier", {"kv_host_memory": host_bytes}),
                        ("storage tier", {"kv_storage_dir": str(storage / "multi-turn")})):
        if name.split()[0] not in args.tiers.split(","):
            continue
        engine = engine_of(model_dir, args, args.kv_cache_memory, **tiers)
        conversations = [[(997 * (c + 1) * i) % (vocab - 1000) + 500 for i in range(document)]
                         for c in range(args.conversations)]
        ttfts, cached, prompts, step_times = [], 0, 0, []
        for turn in range(args.turns):
            for c, history in enumerate(conversations):
                history += [(31 * (turn + 3) * (c + 5) * i) % (vocab - 1000) + 500 for i in range(24)]  # question
            batches = [conversations] if args.concurrent else [[history] for history in conversations]
            answers = [answer for batch in batches for answer in serve(engine, batch, step_times)]
            for history, answer in zip(conversations, answers):
                if turn > 0:  # the first turn of each conversation is cold whatever the tiers
                    ttfts.append(answer.ttft)
                    cached += answer.cached
                    prompts += len(history)
                history += answer.tokens
        engine.shutdown()
        quantiles = statistics.quantiles(ttfts, n=10)
        steps = statistics.quantiles(step_times, n=100)
        print(f"  {name:12s} cached fraction {cached / prompts:.2f}  TTFT p50 {statistics.median(ttfts) * 1e3:8.1f} ms"
              f"  p90 {quantiles[8] * 1e3:8.1f} ms  step p50 {statistics.median(step_times) * 1e3:7.1f} ms"
              f"  p99 {steps[98] * 1e3:7.1f} ms  ({len(step_times)} steps; turns 2..{args.turns} for TTFT; "
              f"{bytes_per_block} bytes a block)")


def gateway(model_dir: Path, args, folder: Path) -> None:
    import openai

    words = "the of and to in is was for on that with as by at from his her it an be are this which or".split()
    print(f"\ntwo stacks behind the SMG gateway: {args.conversations} conversations x {args.turns} turns over a "
          f"{args.document}-word document each, one request at a time")
    for name, policy, storage in (("random, no storage", "random", None),
                                  ("random, shared storage", "random", folder / "shared"),
                                  ("cache_aware, no storage", "cache_aware", None)):
        base = random.Random().randrange(20000, 60000, 100)
        port, state = base + 90, folder / f"state-{policy}-{storage is not None}"
        state.mkdir()
        command = [sys.executable, "-m", "tritonllm", "scale-out", "--stacks", "2", "--model", str(model_dir),
                   "--weight-format", args.weight_format, "--policy", policy, "--port", str(port),
                   "--gateway-metrics-port", str(base + 91), "--first-stack-port", str(base), "--state-dir",
                   str(state), "--kv-cache-memory", str(args.kv_cache_memory)]
        if storage is not None:
            command += ["--kv-storage-dir", str(storage)]
        log_path = state / "scale-out.log"
        with open(log_path, "wb") as log:
            fleet = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            started = time.monotonic()
            while "ready in" not in log_path.read_text(errors="replace"):
                if fleet.poll() is not None or time.monotonic() - started > 1200:
                    raise RuntimeError(f"scale-out did not start:\n{log_path.read_text(errors='replace')[-3000:]}")
                time.sleep(1)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=1200)
            model = client.models.list().data[0].id
            texts = random.Random(7)
            conversations = [[{"role": "system", "content": " ".join(texts.choice(words) + str(texts.randrange(99))
                                                                      for _ in range(args.document))}]
                             for _ in range(args.conversations)]
            cached = prompts = 0
            for turn in range(args.turns):
                for c, messages in enumerate(conversations):
                    messages.append({"role": "user", "content": f"question {turn} of conversation {c}: and then?"})
                    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                                           temperature=0.0)
                    messages.append({"role": "assistant", "content": reply.choices[0].message.content})
                    if turn > 0:
                        details = reply.usage.prompt_tokens_details
                        cached += details.cached_tokens if details else 0
                        prompts += reply.usage.prompt_tokens
            print(f"  {name:24s} cached fraction {cached / prompts:.2f}  ({prompts} prompt tokens in turns "
                  f"2..{args.turns})")
        finally:
            fleet.send_signal(signal.SIGTERM)
            fleet.wait(120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weight-format", default="int4")
    parser.add_argument("--kv-cache-memory", type=int, default=96 << 20, help="the multi-turn workload's pool")
    parser.add_argument("--long-prompt", type=int, default=4000)
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--document", type=int, default=1000)
    parser.add_argument("--working-set", type=int, default=3, help="conversations' tokens / device pool's")
    parser.add_argument("--concurrent", action="store_true", help="each turn's requests at once")
    parser.add_argument("--tiers", default="no,host,storage", help="the multi-turn workload's tier settings to run")
    parser.add_argument("--read-delay", type=float, default=0.0,
                        help="seconds each storage block file takes to read (a slow disk, simulated)")
    parser.add_argument("--skip-long", action="store_true")
    parser.add_argument("--skip-multi-turn", action="store_true")
    parser.add_argument("--gateway", action="store_true", help="only the two stacks behind the SMG gateway")
    args = parser.parse_args()
    model_dir = prepare_default_model()
    if args.read_delay:
        read_block_file = kv_tiers.read_block_file
        kv_tiers.read_block_file = lambda path: time.sleep(args.read_delay) or read_block_file(path)
    print(f"load average {' '.join(f'{load:.1f}' for load in os.getloadavg())} on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as folder:
        if args.gateway:
            gateway(model_dir, args, Path(folder))
            return
        if not args.skip_long:
            long_prompt(model_dir, args, Path(folder) / "long")
        if not args.skip_multi_turn:
            multi_turn(model_dir, args, Path(folder))


if __name__ == "__main__":
    main()
