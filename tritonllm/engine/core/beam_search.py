"""Beam search (vLLM's `use_beam_search`), deciding as transformers' `generate(num_beams=w, do_sample=False)` does.

A beam request's beams are ordinary sequences of the running batch (EngineCore forks and frees them). Each step,
every live beam's logits give its K best continuations by log-softmax of the raw logits (temperature and filters
play no part, as in vLLM; before min_tokens the stop tokens are banned), K = max(2, 1 + stop tokens) * w. Once every
live beam has offered its continuations, `advance` ranks them all by cumulative logprob and keeps the best K:
- among the best w of them, those that end (a stop token, or the length limit) are finished hypotheses, scored
  cumulative logprob / generated tokens ** length_penalty; the best w hypotheses are kept;
- the best w that go on are the next beams.
The search ends when no beam goes on, when `early_stopping` and w hypotheses are kept, or once w are kept and the
best running beam, at its length, cannot beat the worst of them (transformers' heuristic for early_stopping
false). The kept hypotheses, best first, are the request's choices."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tritonllm.engine.core.sampler import score, stop_tokens
from tritonllm.engine.core.sequence import SampledToken, Sequence, SequenceUpdate
from tritonllm.interface.tensors import FinishReason


@dataclass(frozen=True)
class Continuation:
    """A beam followed by one more token."""

    parent: Sequence
    token: SampledToken
    score: float  # the cumulative logprob with this token
    finish_reason: FinishReason | None  # why it would end here (None: it goes on)


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam: its output tokens and its length-penalized score."""

    tokens: list[SampledToken]
    score: float
    finish_reason: FinishReason
    stop_token_id: int | None


@dataclass
class BeamSearch:
    """One request's search: its live beams' scores and tokens, their offered continuations, the hypotheses."""

    width: int
    num_candidates: int  # K: the continuations kept per step
    length_penalty: float
    early_stopping: bool
    scores: dict[Sequence, float] = field(default_factory=dict)  # live beam → cumulative logprob
    tokens: dict[Sequence, list[SampledToken]] = field(default_factory=dict)  # live beam → its output tokens
    offers: dict[Sequence, list[Continuation]] = field(default_factory=dict)  # this step's, by live beam
    hypotheses: list[Hypothesis] = field(default_factory=list)  # best first, at most `width`
    done: bool = False

    @classmethod
    def start(cls, first: Sequence, num_stop_tokens: int) -> "BeamSearch":
        params = first.params
        width = params.num_sequences
        search = cls(width, max(2, 1 + num_stop_tokens) * width, params.length_penalty, params.early_stopping)
        search.scores[first], search.tokens[first] = 0.0, []
        return search

    def offer(self, beam: Sequence, continuations: list[Continuation]) -> None:
        """A live beam's best continuations this step (best first); an offer made again replaces the first."""
        self.offers[beam] = continuations

    def ready(self) -> bool:
        """Every live beam has offered its continuations."""
        return len(self.offers) == len(self.scores)

    def advance(self) -> list[Continuation]:
        """Rank the offers (see the module's docstring); returns the continuations that are the next beams, best
        first (none once `done`). The caller gives each a sequence, then calls `continue_with`."""
        ranked = sorted((c for offers in self.offers.values() for c in offers), key=lambda c: c.score,
                        reverse=True)[:self.num_candidates]
        self.offers = {}
        if not (self.early_stopping and len(self.hypotheses) == self.width):
            finished = [self._finished(c) for c in ranked[:self.width] if c.finish_reason is not None]
            self.hypotheses = sorted(self.hypotheses + finished, key=lambda h: h.score, reverse=True)[:self.width]
        going_on = [c for c in ranked if c.finish_reason is None][:self.width]
        num_generated = len(self.tokens[ranked[0].parent]) + 1
        full = len(self.hypotheses) == self.width
        self.done = (not going_on or (self.early_stopping and full) or
                     (full and going_on[0].score / num_generated ** self.length_penalty <= self.hypotheses[-1].score))
        if self.done:
            self.scores, self.tokens = {}, {}
            return []
        return going_on

    def continue_with(self, beams: list[tuple[Sequence, Continuation]]) -> None:
        """The next beams: each sequence now holds its continuation's tokens."""
        self.tokens = {beam: self.tokens[c.parent] + [c.token] for beam, c in beams}
        self.scores = {beam: c.score for beam, c in beams}

    def choices(self) -> list[SequenceUpdate]:
        """The request's choices once it has finished: the hypotheses, best first, or (cut short) aborted ones."""
        if not self.done:
            return [SequenceUpdate(index, [], FinishReason.ABORT) for index in range(self.width)]
        return [SequenceUpdate(index, hypothesis.tokens, hypothesis.finish_reason, hypothesis.stop_token_id)
                for index, hypothesis in enumerate(self.hypotheses)]

    def _finished(self, continuation: Continuation) -> Hypothesis:
        tokens = self.tokens[continuation.parent] + [continuation.token]
        stop_token = continuation.token.token_id if continuation.finish_reason is FinishReason.STOP else None
        return Hypothesis(tokens, continuation.score / len(tokens) ** self.length_penalty,
                          continuation.finish_reason, stop_token)


def offer_continuations(raw: torch.Tensor, beams: list[Sequence], eos_token_ids: set[int],
                        max_model_len: int) -> None:
    """Each beam offers its search the K best continuations of its logits row (raw: [beams, vocab])."""
    logprobs = torch.log_softmax(raw.float(), dim=-1)
    stops = [stop_tokens(beam.params, eos_token_ids) for beam in beams]
    ranked = logprobs
    banned = [i for i, beam in enumerate(beams) if beam.num_output_tokens < beam.params.min_tokens and stops[i]]
    if banned:
        ranked = logprobs.clone()
        for i in banned:
            ranked[i, stops[i]] = float("-inf")
    most = min(max(beam.request.beams.num_candidates for beam in beams), raw.shape[-1])
    values, ids = ranked.topk(most, dim=-1)
    for i, beam in enumerate(beams):
        search, params = beam.request.beams, beam.params
        k = min(search.num_candidates, most)
        tokens = ids[i, :k]
        if params.logprobs is None:
            sampled = [SampledToken(token, logprob) for token, logprob in
                       zip(tokens.tolist(), logprobs[i].gather(0, tokens).tolist())]
        else:  # with their rank and alternatives, as a sampled token's
            row = raw[i].float().expand(k, -1)
            sampled = score(row, tokens, torch.logsumexp(row, dim=-1), [params.logprobs] * k)
        length_ends = (beam.num_output_tokens + 1 >= beam.request.max_tokens or beam.num_tokens + 1 >= max_model_len)
        stop_set = set(stops[i])
        search.offer(beam, [
            Continuation(beam, token, search.scores[beam] + value,
                         FinishReason.STOP if token.token_id in stop_set else
                         FinishReason.LENGTH if length_ends else None)
            for token, value in zip(sampled, values[i, :k].tolist())])
