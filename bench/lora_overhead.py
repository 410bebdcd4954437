"""LoRA overhead in the engine: decode throughput of a batch on the base model vs the same batch where every
sequence uses one of two random rank-8 adapters (all seven projections), plus the max |Δlogit| of an adapter
against transformers with the adapter merged into its weights.

    .venv/bin/python bench/lora_overhead.py [--batch 8] [--tokens 32]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from tritonllm.engine.config import EngineConfig  # noqa: E402
from tritonllm.engine.llm_engine import LLMEngine  # noqa: E402
from tritonllm.interface.parameters import SamplingParams  # noqa: E402
from tritonllm.engine.llm_engine import Request  # noqa: E402
from tritonllm.model_files import prepare_default_model  # noqa: E402
from engine_helpers import generate  # noqa: E402
from lora_helpers import merged_model, write_random_adapter  # noqa: E402


def tokens_per_second(engine: LLMEngine, batch: int, tokens: int, adapters: list[str | None]) -> float:
    params = [SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                             lora_path=adapters[i % len(adapters)]) for i in range(batch)]
    prompts = [f"Story number {i}: once upon a time" for i in range(batch)]
    generate(engine, prompts, params)  # warm up (loads the adapters into their slots)
    started = time.perf_counter()
    generate(engine, prompts, params)
    return batch * tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    model_dir = prepare_default_model()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        for seed, name in enumerate(("a", "b"), start=1):
            write_random_adapter(root / name, model_dir, seed=seed)
        engine = LLMEngine(EngineConfig(model_path=str(model_dir), kv_cache_memory=64 << 20, lora_dir=str(root),
                                        max_loras=2, max_lora_rank=8))
        base = tokens_per_second(engine, args.batch, args.tokens, [None])
        lora = tokens_per_second(engine, args.batch, args.tokens, ["a", "b"])
        print(f"batch {args.batch}, {args.tokens} tokens each, device {engine.core.runner.device}:")
        print(f"  base model      {base:8.1f} tokens/s")
        print(f"  two adapters    {lora:8.1f} tokens/s  (slowdown x{base / lora:.2f})")

        prompt_ids = engine.tokenizer.encode("The capital of France is")
        engine.add_request(Request("logits", prompt_ids, SamplingParams(max_tokens=1, lora_path="a")))
        ours = engine.core.runner.execute(engine.core.scheduler.schedule()).logits[0]
        with torch.no_grad():
            expected = merged_model(model_dir, root / "a")(torch.tensor([prompt_ids])).logits[0, -1]
        print(f"  max |Δlogit| vs merged-weights reference: {(ours - expected).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
