"""Batched LoRA: each token adds the low-rank update of its own adapter slot (−1: the base model, no update).

`lora_a` [slots, rank, in] and `lora_b` [slots, out, rank] hold every loaded adapter stacked (the scaling folded
into B). The kernel gathers per token (Punica's BGMV): shrink x @ A[slot]ᵀ → [tokens, rank] in float32, then
expand by B[slot]. The reference groups the tokens by slot instead (one matmul pair per adapter in the batch)."""

from __future__ import annotations

import torch

from tritonllm.kernels.openai_triton import tl, triton


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, slots_ptr, out_ptr, rank, width, x_stride, a_slot_stride, a_row_stride,
                        out_stride, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    rows = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    if slot >= 0:
        for start in range(0, width, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + token * x_stride + cols, mask=cols < width, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + slot * a_slot_stride + rows[:, None] * a_row_stride + cols[None, :],
                        mask=(rows[:, None] < rank) & (cols[None, :] < width), other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
    tl.store(out_ptr + token * out_stride + rows, acc, mask=rows < rank)


@triton.jit
def _lora_expand_kernel(h_ptr, b_ptr, slots_ptr, out_ptr, rank, width, h_stride, b_slot_stride, b_row_stride,
                        out_stride, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + token)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if slot >= 0:
        ranks = tl.arange(0, BLOCK_R)
        h = tl.load(h_ptr + token * h_stride + ranks, mask=ranks < rank, other=0.0)
        b = tl.load(b_ptr + slot * b_slot_stride + cols[:, None] * b_row_stride + ranks[None, :],
                    mask=(cols[:, None] < width) & (ranks[None, :] < rank), other=0.0).to(tl.float32)
        acc = tl.sum(b * h[None, :], axis=1)
    tl.store(out_ptr + token * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < width)


_BLOCK_K = 128
_BLOCK_N = 128


def lora_delta_triton(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor,
                      active_slots: tuple[int, ...]) -> torch.Tensor:
    tokens, width = x.shape
    rank, out_width = lora_a.shape[1], lora_b.shape[1]
    x, lora_a, lora_b = x.contiguous(), lora_a.contiguous(), lora_b.contiguous()
    shrunk = torch.empty(tokens, rank, dtype=torch.float32, device=x.device)
    out = torch.empty(tokens, out_width, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    block_r = triton.next_power_of_2(rank)
    _lora_shrink_kernel[(tokens,)](x, lora_a, token_slots, shrunk, rank, width, x.stride(0), lora_a.stride(0),
                                   lora_a.stride(1), shrunk.stride(0), BLOCK_R=block_r, BLOCK_K=_BLOCK_K)
    _lora_expand_kernel[(tokens, triton.cdiv(out_width, _BLOCK_N))](
        shrunk, lora_b, token_slots, out, rank, out_width, shrunk.stride(0), lora_b.stride(0), lora_b.stride(1),
        out.stride(0), BLOCK_R=block_r, BLOCK_N=_BLOCK_N)
    return out


def lora_delta_reference(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor,
                         active_slots: tuple[int, ...]) -> torch.Tensor:
    """x [tokens, in], token_slots [tokens] (int, −1 = none) → the per-token update [tokens, out] in x's dtype.
    active_slots: the slots token_slots holds, known on the host (so neither version reads the device)."""
    out = torch.zeros(x.shape[0], lora_b.shape[1], dtype=x.dtype, device=x.device)
    for slot in active_slots:
        rows = token_slots == slot
        out[rows] = (x[rows] @ lora_a[slot].T) @ lora_b[slot].T
    return out
