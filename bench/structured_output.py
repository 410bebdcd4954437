"""Cost of constrained decoding in the engine: the per-step token mask, and decoding speed with and without a grammar.

    .venv/bin/python bench/structured_output.py [--model DIR] [--batch-sizes 1,8,32] [--tokens 64]

1. Mask cost: for B sequences mid-way through a JSON schema, the time to fill their bitmasks (llguidance) and to
   apply them to [B, vocab] logits, in microseconds per sequence.
2. Decoding: B requests of `--tokens` tokens each, greedy, run in-process with a JSON schema whose long string
   field (minLength 1000 characters) keeps every request going to max_tokens, beside the same requests unconstrained (the baseline): tokens/s
   and the ratio. Grammar compile time is excluded (the schema is compiled once before timing)."""

from __future__ import annotations

import argparse
import json
import time

import torch
from tqdm import tqdm

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.llm_engine import LLMEngine
from tritonllm.interface.parameters import SamplingParams
from tritonllm.engine.llm_engine import Request
from tritonllm.model_files import prepare_default_model
from tritonllm.kernels import apply_token_bitmask

SCHEMA = json.dumps({"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                                      "story": {"type": "string", "minLength": 1000}},
                     "required": ["title", "story"], "additionalProperties": False})
PREFIX = '{"title":"A tale","story":"Once upon a time'


def mask_cost(engine: LLMEngine, batch: int, repeats: int) -> tuple[float, float]:
    """(fill, apply) microseconds per sequence, for matchers inside a JSON string."""
    template = engine.parts.grammars.compile("json_schema", SCHEMA, on_done=lambda: None).result()
    matchers = []
    for _ in range(batch):
        matcher = template.deep_copy()
        assert matcher.consume_tokens(engine.tokenizer.encode(PREFIX, add_special_tokens=False))
        matchers.append(matcher)
    logits = torch.randn(batch, engine.vocab_size)
    apply_token_bitmask(logits, engine.core.sampler.bitmasks.fill(matchers))  # warm-up
    fill = apply = 0.0
    for _ in range(repeats):
        started = time.perf_counter()
        bitmask = engine.core.sampler.bitmasks.fill(matchers)
        filled = time.perf_counter()
        apply_token_bitmask(logits, bitmask)
        fill += filled - started
        apply += time.perf_counter() - filled
    scale = 1e6 / (repeats * batch)
    return fill * scale, apply * scale


def decode(engine: LLMEngine, batch: int, tokens: int, constrained: bool, label: str) -> float:
    """Output tokens per second for `batch` concurrent greedy requests of `tokens` tokens."""
    extra = {"json_schema": SCHEMA} if constrained else {}
    for index in range(batch):
        engine.add_request(Request(f"{label}-{index}", f"Story number {index}:",
                                   SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, **extra)))
    started, first = time.perf_counter(), engine.core.num_generated_tokens
    with tqdm(total=batch * tokens, desc=label, leave=False) as progress:
        while engine.has_unfinished_requests():
            before = engine.core.num_generated_tokens
            engine.step()
            progress.update(engine.core.num_generated_tokens - before)
    produced = engine.core.num_generated_tokens - first
    assert produced == batch * tokens, "every request should have reached max_tokens"
    return produced / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF model directory (default: the prepared SmolLM2)")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    model = args.model or str(prepare_default_model())
    engine = LLMEngine(EngineConfig(model_path=model, max_num_seqs=64))
    sizes = [int(size) for size in args.batch_sizes.split(",")]

    print("mask cost (JSON schema, inside a string), microseconds per sequence per step")
    print(f"{'batch':>6} {'fill':>8} {'apply':>8}")
    for batch in sizes:
        fill, apply = mask_cost(engine, batch, repeats=50)
        print(f"{batch:>6} {fill:8.1f} {apply:8.1f}")

    decode(engine, 1, 4, constrained=True, label="warm-up")  # compiles the schema once
    print(f"\ndecoding {args.tokens} tokens per request, greedy; baseline = the same requests unconstrained")
    print(f"{'batch':>6} {'plain tok/s':>12} {'json tok/s':>11} {'ratio':>6}")
    for batch in sizes:
        plain = decode(engine, batch, args.tokens, constrained=False, label=f"plain x{batch}")
        constrained = decode(engine, batch, args.tokens, constrained=True, label=f"json x{batch}")
        print(f"{batch:>6} {plain:12.1f} {constrained:11.1f} {constrained / plain:6.2f}")


if __name__ == "__main__":
    main()
