"""Sampling filters and the inverse-CDF draw, on small known distributions."""

import torch

from tritonllm.engine.core.structured_output import allowed_tokens_bitmask
from tritonllm.kernels import filter_probs
from tritonllm.kernels.sampling import apply_token_bitmask_reference, sample_from


def test_filters_keep_what_each_rule_allows():
    probs = torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]] * 4)
    top_k = torch.tensor([2, 0, 0, 1])
    top_p = torch.tensor([1.0, 0.75, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.3, 0.0])
    kept = filter_probs(probs, top_k, top_p, min_p)
    kept_sets = [set(kept[r].nonzero().flatten().tolist()) for r in range(4)]
    assert kept_sets[0] == {1, 3}  # top_k=2
    assert kept_sets[1] == {1, 3, 4}  # 0.4 + 0.3 < 0.75 needs a third token
    assert kept_sets[2] == {1, 3, 4}  # min_p: at least 0.3 * 0.4 = 0.12
    assert kept_sets[3] == {1}  # exactly one token survives


def test_nucleus_wider_than_the_candidate_window_is_exact():
    vocab = 1000
    weights = 1 + 1e-3 * torch.arange(vocab).flip(0).float()  # nearly flat, no ties: top_p=0.9 needs ~900 tokens
    probs = (weights / weights.sum()).unsqueeze(0)
    kept = filter_probs(probs, torch.tensor([0]), torch.tensor([0.9]), torch.tensor([0.0]))
    expected = int((probs[0].cumsum(dim=0) < 0.9).sum()) + 1  # the shortest prefix reaching 0.9
    assert expected > 256 and torch.equal(kept[0] > 0, torch.arange(vocab) < expected)


def test_ties_at_the_threshold_are_all_kept():
    probs = torch.full((1, 1000), 1.0 / 1000)  # flat: every token is tied with the k-th / nucleus threshold
    kept = filter_probs(probs.repeat(2, 1), torch.tensor([5, 0]), torch.tensor([1.0, 0.9]), torch.tensor([0.0, 0.0]))
    assert torch.equal(kept, probs.repeat(2, 1))


def test_inverse_cdf_draws_follow_the_distribution():
    generator = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.25, 0.25]])
    draws = torch.stack([sample_from(probs, torch.rand(1, generator=generator)) for _ in range(20000)]).flatten()
    counts = torch.bincount(draws, minlength=5).float() / draws.numel()
    assert counts[0] == 0 and counts[2] == 0
    assert torch.allclose(counts, probs[0], atol=0.02)


def test_allowed_tokens_bitmask_sets_exactly_their_bits():
    allowed = [0, 31, 32, 63, 70]
    logits = torch.zeros(1, 71)
    apply_token_bitmask_reference(logits, torch.from_numpy(allowed_tokens_bitmask(allowed, 71)).unsqueeze(0))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == allowed
