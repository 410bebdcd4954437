"""The engine core's data: a request on token ids and its sequences (one per choice), and what the core emits
for them. No text here: tokenization and detokenization happen in tritonllm/engine/processing."""

from __future__ import annotations

import enum
import itertools
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from tritonllm.interface.parameters import SamplingParams
from tritonllm.engine.layers.lora import LoraAdapter

if TYPE_CHECKING:
    from tritonllm.engine.core.beam_search import BeamSearch


_arrivals = itertools.count()  # (next() is atomic: requests are made on Triton's threads)


@dataclass(frozen=True)
class CachedTokens:
    """Prompt tokens served from the prefix cache, by the tier they came from (device pool, host memory,
    storage)."""

    device: int = 0
    host: int = 0
    storage: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.storage

    def by_tier(self) -> tuple[int, int, int]:
        return self.device, self.host, self.storage

    def within(self, limit: int) -> "CachedTokens":
        """The first `limit` tokens of these, in tier order (a resumed sequence's cache holds output tokens too)."""
        device = min(self.device, limit)
        host = min(self.host, limit - device)
        return CachedTokens(device, host, min(self.storage, limit - device - host))

    def __add__(self, other: "CachedTokens") -> "CachedTokens":
        return CachedTokens(self.device + other.device, self.host + other.host, self.storage + other.storage)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # off the queue, waiting for its prefix's blocks from storage (scheduler.py)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float  # in the model's raw distribution
    top: tuple[tuple[int, float], ...] = ()  # the requested number of most likely (token id, logprob)
    rank: int | None = None  # 1 + the tokens more likely than it, when logprobs were asked for


@dataclass
class CoreRequest:
    """A validated request as the core runs it (made by processing.InputProcessor)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens resolved against the context length
    lora: LoraAdapter | None = None
    grammar: Future | None = None  # the compiling matcher of a constrained request
    allowed_tokens: np.ndarray | None = None  # [bitmask words] int32 of params.allowed_token_ids, built once
    reasoning_start: enum.Enum | None = None  # a chat's processing.reasoning.ReasoningStart, for the output
    # processor (None: no reasoning to parse); the core does not read it
    sequences: list["Sequence"] = field(default_factory=list)  # its choices; under beam search its live beams
    beams: "BeamSearch | None" = None  # the search of a use_beam_search request (the core makes it)
    prompt_logprobs_sent: bool = False
    prompt_hidden_states_sent: bool = False
    arrival: int = field(default_factory=lambda: next(_arrivals))  # the order requests arrived in
    queued_at: float | None = None  # time.monotonic() when the core received it
    scheduled_at: float | None = None  # ... and first scheduled a sequence of it

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.sequences)

    def times(self) -> "RequestTimes | None":
        return None if self.queued_at is None else RequestTimes(self.queued_at, self.scheduled_at)


class Sequence:
    """One choice of a request: prompt + generated tokens, its KV blocks and what it has not emitted yet."""

    def __init__(self, request: CoreRequest, index: int, generator: torch.Generator):
        self.request = request
        self.index = index
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.full_block_keys: list[bytes] = []  # prefix-cache key of each full block, in order
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.prefix_matched = False  # its cached prefix is in block_table (until its blocks are freed)
        self.cached_tokens = CachedTokens()  # prompt tokens that came from the prefix cache at first admission
        self.generator = generator
        self.grammar = None  # llguidance matcher of a constrained request (structured_output.py), else None
        self.lora_slot = -1  # the adapter's slot in the LoRA pool while running; −1 = none (or not admitted)
        self.finish_reason: str | None = None
        self.stop_token_id: int | None = None  # the stop token (EOS included) that ended it
        # not emitted yet
        self.pending_tokens: list[SampledToken] = []
        self.pending_hidden_states: list[torch.Tensor] = []  # [hidden] rows
        self.pending_routed_experts: list[torch.Tensor] = []  # [MoE layers, top_k] expert ids
        # filled during prefill when requested
        self.prompt_logprobs: list[SampledToken] = []  # of prompt positions 1.. (position 0 has none)
        self.prompt_hidden_states: list[torch.Tensor] = []  # [rows, hidden] chunks

    def fork(self, index: int) -> "Sequence":
        """A copy of this sequence (a beam search's beam chosen twice) with none of its KV blocks yet; its prompt
        logprobs and cached tokens are the parent's (the request's)."""
        child = Sequence(self.request, index, self.generator)
        child.token_ids = list(self.token_ids)
        child.cached_tokens = self.cached_tokens
        child.prompt_logprobs = self.prompt_logprobs
        return child

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and not all computed: its prompt must not come from the cache."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def has_token_mask(self) -> bool:
        """Its grammar or its request's allowed_token_ids limit the tokens it may sample."""
        return self.grammar is not None or self.request.allowed_tokens is not None

    @property
    def num_prompt_hidden_states(self) -> int:
        return sum(chunk.shape[0] for chunk in self.prompt_hidden_states)

    @property
    def needs_prompt_hidden_states(self) -> bool:
        """Like needs_prompt_logprobs, for the prompt's hidden states."""
        return self.params.return_prompt_hidden_states and self.num_prompt_hidden_states < self.num_prompt_tokens


@dataclass
class SequenceUpdate:
    """What one sequence produced since its last update."""

    index: int
    tokens: list[SampledToken]
    finish_reason: str | None  # None while it runs: length, stop (a stop token or a complete grammar), abort
    stop_token_id: int | None = None  # the stop token that finished it, if one did
    hidden_states: list[torch.Tensor] = field(default_factory=list)  # [hidden] per new token, when asked for
    routed_experts: list[torch.Tensor] = field(default_factory=list)  # [MoE layers, top_k] per new token


@dataclass(frozen=True)
class RequestTimes:
    """When the core received a request and first scheduled one of its sequences, by time.monotonic() (one clock
    for every thread of the process): with the responder's own times of the outputs they make the queue, prefill
    and decode times."""

    queued: float
    scheduled: float | None  # None while it has not been scheduled (or if it never was)


@dataclass
class CoreOutput:
    """One request's news from one engine step."""

    request_id: str
    sequences: list[SequenceUpdate]
    num_prompt_tokens: int
    num_cached_tokens: int
    finished: bool  # every sequence has finished in the core
    error: Exception | None = None
    prompt_logprobs: list[SampledToken] | None = None  # of prompt positions 1.., once the prompt is processed
    prompt_hidden_states: torch.Tensor | None = None  # [prompt tokens, hidden], once likewise
    times: RequestTimes | None = None  # None: the core never took the request (e.g. refused by a dead engine)
    cached_by_tier: tuple[int, int, int] = (0, 0, 0)  # num_cached_tokens by tier: device, host, storage
