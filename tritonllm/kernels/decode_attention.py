"""Attention of one new token per sequence over its paged context (decode steps).

Flash-decoding: each (sequence, kv head) is split along the context into pieces processed in parallel, each
writing a normalized partial output and its log-sum-exp; a second kernel merges them weighted by
exp(lse - max lse), which stays finite however long the context. One program covers a whole GQA group of
query heads, so every key/value tile is read once per kv head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tritonllm.kernels.attention_tile import load_paged_tile, online_softmax_step
from tritonllm.kernels.openai_triton import tl, triton

_BLOCK_N = 64  # context tokens per tile
_SPLIT_TOKENS = 512  # context tokens per split (a multiple of _BLOCK_N): shorter contexts are not split
_MAX_SPLITS = 32


@dataclass(frozen=True)
class DecodeWorkspace:
    """The split kernel's scratch for up to `max_seqs` sequences, allocated once (not per call: a CUDA graph
    replays the same addresses): partial outputs and their log-sum-exps, used as flat prefixes."""

    partial: torch.Tensor  # [max_seqs * heads * _MAX_SPLITS * dim] float32
    lse: torch.Tensor  # [max_seqs * heads * _MAX_SPLITS] float32

    @classmethod
    def allocate(cls, max_seqs: int, num_heads: int, head_dim: int, device: torch.device) -> "DecodeWorkspace":
        rows = max_seqs * num_heads * _MAX_SPLITS
        return cls(torch.empty(rows * triton.next_power_of_2(head_dim), dtype=torch.float32, device=device),
                   torch.empty(rows, dtype=torch.float32, device=device))


@triton.jit
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, partial_ptr,
                         lse_ptr, scale, q_seq_stride, q_head_stride, table_stride, block_stride, slot_stride,
                         cache_head_stride, group, head_dim, block_size, split_len, num_splits,
                         GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_heads = tl.num_programs(1) * group
    rows, dims = tl.arange(0, GROUP), tl.arange(0, DIM)
    row_mask, dim_mask = rows < group, dims < head_dim
    heads = kv_head * group + rows
    q = tl.load(q_ptr + seq * q_seq_stride + heads[:, None] * q_head_stride + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)

    running_max = tl.full([GROUP], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP], tl.float32)
    acc = tl.zeros([GROUP, DIM], tl.float32)
    start = split * split_len
    end = tl.minimum(start + split_len, tl.load(context_lens_ptr + seq))
    table_row = block_tables_ptr + seq * table_stride
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        k = load_paged_tile(k_cache_ptr, table_row, tokens, token_mask, kv_head, block_size, block_stride,
                            slot_stride, cache_head_stride, dims, dim_mask)
        v = load_paged_tile(v_cache_ptr, table_row, tokens, token_mask, kv_head, block_size, block_stride,
                            slot_stride, cache_head_stride, dims, dim_mask)
        running_max, running_sum, acc = online_softmax_step(q, k, v, token_mask[None, :], scale, running_max,
                                                            running_sum, acc)

    # a split past the end of this sequence's context has nothing: lse -inf, weight 0 in the merge
    has_tokens = running_sum > 0
    lse = tl.where(has_tokens, running_max + tl.log(tl.where(has_tokens, running_sum, 1.0)), float("-inf"))
    partial = acc / tl.where(has_tokens, running_sum, 1.0)[:, None]
    slot = (seq * num_heads + heads) * num_splits + split  # partial [seqs, heads, splits, DIM], lse without DIM
    tl.store(lse_ptr + slot, lse, mask=row_mask)
    tl.store(partial_ptr + slot[:, None] * DIM + dims[None, :], partial, mask=row_mask[:, None])


@triton.jit
def _merge_splits_kernel(partial_ptr, lse_ptr, out_ptr, out_seq_stride, out_head_stride, head_dim, num_splits,
                         SPLITS: tl.constexpr, DIM: tl.constexpr):
    seq, head = tl.program_id(0), tl.program_id(1)
    splits, dims = tl.arange(0, SPLITS), tl.arange(0, DIM)
    base = (seq * tl.num_programs(1) + head) * num_splits
    lse = tl.load(lse_ptr + base + splits, mask=splits < num_splits, other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, axis=0))
    partial = tl.load(partial_ptr + (base + splits)[:, None] * DIM + dims[None, :],
                      mask=(splits < num_splits)[:, None], other=0.0)
    out = tl.sum(weights[:, None] * partial, axis=0) / tl.sum(weights, axis=0)
    tl.store(out_ptr + seq * out_seq_stride + head * out_head_stride + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < head_dim)


def paged_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                  workspace: DecodeWorkspace | None = None) -> torch.Tensor:
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if seqs == 0:
        return out
    # the padded table width bounds every context without reading context_lens back from the device
    max_len = block_tables.shape[1] * block_size
    num_splits = min(_MAX_SPLITS, triton.cdiv(max_len, _SPLIT_TOKENS))
    split_len = triton.cdiv(triton.cdiv(max_len, num_splits), _BLOCK_N) * _BLOCK_N
    num_splits = triton.cdiv(max_len, split_len)
    dim = triton.next_power_of_2(head_dim)
    if workspace is None:
        workspace = DecodeWorkspace.allocate(seqs, num_heads, head_dim, q.device)
    partial = workspace.partial[:seqs * num_heads * num_splits * dim].view(seqs, num_heads, num_splits, dim)
    lse = workspace.lse[:seqs * num_heads * num_splits].view(seqs, num_heads, num_splits)
    _decode_split_kernel[(seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, partial, lse, scale, q.stride(0), q.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), group, head_dim,
        block_size, split_len, num_splits,
        GROUP=max(16, triton.next_power_of_2(group)), DIM=dim, BLOCK_N=_BLOCK_N)  # tl.dot needs 16+ rows
    _merge_splits_kernel[(seqs, num_heads)](
        partial, lse, out, out.stride(0), out.stride(1), head_dim, num_splits,
        SPLITS=triton.next_power_of_2(num_splits), DIM=dim)
    return out


def gather_context(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """cache [blocks, block_size, kv_heads, head_dim], block_table [..., n] → [..., kv_heads, n * block_size, dim]."""
    # whole blocks, one contiguous copy each (index_select: several times cheaper than advanced indexing on CPU)
    gathered = cache.index_select(0, block_table.reshape(-1))
    gathered = gathered.view(*block_table.shape[:-1], -1, *cache.shape[2:])  # [..., n * block_size, kv_heads, dim]
    return gathered.transpose(-3, -2)


def paged_decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                     workspace: DecodeWorkspace | None = None) -> torch.Tensor:
    """(`workspace` is the kernel's scratch; the reference needs none.)"""
    keys = gather_context(k_cache, block_tables).to(q.dtype)  # [seqs, kv_heads, padded context, head_dim]
    values = gather_context(v_cache, block_tables).to(q.dtype)
    mask = torch.arange(keys.shape[-2], device=q.device) < context_lens.unsqueeze(1)
    return F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask.view(len(q), 1, 1, -1),
                                          scale=scale, enable_gqa=True).squeeze(2)
