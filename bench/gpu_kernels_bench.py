"""CUDA microbenchmarks of each Triton kernel beside its torch equivalent, then engine decode tokens/s in bf16
with the kernels on and off (TRITONLLM_FORCE_KERNELS=0: the torch path).

    python bench/gpu_kernels_bench.py CONFIG_DIR   # random weights shaped by CONFIG_DIR/config.json (+ tokenizer)"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from tritonllm import kernels
from tritonllm.engine.config import EngineConfig
from tritonllm.engine.llm_engine import LLMEngine
from gpu_engine_check import decode_rate, random_checkpoint  # bench/ is the script's directory
from tritonllm.kernels.activation import silu_and_mul_reference, silu_and_mul_triton
from tritonllm.kernels.decode_attention import paged_decode_attention_reference, paged_decode_attention_triton
from tritonllm.kernels.kv_cache import store_kv_cache_reference, store_kv_cache_triton
from tritonllm.kernels.prefill_attention import prefill_attention_reference, prefill_attention_triton
from tritonllm.kernels.rms_norm import rms_norm_reference, rms_norm_triton
from tritonllm.kernels.rotary import rotary_embedding_reference, rotary_embedding_triton

DTYPE = torch.bfloat16
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def report(name: str, bytes_moved: int, candidates: dict) -> None:
    """Time each callable (ms, median) and the bandwidth the bytes it must move imply."""
    cells = []
    for label, fn in candidates.items():
        ms = do_bench(fn, warmup=10, rep=50)
        cells.append(f"{label} {ms * 1e3:8.1f} us {bytes_moved / ms / 1e6:7.0f} GB/s")
    print(f"{name:<28}" + "   |   ".join(cells))


def size(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def paged_cache(num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return torch.randn(shape, device="cuda", dtype=DTYPE), torch.randn(shape, device="cuda", dtype=DTYPE)


def bench_kernels() -> None:
    tokens, hidden = 4096, 4096
    x, residual = (torch.randn(tokens, hidden, device="cuda", dtype=DTYPE) for _ in range(2))
    weight = torch.randn(hidden, device="cuda", dtype=DTYPE)
    report("rms_norm + residual", 4 * size(x), {
        "triton": lambda: rms_norm_triton(x, weight, 1e-6, residual),
        "eager": lambda: rms_norm_reference(x, weight, 1e-6, residual)})

    gate_up = torch.randn(tokens, 2 * 11008, device="cuda", dtype=DTYPE)
    report("silu_and_mul", size(gate_up) * 3 // 2, {
        "triton": lambda: silu_and_mul_triton(gate_up), "eager": lambda: silu_and_mul_reference(gate_up)})

    q = torch.randn(tokens, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    k, v = (torch.randn(tokens, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(2))
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    cos, sin = (torch.rand(8192, HEAD_DIM // 2, device="cuda") for _ in range(2))
    report("rotary (q and k, in place)", 2 * size(q, k), {
        "triton": lambda: rotary_embedding_triton(q, k, cos[positions], sin[positions]),
        "eager": lambda: rotary_embedding_reference(q, k, cos[positions], sin[positions])})

    k_cache, v_cache = paged_cache(tokens // BLOCK_SIZE * 2)
    slots = torch.randperm(k_cache.shape[0] * BLOCK_SIZE, device="cuda")[:tokens]
    report("store_kv_cache", 2 * size(k, v), {
        "triton": lambda: store_kv_cache_triton(k, v, k_cache, v_cache, slots),
        "index_copy_": lambda: store_kv_cache_reference(k, v, k_cache, v_cache, slots)})

    for seqs, context in ((1, 8192), (64, 2048)):
        blocks = context // BLOCK_SIZE
        k_cache, v_cache = paged_cache(seqs * blocks)
        tables = torch.randperm(seqs * blocks, device="cuda").view(seqs, blocks)
        lens = torch.full((seqs,), context, dtype=torch.int32, device="cuda")
        q = torch.randn(seqs, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        dense_k, dense_v = (c[tables].flatten(1, 2).transpose(1, 2).contiguous() for c in (k_cache, v_cache))
        report(f"decode {seqs} x {context} ctx", size(k_cache, v_cache), {
            "triton paged": lambda: paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, 0.088),
            "torch paged (ref)": lambda: paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, 0.088),
            "SDPA dense": lambda: F.scaled_dot_product_attention(q.unsqueeze(2), dense_k, dense_v, scale=0.088,
                                                                 enable_gqa=True)})

    chunks, chunk_len = 4, 1024
    blocks = chunk_len // BLOCK_SIZE
    k_cache, v_cache = paged_cache(chunks * blocks)
    tables = torch.randperm(chunks * blocks, device="cuda").view(chunks, blocks)
    q = torch.randn(chunks * chunk_len, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    lens = torch.full((chunks,), chunk_len, dtype=torch.int32, device="cuda")
    starts = torch.arange(chunks, dtype=torch.int32, device="cuda") * chunk_len
    dense_q = q.view(chunks, chunk_len, HEADS, HEAD_DIM).transpose(1, 2)
    dense_k, dense_v = (c[tables].flatten(1, 2).transpose(1, 2).contiguous() for c in (k_cache, v_cache))
    report(f"prefill {chunks} x {chunk_len} causal", 2 * size(q) + size(k_cache, v_cache), {
        "triton paged": lambda: prefill_attention_triton(q, k_cache, v_cache, starts, lens, lens, tables, 0.088),
        "torch paged (ref)": lambda: prefill_attention_reference(q, k_cache, v_cache, starts, lens, lens, tables, 0.088),
        "SDPA dense": lambda: F.scaled_dot_product_attention(dense_q, dense_k, dense_v, is_causal=True, scale=0.088,
                                                             enable_gqa=True)})


def bench_engine(config_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model_path=str(random_checkpoint(config_dir)), dtype="bfloat16",
                                    kv_cache_memory=4 << 30))
    for mode, label in (("", "kernels"), ("0", "torch path")):
        kernels.force(mode)
        for batch in (1, 64):
            decode_rate(engine, batch, tokens=8)  # warm-up (and Triton compilation)
            print(f"engine bf16 decode, batch {batch:>2}, {label:<10}: {decode_rate(engine, batch, tokens=64):7.0f} tokens/s")
    kernels.force("")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config_dir", type=Path, help="directory with a Llama config.json and tokenizer files")
    args = parser.parse_args()
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    torch.manual_seed(0)
    bench_kernels()
    bench_engine(args.config_dir)


if __name__ == "__main__":
    main()
