"""Turns the engine core's token ids into what a client sees: text (incremental detokenization), logprobs with
token texts, stop strings and `stop_regex`, and each choice's delta since the last output.

Text that could still become the start of a stop string is held back until it is known not to be, so a client
never sees part of a stop string that is later trimmed. Stop strings may span tokens. A choice that a stop
string ends here is still running in the core: `process` says which sequences the core should abort.

Owned by one thread (the Triton responder, or LLMEngine's caller); it has its own tokenizer."""

from __future__ import annotations

import logging
from bisect import bisect_left
from dataclasses import dataclass, field

from tritonllm.engine.core.sequence import CoreOutput, SampledToken, SequenceUpdate
from tritonllm.interface.parameters import SamplingParams
from tritonllm.interface.tensors import FinishReason
from tritonllm.interface.tools import ToolSpec
from tritonllm.engine.processing.detokenizer import IncrementalDetokenizer
from tritonllm.engine.processing.outputs import ChoiceDelta, RequestOutput, TokenLogprob
from tritonllm.engine.processing.reasoning import ReasoningParser, ReasoningStart, ReasoningTags
from tritonllm.engine.processing.tool_calls import ToolCallParser

log = logging.getLogger(__name__)


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


@dataclass
class _Choice:
    index: int
    detokenizer: IncrementalDetokenizer
    text: str = ""
    num_sent_chars: int = 0
    num_output_tokens: int = 0
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    pending_token_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    pending_hidden_states: list = field(default_factory=list)
    pending_routed_experts: list = field(default_factory=list)
    tool_calls: ToolCallParser | None = None  # when the request's tools may be called: its text holds calls
    reasoning: ReasoningParser | None = None  # a reasoning model's chat: its text starts with the reasoning
    token_ends: list[int] = field(default_factory=list)  # len(text) after each token, while the reasoning runs
    num_reasoning_tokens: int | None = None  # once the reasoning has ended

    def reasoning_tokens(self) -> int:
        """The output tokens that the reasoning took so far (the one that completed its end tag included)."""
        if self.reasoning is None:
            return 0
        if self.num_reasoning_tokens is None and self.reasoning.reasoning_end is not None:
            self.num_reasoning_tokens = bisect_left(self.token_ends, self.reasoning.reasoning_end) + 1
            self.token_ends = []
        if self.num_reasoning_tokens is not None:
            return self.num_reasoning_tokens
        return self.num_output_tokens if self.reasoning.reasoning else 0


@dataclass
class _RequestState:
    params: SamplingParams
    prompt_token_ids: list[int]
    choices: list[_Choice]
    started: bool = False  # an output has gone out (the first carries the prompt's token ids)


class OutputProcessor:
    def __init__(self, tokenizer, reasoning_tags: ReasoningTags | None = None):
        self.tokenizer = tokenizer
        self.reasoning_tags = reasoning_tags  # the served model's (None: it does not reason in tags)
        self.requests: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    tools: ToolSpec | None = None, reasoning_start: ReasoningStart | None = None) -> None:
        parse_calls = tools is not None and tools.constrained
        choices = [_Choice(i, IncrementalDetokenizer(prompt_token_ids, params.skip_special_tokens),
                           tool_calls=ToolCallParser() if parse_calls else None,
                           reasoning=None if reasoning_start is None or not params.separate_reasoning else
                           ReasoningParser(self.reasoning_tags, reasoning_start))
                   for i in range(params.num_sequences)]
        self.requests[request_id] = _RequestState(params, prompt_token_ids, choices)

    def abort(self, request_id: str) -> None:
        """Forget a request (ended elsewhere, e.g. cancelled by its client): later core outputs are dropped."""
        self.requests.pop(request_id, None)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def process(self, output: CoreOutput) -> tuple[RequestOutput | None, list[int]]:
        """(what the client may see now, or None; the sequences the core should stop because a stop string
        ended them here). A request whose own processing fails ends with that error, alone."""
        state = self.requests.get(output.request_id)
        if state is None:  # ended already
            return None, []
        if output.error is not None:
            del self.requests[output.request_id]
            return RequestOutput(output.request_id, [], output.num_prompt_tokens, 0, True, error=output.error,
                                 times=output.times), []
        try:
            return self._process(state, output)
        except Exception as exc:
            log.exception("request %s failed while processing its output", output.request_id)
            del self.requests[output.request_id]
            still_running = [c.index for c in state.choices if c.finish_reason is None]
            return (RequestOutput(output.request_id, [], output.num_prompt_tokens, 0, True, error=exc,
                                  times=output.times), still_running)

    def _process(self, state: _RequestState, output: CoreOutput) -> tuple[RequestOutput | None, list[int]]:
        stopped_here = []
        touched = []
        for update in output.sequences:
            choice = state.choices[update.index]
            if choice.finish_reason is not None:
                continue  # ended by a stop string: what the core made after it is dropped
            self._apply(state.params, choice, update)
            touched.append(choice)
            if choice.finish_reason is not None and update.finish_reason is None:
                stopped_here.append(choice.index)
        choices = [delta for choice in touched if (delta := self._take_delta(state.params, choice))]
        finished = all(choice.finish_reason is not None for choice in state.choices)
        prompt_logprobs = None
        if output.prompt_logprobs is not None:
            first = state.prompt_token_ids[0]
            prompt_logprobs = [TokenLogprob(first, self.token_text(first), None, [])]
            prompt_logprobs += map(self._token_logprob, output.prompt_logprobs)
        if finished:
            del self.requests[output.request_id]
        if not choices and not finished and prompt_logprobs is None and output.prompt_hidden_states is None:
            return None, stopped_here
        prompt_token_ids = None if state.started else state.prompt_token_ids
        state.started = True
        return RequestOutput(output.request_id, choices, output.num_prompt_tokens, output.num_cached_tokens,
                             finished, prompt_token_ids=prompt_token_ids, prompt_logprobs=prompt_logprobs,
                             prompt_hidden_states=output.prompt_hidden_states, times=output.times,
                             cached_by_tier=output.cached_by_tier), stopped_here

    def _token_logprob(self, sampled: SampledToken) -> TokenLogprob:
        return TokenLogprob(sampled.token_id, self.token_text(sampled.token_id), sampled.logprob,
                            [(token_id, self.token_text(token_id), logprob) for token_id, logprob in sampled.top],
                            sampled.rank)

    def _apply(self, params: SamplingParams, choice: _Choice, update: SequenceUpdate) -> None:
        choice.pending_hidden_states += update.hidden_states
        choice.pending_routed_experts += update.routed_experts
        for sampled in update.tokens:
            choice.num_output_tokens += 1
            choice.cumulative_logprob += sampled.logprob
            choice.pending_token_ids.append(sampled.token_id)
            if params.logprobs is not None:
                choice.pending_logprobs.append(self._token_logprob(sampled))
            # a stop token's own text is not part of the output (unless no_stop_trim)
            trimmed = sampled.token_id == update.stop_token_id and not params.no_stop_trim
            searched_from = len(choice.text)
            choice.text += choice.detokenizer.add(self.tokenizer, sampled.token_id, decode=not trimmed)
            if choice.reasoning is not None and choice.reasoning.reasoning_end is None:
                choice.token_ends.append(len(choice.text))
            if (choice.num_output_tokens >= params.min_tokens and (params.stop or params.stop_regex)
                    and self._find_stop_string(params, choice, searched_from)):
                return
        if update.finish_reason is not None:
            choice.finish_reason = update.finish_reason
            choice.matched_stop = update.stop_token_id

    @staticmethod
    def _find_stop_string(params: SamplingParams, choice: _Choice, searched_from: int) -> bool:
        """End the choice at the earliest stop string or stop_regex match in its text, if any."""
        text = choice.text
        matches = []  # (start, end, matched_stop: the stop string, or the stop_regex pattern as SGLang says)
        if params.stop:
            start = max(0, searched_from - max(len(stop) for stop in params.stop) + 1)
            for stop in params.stop:
                found = text.find(stop, start)
                if found >= 0:
                    matches.append((found, found + len(stop), stop))
        # A regex match may start anywhere not yet sent (text it may still match is held back); matches in sent
        # text were made before min_tokens, and like stop strings made then they don't count.
        for pattern in params.stop_patterns:
            found = pattern.search(text, choice.num_sent_chars)
            if found:
                matches.append((found.start(), found.end(), pattern.pattern))
        if not matches:
            return False
        start, end, matched = min(matches)
        choice.text = text[:end] if params.no_stop_trim else text[:start]
        choice.finish_reason, choice.matched_stop = FinishReason.STOP, matched
        return True

    @staticmethod
    def _take_delta(params: SamplingParams, choice: _Choice) -> ChoiceDelta | None:
        """What the client may see now that it has not seen yet; None when there is nothing new."""
        finished = choice.finish_reason is not None
        text = choice.text
        end = len(text) if finished else \
            len(text) - held_back_length(text, params.stop, params.stop_patterns, choice.num_sent_chars)
        end = max(end, choice.num_sent_chars)
        new_text = text[choice.num_sent_chars:end]
        choice.num_sent_chars = end
        finish_reason, tool_calls, reasoning = choice.finish_reason, [], None
        if choice.reasoning is not None:  # the reasoning first: constraints and tool calls are the answer's
            reasoning, new_text = choice.reasoning.feed(new_text, finished)
        if choice.tool_calls is not None:  # the text's calls become tool-call deltas, the rest content
            new_text, tool_calls = choice.tool_calls.feed(new_text, finished)
            if finish_reason == FinishReason.STOP and choice.tool_calls.calls:
                finish_reason = FinishReason.TOOL_CALLS
        if not (new_text or reasoning or tool_calls or choice.pending_logprobs or choice.pending_hidden_states
                or choice.pending_routed_experts or finished):
            return None  # (its new tokens go with the next delta)
        delta = ChoiceDelta(
            index=choice.index, text=new_text, token_ids=choice.pending_token_ids, logprobs=choice.pending_logprobs,
            cumulative_logprob=choice.cumulative_logprob, num_output_tokens=choice.num_output_tokens,
            finish_reason=finish_reason, matched_stop=choice.matched_stop,
            hidden_states=choice.pending_hidden_states, routed_experts=choice.pending_routed_experts,
            tool_calls=tool_calls, reasoning=reasoning, num_reasoning_tokens=choice.reasoning_tokens())
        choice.pending_token_ids, choice.pending_logprobs = [], []
        choice.pending_hidden_states, choice.pending_routed_experts = [], []
        return delta
