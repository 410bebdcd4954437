"""What request processing hands to the Triton glue: per request, each choice's new text and what came with it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tritonllm.engine.core.sequence import RequestTimes


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float | None  # None for the first prompt token, which nothing predicts
    top: list[tuple[int, str, float]]  # the most likely alternatives, most likely first: (id, text, logprob)
    rank: int | None = None  # 1 + the tokens more likely than it (None for the first prompt token)


@dataclass
class ChoiceDelta:
    """What one choice produced since the last output."""

    index: int
    text: str
    logprobs: list[TokenLogprob]  # of the new tokens, when asked for
    cumulative_logprob: float
    num_output_tokens: int
    finish_reason: str | None
    matched_stop: str | int | None = None
    hidden_states: list[torch.Tensor] = field(default_factory=list)  # [hidden] per new token, when asked for
    routed_experts: list[torch.Tensor] = field(default_factory=list)  # [MoE layers, top_k] per new token, likewise
    token_ids: list[int] = field(default_factory=list)  # the new tokens (a trimmed stop token included)
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI's tool-call deltas of the new text (tool_calls.py)
    reasoning: str | None = None  # the new reasoning text (reasoning.py; `text` is the answer's); None: not parsed
    num_reasoning_tokens: int = 0  # of num_output_tokens, those of the reasoning (its end tag's included)


@dataclass
class RequestOutput:
    request_id: str
    choices: list[ChoiceDelta]
    num_prompt_tokens: int
    num_cached_tokens: int
    finished: bool
    error: Exception | None = None
    prompt_token_ids: list[int] | None = None  # in the request's first output
    prompt_logprobs: list[TokenLogprob] | None = None  # sent once, when the prompt has been processed
    prompt_hidden_states: torch.Tensor | None = None  # [prompt tokens, hidden], sent once likewise
    times: RequestTimes | None = None  # the core's, for the metrics (None: the core never took the request)
    cached_by_tier: tuple[int, int, int] = (0, 0, 0)  # num_cached_tokens by tier: device, host, storage
