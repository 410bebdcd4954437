"""Batched penalties, logit bias, token bitmask and probability filtering against their torch references (exact:
same fp32 math; the filters keep the same sets and copy the kept values)."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import DEVICE
from tritonllm.kernels.sampling import (apply_logit_bias_reference, apply_logit_bias_triton, apply_penalties_reference,
                              apply_penalties_triton, apply_token_bitmask_reference, apply_token_bitmask_triton,
                              filter_probs_reference, filter_probs_triton)

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


def filter_params(rows: list[tuple[int, float, float]]):
    top_k, top_p, min_p = zip(*rows)
    return (torch.tensor(top_k, device=DEVICE), torch.tensor(top_p, device=DEVICE),
            torch.tensor(min_p, device=DEVICE))


def filter_both(probs: torch.Tensor, params) -> torch.Tensor:
    ours = filter_probs_triton(probs, *params)
    torch.testing.assert_close(ours, filter_probs_reference(probs, *params), atol=0, rtol=0)
    return ours


@pytest.mark.parametrize("vocab", [1000, 49152])  # neither a multiple of the kernel's tile
def test_filter_probs_per_row_rules(vocab):
    # one launch, each row its own rule: top-k, top-p, min-p alone, all three, a nucleus wider than 256 tokens
    rows = [(40, 1.0, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.02), (20, 0.5, 0.1), (0, 0.95, 0.0)]
    probs = (3 * torch.randn(len(rows), vocab, device=DEVICE)).softmax(dim=-1)
    probs[-1] = torch.randn(vocab, device=DEVICE).softmax(dim=-1)  # flatter: the nucleus spans most of the vocab
    kept = (filter_both(probs, filter_params(rows)) > 0).sum(dim=-1).tolist()
    assert kept[0] == 40 and kept[3] <= 20 and kept[4] > 256
    assert all(1 <= n < vocab for n in kept)


def test_filter_probs_keep_exactly_the_most_likely_token():
    probs = (3 * torch.randn(3, 1000, device=DEVICE)).softmax(dim=-1)
    ours = filter_both(probs, filter_params([(1, 1.0, 0.0), (0, 1e-6, 0.0), (0, 1.0, 1.0)]))
    assert ((ours > 0).sum(dim=-1) == 1).all()
    assert torch.equal(ours.argmax(dim=-1), probs.argmax(dim=-1))


def test_filter_probs_neutral_parameters_keep_everything():
    probs = (3 * torch.randn(3, 1000, device=DEVICE)).softmax(dim=-1)
    ours = filter_both(probs, filter_params([(0, 1.0, 0.0), (1000, 1.0, 0.0), (5000, 1.0, 0.0)]))
    torch.testing.assert_close(ours, probs, atol=0, rtol=0)


def test_filter_probs_flat_distribution_nucleus_needs_most_of_the_vocab():
    vocab = 1000
    weights = 1 + 1e-3 * torch.randperm(vocab, device=DEVICE).float()  # nearly flat, no ties
    probs = (weights / weights.sum()).unsqueeze(0)
    ours = filter_both(probs, filter_params([(0, 0.9, 0.0)]))
    values = probs[0].sort(descending=True).values
    expected = int((values.cumsum(dim=0) < 0.9).sum()) + 1  # the shortest prefix reaching 0.9
    assert int((ours > 0).sum()) == expected and 850 < expected < 950
    assert torch.equal(ours[0] > 0, probs[0] >= values[expected - 1])
