"""Chooses the next token of each sequence from its logits.

Logits are first adjusted (min_tokens bans, logit_bias, repetition/frequency/presence penalties, and last the
token bitmask of a constrained sequence's grammar, so nothing can re-enable a token it forbids), then the
token is greedy or drawn with temperature (kernels.sample_tokens: on the CPU a fused op that also gives the
softmax normalizer logprobs need) or with top-k / top-p / min-p too (kernels.filter_probs), each sequence from
its own generator so a seeded request is reproducible whatever else runs beside it. Logprobs are those of the
model's raw distribution (before any adjustment, temperature or filtering), as in vLLM and SGLang."""

from __future__ import annotations

import torch

from tritonllm.engine.core.sequence import SampledToken, Sequence
from tritonllm.interface.parameters import SamplingParams
from tritonllm.engine.core.structured_output import BitmaskFiller
from tritonllm.kernels import apply_logit_bias, apply_penalties, apply_token_bitmask, filter_probs, sample_tokens
from tritonllm.kernels.sampling import sample_from


def score(raw: torch.Tensor, tokens: torch.Tensor, log_normalizers: torch.Tensor,
          num_top: list[int | None]) -> list[SampledToken]:
    """Each row's logprob of its token under softmax(raw) (log_normalizers: log Σ exp of each row); a row whose
    num_top is set (logprobs asked for) also gets the token's rank and its num_top most likely alternatives."""
    chosen_logits = raw.gather(1, tokens.unsqueeze(1))
    chosen = (chosen_logits.squeeze(1) - log_normalizers).tolist()
    ranks = {}
    wanted = [i for i, k in enumerate(num_top) if k is not None]
    if wanted:  # vLLM's rank: 1 + the tokens strictly more likely
        rows = torch.tensor(wanted, device=raw.device)
        ranks = dict(zip(wanted, ((raw[rows] > chosen_logits[rows]).sum(dim=-1) + 1).tolist()))
    top_values = top_ids = []
    most = max((k or 0 for k in num_top), default=0)
    if most:
        values, ids = raw.topk(most, dim=-1)
        top_values, top_ids = (values - log_normalizers.unsqueeze(1)).tolist(), ids.tolist()
    return [SampledToken(token, chosen[i], tuple(zip(top_ids[i][:k], top_values[i][:k])) if k else (),
                         ranks.get(i))
            for i, (token, k) in enumerate(zip(tokens.tolist(), num_top))]


def stop_tokens(params: SamplingParams, eos_token_ids: set[int]) -> list[int]:
    """The tokens that end a sequence of these parameters: its stop tokens, and EOS unless ignore_eos."""
    stops = set(params.stop_token_ids)
    if not params.ignore_eos:
        stops |= eos_token_ids
    return sorted(stops)


class Sampler:
    def __init__(self, eos_token_ids: set[int], vocab_size: int):
        self.eos_token_ids = eos_token_ids
        self.bitmasks = BitmaskFiller(vocab_size)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken]:
        raw, device = logits, logits.device
        logits = self._adjust(logits, seqs)
        params = [seq.params for seq in seqs]
        drawn = [i for i, p in enumerate(params) if not p.greedy]
        filtered = [i for i in drawn if params[i].has_filters]
        uniforms = torch.zeros(len(seqs), device=device)
        if drawn:  # one draw per sequence from its own generator: reproducible whatever else is in the batch
            uniforms[torch.tensor(drawn, device=device)] = torch.cat(
                [torch.rand(1, generator=seqs[i].generator, device=device) for i in drawn])
        # a filtered row is drawn below from its filtered distribution (here it gets its argmax, cheaply)
        inverse_temperatures = torch.tensor([0.0 if p.greedy or p.has_filters else 1.0 / p.temperature
                                             for p in params], device=device)
        tokens, log_normalizers = sample_tokens(logits, raw, inverse_temperatures, uniforms)
        if filtered:
            rows = torch.tensor(filtered, device=device)
            kept = [params[i] for i in filtered]
            temperature = torch.tensor([p.temperature for p in kept], device=device).unsqueeze(1)
            probs = filter_probs(
                (logits[rows] / temperature).softmax(dim=-1),
                torch.tensor([p.top_k for p in kept], device=device),
                torch.tensor([p.top_p for p in kept], device=device),
                torch.tensor([p.min_p for p in kept], device=device),
            )
            tokens[rows] = sample_from(probs, uniforms[rows])
        return score(raw, tokens, log_normalizers, [p.logprobs for p in params])

    def _adjust(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """min_tokens bans, logit_bias, penalties and grammars; returns logits unchanged (not copied) when none
        apply."""
        bans = {i: stop_tokens(seq.params, self.eos_token_ids) for i, seq in enumerate(seqs)
                if seq.num_output_tokens < seq.params.min_tokens}
        biased = [i for i, seq in enumerate(seqs) if seq.params.logit_bias]
        penalized = [i for i, seq in enumerate(seqs) if seq.params.has_penalties]
        constrained = any(seq.has_token_mask for seq in seqs)
        if not (bans or biased or penalized or constrained):
            return logits
        logits = logits.clone()
        if biased:
            entries = [(i, token, bias) for i in biased for token, bias in seqs[i].params.logit_bias.items()]
            rows, token_ids, biases = zip(*entries)
            apply_logit_bias(logits, torch.tensor(rows, device=logits.device),
                             torch.tensor(token_ids, device=logits.device),
                             torch.tensor(biases, dtype=logits.dtype, device=logits.device))
        if penalized:
            logits[penalized] = self._penalize(logits[penalized], [seqs[i] for i in penalized])
        for i, banned in bans.items():
            if banned:
                logits[i, banned] = float("-inf")
        if constrained:
            bitmask = self.bitmasks.fill(seqs)
            apply_token_bitmask(logits, bitmask.to(logits.device, non_blocking=True))
        return logits

    @staticmethod
    def _penalize(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        rows, vocab, device = len(seqs), logits.shape[-1], logits.device
        output_counts = torch.zeros(rows, vocab, dtype=logits.dtype, device=device)
        prompt_mask = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
        for row, seq in enumerate(seqs):
            output = torch.tensor(seq.output_token_ids, dtype=torch.long, device=device)
            output_counts[row].index_add_(0, output, torch.ones_like(output, dtype=logits.dtype))
            prompt_mask[row, seq.token_ids[:seq.num_prompt_tokens]] = True

        def column(name: str) -> torch.Tensor:
            return torch.tensor([getattr(seq.params, name) for seq in seqs], dtype=logits.dtype, device=device)

        return apply_penalties(logits, output_counts, prompt_mask, column("repetition_penalty"),
                               column("frequency_penalty"), column("presence_penalty"))
