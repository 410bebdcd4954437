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


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Per-row top-k (<= 0: off), top-p and min-p filtering; removed entries become -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    remove = ranks >= k
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    remove |= mass_before >= top_p.unsqueeze(1)  # keeps at least the most likely token
    remove |= probs < min_p.unsqueeze(1) * probs[:, :1]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


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
            scaled = logits[rows] / temperature
            if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
                scaled = filter_logits(
                    scaled,
                    torch.tensor([p.top_k for p in params], device=logits.device),
                    torch.tensor([p.top_p for p in params], device=logits.device),
                    torch.tensor([p.min_p for p in params], device=logits.device),
                )
            probs = scaled.softmax(dim=-1)
            # exponential race: argmax(p / E) with E ~ Exp(1) draws from p, with each sequence's own generator
            noise = torch.stack([torch.empty_like(probs[0]).exponential_(generator=seqs[i].generator)
                                 for i in random_rows])
            chosen[rows] = (probs / noise).argmax(dim=-1)

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
