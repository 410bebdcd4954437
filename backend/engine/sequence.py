"""A request and its sequences (one per choice), with the state the scheduler and output processor share."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
import torch

from backend.engine.lora import LoraAdapter
from backend.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float | None  # None for the first prompt token, which nothing predicts
    top: list[tuple[int, str, float]]  # the most likely alternatives: (id, text, logprob)


class Sequence:
    """One choice of a request: prompt + generated tokens, its KV blocks and what has been sent so far."""

    def __init__(self, request: "Request", index: int, prompt_token_ids: list[int], generator: torch.Generator):
        self.request = request
        self.index = index
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.full_block_keys: list[int] = []  # prefix-cache key of each full block, in order
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # prompt tokens that came from the prefix cache at first admission
        self.generator = generator
        self.grammar = None  # llguidance matcher of a constrained request (structured_output.py), else None
        # output side
        self.output_text = ""
        self.num_sent_chars = 0
        self.cumulative_logprob = 0.0
        self.pending_logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob] = []  # filled during prefill when requested
        self.pending_hidden_states: list[torch.Tensor] = []  # [hidden] rows of tokens not yet sent
        self.prompt_hidden_states: list[torch.Tensor] = []  # [rows, hidden] chunks, filled during prefill
        self.pending_routed_experts: list[torch.Tensor] = []  # [MoE layers, top_k] expert ids of tokens not yet sent
        self.lora_slot = -1  # the adapter's slot in the LoRA pool while running; −1 = none (or not admitted)
        self.finish_reason: str | None = None
        self.matched_stop: str | int | None = None  # the stop string / token id that ended it
        # incremental detokenizer offsets (into token_ids)
        self.prefix_offset = max(self.num_prompt_tokens - 5, 0)
        self.read_offset = self.num_prompt_tokens

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
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def num_prompt_hidden_states(self) -> int:
        return sum(chunk.shape[0] for chunk in self.prompt_hidden_states)

    @property
    def needs_prompt_hidden_states(self) -> bool:
        """Like needs_prompt_logprobs, for the prompt's hidden states."""
        return self.params.return_prompt_hidden_states and self.num_prompt_hidden_states < self.num_prompt_tokens

    @property
    def prefix_cache_salt(self) -> str | None:
        """KV computed under one adapter is not valid for another (or the base model): the cache keys differ."""
        return None if self.request.lora is None else self.request.lora.name


@dataclass
class ChoiceDelta:
    """What one choice produced since the last output."""

    index: int
    text: str
    logprobs: list[TokenLogprob]
    cumulative_logprob: float
    num_output_tokens: int
    finish_reason: str | None
    matched_stop: str | int | None = None
    hidden_states: list[torch.Tensor] = field(default_factory=list)  # [hidden] per new token, when asked for
    routed_experts: list[torch.Tensor] = field(default_factory=list)  # [MoE layers, top_k] per new token, likewise


@dataclass
class RequestOutput:
    request_id: str
    choices: list[ChoiceDelta]
    num_prompt_tokens: int
    num_cached_tokens: int
    finished: bool
    error: Exception | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # sent once, when the prompt has been processed
    prompt_hidden_states: torch.Tensor | None = None  # [prompt tokens, hidden], sent once likewise


@dataclass
class Request:
    request_id: str
    prompt: str | list[int] | list[dict]  # text, token ids or chat messages (see LLMEngine._tokenize)
    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    sequences: list[Sequence] = field(default_factory=list)
    max_tokens: int = 0  # params.max_tokens resolved against the context length
    prompt_logprobs_sent: bool = False
    prompt_hidden_states_sent: bool = False
    lora: LoraAdapter | None = None  # resolved from params.lora_path when the request is added

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.sequences)
