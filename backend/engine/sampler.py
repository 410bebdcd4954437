"""Chooses the next token of each sequence from its logits: greedy or temperature / top-k / top-p / min-p
sampling, each sequence drawing from its own generator so a seeded request is reproducible whatever else
runs beside it. Logprobs are those of the model's raw distribution (before temperature and filtering)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.engine.sequence import Sequence


@dataclass
class SampledToken:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the requested number of most likely tokens


_CANDIDATES = 256  # filtered rows sample among their most likely tokens; wider only when the nucleus needs it


def filtered_candidates(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                        min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row top-k (<= 0: off), top-p and min-p filtering of probabilities [rows, vocab].

    Returns (kept probabilities, token ids), both [rows, candidates], most likely first; removed entries are 0.
    Only the top candidates are sorted; a row whose nucleus reaches past them is sorted in full."""
    vocab = probs.shape[-1]
    width = min(vocab, max(_CANDIDATES, int(top_k.max())))
    values, ids = probs.topk(width, dim=-1)
    if width < vocab:
        needs_more = (top_k <= 0) | (top_k > width)
        needs_more &= values.sum(dim=-1) < top_p
        if bool(needs_more.any()):
            values, ids = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(values.shape[-1], device=probs.device).unsqueeze(0)
    remove = ranks >= torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    remove |= values.cumsum(dim=-1) - values >= top_p.unsqueeze(1)  # always keeps the most likely token
    remove |= values < min_p.unsqueeze(1) * values[:, :1]
    return values.masked_fill(remove, 0.0), ids


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one uniform number per row picks an index of that row's (unnormalized) probs."""
    cdf = probs.cumsum(dim=-1)
    targets = uniforms.unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


class Sampler:
    def __init__(self, eos_token_ids: set[int]):
        self.eos_token_ids = eos_token_ids

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken]:
        logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._block_early_stops(logits, seqs)
        chosen = logits.argmax(dim=-1)
        random_rows = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            params = [seqs[i].params for i in random_rows]
            temperature = torch.tensor([p.temperature for p in params], device=logits.device).unsqueeze(1)
            probs = (logits[rows] / temperature).softmax(dim=-1)
            # one draw per sequence from its own generator: reproducible whatever else is in the batch
            uniforms = torch.cat([torch.rand(1, generator=seqs[i].generator, device=logits.device)
                                  for i in random_rows])
            if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
                kept, ids = filtered_candidates(
                    probs,
                    torch.tensor([p.top_k for p in params], device=logits.device),
                    torch.tensor([p.top_p for p in params], device=logits.device),
                    torch.tensor([p.min_p for p in params], device=logits.device),
                )
                chosen[rows] = ids.gather(1, sample_from(kept, uniforms).unsqueeze(1)).squeeze(1)
            else:
                chosen[rows] = sample_from(probs, uniforms)

        chosen_logprobs = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
        max_top = max((seq.params.logprobs or 0) for seq in seqs)
        top_values = top_ids = None
        if max_top:
            top_values, top_ids = logprobs.topk(max_top, dim=-1)
            top_values, top_ids = top_values.tolist(), top_ids.tolist()
        results = []
        for i, (token, seq) in enumerate(zip(chosen.tolist(), seqs)):
            wanted = seq.params.logprobs or 0
            top = list(zip(top_ids[i][:wanted], top_values[i][:wanted])) if wanted else []
            results.append(SampledToken(token, chosen_logprobs[i], top))
        return results

    def _block_early_stops(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Before min_tokens, EOS and stop tokens cannot be sampled."""
        rows = [i for i, seq in enumerate(seqs) if seq.num_output_tokens < seq.params.min_tokens]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            banned = set(seqs[i].params.stop_token_ids)
            if not seqs[i].params.ignore_eos:
                banned |= self.eos_token_ids
            if banned:
                logits[i, list(banned)] = float("-inf")
        return logits
