"""Paged decode (split-K) and prefill attention against their SDPA references."""

from __future__ import annotations

import pytest
import torch

import tritonllm.kernels.decode_attention as decode_attention
from kernel_cases import ATTENTION_TOLERANCES, DEVICE, DTYPES
from tritonllm.kernels.decode_attention import paged_decode_attention_reference, paged_decode_attention_triton
from tritonllm.kernels.prefill_attention import prefill_attention_reference, prefill_attention_triton

BLOCK_SIZE = 16
NUM_BLOCKS = 24


def paged_cache(kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim)
    return (torch.randn(shape, device=DEVICE).to(dtype), torch.randn(shape, device=DEVICE).to(dtype))


def block_tables(context_lens: list[int]) -> torch.Tensor:
    """Distinct, shuffled blocks per sequence, padded with block 0 to the longest context."""
    width = -(-max(context_lens) // BLOCK_SIZE)
    pool = torch.randperm(NUM_BLOCKS).tolist()
    rows = []
    for length in context_lens:
        used = -(-length // BLOCK_SIZE)
        rows.append(pool[:used] + [0] * (width - used))
        pool = pool[used:]
    return torch.tensor(rows, device=DEVICE)


GQA = [(4, 4), (6, 2), (8, 1)]  # query heads per kv head: 1, 3, 8


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads", GQA)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("split_tokens", [512, 64])  # 64: several splits per sequence, merged by log-sum-exp
def test_decode_attention(dtype, heads, kv_heads, head_dim, split_tokens, monkeypatch):
    monkeypatch.setattr(decode_attention, "_SPLIT_TOKENS", split_tokens)
    context_lens = [1, 16, 37, 150]  # one token, exactly one block, a partial block, several splits
    k_cache, v_cache = paged_cache(kv_heads, head_dim, dtype)
    q = torch.randn(len(context_lens), heads, head_dim, device=DEVICE).to(dtype)
    tables = block_tables(context_lens)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    torch.testing.assert_close(paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, scale),
                               paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, scale),
                               **ATTENTION_TOLERANCES[dtype])


def test_decode_split_merge_is_safe_with_large_scores(monkeypatch):
    """Scores in the thousands overflow exp() unless every split and the merge subtract their maxima."""
    monkeypatch.setattr(decode_attention, "_SPLIT_TOKENS", 64)
    context_lens = [200, 65]
    k_cache, v_cache = paged_cache(2, 64, torch.float32)
    q = 30 * torch.randn(2, 4, 64, device=DEVICE)
    tables = block_tables(context_lens)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    ours = paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, 1.0)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, 1.0),
                               **ATTENTION_TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads", GQA)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_attention(dtype, heads, kv_heads, head_dim):
    # (query_len, context_len): a whole prompt over more than one query tile, a later chunk after a cached
    # prefix ending on a block boundary, a one-token chunk, and a chunk whose context ends mid-block
    chunks = [(40, 40), (7, 23), (1, 16), (12, 45)]
    query_lens = [q for q, _ in chunks]
    context_lens = [c for _, c in chunks]
    starts = torch.tensor([0] + query_lens[:-1], device=DEVICE).cumsum(0).to(torch.int32)
    k_cache, v_cache = paged_cache(kv_heads, head_dim, dtype)
    q = torch.randn(sum(query_lens), heads, head_dim, device=DEVICE).to(dtype)
    tables = block_tables(context_lens)
    args = (q, k_cache, v_cache, starts, torch.tensor(query_lens, dtype=torch.int32, device=DEVICE),
            torch.tensor(context_lens, dtype=torch.int32, device=DEVICE), tables, head_dim ** -0.5)
    torch.testing.assert_close(prefill_attention_triton(*args), prefill_attention_reference(*args),
                               **ATTENTION_TOLERANCES[dtype])
