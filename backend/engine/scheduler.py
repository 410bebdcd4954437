"""Continuous batching: which sequences run this step, and how many of their tokens.

Every step has a token budget. Running sequences go first (a decode needs one token, an unfinished prefill
takes the next chunk), then waiting sequences are admitted FCFS while budget, sequence slots and KV blocks
last. A long prompt is therefore split into chunks and never stalls running decodes for more than one chunk.
When blocks run out, the newest running sequence is preempted: its blocks are freed and it is recomputed later
(its generated tokens are kept, and the prefix cache usually makes the recompute cheap).
A sequence with a LoRA adapter is admitted only once its adapter holds a slot of the LoRA pool; until a slot
frees up it waits (FCFS: the requests behind it wait too)."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from backend.engine.block_manager import BlockManager
from backend.engine.lora_slots import LoraSlotPool
from backend.engine.sequence import Sequence, SequenceStatus

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
                 lora_slots: LoraSlotPool | None = None):
        self.block_manager = block_manager
        self.lora_slots = lora_slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def num_running_requests(self) -> int:
        return len({id(seq.request) for seq in self.running})

    def num_waiting_requests(self) -> int:
        """Requests none of whose sequences runs (a request counts once, whatever its n; one with a sequence
        running is running, even while another of its sequences waits after a preemption)."""
        running = {id(seq.request) for seq in self.running}
        return len({id(seq.request) for seq in self.waiting} - running)

    def schedule(self) -> list[ScheduledSequence]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted = False

        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.ensure_slots(seq, seq.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSequence(seq, num_new))
                budget -= num_new
                index += 1

        # Admitting new work right after a preemption would just thrash.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            if not self._hold_lora_slot(seq):
                break
            if not seq.block_table:
                cached = self.block_manager.allocate_cached_prefix(seq)
                seq.num_computed_tokens = cached
                if seq.num_output_tokens == 0:
                    seq.num_cached_tokens = cached
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.block_manager.ensure_slots(seq, seq.num_computed_tokens + num_new):
                self.block_manager.free(seq)  # don't pin cached blocks (or an adapter slot) while waiting
                self._release_lora_slot(seq)
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        log.info("preempting a sequence of request %s (%d tokens) to free KV blocks",
                 seq.request.request_id, seq.num_tokens)
        self.num_preemptions += 1
        self.block_manager.free(seq)
        self._release_lora_slot(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks."""
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
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
