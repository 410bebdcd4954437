"""Where an engine step's time goes, in-process (no Triton): decode steps of a batch of greedy sequences under
torch.profiler, grouped by operator, plus ms per step.

    .venv/bin/python bench/engine_profile.py [--model FILE.gguf] [--batch 1,32] [--context 200] [--steps 32]
        [--weight-format auto]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from tritonllm.engine.config import EngineConfig  # noqa: E402
from tritonllm.interface.parameters import SamplingParams  # noqa: E402
from tritonllm.engine.llm_engine import LLMEngine, Request  # noqa: E402
from tritonllm.model_files import prepare_default_model, resolve_model_path  # noqa: E402


def decoding_engine(engine: LLMEngine, batch: int, context: int, steps: int) -> None:
    """Add `batch` requests with prompts of `context` tokens and run until all of them decode."""
    prompt = list(range(1000, 1000 + context))
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(Request(f"p{batch}-{i}", prompt, params))
    while len(engine.core.scheduler.running) < batch or any(
            seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.core.scheduler.running):
        engine.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a GGUF or HF checkpoint (default: the shipped model)")
    parser.add_argument("--batch", default="1,32")
    parser.add_argument("--context", type=int, default=200, help="prompt tokens of each sequence")
    parser.add_argument("--steps", type=int, default=32, help="decode steps profiled")
    parser.add_argument("--weight-format", default="auto")
    parser.add_argument("--rows", type=int, default=15, help="operators listed")
    args = parser.parse_args()
    model = resolve_model_path(args.model) if args.model else prepare_default_model()
    engine = LLMEngine(EngineConfig(model_path=str(model), kv_cache_memory=512 << 20,
                                    max_num_seqs=64, weight_format=args.weight_format))
    print(f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, "
          f"weights {engine.core.runner.weight_format}")
    for batch in map(int, args.batch.split(",")):
        decoding_engine(engine, batch, args.context, args.steps)
        for _ in range(3):  # warm-up
            engine.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            started = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            elapsed = time.perf_counter() - started
        print(f"\nbatch {batch}, context ~{args.context}: {elapsed / args.steps * 1e3:.1f} ms/step, "
              f"{batch * args.steps / elapsed:.1f} tok/s")
        total = sum(event.self_cpu_time_total for event in prof.key_averages())
        print(f"  torch operators {total / args.steps / 1e3:.1f} ms/step (the CPU ops' C calls are not among them)")
        for event in sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:args.rows]:
            print(f"  {event.key:<40} {event.self_cpu_time_total / total * 100:5.1f} %  "
                  f"{event.count / args.steps:6.1f} calls/step")
        engine.abort_all()
        engine.step()


if __name__ == "__main__":
    main()
