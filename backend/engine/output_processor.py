"""Applies each sampled token to its sequence: its grammar, stop tokens, stop strings, max_tokens, and what may
be sent.

Text that could still become the start of a stop string is held back until it is known not to be, so a
client never sees part of a stop string that is later trimmed. Stop strings may span tokens."""

from __future__ import annotations

from backend.engine.detokenizer import IncrementalDetokenizer
from backend.engine.sampler import SampledToken
from backend.engine.sequence import ChoiceDelta, Sequence, SequenceStatus, TokenLogprob
from backend.engine.structured_output import advance


def held_back_length(text: str, stops: list[str], patterns: list, searched_from: int) -> int:
    """How much of text's end may still become (part of) a stop: the longest suffix that is a proper prefix of
    a stop string, or everything from where a stop_regex partially matches up to the end."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    for pattern in patterns:
        match = pattern.search(text, searched_from, partial=True)
        if match is not None and match.partial:
            longest = max(longest, len(text) - match.start())
    return longest


class OutputProcessor:
    def __init__(self, detokenizer: IncrementalDetokenizer, eos_token_ids: set[int], max_model_len: int):
        self.detokenizer = detokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def token_logprob(self, sampled: SampledToken) -> TokenLogprob:
        text = self.detokenizer.token_text
        return TokenLogprob(sampled.token_id, text(sampled.token_id), sampled.logprob,
                            [(token_id, text(token_id), logprob) for token_id, logprob in sampled.top])

    def append_token(self, seq: Sequence, sampled: SampledToken) -> None:
        """Add the sampled token; sets seq.finish_reason when the sequence is done."""
        seq.token_ids.append(sampled.token_id)
        seq.cumulative_logprob += sampled.logprob
        params = seq.params
        if params.logprobs is not None:
            seq.pending_logprobs.append(self.token_logprob(sampled))
        grammar_complete = seq.grammar is not None and advance(seq.grammar, sampled.token_id)

        may_stop = seq.num_output_tokens >= params.min_tokens
        stop_token = may_stop and (
            sampled.token_id in params.stop_token_ids
            or (not params.ignore_eos and sampled.token_id in self.eos_token_ids))
        if stop_token and not params.no_stop_trim:  # the stop token's own text is not part of the output
            self._finish(seq, "stop", sampled.token_id)
            return
        searched_from = len(seq.output_text)
        seq.output_text += self.detokenizer.decode_new_text(seq)
        if stop_token:
            self._finish(seq, "stop", sampled.token_id)
            return
        if may_stop and (params.stop or params.stop_regex) and self._find_stop_string(seq, searched_from):
            return
        if grammar_complete:  # e.g. a JSON object's closing brace: only EOS could follow
            self._finish(seq, "stop", None)
            return
        if seq.num_output_tokens >= seq.request.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length", None)

    @staticmethod
    def _finish(seq: Sequence, reason: str, matched: str | int | None) -> None:
        seq.finish_reason, seq.matched_stop = reason, matched

    def _find_stop_string(self, seq: Sequence, searched_from: int) -> bool:
        """End the sequence at the earliest stop string or stop_regex match in its text, if any."""
        params, text = seq.params, seq.output_text
        matches = []  # (start, end, what matched)
        if params.stop:
            start = max(0, searched_from - max(len(stop) for stop in params.stop) + 1)
            for stop in params.stop:
                found = text.find(stop, start)
                if found >= 0:
                    matches.append((found, found + len(stop), stop))
        for pattern in params.stop_patterns:  # a regex may match anywhere, so the whole text is searched
            found = pattern.search(text)
            if found:
                matches.append((found.start(), found.end(), found.group(0)))
        if not matches:
            return False
        start, end, matched = min(matches)
        seq.output_text = text[:end] if params.no_stop_trim else text[:start]
        self._finish(seq, "stop", matched)
        return True

    def take_delta(self, seq: Sequence) -> ChoiceDelta | None:
        """What the client may see now that it has not seen yet; None when there is nothing new."""
        text = seq.output_text
        params = seq.params
        end = len(text) if seq.is_finished else \
            len(text) - held_back_length(text, params.stop, params.stop_patterns, seq.num_sent_chars)
        end = max(end, seq.num_sent_chars)
        new_text = text[seq.num_sent_chars:end]
        if not new_text and not seq.pending_logprobs and not seq.pending_hidden_states \
                and not seq.pending_routed_experts and not seq.is_finished:
            return None
        seq.num_sent_chars = end
        logprobs, seq.pending_logprobs = seq.pending_logprobs, []
        hidden_states, seq.pending_hidden_states = seq.pending_hidden_states, []
        routed_experts, seq.pending_routed_experts = seq.pending_routed_experts, []
        return ChoiceDelta(
            index=seq.index, text=new_text, logprobs=logprobs,
            cumulative_logprob=seq.cumulative_logprob, num_output_tokens=seq.num_output_tokens,
            finish_reason=seq.finish_reason if seq.status is SequenceStatus.FINISHED else None,
            matched_stop=seq.matched_stop if seq.status is SequenceStatus.FINISHED else None,
            hidden_states=hidden_states, routed_experts=routed_experts,
        )
