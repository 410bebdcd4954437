"""Throughput and latency of a running tritonllm stack, beside transformers `generate` on the same prompts.

Start the stack first (`make serve`), then:  .venv/bin/python bench/throughput.py [--concurrency 1,4,16,32,64]

For each concurrency N, N streaming clients send the fixed prompt set through the OpenAI adapter; the script
reports output tokens/s, time to first token and inter-token latency (p50/p99). At N=1 it also measures the
same through tritonclient's gRPC stream directly (no adapter). The baseline runs transformers' generate in
this process on the same prompts and max_tokens: one at a time, and batched N at a time; ratios are printed."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
import torch
import tritonclient.grpc.aio as grpcaio
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from backend.model_files import resolve_model_path

TOPICS = ["the history of Rome", "how vaccines work", "a trip to Japan", "the rules of chess", "black holes",
          "baking sourdough bread", "the French revolution", "machine learning", "coral reefs", "jazz music",
          "the water cycle", "medieval castles", "electric cars", "the Silk Road", "volcanoes", "honey bees"]


def make_prompts(count: int) -> list[str]:
    """Deterministic prompts of varied lengths (about 10 to 120 tokens)."""
    prompts = []
    for i in range(count):
        topic = TOPICS[i % len(TOPICS)]
        context = " ".join(f"Fact {j}: {TOPICS[(i + j) % len(TOPICS)]} is a fascinating subject." for j in range(i % 9))
        prompts.append(f"{context} Write a short essay about {topic}.".strip())
    return prompts


@dataclass
class Timing:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tokens: int = 0


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


async def adapter_stream(client: httpx.AsyncClient, base_url: str, model: str, prompt: str, max_tokens: int,
                         timing: Timing) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.7, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    first = True
    async with client.stream("POST", f"{base_url}/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk["choices"] and chunk["choices"][0]["text"]:
                (timing.ttft if first else timing.itl).append(now - (start if first else last))
                first, last = False, now
            if chunk.get("usage"):
                timing.tokens += chunk["usage"]["completion_tokens"]


async def grpc_stream(client: grpcaio.InferenceServerClient, prompt: str, max_tokens: int, timing: Timing) -> None:
    def tensor(name, array, dtype):
        t = grpcaio.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        return t
    params = {"max_tokens": max_tokens, "temperature": 0.7, "ignore_eos": True}
    inputs = [tensor("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
              tensor("stream", np.array([True]), "BOOL"),
              tensor("sampling_parameters", np.array([json.dumps(params).encode()], dtype=np.object_), "BYTES")]

    async def requests():
        yield {"model_name": "llm", "inputs": inputs}

    start = last = time.perf_counter()
    first = True
    async for result, error in client.stream_infer(requests()):
        if error is not None:
            raise error
        now = time.perf_counter()
        if result.as_numpy("text_output") is not None and result.as_numpy("text_output")[0]:
            (timing.ttft if first else timing.itl).append(now - (start if first else last))
            first, last = False, now
    timing.tokens += max_tokens


async def run_level(args, model: str, prompts: list[str], concurrency: int) -> tuple[Timing, float]:
    timing = Timing()
    pending = list(prompts)
    bar = tqdm(total=len(prompts), desc=f"adapter N={concurrency}", leave=False)
    async with httpx.AsyncClient(timeout=600) as client:
        async def worker():
            while pending:
                await adapter_stream(client, args.base_url, model, pending.pop(0), args.max_tokens, timing)
                bar.update()
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    bar.close()
    return timing, timing.tokens / elapsed


async def run_grpc(args, prompts: list[str]) -> tuple[Timing, float]:
    timing = Timing()
    client = grpcaio.InferenceServerClient(args.grpc_url)
    start = time.perf_counter()
    for prompt in tqdm(prompts, desc="tritonclient N=1", leave=False):
        await grpc_stream(client, prompt, args.max_tokens, timing)
    elapsed = time.perf_counter() - start
    await client.close()
    return timing, timing.tokens / elapsed


def hf_baseline(model_dir, prompts: list[str], max_tokens: int, batch: int) -> float:
    """transformers generate on the prompts, `batch` at a time (left-padded); returns output tokens/s."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens, start = 0, time.perf_counter()
    for i in tqdm(range(0, len(prompts), batch), desc=f"transformers batch={batch}", leave=False):
        encoded = tokenizer(prompts[i:i + batch], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**encoded, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        tokens += (out.shape[1] - encoded.input_ids.shape[1]) * out.shape[0]
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:9000/v1")
    parser.add_argument("--grpc-url", default="127.0.0.1:8001")
    parser.add_argument("--model-path", default="", help="model for the baseline (default: the default model)")
    parser.add_argument("--concurrency", default="1,4,16,32,64")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--skip-baseline", action="store_true")
    args = parser.parse_args()
    model = httpx.get(f"{args.base_url}/models").json()["data"][0]["id"]
    levels = [int(n) for n in args.concurrency.split(",")]

    print(f"model {model}, max_tokens {args.max_tokens}, temperature 0.7, ignore_eos")
    rows = []
    for n in levels:
        prompts = make_prompts(max(n * args.requests_per_client, 4))
        timing, rate = asyncio.run(run_level(args, model, prompts, n))
        rows.append((n, len(prompts), rate, timing))
    grpc_timing, grpc_rate = asyncio.run(run_grpc(args, make_prompts(4)))

    baseline_single = baseline = {}
    if not args.skip_baseline:
        model_dir = resolve_model_path(args.model_path)
        single = hf_baseline(model_dir, make_prompts(4), args.max_tokens, batch=1)
        baseline_single = {n: single for n in levels}
        baseline = {n: hf_baseline(model_dir, make_prompts(max(n * args.requests_per_client, 4)),
                                   args.max_tokens, batch=n) for n in levels}

    header = f"{'N':>3} {'reqs':>5} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}"
    if baseline:
        header += f" {'HF b=1':>8} {'ratio':>6} {'HF b=N':>8} {'ratio':>6}"
    print(header + "   (latencies in ms)")
    for n, count, rate, timing in rows:
        line = (f"{n:>3} {count:>5} {rate:>8.1f} {pct(timing.ttft, 50):>9.0f} {pct(timing.ttft, 99):>9.0f} "
                f"{pct(timing.itl, 50):>8.1f} {pct(timing.itl, 99):>8.1f}")
        if baseline:
            line += (f" {baseline_single[n]:>8.1f} {rate / baseline_single[n]:>5.1f}x"
                     f" {baseline[n]:>8.1f} {rate / baseline[n]:>5.1f}x")
        print(line)
    print(f"tritonclient direct, N=1: {grpc_rate:.1f} tok/s, TTFT p50 {pct(grpc_timing.ttft, 50):.0f} ms, "
          f"ITL p50 {pct(grpc_timing.itl, 50):.1f} ms, p99 {pct(grpc_timing.itl, 99):.1f} ms")


if __name__ == "__main__":
    main()
