"""The synchronous engine: `add_request`, `abort_request`, and `step()` = schedule → run → sample → process.

Importable and testable without Triton; `EngineLoop` drives it from its own thread."""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoTokenizer

from backend.config import EngineConfig
from backend.engine.block_manager import BlockManager
from backend.engine.detokenizer import IncrementalDetokenizer
from backend.engine.lora import AdapterDirectory, LoraAdapter
from backend.engine.model_runner import ModelRunner, PromptHiddenStates, PromptLogits
from backend.engine.output_processor import OutputProcessor
from backend.engine.sampler import Sampler, score
from backend.engine.sampling_params import SamplingParams
from backend.engine.scheduler import Scheduler
from backend.engine.structured_output import GrammarCompiler
from backend.engine.sequence import Request, RequestOutput, Sequence, TokenLogprob
from backend.errors import InvalidRequest
from backend.model_files import resolve_model_path

log = logging.getLogger(__name__)


def eos_token_ids(model_dir: Path, tokenizer) -> set[int]:
    ids = set()
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.exists():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [] if value is None else [value])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class LLMEngine:
    def __init__(self, config: EngineConfig):
        started = time.monotonic()
        self.config = config
        self.model_dir = resolve_model_path(config.model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.runner = ModelRunner(config, self.model_dir)
        arch = self.runner.model.arch
        self.max_model_len = min(config.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings)
        self.eos_token_ids = eos_token_ids(self.model_dir, self.tokenizer)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.adapters = (AdapterDirectory(config.lora_dir, arch, config.max_lora_rank) if config.lora_dir else None)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.runner.lora_slots)
        self.sampler = Sampler(self.eos_token_ids, self.vocab_size)
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.output_processor = OutputProcessor(IncrementalDetokenizer(self.tokenizer), self.eos_token_ids,
                                                self.max_model_len)
        self.requests: dict[str, Request] = {}
        self.ready_outputs: list[RequestOutput] = []  # produced outside step(): aborts
        self.compiling: dict[str, Future] = {}  # request id → its grammar, compiling; not yet scheduled
        self.on_grammar_ready: Callable[[], None] = lambda: None  # the engine loop's wake-up call
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        log.info("engine ready in %.1f s: %s, max_model_len %d", time.monotonic() - started,
                 self.model_dir, self.max_model_len)

    @property
    def vocab_size(self) -> int:
        return self.runner.model.arch.vocab_size

    def add_request(self, request: Request) -> None:
        """Tokenize, validate and queue a request. Raises InvalidRequest; the request is then not queued."""
        if request.request_id in self.requests:
            raise InvalidRequest(f"duplicate request id {request.request_id!r}")
        request.prompt_token_ids = self._tokenize(request.prompt)
        prompt_len = len(request.prompt_token_ids)
        capacity = min(self.max_model_len, self.block_manager.num_blocks * self.block_manager.block_size)
        if prompt_len >= capacity:
            raise InvalidRequest(f"the prompt has {prompt_len} tokens; this model accepts at most {capacity - 1}")
        max_tokens = request.params.max_tokens
        request.max_tokens = capacity - prompt_len if max_tokens is None else max_tokens
        if prompt_len + request.max_tokens > capacity:
            raise InvalidRequest(
                f"prompt ({prompt_len} tokens) + max_tokens ({request.max_tokens}) exceeds the context length "
                f"of {capacity} tokens")
        self._check_token_ids(request.params)
        self._check_extensions(request)
        request.lora = self._adapter(request.params.lora_path)
        for index in range(request.params.num_sequences):
            generator = torch.Generator(device=self.runner.device)
            if request.params.seed is None:
                generator.seed()
            else:
                generator.manual_seed(request.params.seed + index)
            request.sequences.append(Sequence(request, index, request.prompt_token_ids, generator))
        self.requests[request.request_id] = request
        self.num_prompt_tokens += prompt_len
        if request.params.constraint is not None:
            # scheduled once compiled (see _admit_compiled): a slow compile holds back this request alone
            self.compiling[request.request_id] = self.grammars.compile(*request.params.constraint,
                                                                       on_done=lambda: self.on_grammar_ready())
            return
        for seq in request.sequences:
            self.scheduler.add(seq)

    def _admit_compiled(self, outputs: list[RequestOutput]) -> None:
        """Schedule the requests whose grammar is ready, each sequence with its own matcher; fail the ones
        whose grammar is invalid."""
        for request_id, future in list(self.compiling.items()):
            if not future.done():
                continue
            error = future.exception()
            if error is not None:
                outputs.append(self.fail_request(request_id, error))
                continue
            del self.compiling[request_id]
            for seq in self.requests[request_id].sequences:
                seq.grammar = future.result().deep_copy()
                self.scheduler.add(seq)

    def _check_token_ids(self, params: SamplingParams) -> None:
        for name, token_ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias)):
            bad = [t for t in token_ids if t >= self.vocab_size]
            if bad:
                raise InvalidRequest(f"{name} has token id {bad[0]}, outside the vocabulary [0, {self.vocab_size})")

    def _check_extensions(self, request: Request) -> None:
        params = request.params
        if params.return_routed_experts and not self.runner.model.arch.is_moe:
            raise InvalidRequest(f"the model {self.model_dir.name} has no experts (dense Llama): "
                                 "return_routed_experts needs a mixture-of-experts model", "return_routed_experts")
        if params.return_hidden_states or params.return_prompt_hidden_states:
            per_choice = (request.max_tokens if params.return_hidden_states else 0) + \
                (len(request.prompt_token_ids) if params.return_prompt_hidden_states else 0)
            rows = per_choice * params.num_sequences
            if rows > self.config.max_hidden_states_tokens:
                raise InvalidRequest(
                    f"return_hidden_states would return {rows} hidden states (choices × (max_tokens + echoed prompt "
                    f"tokens)); this server's max_hidden_states_tokens is {self.config.max_hidden_states_tokens}: "
                    "lower max_tokens or n", "return_hidden_states")

    def _adapter(self, lora_path: str | None) -> LoraAdapter | None:
        """The request's LoRA adapter: the loaded one when resident, else read from its files."""
        if lora_path is None:
            return None
        if self.adapters is None:
            raise InvalidRequest("LoRA adapters are not enabled on this server (no lora_dir)", "lora_path")
        name = self.adapters.resolve(lora_path)
        return self.runner.lora_slots.resident(name) or self.adapters.load(name)

    def _tokenize(self, prompt: str | list[int] | list[dict]) -> list[int]:
        """Token ids of a text, token-id or chat-messages prompt."""
        if prompt and isinstance(prompt[0], dict):
            # The rendered template carries its own special tokens (BOS included where the model has one).
            token_ids = self.tokenizer.encode(self._render_chat(prompt), add_special_tokens=False)
        elif isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = [int(t) for t in prompt]
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if not token_ids:
            raise InvalidRequest("the prompt is empty")
        return token_ids

    def _render_chat(self, messages: list[dict]) -> str:
        """The model's own chat template applied to the messages, ready for the assistant's answer."""
        if not self.tokenizer.chat_template:
            raise InvalidRequest(f"the model {self.model_dir.name} has no chat template: send text_input or "
                                 "input_ids instead of messages")
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as error:  # templates may raise on their own, e.g. on an unexpected role order
            raise InvalidRequest(f"the chat template rejected the messages: {error}") from None

    def abort_request(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is None:
            return
        self.compiling.pop(request_id, None)
        live = [seq for seq in request.sequences if not seq.is_finished]
        for seq in live:
            seq.finish_reason = "abort"
            self.scheduler.finish(seq)
        self._emit(request, live, self.ready_outputs)

    def has_work(self) -> bool:
        """Whether step() has anything to do now (a request whose grammar still compiles has not)."""
        return (self.scheduler.has_work() or bool(self.ready_outputs)
                or any(future.done() for future in self.compiling.values()))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self.ready_outputs)

    def num_waiting_requests(self) -> int:
        """Requests not running yet: compiling their grammar or waiting for admission."""
        return self.scheduler.num_waiting_requests() + len(self.compiling)

    def step(self) -> list[RequestOutput]:
        outputs, self.ready_outputs = self.ready_outputs, []
        self._admit_compiled(outputs)
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return outputs
        result = self.runner.execute(scheduled)
        logits, sample_seqs = result.logits, result.sample_seqs
        failed: dict[str, Exception] = {}  # request id → what went wrong in its own post-processing

        def isolated(seq: Sequence, work, *args) -> None:
            """Run per-request work; an exception fails that request alone, not the batch."""
            if seq.request.request_id in failed:
                return
            try:
                work(*args)
            except Exception as exc:
                log.exception("request %s failed while processing its output", seq.request.request_id)
                failed[seq.request.request_id] = exc

        for chunk in result.prompt_logits:
            isolated(chunk.seq, self._record_prompt_logprobs, chunk)
        for chunk in result.prompt_hidden:
            self._record_prompt_hidden_states(chunk)
        for item in scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(item.seq)
        # max_tokens=0 (e.g. scoring a prompt with echo + logprobs): the prompt is processed, nothing sampled
        for seq in sample_seqs:
            if seq.request.max_tokens == 0:
                seq.finish_reason = "length"
        generating = [i for i, seq in enumerate(sample_seqs) if seq.finish_reason is None]
        if generating:
            for i, sampled in zip(generating, self.sampler(logits[generating], [sample_seqs[i] for i in generating])):
                isolated(sample_seqs[i], self.output_processor.append_token, sample_seqs[i], sampled)
                if sample_seqs[i].params.return_hidden_states:
                    sample_seqs[i].pending_hidden_states.append(result.sample_hidden[i])
                if sample_seqs[i].params.return_routed_experts:
                    sample_seqs[i].pending_routed_experts.append(result.sample_routed_experts[i])
                self.num_generated_tokens += 1
        touched: dict[str, list[Sequence]] = {}
        for seq in sample_seqs:
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
            touched.setdefault(seq.request.request_id, []).append(seq)
        for request_id, seqs in touched.items():
            if request_id not in failed:
                isolated(seqs[0], self._emit, self.requests[request_id], seqs, outputs)
        for request_id, exc in failed.items():
            outputs.append(self.fail_request(request_id, exc))
        return outputs

    def fail_request(self, request_id: str, exc: Exception) -> RequestOutput:
        """End a request with an error: its sequences stop and free their blocks."""
        request = self.requests.pop(request_id)
        self.compiling.pop(request_id, None)
        for seq in request.sequences:
            if not seq.is_finished:
                self.scheduler.finish(seq)
        return RequestOutput(request_id, [], len(request.prompt_token_ids), 0, True, error=exc)

    def _record_prompt_logprobs(self, chunk: PromptLogits) -> None:
        seq = chunk.seq
        if len(seq.prompt_logprobs) != (chunk.start + 1 if chunk.start else 0):  # recorded before a preemption
            return
        if not seq.prompt_logprobs:  # the first token has no context to be predicted from: text only
            first = seq.token_ids[0]
            seq.prompt_logprobs.append(TokenLogprob(first, self.output_processor.detokenizer.token_text(first),
                                                    None, []))
        rows = chunk.logits.shape[0]
        targets = torch.tensor(seq.token_ids[chunk.start + 1:chunk.start + 1 + rows], device=chunk.logits.device)
        scored = score(torch.log_softmax(chunk.logits, dim=-1), targets, [seq.params.prompt_logprobs] * rows)
        seq.prompt_logprobs.extend(map(self.output_processor.token_logprob, scored))

    @staticmethod
    def _record_prompt_hidden_states(chunk: PromptHiddenStates) -> None:
        if chunk.seq.num_prompt_hidden_states == chunk.start:  # else recorded already, before a preemption
            chunk.seq.prompt_hidden_states.append(chunk.hidden)

    def _emit(self, request: Request, seqs: list[Sequence], outputs: list[RequestOutput]) -> None:
        choices = [delta for delta in map(self.output_processor.take_delta, seqs) if delta is not None]
        finished = request.finished
        if choices or finished:
            prompt_logprobs = None
            first = request.sequences[0]
            if first.params.prompt_logprobs is not None and not request.prompt_logprobs_sent \
                    and not first.needs_prompt_logprobs:
                prompt_logprobs, request.prompt_logprobs_sent = first.prompt_logprobs, True
            prompt_hidden_states = None
            if first.params.return_prompt_hidden_states and not request.prompt_hidden_states_sent \
                    and not first.needs_prompt_hidden_states:
                prompt_hidden_states = torch.cat(first.prompt_hidden_states)
                request.prompt_hidden_states_sent = True
            outputs.append(RequestOutput(
                request.request_id, choices, len(request.prompt_token_ids),
                min(seq.num_cached_tokens for seq in request.sequences), finished,
                prompt_logprobs=prompt_logprobs, prompt_hidden_states=prompt_hidden_states))
        if finished:
            del self.requests[request.request_id]

    def stats(self) -> "EngineStats":
        bm = self.block_manager
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting) + len(self.compiling),
            free_blocks=bm.num_free_blocks,
            total_blocks=bm.num_blocks,
            prefix_cache_hit_rate=bm.prefix_hits / bm.prefix_queries if bm.prefix_queries else 0.0,
            prompt_tokens=self.num_prompt_tokens,
            generated_tokens=self.num_generated_tokens,
            preemptions=self.scheduler.num_preemptions,
            loaded_loras=() if self.runner.lora_slots is None else tuple(self.runner.lora_slots.loaded_names()),
            unfinished_requests=len(self.requests) + len(self.ready_outputs),
        )


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's state, taken on its own thread; other threads read snapshots, never the engine."""

    running: int  # sequences in the running batch
    waiting: int  # sequences waiting for admission or for their grammar
    free_blocks: int
    total_blocks: int
    prefix_cache_hit_rate: float
    prompt_tokens: int  # counters since start
    generated_tokens: int
    preemptions: int
    loaded_loras: tuple[str, ...]
    unfinished_requests: int
