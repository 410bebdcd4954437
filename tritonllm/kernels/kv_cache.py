"""Writes new keys/values into the paged cache [blocks, block_size, kv_heads, head_dim] through a slot
mapping (slot = block * block_size + offset)."""

from __future__ import annotations

import torch

from tritonllm.kernels.openai_triton import tl, triton


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, k_token_stride, v_token_stride,
                     head_stride_k, head_stride_v, slot_stride, cache_head_stride, num_heads, head_dim,
                     HEADS: tl.constexpr, DIM: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token).to(tl.int64)  # int64: slot * slot_stride overflows int32 on large pools
    heads = tl.arange(0, HEADS)[:, None]
    dims = tl.arange(0, DIM)[None, :]
    mask = (heads < num_heads) & (dims < head_dim)
    cache_offsets = slot * slot_stride + heads * cache_head_stride + dims
    k = tl.load(k_ptr + token * k_token_stride + heads * head_stride_k + dims, mask=mask)
    v = tl.load(v_ptr + token * v_token_stride + heads * head_stride_v + dims, mask=mask)
    tl.store(k_cache_ptr + cache_offsets, k, mask=mask)
    tl.store(v_cache_ptr + cache_offsets, v, mask=mask)


def store_kv_cache_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k.stride(-1) == 1 and v.stride(-1) == 1
    num_heads, head_dim = k.shape[1], k.shape[2]
    if k.shape[0]:
        _store_kv_kernel[(k.shape[0],)](
            k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), k.stride(1), v.stride(1),
            k_cache.stride(1), k_cache.stride(2), num_heads, head_dim,
            HEADS=triton.next_power_of_2(num_heads), DIM=triton.next_power_of_2(head_dim))


def store_kv_cache_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             slot_mapping: torch.Tensor) -> None:
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
