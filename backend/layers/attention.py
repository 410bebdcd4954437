"""Attention over the paged KV cache.

The flat batch puts single-token queries (decodes) first, then multi-token prefill chunks. New keys/values
are written to the cache through `slot_mapping`; each sequence then attends to its whole context, read back
through its block table, so cached prefixes and earlier chunks are seen exactly like fresh tokens. The ops
come from `kernels` (Triton on CUDA, torch references elsewhere)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import kernels


@dataclass
class PrefillChunk:
    query_start: int  # row of its first query token in the flat batch
    query_len: int
    context_len: int  # tokens it attends to: cached prefix + earlier chunks + this chunk
    block_table: torch.Tensor  # [blocks] the blocks holding those tokens


@dataclass
class PrefillBatch:
    """The prefill chunks as the prefill attention op reads them; rows relative to the first prefill row."""
    query_starts: torch.Tensor  # [chunks]
    query_lens: torch.Tensor  # [chunks]
    context_lens: torch.Tensor  # [chunks]
    block_tables: torch.Tensor  # [chunks, max blocks], padded with block 0

    @classmethod
    def pack(cls, chunks: list[PrefillChunk], first_row: int, device: torch.device) -> "PrefillBatch":
        width = max(len(c.block_table) for c in chunks)
        columns = [[c.query_start - first_row for c in chunks], [c.query_len for c in chunks],
                   [c.context_len for c in chunks]]
        starts, lens, context_lens = torch.tensor(columns, dtype=torch.int32, device=device)
        tables = torch.stack([F.pad(c.block_table, (0, width - len(c.block_table))) for c in chunks])
        return cls(starts, lens, context_lens, tables)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V go (block * block_size + offset)
    num_decode_tokens: int  # rows [0, num_decode_tokens) are one-token queries
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks], padded with block 0
    decode_context_lens: torch.Tensor | None  # [num_decodes] int32: tokens each decode attends to
    prefills: list[PrefillChunk]
    prefill_batch: PrefillBatch | None = field(init=False)  # packed once per step, shared by every layer

    def __post_init__(self):
        self.prefill_batch = (PrefillBatch.pack(self.prefills, self.num_decode_tokens, self.slot_mapping.device)
                              if self.prefills else None)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim];
    caches: [blocks, block_size, kv_heads, head_dim]."""
    kernels.store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    num_decode = meta.num_decode_tokens
    if meta.prefill_batch is None:  # decodes only (most steps)
        return kernels.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                              scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_decode:
        out[:num_decode] = kernels.paged_decode_attention(q[:num_decode], k_cache, v_cache, meta.decode_block_tables,
                                                          meta.decode_context_lens, scale)
    batch = meta.prefill_batch
    out[num_decode:] = kernels.prefill_attention(q[num_decode:], k_cache, v_cache, batch.query_starts,
                                                 batch.query_lens, batch.context_lens, batch.block_tables, scale)
    return out
