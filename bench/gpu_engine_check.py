"""CUDA check of the engine (no custom kernels yet): our forward pass in float32 and bfloat16 against
transformers, greedy agreement bf16 vs fp32, and decode throughput at batch 1 and 64.

    python bench/gpu_engine_check.py --model-dir DIR        # any HF Llama directory
    python bench/gpu_engine_check.py --random-from CONFIG_DIR  # random weights shaped by CONFIG_DIR/config.json

The random option exists for machines that cannot receive the default model's weights; throughput does not
depend on the weights' values, and logits are still compared against transformers on the same weights."""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.llm_engine import LLMEngine
from tritonllm.interface.parameters import SamplingParams
from tritonllm.engine.llm_engine import Request

PROMPTS = ["The capital of France is", "def quicksort(items):", "Once upon a time, in a quiet village,"]


def random_checkpoint(config_dir: Path) -> Path:
    out = Path(tempfile.mkdtemp(prefix="random-llama-"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
    model.save_pretrained(out)
    for name in config_dir.iterdir():
        if name.name.startswith("tokenizer") or name.suffix == ".jinja":
            shutil.copy(name, out / name.name)
    return out


def engine_logits(engine: LLMEngine, prompt: str) -> torch.Tensor:
    """Logits of the first generated position, taken from the engine's own runner."""
    captured = {}
    sampler = engine.core.sampler

    def capture(logits, seqs):
        captured["logits"] = logits.float().cpu()
        return sampler(logits, seqs)

    engine.core.sampler = capture
    request = Request(f"logits-{time.monotonic()}", prompt, SamplingParams(max_tokens=1, temperature=0))
    engine.add_request(request)
    while engine.has_work():
        engine.step()
    engine.core.sampler = sampler
    return captured["logits"][0]


def greedy(engine: LLMEngine, prompt: str, tokens: int) -> list[int]:
    request = Request(f"greedy-{time.monotonic()}", prompt, SamplingParams(max_tokens=tokens, temperature=0,
                                                                           ignore_eos=True))
    engine.add_request(request)
    while engine.has_work():
        engine.step()
    return request.sequences[0].output_token_ids


def decode_rate(engine: LLMEngine, batch: int, tokens: int = 128) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.7, ignore_eos=True)
    for i in range(batch):
        engine.add_request(Request(f"rate-{batch}-{i}-{time.monotonic()}", PROMPTS[i % len(PROMPTS)], params))
    engine.step()  # prefill
    torch.cuda.synchronize()
    start, steps = time.perf_counter(), 0
    while engine.has_work():
        engine.step()
        steps += 1
    torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--model-dir", type=Path)
    group.add_argument("--random-from", type=Path)
    args = parser.parse_args()
    model_dir = args.model_dir or random_checkpoint(args.random_from)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, model {model_dir}")

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engines = {dtype: LLMEngine(EngineConfig(model_path=str(model_dir), dtype=dtype, kv_cache_memory=4 << 30))
               for dtype in ("float32", "bfloat16")}
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)], device="cuda")
        with torch.no_grad():
            reference = hf(ids).logits[0, -1].float().cpu()
        for dtype, engine in engines.items():
            ours = engine_logits(engine, prompt)
            print(f"{dtype:>8} logits vs transformers fp32: max abs diff {(ours - reference).abs().max():.2e} "
                  f"(logit range {reference.abs().max():.1f}), same argmax {bool(ours.argmax() == reference.argmax())}"
                  f"  [{prompt!r}]")
    for prompt in PROMPTS:
        fp32, bf16 = (greedy(engines[d], prompt, 32) for d in ("float32", "bfloat16"))
        same = next((i for i, (a, b) in enumerate(zip(fp32, bf16)) if a != b), len(fp32))
        print(f"greedy bf16 vs fp32: first {same} of 32 tokens identical  [{prompt!r}]")
    del engines["float32"]
    torch.cuda.empty_cache()
    for batch in (1, 64):
        decode_rate(engines["bfloat16"], batch, tokens=16)  # warm-up
        print(f"bf16 decode, batch {batch}: {decode_rate(engines['bfloat16'], batch):.0f} tokens/s")


if __name__ == "__main__":
    main()
