"""Continuous batching: which sequences run this step, and how many of their tokens.

Every step has a token budget. Running sequences go first (a decode needs one token, an unfinished prefill
takes the next chunk), then waiting sequences are admitted FCFS while budget, sequence slots and KV blocks
last. A long prompt is therefore split into chunks and never stalls running decodes for more than one chunk.
While sequences decode, a prompt chunk is also charged for its attention to the context before it (in tokens of
projection work, `attention_equivalent`: the context that costs one token's projections), so a chunk deep into a
long prompt is smaller and a step with decodes in it takes about as long as one with a short prompt's chunk; and
a step's prompt chunks together take at most `prompt_budget` of that work (step_pacer.py: what keeps the step
within a bound on the decodes' inter-token latency). A prompt chunk takes at most half of the room left for prompts
while a prompt with fewer tokens left waits behind it (running, or queued with a sequence slot free): short requests
arriving during a long prompt's minutes of small paced chunks start within steps instead of after it, and the long
prompt still goes on.
When blocks run out, the newest running sequence is preempted: its blocks are freed and it is recomputed later
(its generated tokens are kept, and the prefix cache usually makes the recompute cheap).
A sequence whose prefix match reaches the storage tier leaves the queue while the blocks are read (holding no
block, no adapter slot, no budget): the others are scheduled meanwhile, and once the read is done (or late: the
rest is then computed) it goes back to the queue's front with its whole cached prefix.
A sequence with a LoRA adapter is admitted only once its adapter holds a slot of the LoRA pool; until a slot
frees up it waits (FCFS: the requests behind it wait too).

Under the `priority` policy (vLLM's) both queues are ordered by rank, (priority, arrival): lower priority values
first, equal priorities first come, first served. Admission takes the best-ranked waiting sequence, and when it
lacks a sequence slot or KV blocks, running sequences of a strictly worse priority are preempted for it (the
worst-ranked first, by recompute as above) instead of it waiting; the victim that needs blocks is likewise the
worst-ranked running sequence. A preempted sequence keeps its rank, so it resumes ahead of later arrivals of its
priority. Waiting for a LoRA slot preempts nothing."""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import time
from collections import deque
from dataclasses import dataclass

from tritonllm.engine.core.block_manager import BlockManager, PrefixRead
from tritonllm.engine.core.lora_slots import LoraSlotPool
from tritonllm.engine.core.sequence import CachedTokens, Sequence, SequenceStatus

log = logging.getLogger(__name__)


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """After this step the sequence has computed all its tokens, so the next one is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 lora_slots: LoraSlotPool | None = None, policy: str = "fcfs",
                 attention_equivalent: int | None = None):
        self.block_manager = block_manager
        self.attention_equivalent = attention_equivalent  # None: chunks charged by their tokens alone
        self.by_priority = policy == "priority"
        self.lora_slots = lora_slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: dict[Sequence, PrefixRead] = {}  # waiting for their prefix's blocks from storage
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._enqueue(self.waiting, seq, front=False)

    def _enqueue(self, queue: deque[Sequence] | list[Sequence], seq: Sequence, front: bool) -> None:
        """Under priority, by rank (after the equal ranks: FCFS among them); else at the front or the back."""
        if self.by_priority:
            bisect.insort(queue, seq, key=_rank)
        elif front:
            queue.appendleft(seq)
        else:
            queue.append(seq)

    def has_work(self) -> bool:
        """Whether schedule() may have something to schedule now (a sequence whose storage read goes on has not)."""
        now = time.monotonic()
        return bool(self.waiting or self.running or any(p.read.done(now) for p in self.loading.values()))

    def next_read_deadline(self) -> float | None:
        """When the earliest storage read a sequence waits for is late (time.monotonic), if any."""
        return min((pending.read.deadline for pending in self.loading.values()), default=None)

    def num_running_requests(self) -> int:
        return len({id(seq.request) for seq in self.running})

    def num_waiting_requests(self) -> int:
        """Requests none of whose sequences runs (a request counts once, whatever its n; one with a sequence
        running is running, even while another of its sequences waits after a preemption)."""
        running = {id(seq.request) for seq in self.running}
        return len({id(seq.request) for seq in (*self.waiting, *self.loading)} - running)

    def schedule(self, prompt_budget: int | None = None) -> list[ScheduledSequence]:
        """This step's sequences and tokens; while sequences decode, the prompt chunks among them take at most
        `prompt_budget` (None: the token budget alone)."""
        self._requeue_loaded()
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted = False
        decoding = self.attention_equivalent is not None and any(_decodes(seq) for seq in self.running)
        prompt_room = min(budget, prompt_budget) if decoding and prompt_budget is not None else budget

        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            prompt = not _decodes(seq)
            room = budget
            if prompt:
                room = min(budget, prompt_room)
                if self._shorter_prompt_behind(seq, index):
                    room = (room + 1) // 2  # (none stays none: the pacer's steps of decodes alone)
            num_new, cost = self._chunk(seq, room, decoding)
            if num_new == 0:  # a beam whose continuations wait for its siblings' (beam_search.py)
                index += 1
                continue
            while not self.block_manager.ensure_slots(seq, seq.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim, "to free KV blocks")
                preempted = True
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSequence(seq, num_new))
                budget -= cost
                prompt_room -= cost if prompt else 0
                index += 1

        # Admitting new work right after a preemption would just thrash.
        while self.waiting and min(budget, prompt_room) > 0 and not preempted:
            seq = self.waiting[0]
            if len(self.running) >= self.max_num_seqs:
                given_back = self._preempt_worse_priority(seq, scheduled)
                if given_back is None:
                    break
                budget += given_back[0]
                prompt_room += given_back[1]
                continue
            if not self._hold_lora_slot(seq):
                break
            if not seq.prefix_matched:
                match = self.block_manager.allocate_cached_prefix(seq)
                if isinstance(match, PrefixRead):
                    self.waiting.popleft()
                    self._release_lora_slot(seq)
                    seq.status = SequenceStatus.LOADING
                    self.loading[seq] = match
                    continue
                self._matched(seq, match)
            num_new, cost = self._chunk(seq, min(budget, prompt_room), decoding)
            if not self.block_manager.ensure_slots(seq, seq.num_computed_tokens + num_new):
                self.block_manager.free(seq)  # don't pin cached blocks (or an adapter slot) while waiting
                self._release_lora_slot(seq)
                given_back = self._preempt_worse_priority(seq, scheduled)
                if given_back is None:
                    break
                budget += given_back[0]
                prompt_room += given_back[1]
                continue  # again, with the victim's blocks free
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self._enqueue(self.running, seq, front=False)
            scheduled.append(ScheduledSequence(seq, num_new))
            budget -= cost
            prompt_room -= cost
        return scheduled

    def _shorter_prompt_behind(self, seq: Sequence, index: int) -> bool:
        """Whether a prompt with fewer tokens left than running[index]'s waits behind it for this step's room."""
        left = _tokens_left(seq)
        behind = self.running[index + 1:]
        if len(self.running) < self.max_num_seqs:
            behind = itertools.chain(behind, self.waiting)
        return any(not _decodes(other) and _tokens_left(other) < left for other in behind)

    def step_work(self, scheduled: list[ScheduledSequence]) -> tuple[int, int]:
        """(decoding sequences, units of prompt work: tokens weighted as _chunk weighs them) of a step just
        scheduled (before its tokens count as computed)."""
        decodes = sum(1 for item in scheduled if _decodes(item.seq))
        work = sum(math.ceil(item.num_new_tokens * self._weight(item.seq)) for item in scheduled
                   if not _decodes(item.seq))
        return decodes, work

    def _weight(self, seq: Sequence) -> float:
        """A prompt token's work in tokens of projections: 1 + its attention to the context before it."""
        return 1 + seq.num_computed_tokens / (self.attention_equivalent or math.inf)

    def _chunk(self, seq: Sequence, budget: int, decoding: bool) -> tuple[int, int]:
        """(tokens of `seq` to compute this step, the budget they take): while others decode, a prompt chunk's
        tokens weigh _weight each."""
        num_new = min(_tokens_left(seq), budget)
        if not decoding or num_new <= 1:
            return num_new, num_new
        weight = self._weight(seq)
        num_new = max(1, min(num_new, int(budget / weight)))
        return num_new, min(budget, math.ceil(num_new * weight))

    def add_running(self, seq: Sequence) -> None:
        """A forked beam joins the running batch beside its parent (it computes its partial block with the next
        step); it waits first in line instead when the batch is full or it cannot hold its adapter's slot."""
        if len(self.running) >= self.max_num_seqs or not self._hold_lora_slot(seq):
            self.block_manager.free(seq)
            seq.status = SequenceStatus.WAITING
            self._enqueue(self.waiting, seq, front=True)
            return
        seq.status = SequenceStatus.RUNNING
        self._enqueue(self.running, seq, front=False)

    def _requeue_loaded(self) -> None:
        """Sequences whose storage read is done take its blocks and go back to the queue's front."""
        now = time.monotonic()
        done = [seq for seq, pending in self.loading.items() if pending.read.done(now)]
        for seq in sorted(done, key=_rank, reverse=True):  # (each goes to the front: the first last)
            self._matched(seq, self.block_manager.finish_prefix_read(seq, self.loading.pop(seq)))
            seq.status = SequenceStatus.WAITING
            self._enqueue(self.waiting, seq, front=True)

    @staticmethod
    def _matched(seq: Sequence, cached: CachedTokens) -> None:
        seq.prefix_matched = True
        seq.num_computed_tokens = cached.total
        if seq.num_output_tokens == 0:
            seq.cached_tokens = cached

    def _preempt_worse_priority(self, seq: Sequence, scheduled: list[ScheduledSequence]) -> tuple[int, int] | None:
        """Under priority, preempt the worst-ranked running sequence for `seq` if its priority is strictly worse;
        returns the tokens of this step's budget it held, and of the prompt room (None: no such sequence, `seq`
        waits)."""
        if not self.by_priority or not self.running or \
                self.running[-1].params.priority <= seq.params.priority:
            return None
        victim = self.running.pop()
        prompt = not _decodes(victim)
        self._preempt(victim, f"for a request of priority {seq.params.priority}")
        for index, item in enumerate(scheduled):
            if item.seq is victim:  # scheduled earlier in this step: its tokens go back to the budget
                del scheduled[index]
                return item.num_new_tokens, item.num_new_tokens if prompt else 0
        return 0, 0

    def _preempt(self, seq: Sequence, why: str) -> None:
        log.info("preempting a sequence of request %s (%d tokens) %s", seq.request.request_id, seq.num_tokens, why)
        self.num_preemptions += 1
        self.block_manager.free(seq)
        self._release_lora_slot(seq)
        seq.status = SequenceStatus.WAITING
        self._enqueue(self.waiting, seq, front=True)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks."""
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.loading:
            self.loading.pop(seq).read.cancel()
        self.block_manager.free(seq)
        self._release_lora_slot(seq)

    def _hold_lora_slot(self, seq: Sequence) -> bool:
        """Give the sequence its adapter's slot (loading it if needed); False when no slot can be had now."""
        if seq.request.lora is None or seq.lora_slot >= 0:
            return True
        slot = self.lora_slots.acquire(seq.request.lora)
        if slot is None:
            return False
        seq.lora_slot = slot
        return True

    def _release_lora_slot(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0:
            self.lora_slots.release(seq.lora_slot)
            seq.lora_slot = -1


def _tokens_left(seq: Sequence) -> int:
    """Tokens of the sequence not yet computed (a decode's one newest token, or what is left of its prompt)."""
    return seq.num_tokens - seq.num_computed_tokens


def _decodes(seq: Sequence) -> bool:
    """Whether the sequence's next step computes its one newest token (it decodes) rather than prompt tokens."""
    return _tokens_left(seq) == 1 and seq.num_output_tokens > 0


def _rank(seq: Sequence) -> tuple[int, int]:
    """Lower runs first: the request's priority, then its arrival."""
    return seq.params.priority, seq.request.arrival
