"""Batched penalties, logit bias and token bitmask against their torch references (exact: same fp32 math)."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import DEVICE
from kernels.sampling import (apply_logit_bias_reference, apply_logit_bias_triton, apply_penalties_reference,
                              apply_penalties_triton, apply_token_bitmask_reference, apply_token_bitmask_triton)

VOCAB = 1100  # not a multiple of the kernels' block nor of 32


def penalty_inputs(rows: int):
    logits = 5 * torch.randn(rows, VOCAB, device=DEVICE)
    counts = torch.randint(0, 3, (rows, VOCAB), device=DEVICE).float() * (torch.rand(rows, VOCAB, device=DEVICE) < 0.05)
    prompt_mask = torch.rand(rows, VOCAB, device=DEVICE) < 0.05
    return logits, counts, prompt_mask


@pytest.mark.parametrize("rows", [1, 3])
def test_penalties_per_row(rows):
    logits, counts, prompt_mask = penalty_inputs(rows)
    params = [torch.rand(rows, device=DEVICE) + 0.5, torch.randn(rows, device=DEVICE), torch.randn(rows, device=DEVICE)]
    torch.testing.assert_close(apply_penalties_triton(logits, counts, prompt_mask, *params),
                               apply_penalties_reference(logits, counts, prompt_mask, *params), atol=0, rtol=0)


def test_neutral_penalties_with_nothing_seen_leave_logits_unchanged():
    logits, _, _ = penalty_inputs(2)
    counts = torch.zeros_like(logits)
    prompt_mask = torch.zeros_like(logits, dtype=torch.bool)
    ones, zeros = torch.ones(2, device=DEVICE), torch.zeros(2, device=DEVICE)
    out = apply_penalties_triton(logits, counts, prompt_mask, ones, zeros, zeros)
    torch.testing.assert_close(out, logits, atol=0, rtol=0)
    torch.testing.assert_close(out, apply_penalties_reference(logits, counts, prompt_mask, ones, zeros, zeros))


def test_logit_bias_scatter():
    logits = torch.randn(3, VOCAB, device=DEVICE)
    rows = torch.tensor([0, 0, 2, 2, 2], device=DEVICE)
    token_ids = torch.tensor([0, VOCAB - 1, 5, 6, 1023], device=DEVICE)
    biases = torch.tensor([100.0, -100.0, 1.5, -2.0, 0.25], device=DEVICE)
    ours, expected = logits.clone(), logits.clone()
    apply_logit_bias_triton(ours, rows, token_ids, biases)
    apply_logit_bias_reference(expected, rows, token_ids, biases)
    torch.testing.assert_close(ours, expected, atol=0, rtol=0)


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] bool → [rows, ceil(vocab / 32)] int32, bit t % 32 of word t // 32."""
    words = -(-allowed.shape[1] // 32)
    padded = torch.zeros(allowed.shape[0], words * 32, dtype=torch.int64, device=allowed.device)
    padded[:, :allowed.shape[1]] = allowed.long()
    packed = (padded.view(allowed.shape[0], words, 32) << torch.arange(32, device=allowed.device)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # bit 31 is the sign bit


def test_token_bitmask():
    allowed = torch.rand(3, VOCAB, device=DEVICE) < 0.5
    allowed[1] = False
    allowed[1, VOCAB - 1] = True  # exactly one token left, in the last partial word
    allowed[2] = False
    allowed[2, 31] = True  # exactly one token left, on the sign bit
    logits = torch.randn(3, VOCAB, device=DEVICE)
    ours, expected = logits.clone(), logits.clone()
    bitmask = pack_bitmask(allowed)
    apply_token_bitmask_triton(ours, bitmask)
    apply_token_bitmask_reference(expected, bitmask)
    torch.testing.assert_close(ours, expected, atol=0, rtol=0)
    torch.testing.assert_close(ours, logits.masked_fill(~allowed, float("-inf")), atol=0, rtol=0)
    assert ours[1].argmax() == VOCAB - 1 and ours[2].argmax() == 31
