"""Neox-style rotary embedding (first half / second half of each head), applied to q and k in place.

cos and sin are [tokens, head_dim / 2] float32: each token's row of the tables (rope scaling already folded in),
gathered once per step for the batch's positions and shared by every layer."""

from __future__ import annotations

import torch

from tritonllm.kernels.openai_triton import tl, triton


@triton.jit
def _rotate_heads(x_ptr, token_stride, head_stride, num_heads, cos, sin, token, half,
                  HEADS: tl.constexpr, HALF: tl.constexpr):
    heads = tl.arange(0, HEADS)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    mask = (heads < num_heads) & (dims < half)
    first_ptr = x_ptr + token * token_stride + heads * head_stride + dims
    first = tl.load(first_ptr, mask=mask, other=0.0)
    second = tl.load(first_ptr + half, mask=mask, other=0.0)
    # every operand and product rounded to the dtype as the eager path rounds them: the same result in bf16
    cos = cos.to(first.dtype)
    sin = sin.to(first.dtype)
    tl.store(first_ptr, (first * cos).to(first.dtype) - (second * sin).to(first.dtype), mask=mask)
    tl.store(first_ptr + half, (second * cos).to(first.dtype) + (first * sin).to(first.dtype), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_token_stride, q_head_stride,
                   k_token_stride, k_head_stride, table_stride, num_q_heads, num_k_heads, half,
                   Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr, HALF: tl.constexpr):
    token = tl.program_id(0)
    dims = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_ptr + token * table_stride + dims, mask=dims < half, other=0.0)
    sin = tl.load(sin_ptr + token * table_stride + dims, mask=dims < half, other=0.0)
    _rotate_heads(q_ptr, q_token_stride, q_head_stride, num_q_heads, cos, sin, token, half, Q_HEADS, HALF)
    _rotate_heads(k_ptr, k_token_stride, k_head_stride, num_k_heads, cos, sin, token, half, K_HEADS, HALF)


def rotary_embedding_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1 and cos.stride() == sin.stride()
    half = q.shape[-1] // 2
    if q.shape[0]:
        _rotary_kernel[(q.shape[0],)](
            q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
            q.shape[1], k.shape[1], half, Q_HEADS=triton.next_power_of_2(q.shape[1]),
            K_HEADS=triton.next_power_of_2(k.shape[1]), HALF=triton.next_power_of_2(half))


def rotary_embedding_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    # x·[cos, cos] + [second, first]·[−sin, sin] is the rotation, in three ops per tensor
    cos_full = torch.cat((cos, cos), dim=-1).unsqueeze(1).to(q.dtype)  # [tokens, 1, head_dim]
    sin_signed = torch.cat((-sin, sin), dim=-1).unsqueeze(1).to(q.dtype)
    for x in (q, k):
        first, second = x.chunk(2, dim=-1)
        swapped = torch.cat((second, first), dim=-1)
        x.mul_(cos_full).addcmul_(swapped, sin_signed)
