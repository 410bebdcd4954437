"""Attention over the paged KV cache.

The flat batch puts single-token queries (decodes) first, then multi-token prefill chunks. New keys/values
are written to the cache through `slot_mapping`; each sequence then attends to its whole context, read back
through its block table, so cached prefixes and earlier chunks are seen exactly like fresh tokens. The ops
come from `kernels` (Triton on CUDA, the C ops on float32 CPU tensors, torch references elsewhere); prompt rows
computed in bf16 (row_dtype.py) attend through torch's flash kernel on the CPU's bf16 matrix units."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tritonllm import kernels
from tritonllm.engine.layers.row_dtype import matmul_dtype
from tritonllm.kernels.decode_attention import DecodeWorkspace
from tritonllm.kernels.prefill_attention_bf16 import prefill_attention_bf16


@dataclass(frozen=True)
class PrefillBatch:
    """The prefill chunks as the prefill attention op reads them; rows relative to the first prefill row."""

    query_starts: torch.Tensor  # [chunks] int32
    query_lens: torch.Tensor  # [chunks] int32
    context_lens: torch.Tensor  # [chunks] int32: tokens each attends to (cached prefix + earlier chunks + itself)
    block_tables: torch.Tensor  # [chunks, blocks] the blocks holding those tokens (padding: any valid block)


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's attention inputs, shared by every layer. The tensors are views of the model runner's
    persistent buffers (engine/input_batch.py): nothing here is allocated per step."""

    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V go (block * block_size + offset)
    num_decode_tokens: int  # rows [0, num_decode_tokens) are one-token queries
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] (padding: any valid block)
    decode_context_lens: torch.Tensor | None  # [num_decodes] int32: tokens each decode attends to
    prefill: PrefillBatch | None = None  # the multi-token chunks after the decodes
    decode_workspace: DecodeWorkspace | None = None  # the decode kernel's scratch (CUDA), preallocated


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim];
    caches: [blocks, block_size, kv_heads, head_dim]."""
    kernels.store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    num_decode = meta.num_decode_tokens
    if meta.prefill is None:  # decodes only (most steps)
        return kernels.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                              scale, meta.decode_workspace)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_decode:
        out[:num_decode] = kernels.paged_decode_attention(q[:num_decode], k_cache, v_cache, meta.decode_block_tables,
                                                          meta.decode_context_lens, scale, meta.decode_workspace)
    batch = meta.prefill
    prefill_attention = prefill_attention_bf16 if matmul_dtype() == torch.bfloat16 else kernels.prefill_attention
    out[num_decode:] = prefill_attention(q[num_decode:], k_cache, v_cache, batch.query_starts, batch.query_lens,
                                         batch.context_lens, batch.block_tables, scale)
    return out
