"""Attention over the paged KV cache (torch path).

The flat batch puts single-token queries (decodes) first, then multi-token prefill chunks. New keys/values
are written to the cache through `slot_mapping`; each sequence then attends to its whole context, read back
through its block table, so cached prefixes and earlier chunks are seen exactly like fresh tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    query_start: int  # row of its first query token in the flat batch
    query_len: int
    context_len: int  # tokens it attends to: cached prefix + earlier chunks + this chunk
    block_table: torch.Tensor  # [blocks] the blocks holding those tokens


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V go (block * block_size + offset)
    num_decode_tokens: int  # rows [0, num_decode_tokens) are one-token queries
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks], padded with block 0
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] True for real context
    prefills: list[PrefillChunk]


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """cache [blocks, block_size, kv_heads, head_dim], block_table [..., n] → [..., kv_heads, n * block_size, dim]."""
    gathered = cache[block_table]  # whole blocks: contiguous copies
    gathered = gathered.flatten(-4, -3)  # [..., n * block_size, kv_heads, head_dim]
    return gathered.transpose(-3, -2)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim];
    caches: [blocks, block_size, kv_heads, head_dim]."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    num_decode = meta.num_decode_tokens
    if num_decode:
        keys = _gather_context(k_cache, meta.decode_block_tables)  # [decodes, kv_heads, context, head_dim]
        values = _gather_context(v_cache, meta.decode_block_tables)
        out[:num_decode] = F.scaled_dot_product_attention(
            q[:num_decode].unsqueeze(2), keys, values, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True,
        ).squeeze(2)
    for chunk in meta.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        context_len = chunk.context_len
        keys = _gather_context(k_cache, chunk.block_table)[:, :context_len]  # [kv_heads, context, head_dim]
        values = _gather_context(v_cache, chunk.block_table)[:, :context_len]
        query = q[rows].transpose(0, 1)  # [heads, query_len, head_dim]
        if context_len == chunk.query_len:
            result = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:  # the chunk's queries sit at the end of the context: causal with an offset
            offset = context_len - chunk.query_len
            query_pos = torch.arange(chunk.query_len, device=q.device).unsqueeze(1) + offset
            mask = torch.arange(context_len, device=q.device).unsqueeze(0) <= query_pos
            result = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[rows] = result.transpose(0, 1)
    return out
