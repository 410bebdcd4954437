"""The engine core: token ids in, token ids (with logprobs) out. `step()` = schedule → run → sample → update.

It owns the model, the KV cache, the scheduler and each constrained sequence's grammar matcher, and decides the
stops that are about tokens (EOS, stop tokens, a complete grammar, max_tokens, the context's end). Text — stop
strings included — is tritonllm/engine/processing's business, on another thread. Synchronous and importable without
Triton; `CoreLoop` runs it on its own thread."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.core.beam_search import BeamSearch, Continuation, offer_continuations
from tritonllm.engine.core.block_manager import BlockManager
from tritonllm.engine.core.core_messages import AbortAll, AbortRequest, AddRequest, CoreMessage
from tritonllm.engine.core.kv_tiers import DeviceBlocks, HostTier, StorageTier, host_tier_bytes
from tritonllm.engine.core.model_runner import ModelRunner, PromptHiddenStates, PromptLogits
from tritonllm.engine.core.prefix_keys import files_digest, model_key
from tritonllm.engine.core.sampler import Sampler, score, stop_tokens
from tritonllm.engine.core.scheduler import ScheduledSequence, Scheduler
from tritonllm.engine.core.sequence import CoreOutput, CoreRequest, SampledToken, Sequence, SequenceUpdate
from tritonllm.engine.core.step_pacer import StepPacer
from tritonllm.engine.core.structured_output import advance
from tritonllm.interface.errors import InvalidRequest
from tritonllm.interface.tensors import FinishReason

log = logging.getLogger(__name__)

STORAGE_FLUSH_SECONDS = 3.0  # how long shutting down waits for the storage tier's queued writes


@dataclass(frozen=True)
class ModelLimits:
    """What request processing must know of the model and the KV pool to validate a request."""

    name: str
    vocab_size: int
    max_model_len: int
    capacity: int  # tokens one sequence may hold: prompt + output
    is_moe: bool
    arch: object  # ModelArchitecture (LoRA shapes)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the core's state, taken on its own thread; other threads read snapshots, never the core."""

    running: int  # requests with a sequence in the running batch
    waiting: int  # requests none of whose sequences runs: waiting for admission (or readmission) or their grammar
    free_blocks: int
    total_blocks: int
    prefix_cache_hit_rate: float
    prefix_cache_hits: tuple[int, int, int]  # prompt tokens served by each tier (CACHE_TIERS), since start
    max_model_len: int  # tokens one request may hold (prompt + output): the capacity of ModelLimits
    prompt_tokens: int  # counters since start
    generated_tokens: int
    preemptions: int
    loaded_loras: tuple[str, ...]
    unfinished_requests: int
    dead: str = ""  # why the engine gave up (CoreLoop), empty while it serves

    @property
    def is_dead(self) -> bool:
        return bool(self.dead)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the KV blocks that sequences hold (blocks kept only as cached prefixes count as free)."""
        return 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 0.0


class EngineCore:
    def __init__(self, config: EngineConfig, model_dir: Path, eos_token_ids: set[int]):
        started = time.monotonic()
        self.config = config
        self.runner = ModelRunner(config, model_dir)
        arch = self.runner.model.arch
        max_model_len = self.runner.max_model_len
        self.limits = ModelLimits(
            name=model_dir.name, vocab_size=arch.vocab_size, max_model_len=max_model_len,
            capacity=min(max_model_len, self.runner.num_blocks * config.block_size), is_moe=arch.is_moe, arch=arch)
        self.eos_token_ids = eos_token_ids
        model = model_key(files_digest(model_dir), model_class=type(self.runner.model).__name__, arch=arch,
                          weights=self.runner.weight_format, activations=self.runner.dtype,
                          prompts=self.runner.prefill_dtype, decodes=self.runner.decode_dtype, kv_dtype=self.runner.kv_dtype,
                          block_size=config.block_size, device=self.runner.device.type)
        blocks = DeviceBlocks(self.runner.kv_caches)
        tiered = config.enable_prefix_caching  # (the tiers hold cached prefixes)
        host_bytes = host_tier_bytes(config.kv_host_memory, self.runner.device, config.kv_cache_memory) if tiered else 0
        storage = config.kv_storage_dir if tiered else ""
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching, model,
            HostTier(host_bytes, blocks) if host_bytes else None,
            StorageTier(storage, config.kv_storage_size, model, blocks) if storage else None)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.runner.lora_slots, config.scheduling_policy, arch.attention_equivalent)
        self.pacer = StepPacer(config.max_decode_slowdown)
        self.sampler = Sampler(eos_token_ids, arch.vocab_size)
        # private to the thread that runs the core: other threads send messages (apply) and read stats()
        self._requests: dict[str, CoreRequest] = {}
        self._compiling: dict[str, CoreRequest] = {}  # waiting for their grammar; not yet scheduled
        self._ready_outputs: list[CoreOutput] = []  # produced outside step(): aborts, requests that failed to add
        self._last_batch = "no step yet"  # what the latest step ran, for the log when a step fails
        # the core loop's wake-up call: a request became schedulable (its grammar compiled, its storage read ended)
        self.wake: Callable[[], None] = lambda: None
        if self.block_manager.storage is not None:
            self.block_manager.storage.on_read_done = lambda: self.wake()
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        log.info("engine core ready in %.1f s: %s, max_model_len %d", time.monotonic() - started, model_dir,
                 max_model_len)

    def apply(self, message: CoreMessage) -> None:
        """One message of the core's inbox; its outputs come with the next step."""
        match message:
            case AddRequest(request):
                try:
                    self.add_request(request)
                except Exception as exc:  # e.g. a duplicate request id: this request fails, the core goes on
                    log.exception("request %s could not be added", request.request_id)
                    self._ready_outputs.append(
                        CoreOutput(request.request_id, [], len(request.prompt_token_ids), 0, True, error=exc))
            case AbortRequest(request_id, indices):
                self.abort_request(request_id, None if indices is None else list(indices))
            case AbortAll():
                for request_id in list(self._requests):
                    self.abort_request(request_id)

    def add_request(self, request: CoreRequest) -> None:
        if request.request_id in self._requests:
            raise InvalidRequest(f"duplicate request id {request.request_id!r}")
        # a beam search starts from one sequence (its prompt computed once), forked once its continuations are known
        for index in range(1 if request.params.use_beam_search else request.params.num_sequences):
            generator = torch.Generator(device=self.runner.device)
            if request.params.seed is None:
                generator.seed()
            else:
                generator.manual_seed(request.params.seed + index)
            request.sequences.append(Sequence(request, index, generator))
        if request.params.use_beam_search:
            request.beams = BeamSearch.start(request.sequences[0],
                                             len(stop_tokens(request.params, self.eos_token_ids)))
        self._requests[request.request_id] = request
        request.queued_at = time.monotonic()
        self.num_prompt_tokens += len(request.prompt_token_ids)
        if request.grammar is not None:  # scheduled once compiled: a slow compile holds back this request alone
            self._compiling[request.request_id] = request
            request.grammar.add_done_callback(lambda _: self.wake())
            return
        for seq in request.sequences:
            self.scheduler.add(seq)

    def _admit_compiled(self, outputs: list[CoreOutput]) -> None:
        """Schedule the requests whose grammar is ready, each sequence with its own matcher; fail the ones
        whose grammar is invalid."""
        for request_id, request in list(self._compiling.items()):
            if not request.grammar.done():
                continue
            error = request.grammar.exception()
            if error is not None:
                outputs.append(self.fail_request(request_id, error))
                continue
            del self._compiling[request_id]
            for seq in request.sequences:
                if not seq.is_finished:  # (an aborted choice)
                    seq.grammar = request.grammar.result().deep_copy()
                    self.scheduler.add(seq)

    def abort_request(self, request_id: str, indices: list[int] | None = None) -> None:
        """Stop the request's sequences (those of `indices`, else all) and free their blocks; an output says so."""
        request = self._requests.get(request_id)
        if request is None:
            return
        live = [seq for seq in request.sequences if not seq.is_finished and (indices is None or seq.index in indices)]
        for seq in live:
            seq.finish_reason = FinishReason.ABORT
            self.scheduler.finish(seq)
        if request.finished:
            self._compiling.pop(request_id, None)
        self._emit(request, live, self._ready_outputs)

    def has_work(self) -> bool:
        """Whether step() has anything to do now (a request whose grammar still compiles has not)."""
        return (self.scheduler.has_work() or bool(self._ready_outputs)
                or any(request.grammar.done() for request in self._compiling.values()))

    def idle_wait(self, longest: float) -> float:
        """How long the loop may sleep when it has no work (at most `longest`): until a storage read is late."""
        deadline = self.scheduler.next_read_deadline()
        return longest if deadline is None else min(longest, max(0.0, deadline - time.monotonic()))

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests or self._ready_outputs)

    def step(self) -> list[CoreOutput]:
        outputs, self._ready_outputs = self._ready_outputs, []
        self._admit_compiled(outputs)
        started = time.perf_counter()
        scheduled = self.scheduler.schedule(self.pacer.prompt_budget())
        if not scheduled:
            return outputs
        work = self.scheduler.step_work(scheduled)
        self._last_batch = describe_batch(scheduled)
        now = time.monotonic()
        for item in scheduled:
            if item.seq.request.scheduled_at is None:
                item.seq.request.scheduled_at = now
        result = self.runner.execute(scheduled)
        logits, sample_seqs = result.logits, result.sample_seqs
        failed: dict[str, Exception] = {}  # request id → what went wrong in its own bookkeeping

        def isolated(seq: Sequence, work, *args) -> None:
            """Run per-request work; an exception fails that request alone, not the batch."""
            if seq.request.request_id not in failed:
                try:
                    work(*args)
                except Exception as exc:
                    log.exception("request %s failed while processing its step", seq.request.request_id)
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
                seq.finish_reason = FinishReason.LENGTH
        beams = [i for i, seq in enumerate(sample_seqs) if seq.request.beams is not None]
        if beams:
            self._step_beams(logits[beams], [sample_seqs[i] for i in beams], failed)
        generating = [i for i, seq in enumerate(sample_seqs) if seq.finish_reason is None and seq.request.beams is None]
        if generating:
            for i, sampled in zip(generating, self._sample(logits[generating], [sample_seqs[i] for i in generating],
                                                           failed)):
                seq = sample_seqs[i]
                if sampled is None:  # its sampling failed: the request fails below
                    continue
                isolated(seq, self._append_token, seq, sampled)
                if seq.params.return_hidden_states:
                    seq.pending_hidden_states.append(result.sample_hidden[i])
                if seq.params.return_routed_experts:
                    seq.pending_routed_experts.append(result.sample_routed_experts[i])
            self.num_generated_tokens += len(generating)
        touched: dict[str, list[Sequence]] = {}
        for seq in sample_seqs:
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
            touched.setdefault(seq.request.request_id, []).append(seq)
        for request_id, seqs in touched.items():
            if request_id not in failed:
                self._emit(self._requests[request_id], seqs, outputs)
        outputs.extend(self.fail_request(request_id, exc) for request_id, exc in failed.items())
        self.pacer.observe(time.perf_counter() - started, *work)
        return outputs

    def _step_beams(self, logits: torch.Tensor, beams: list[Sequence], failed: dict[str, Exception]) -> None:
        """The beams offer their continuations; a search whose live beams have all offered theirs advances."""
        try:
            offer_continuations(logits, beams, self.eos_token_ids, self.limits.max_model_len)
        except Exception as exc:
            log.exception("beam search failed while ranking continuations")
            for beam in beams:
                failed.setdefault(beam.request.request_id, exc)
            return
        requests = {id(beam.request): beam.request for beam in beams}.values()
        for request in requests:
            if request.request_id not in failed and request.beams.ready():
                try:
                    self._advance_beams(request)
                except Exception as exc:
                    log.exception("request %s failed while advancing its beams", request.request_id)
                    failed[request.request_id] = exc
        self.num_generated_tokens += len(beams)

    def _advance_beams(self, request: CoreRequest) -> None:
        """The next beams: a parent continued by none is freed first; one continued once goes on itself, continued
        again it is forked (the copy shares its full blocks and joins the batch)."""
        parents, chosen = request.sequences, request.beams.advance()
        continued = {continuation.parent for continuation in chosen}
        for parent in parents:
            if parent not in continued:  # pruned, or the search is done: its blocks and batch slot go back
                self.scheduler.finish(parent)
        taken: set[Sequence] = set()
        next_beams: list[tuple[Sequence, Continuation]] = []
        for index, continuation in enumerate(chosen):
            beam = continuation.parent
            if beam in taken:
                beam = beam.fork(index)
                self.block_manager.share_full_blocks(continuation.parent, beam)
                self.scheduler.add_running(beam)
            taken.add(beam)
            next_beams.append((beam, continuation))
        for beam, continuation in next_beams:  # (after the forks: they copy the parent's tokens)
            beam.token_ids.append(continuation.token.token_id)
        request.beams.continue_with(next_beams)
        request.sequences = [beam for beam, _ in next_beams] or parents

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence],
                failed: dict[str, Exception]) -> list[SampledToken | None]:
        """The batch's tokens; if sampling the batch fails, each sequence is sampled alone so that one request's
        bad sampling state (a grammar, a mask) fails that request only (None in its place)."""
        try:
            return self.sampler(logits, seqs)
        except Exception:
            log.exception("sampling the batch failed; sampling its sequences one by one")
        sampled: list[SampledToken | None] = []
        for row, seq in enumerate(seqs):
            try:
                sampled.append(self.sampler(logits[row:row + 1], [seq])[0])
            except Exception as exc:
                log.exception("request %s failed while sampling", seq.request.request_id)
                failed.setdefault(seq.request.request_id, exc)
                sampled.append(None)
        return sampled

    def fail_in_flight(self, exc: Exception) -> list[CoreOutput]:
        """End every request with an error (a step failed, or the engine is dead); their blocks are freed."""
        self._ready_outputs.clear()
        return [self.fail_request(request_id, exc) for request_id in list(self._requests)]

    def last_batch(self) -> str:
        """What the latest step ran (for the log of a failed step)."""
        return self._last_batch

    def _append_token(self, seq: Sequence, sampled: SampledToken) -> None:
        """Add the sampled token; sets seq.finish_reason when it ends the sequence."""
        seq.token_ids.append(sampled.token_id)
        seq.pending_tokens.append(sampled)
        params = seq.params
        grammar_complete = seq.grammar is not None and advance(seq.grammar, sampled.token_id)
        if seq.num_output_tokens >= params.min_tokens and (
                sampled.token_id in params.stop_token_ids
                or (not params.ignore_eos and sampled.token_id in self.eos_token_ids)):
            seq.finish_reason, seq.stop_token_id = FinishReason.STOP, sampled.token_id
        elif grammar_complete:  # e.g. a JSON object's closing brace: only EOS could follow
            seq.finish_reason = FinishReason.STOP
        elif seq.num_output_tokens >= seq.request.max_tokens or seq.num_tokens >= self.limits.max_model_len:
            seq.finish_reason = FinishReason.LENGTH

    def fail_request(self, request_id: str, exc: Exception) -> CoreOutput:
        """End a request with an error: its sequences stop and free their blocks."""
        request = self._requests.pop(request_id)
        self._compiling.pop(request_id, None)
        for seq in request.sequences:
            if not seq.is_finished:
                self.scheduler.finish(seq)
        return CoreOutput(request_id, [], len(request.prompt_token_ids), 0, True, error=exc, times=request.times())

    def _record_prompt_logprobs(self, chunk: PromptLogits) -> None:
        seq = chunk.seq
        if len(seq.prompt_logprobs) != chunk.start:  # recorded already, before a preemption
            return
        rows = chunk.logits.shape[0]
        targets = torch.tensor(seq.token_ids[chunk.start + 1:chunk.start + 1 + rows], device=chunk.logits.device)
        seq.prompt_logprobs.extend(score(chunk.logits, targets, torch.logsumexp(chunk.logits, dim=-1),
                                         [seq.params.prompt_logprobs] * rows))

    @staticmethod
    def _record_prompt_hidden_states(chunk: PromptHiddenStates) -> None:
        if chunk.seq.num_prompt_hidden_states == chunk.start:  # else recorded already, before a preemption
            chunk.seq.prompt_hidden_states.append(chunk.hidden)

    def _emit(self, request: CoreRequest, seqs: list[Sequence], outputs: list[CoreOutput]) -> None:
        finished = request.finished
        updates = []
        if request.beams is not None:  # its choices come once it has finished
            updates, seqs = (request.beams.choices() if finished else []), []
        for seq in seqs:
            if seq.pending_tokens or seq.finish_reason is not None:
                updates.append(SequenceUpdate(seq.index, seq.pending_tokens, seq.finish_reason, seq.stop_token_id,
                                              seq.pending_hidden_states, seq.pending_routed_experts))
                seq.pending_tokens, seq.pending_hidden_states, seq.pending_routed_experts = [], [], []
        first = request.sequences[0]
        prompt_logprobs = None
        if first.params.prompt_logprobs is not None and not request.prompt_logprobs_sent \
                and not first.needs_prompt_logprobs:
            prompt_logprobs, request.prompt_logprobs_sent = first.prompt_logprobs, True
        prompt_hidden_states = None
        if first.params.return_prompt_hidden_states and not request.prompt_hidden_states_sent \
                and not first.needs_prompt_hidden_states:
            prompt_hidden_states = torch.cat(first.prompt_hidden_states)
            request.prompt_hidden_states_sent = True
        if updates or finished or prompt_logprobs is not None:
            cached = min((seq.cached_tokens for seq in request.sequences), key=lambda tokens: tokens.total)
            outputs.append(CoreOutput(
                request.request_id, updates, len(request.prompt_token_ids), cached.total, finished,
                prompt_logprobs=prompt_logprobs, prompt_hidden_states=prompt_hidden_states, times=request.times(),
                cached_by_tier=cached.by_tier()))
        if finished:
            del self._requests[request.request_id]

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            running=self.scheduler.num_running_requests(),
            waiting=self.num_waiting_requests(),
            free_blocks=bm.num_free_blocks,
            total_blocks=bm.num_blocks,
            prefix_cache_hit_rate=bm.prefix_hits.total / bm.prefix_queries if bm.prefix_queries else 0.0,
            prefix_cache_hits=bm.prefix_hits.by_tier(),
            max_model_len=self.limits.capacity,
            prompt_tokens=self.num_prompt_tokens,
            generated_tokens=self.num_generated_tokens,
            preemptions=self.scheduler.num_preemptions,
            loaded_loras=() if self.runner.lora_slots is None else tuple(self.runner.lora_slots.loaded_names()),
            unfinished_requests=len(self._requests) + len(self._ready_outputs),
        )

    def close(self) -> None:
        """Let the storage tier's queued writes land (for a few seconds at most), then stop its threads."""
        storage = self.block_manager.storage
        if storage is not None:
            storage.wait_for_writes(STORAGE_FLUSH_SECONDS)
            storage.close()

    def num_waiting_requests(self) -> int:
        """Requests not running yet: compiling their grammar or waiting for admission."""
        return self.scheduler.num_waiting_requests() + len(self._compiling)


def describe_batch(scheduled: list[ScheduledSequence]) -> str:
    """One line on a step's batch: sequences, tokens, and each request's share (as vLLM logs a failed step's)."""
    tokens = sum(item.num_new_tokens for item in scheduled)
    parts = [f"{item.seq.request.request_id}#{item.seq.index}: {item.num_new_tokens} new of "
             f"{item.seq.num_tokens}{' lora ' + item.seq.request.lora.name if item.seq.request.lora else ''}"
             f"{' grammar' if item.seq.grammar is not None else ''}"
             for item in scheduled]
    return f"{len(scheduled)} sequences, {tokens} tokens [{'; '.join(parts)}]"
