"""One run, one machine: the whole stack (OpenAI adapter → Triton → engine) at 1 and N streams, the engine
in-process at batch 1 and N, and transformers `generate` one request at a time — with the ratios between them.

    .venv/bin/python bench/throughput.py [--streams 1,32] [--tokens 128] [--weight-format auto]
        [--url http://HOST:PORT/v1]   # a running stack instead of starting one

Every client streams (temperature 0.7, ignore_eos, `--tokens` tokens per request). The stack is started here
(`tritonllm serve` on free ports) and stopped before the in-process runs, so they do not share the cores."""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from tritonllm.engine.config import EngineConfig  # noqa: E402
from tritonllm.interface.parameters import SamplingParams  # noqa: E402
from tritonllm.engine.llm_engine import LLMEngine, Request  # noqa: E402
from tritonllm.model_files import prepare_default_model  # noqa: E402
from stack_helpers import running_stack  # noqa: E402

TOPICS = ["the history of Rome", "how vaccines work", "a trip to Japan", "the rules of chess", "black holes",
          "baking sourdough bread", "the French revolution", "machine learning", "coral reefs", "jazz music",
          "the water cycle", "medieval castles", "electric cars", "the Silk Road", "volcanoes", "honey bees"]


def make_prompts(count: int) -> list[str]:
    """Deterministic prompts of varied lengths (about 10 to 120 tokens)."""
    prompts = []
    for i in range(count):
        context = " ".join(f"Fact {j}: {TOPICS[(i + j) % len(TOPICS)]} is a fascinating subject." for j in range(i % 9))
        prompts.append(f"{context} Write a short essay about {TOPICS[i % len(TOPICS)]}.".strip())
    return prompts


@dataclass
class Run:
    """One measurement: output tokens over wall time, with per-request first-token and inter-token times."""

    tokens: int = 0
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    errors: int = 0  # requests that failed or returned other than the tokens asked for

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")

    @property
    def decode_rate(self) -> float:
        """Tokens per second of one stream once its first token is out (1 / mean ITL)."""
        return len(self.itl) / sum(self.itl) if self.itl else float("nan")


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3 if values else float("nan")


async def _stream(client: httpx.AsyncClient, url: str, model: str, prompt: str, tokens: int, run: Run) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.7, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    async with client.stream("POST", f"{url}/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk["choices"] and chunk["choices"][0]["text"]:
                if run.ttft:
                    run.itl.append(now - last)
                else:
                    run.ttft.append(now - start)
                last = now
            if chunk.get("usage"):
                run.tokens += chunk["usage"]["completion_tokens"]


async def streaming_run(url: str, model: str, streams: int, requests_per_stream: int, tokens: int,
                        label: str = "stack") -> Run:
    """`streams` clients of an OpenAI completions API, each sending requests_per_stream requests one after the
    other (the load generator of this file and of bench/peers.py)."""
    run = Run()
    prompts = make_prompts(streams * requests_per_stream)
    progress = tqdm(total=len(prompts), desc=f"{label}, {streams} streams", leave=False)
    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=streams + 4)) as client:
        async def client_loop(index: int) -> None:
            for prompt in prompts[index::streams]:
                per_request = Run()
                try:
                    await _stream(client, url, model, prompt, tokens, per_request)
                except httpx.HTTPError as error:
                    progress.write(f"{label}: request failed: {error!r}")
                    per_request.errors = 1
                if per_request.tokens != tokens or not per_request.ttft:  # no text: tokens that decode to nothing
                    per_request.errors = 1
                run.errors += per_request.errors
                run.tokens += per_request.tokens
                run.ttft += per_request.ttft
                run.itl += per_request.itl
                progress.update()

        started = time.perf_counter()
        await asyncio.gather(*(client_loop(i) for i in range(streams)))
        run.seconds = time.perf_counter() - started
    progress.close()
    return run


def engine_run(engine: LLMEngine, batch: int, tokens: int) -> Run:
    """`batch` requests at once, in-process: each one's TTFT from then to the step that gives it its first token
    (as the streaming clients measure theirs); ITL is the time per step once tokens come out."""
    run = Run()
    params = SamplingParams(max_tokens=tokens, temperature=0.7, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(batch)):
        engine.add_request(Request(f"bench-{batch}-{i}", prompt, params))
    started = last = time.perf_counter()
    answered: set[str] = set()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        produced = sum(len(c.token_ids) for o in outputs for c in o.choices)
        if produced and run.tokens:
            run.itl.append(now - last)
        for output in outputs:
            if output.request_id not in answered and any(c.token_ids for c in output.choices):
                answered.add(output.request_id)
                run.ttft.append(now - started)
        run.tokens += produced
        last = now
    run.seconds = time.perf_counter() - started
    return run


def generate_run(model_dir: Path, requests: int, tokens: int) -> Run:
    """transformers generate, one request at a time, sampling like the others."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    run = Run()
    started = time.perf_counter()
    for prompt in tqdm(make_prompts(requests), desc="transformers generate", leave=False):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True, temperature=0.7,
                                 top_k=0, pad_token_id=tokenizer.eos_token_id)
        run.tokens += out.shape[1] - ids.shape[1]
    run.seconds = time.perf_counter() - started
    return run


def cpu_description() -> str:
    model, flags = platform.processor(), ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        model = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
        present = set(next(line for line in info.splitlines() if line.startswith("flags")).split(":", 1)[1].split())
        flags = " ".join(sorted(f for f in present if f.startswith(("avx", "amx", "fma"))))
    except (OSError, StopIteration):
        pass
    return f"{model} ({torch.get_num_threads()} torch threads; {flags}; torch {torch.__version__}, " \
           f"{torch.backends.cpu.get_cpu_capability()})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running stack's OpenAI API root (default: start one here)")
    parser.add_argument("--streams", default="1,32", help="concurrent streams / in-process batch sizes")
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--weight-format", default="auto")
    parser.add_argument("--generate-requests", type=int, default=2, help="transformers generate requests")
    args = parser.parse_args()
    levels = [int(n) for n in args.streams.split(",")]
    model_dir = prepare_default_model()
    print(f"CPU: {cpu_description()}")

    stack: dict[int, Run] = {}
    if args.url:
        model = httpx.get(f"{args.url}/models", timeout=10).json()["data"][0]["id"]
        stack = {n: asyncio.run(streaming_run(args.url, model, n, args.requests_per_stream, args.tokens))
                 for n in levels}
    else:
        with tempfile.TemporaryDirectory() as state, running_stack(
                model_dir, Path(state), "--weight-format", args.weight_format, "--max-num-seqs", str(max(levels)),
                "--kv-cache-memory", "1GiB") as process:
            url, model = process.stack.base_url, process.stack.model_name
            asyncio.run(streaming_run(url, model, 1, 1, 8))  # warm-up
            stack = {n: asyncio.run(streaming_run(url, model, n, args.requests_per_stream, args.tokens))
                     for n in levels}

    engine = LLMEngine(EngineConfig(model_path=str(model_dir), weight_format=args.weight_format,
                                    max_num_seqs=max(levels)))
    engine_run(engine, 1, 8)  # warm-up
    in_process = {n: engine_run(engine, n, args.tokens) for n in levels}
    print(f"weights: {engine.core.runner.weight_format}")
    del engine
    generate = generate_run(model_dir, args.generate_requests, args.tokens)

    print(f"\n{args.tokens} tokens per request, temperature 0.7, streaming clients")
    print(f"{'':<28} {'tok/s':>8} {'per stream':>11} {'TTFT p50':>9} {'ITL p50':>8} {'errors':>7}")
    for n in levels:
        for name, run in ((f"stack, {n} streams", stack[n]), (f"in-process, batch {n}", in_process[n])):
            print(f"{name:<28} {run.rate:>8.1f} {run.rate / n:>11.1f} {median_ms(run.ttft):>7.0f}ms "
                  f"{median_ms(run.itl):>6.1f}ms {run.errors:>7}")
    print(f"{'transformers generate':<28} {generate.rate:>8.1f} {generate.rate:>11.1f}")
    print("\nratios")
    for n in levels:
        print(f"  stack {n} streams / generate one at a time: {stack[n].rate / generate.rate:.2f}x"
              f"   stack / in-process at {n}: {stack[n].rate / in_process[n].rate:.0%}")
    added = median_ms(stack[levels[0]].itl) - median_ms(in_process[levels[0]].itl)
    print(f"  serving adds {added:.1f} ms per token at {levels[0]} stream(s) (ITL p50, stack − in-process)")


if __name__ == "__main__":
    main()
