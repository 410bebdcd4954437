"""Causal attention for a packed batch of prompt chunks, each reading its whole context through its block table.

A chunk's context is its cached prefix, its earlier chunks and itself (all already in the cache); its queries
are the last query_len positions of that context, so query i may see keys 0 .. context_len - query_len + i."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tritonllm.kernels.attention_tile import load_paged_tile, online_softmax_step
from tritonllm.kernels.decode_attention import gather_context
from tritonllm.kernels.openai_triton import tl, triton

_BLOCK_M = 32  # queries per program
_BLOCK_N = 32  # keys per tile


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, query_starts_ptr, query_lens_ptr, context_lens_ptr,
                    block_tables_ptr, scale, q_token_stride, q_head_stride, out_token_stride, out_head_stride,
                    table_stride, block_stride, slot_stride, cache_head_stride, group, head_dim, block_size,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIM: tl.constexpr):
    tile, head, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_head = head // group
    query_len = tl.load(query_lens_ptr + chunk)
    query_start = tl.load(query_starts_ptr + chunk)
    offset = tl.load(context_lens_ptr + chunk) - query_len  # context position of the chunk's first query
    rows, dims = tile * BLOCK_M + tl.arange(0, BLOCK_M), tl.arange(0, DIM)
    row_mask, dim_mask = rows < query_len, dims < head_dim
    q = tl.load(q_ptr + (query_start + rows)[:, None] * q_token_stride + head * q_head_stride + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    positions = offset + rows

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM], tl.float32)
    # keys up to the tile's last real query; a tile past the chunk's end (the grid covers the longest chunk) has none
    key_end = tl.where(tile * BLOCK_M < query_len, offset + tl.minimum((tile + 1) * BLOCK_M, query_len), 0)
    table_row = block_tables_ptr + chunk * table_stride
    for tile_start in range(0, key_end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < key_end
        k = load_paged_tile(k_cache_ptr, table_row, tokens, token_mask, kv_head, block_size, block_stride,
                            slot_stride, cache_head_stride, dims, dim_mask)
        v = load_paged_tile(v_cache_ptr, table_row, tokens, token_mask, kv_head, block_size, block_stride,
                            slot_stride, cache_head_stride, dims, dim_mask)
        allowed = token_mask[None, :] & (tokens[None, :] <= positions[:, None])
        running_max, running_sum, acc = online_softmax_step(q, k, v, allowed, scale, running_max, running_sum, acc)

    out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
    tl.store(out_ptr + (query_start + rows)[:, None] * out_token_stride + head * out_head_stride + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def prefill_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             query_starts: torch.Tensor, query_lens: torch.Tensor, context_lens: torch.Tensor,
                             block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if len(query_lens) == 0:
        return out
    max_query_len = int(query_lens.max())  # one sync per prefill step, small beside the prefill itself
    grid = (triton.cdiv(max_query_len, _BLOCK_M), num_heads, len(query_lens))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, query_starts, query_lens, context_lens, block_tables, scale, q.stride(0),
        q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), num_heads // num_kv_heads, head_dim, block_size,
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, DIM=triton.next_power_of_2(head_dim))
    return out


def prefill_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                query_starts: torch.Tensor, query_lens: torch.Tensor, context_lens: torch.Tensor,
                                block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    for chunk, (start, query_len, context_len) in enumerate(
            zip(query_starts.tolist(), query_lens.tolist(), context_lens.tolist())):
        rows = slice(start, start + query_len)
        keys = gather_context(k_cache, block_tables[chunk])[:, :context_len].to(q.dtype)  # [kv_heads, context, dim]
        values = gather_context(v_cache, block_tables[chunk])[:, :context_len].to(q.dtype)
        query = q[rows].transpose(0, 1)  # [heads, query_len, head_dim]
        if context_len == query_len:
            result = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:  # the chunk's queries sit at the end of the context: causal with an offset
            offset = context_len - query_len
            query_pos = torch.arange(query_len, device=q.device).unsqueeze(1) + offset
            mask = torch.arange(context_len, device=q.device).unsqueeze(0) <= query_pos
            result = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[rows] = result.transpose(0, 1)
    return out
