"""Continuous batching without a model: the token budget, decodes before prefill chunks, FCFS admission,
preemption by recompute, sequences waiting for a LoRA slot, and the priority policy. Each step is the engine core's bookkeeping with
the forward pass left out (core_fakes.step)."""

from __future__ import annotations

from tritonllm.engine.core.block_manager import BlockManager
from tritonllm.engine.core.scheduler import Scheduler
from tritonllm.engine.core.sequence import Sequence, SequenceStatus
from tritonllm.interface.parameters import SamplingParams
from core_fakes import SAMPLED_TOKEN, adapter, distinct_prompt, lora_slot_pool, make_sequence, planned, step

BLOCK = 4


def scheduler(num_blocks: int = 64, max_num_seqs: int = 8, max_num_batched_tokens: int = 16,
              enable_prefix_caching: bool = True, lora_slots=None, policy: str = "fcfs",
              attention_equivalent: int | None = None) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BLOCK, enable_prefix_caching), max_num_seqs, max_num_batched_tokens,
                     lora_slots, policy, attention_equivalent)


def decoding(sched: Scheduler) -> Sequence:
    """A sequence past its 2-token prompt in `sched`, decoding from the next step on."""
    decode = make_sequence(distinct_prompt(2, start=100))
    sched.add(decode)
    step(sched)
    return decode


def test_decodes_take_one_token_each_and_a_long_prompt_is_prefilled_in_chunks_of_what_is_left():
    sched = scheduler(max_num_batched_tokens=16)
    a, b = make_sequence(distinct_prompt(3, start=100)), make_sequence(distinct_prompt(5, start=200))
    sched.add(a)
    sched.add(b)
    assert planned(step(sched)) == [(a, 3), (b, 5)]  # both prompts fit in one step
    long = make_sequence(distinct_prompt(40, start=300))
    sched.add(long)

    chunks = []
    while long.num_output_tokens == 0:
        scheduled = step(sched)
        assert planned(scheduled)[:2] == [(a, 1), (b, 1)]  # every step, before any prefill
        [(seq, num_new)] = planned(scheduled)[2:]
        assert seq is long
        chunks.append(num_new)
    assert chunks == [14, 14, 12]  # the budget minus the two decodes; it samples after the last chunk only
    assert planned(step(sched)) == [(a, 1), (b, 1), (long, 1)]


def test_while_others_decode_a_prompt_chunk_is_charged_for_its_context_too():
    """attention_equivalent 16: a chunk's tokens weigh 1 + context / 16 each. Alone, the long prompt takes the whole
    budget whatever its context; beside a decode, its chunks shrink as its context grows (and never below one
    token), so the steps the decode waits on stay about as long as a short prompt's."""
    alone = scheduler(num_blocks=128, max_num_batched_tokens=32, attention_equivalent=16)
    long = make_sequence(distinct_prompt(100, start=300))
    alone.add(long)
    chunks = []
    while long.num_output_tokens == 0:
        [(_, num_new)] = planned(step(alone))
        chunks.append(num_new)
    assert chunks == [32, 32, 32, 4]

    beside = scheduler(num_blocks=128, max_num_batched_tokens=32, attention_equivalent=16)
    decode = decoding(beside)
    long = make_sequence(distinct_prompt(100, start=300))
    beside.add(long)
    chunks = []
    while long.num_output_tokens == 0:
        scheduled = planned(step(beside))
        assert scheduled[0] == (decode, 1)
        [(_, num_new)] = scheduled[1:]
        chunks.append(num_new)
    # context 0: 31 tokens; 31: 31 / (1 + 31/16) = 10; 41: 8; 49: 7; ... each step's charge within the budget
    assert chunks[:4] == [31, 10, 8, 7] and sum(chunks) == 100 and min(chunks) >= 1
    assert all(later <= earlier for earlier, later in zip(chunks, chunks[1:-1]))


def test_while_others_decode_prompt_chunks_take_at_most_the_prompt_budget_together():
    """The pacer's bound (step_pacer.py): beside a decode, two prompts' chunks share `prompt_budget` (attention
    weighing them too), the decode keeps its token; with nothing decoding the bound does not apply."""
    sched = scheduler(num_blocks=128, max_num_batched_tokens=32, attention_equivalent=16)
    decode = decoding(sched)
    first, second = make_sequence(distinct_prompt(40, start=300)), make_sequence(distinct_prompt(40, start=400))
    sched.add(first)
    sched.add(second)
    charged = []
    while second.num_output_tokens == 0:
        scheduled = sched.schedule(prompt_budget=6)
        decodes, work = sched.step_work(scheduled)
        assert planned(scheduled)[0] == (decode, 1) and decodes == 1 + (first.num_output_tokens > 0)
        charged.append(work)
        for item in scheduled:  # (step() without its schedule())
            samples = item.samples
            item.seq.num_computed_tokens += item.num_new_tokens
            if samples:
                item.seq.token_ids.append(SAMPLED_TOKEN)
    # (a chunk is never under one token: the second prompt's one token may overrun, by at most 1 + 39 / 16)
    assert max(charged) <= 6 + 4 and sorted(charged)[len(charged) // 2] <= 6 and len(charged) > 80 // 6
    assert first.num_output_tokens > second.num_output_tokens  # first come, first served within the bound

    alone = scheduler(num_blocks=128, max_num_batched_tokens=32, attention_equivalent=16)
    long = make_sequence(distinct_prompt(40, start=500))
    alone.add(long)
    assert planned(alone.schedule(prompt_budget=6)) == [(long, 32)]


def test_a_short_prompt_arriving_behind_a_long_ones_paced_chunks_starts_within_steps():
    """A prompt with fewer tokens left waiting behind a long one takes half the prompt room: it starts in the next
    step and samples within a few, instead of waiting out the long prompt's many small chunks, which go on."""
    sched = scheduler(num_blocks=128, max_num_batched_tokens=32, attention_equivalent=16)
    decode = decoding(sched)
    long = make_sequence(distinct_prompt(200, start=300))
    sched.add(long)
    for _ in range(3):
        step(sched, prompt_budget=6)
    short = make_sequence(distinct_prompt(6, start=600))
    sched.add(short)
    steps = 0
    while short.num_output_tokens == 0:
        scheduled = planned(step(sched, prompt_budget=6))
        steps += 1
        assert scheduled[0] == (decode, 1) and scheduled[1][0] is long and scheduled[1][1] >= 1
    assert steps <= 3 and long.num_output_tokens == 0
    later = make_sequence(distinct_prompt(6, start=700))
    sched.add(later)
    assert planned(step(sched, prompt_budget=0)) == [(decode, 1), (short, 1)]  # the pacer's decodes alone stay so


def test_a_waiting_prompt_never_takes_the_running_decodes_budget():
    sched = scheduler(max_num_batched_tokens=4)
    running = [make_sequence(distinct_prompt(1, start=100 + 10 * i)) for i in range(3)]
    for seq in running:
        sched.add(seq)
    step(sched)
    late = make_sequence(distinct_prompt(9, start=200))
    sched.add(late)
    for _ in range(3):  # one token of budget left per step: the new prompt advances by one
        assert planned(step(sched)) == [(seq, 1) for seq in running] + [(late, 1)]


def test_fcfs_a_request_that_does_not_fit_holds_back_the_ones_behind_it():
    sched = scheduler(num_blocks=8, max_num_batched_tokens=64)
    first = make_sequence(distinct_prompt(18, start=100))  # 5 of the 8 blocks
    sched.add(first)
    step(sched)
    big, small = make_sequence(distinct_prompt(16, start=200)), make_sequence(distinct_prompt(2, start=300))
    sched.add(big)
    sched.add(small)
    assert planned(step(sched)) == [(first, 1)]  # small would fit, but big came first
    assert list(sched.waiting) == [big, small] and big.block_table == [] and sched.block_manager.num_free_blocks == 3

    sched.finish(first)
    assert planned(step(sched)) == [(big, 16), (small, 2)]
    assert sched.num_waiting_requests() == 0


def test_max_num_seqs_bounds_the_running_sequences():
    sched = scheduler(max_num_seqs=2)
    seqs = [make_sequence(distinct_prompt(2, start=100 + 10 * i)) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    assert planned(step(sched)) == [(seqs[0], 2), (seqs[1], 2)]
    assert list(sched.waiting) == [seqs[2]]
    sched.finish(seqs[0])
    assert planned(step(sched)) == [(seqs[1], 1), (seqs[2], 2)]


def test_out_of_blocks_the_newest_running_sequence_is_preempted_and_later_recomputed():
    sched = scheduler(num_blocks=4, max_num_batched_tokens=32)
    manager = sched.block_manager
    older, newer = make_sequence(distinct_prompt(7, start=100)), make_sequence(distinct_prompt(7, start=200))
    sched.add(older)
    sched.add(newer)
    step(sched)  # both prefilled: 2 blocks each, the pool is full
    step(sched)  # the 8th token of each still fits
    behind = make_sequence(distinct_prompt(3, start=300))
    sched.add(behind)

    # the older one's 9th token needs a third block: the newer one gives its two back
    assert planned(step(sched)) == [(older, 1)]
    assert sched.num_preemptions == 1 and sched.running == [older]
    assert newer.status is SequenceStatus.WAITING and newer.block_table == [] and newer.num_computed_tokens == 0
    assert newer.output_token_ids == [SAMPLED_TOKEN, SAMPLED_TOKEN]  # generated tokens are kept
    assert list(sched.waiting) == [newer, behind]  # ahead of what was already waiting
    # a block is free now and `behind` would fit in it, but nothing is admitted in the step that preempted
    assert manager.num_free_blocks == 1

    while older.num_output_tokens < 4:  # the older one runs on; the newer one can't come back yet (FCFS: nor behind)
        assert planned(step(sched)) == [(older, 1)]
    sched.finish(older)
    # recomputed: prompt and generated tokens, from its first block that the prefix cache still holds
    assert planned(step(sched)) == [(newer, 5), (behind, 3)]
    assert newer.num_computed_tokens == 9 and newer.output_token_ids == [SAMPLED_TOKEN] * 3
    assert newer.cached_tokens.total == 0  # the prefix-cache figure of its first admission
    assert sched.num_preemptions == 1


def test_nothing_is_admitted_in_the_step_that_preempted():
    sched = scheduler(num_blocks=4, max_num_batched_tokens=4, enable_prefix_caching=False)
    older, newer = make_sequence(distinct_prompt(4, start=100)), make_sequence(distinct_prompt(3, start=200))
    sched.add(older)
    sched.add(newer)
    while sched.num_preemptions == 0:
        scheduled = step(sched)
    assert planned(scheduled) == [(older, 1)] and list(sched.waiting) == [newer]
    # the newer one's first chunk (3 tokens of budget left) fits in the free block, yet it waits a step
    assert sched.block_manager.num_free_blocks == 1
    assert planned(step(sched)) == [(older, 1), (newer, 3)]


def test_the_sequence_that_needs_a_block_may_preempt_itself():
    sched = scheduler(num_blocks=4, max_num_batched_tokens=32, enable_prefix_caching=False)
    older, newer = make_sequence(distinct_prompt(5, start=100)), make_sequence(distinct_prompt(8, start=200))
    sched.add(older)
    sched.add(newer)
    step(sched)  # older: 2 blocks with room to spare; newer: 2 full blocks
    # the newer one's next token needs a block and it is the newest itself: only it goes back to waiting
    assert planned(step(sched)) == [(older, 1)]
    assert sched.running == [older] and list(sched.waiting) == [newer] and sched.num_preemptions == 1


def test_a_lora_sequence_waits_while_every_slot_is_pinned():
    pool = lora_slot_pool(max_loras=1)
    sched = scheduler(lora_slots=pool)
    with_x = make_sequence(distinct_prompt(3, start=100), lora=adapter("x"))
    sched.add(with_x)
    step(sched)
    assert with_x.lora_slot == 0 and pool.pins == [1]

    with_y = make_sequence(distinct_prompt(3, start=200), lora=adapter("y"))
    base = make_sequence(distinct_prompt(3, start=300))
    also_x = make_sequence(distinct_prompt(3, start=400), lora=adapter("x"))
    for seq in (with_y, base, also_x):
        sched.add(seq)
    for _ in range(2):  # y finds no slot: it waits, and FCFS the requests behind it too
        assert planned(step(sched)) == [(with_x, 1)]
        assert with_y.lora_slot == -1 and list(sched.waiting) == [with_y, base, also_x]

    sched.finish(with_x)
    assert pool.pins == [0] and with_x.lora_slot == -1
    assert planned(step(sched)) == [(with_y, 3), (base, 3)]  # y evicted x from the slot; x must wait again
    assert pool.loaded_names() == ["y"] and list(sched.waiting) == [also_x]


def test_sequences_of_one_adapter_share_its_slot():
    pool = lora_slot_pool(max_loras=1)
    sched = scheduler(lora_slots=pool)
    seqs = [make_sequence(distinct_prompt(3, start=100 + 10 * i), lora=adapter("x")) for i in range(2)]
    for seq in seqs:
        sched.add(seq)
    assert planned(step(sched)) == [(seqs[0], 3), (seqs[1], 3)]
    assert pool.pins == [2] and [seq.lora_slot for seq in seqs] == [0, 0]


def test_a_lora_sequence_that_lacks_blocks_gives_its_slot_back_while_it_waits():
    pool = lora_slot_pool(max_loras=1)
    sched = scheduler(num_blocks=4, max_num_batched_tokens=32, lora_slots=pool)
    base = make_sequence(distinct_prompt(13, start=100))  # 4 blocks: the pool is full
    sched.add(base)
    step(sched)
    with_x = make_sequence(distinct_prompt(3, start=200), lora=adapter("x"))
    sched.add(with_x)
    step(sched)
    assert list(sched.waiting) == [with_x] and pool.pins == [0] and with_x.lora_slot == -1
    sched.finish(base)
    assert planned(step(sched)) == [(with_x, 3)] and pool.pins == [1]


def test_a_preempted_lora_sequence_gives_its_slot_back():
    pool = lora_slot_pool(max_loras=1)
    sched = scheduler(num_blocks=4, max_num_batched_tokens=32, lora_slots=pool)
    base, with_x = make_sequence(distinct_prompt(8, start=100)), make_sequence(distinct_prompt(8, start=200),
                                                                               lora=adapter("x"))
    sched.add(base)
    sched.add(with_x)
    step(sched)  # two full blocks each
    assert pool.pins == [1]
    assert planned(step(sched)) == [(base, 1)]  # base's 9th token took the blocks of the newer with_x
    assert sched.num_preemptions == 1 and pool.pins == [0] and with_x.lora_slot == -1


def test_num_waiting_requests_counts_requests_not_choices():
    sched = scheduler()
    seq = make_sequence(distinct_prompt(3, start=100), SamplingParams(n=2))
    sibling = Sequence(seq.request, 1, seq.generator)
    sched.add(seq)
    sched.add(sibling)
    assert len(sched.waiting) == 2 and sched.num_waiting_requests() == 1


# --- the priority policy ------------------------------------------------------------------------------------------

def prioritized(priority: int, length: int, start: int, **params) -> Sequence:
    return make_sequence(distinct_prompt(length, start=start), SamplingParams(priority=priority, **params))


def test_priority_admits_lower_values_first_and_equal_ones_in_arrival_order():
    sched = scheduler(max_num_seqs=1, policy="priority")
    late_low, first_mid, high, second_mid = (prioritized(p, 2, start=100 + 10 * i) for i, p in enumerate((5, 1, -3, 1)))
    for seq in (late_low, first_mid, high, second_mid):
        sched.add(seq)
    assert list(sched.waiting) == [high, first_mid, second_mid, late_low]
    admitted = []
    while sched.has_work():
        scheduled = step(sched)
        admitted += [seq for seq, num_new in planned(scheduled) if num_new == 2]
        for seq in list(sched.running):
            if seq.num_output_tokens == 2:
                sched.finish(seq)
    assert admitted == [high, first_mid, second_mid, late_low]
    assert sched.num_preemptions == 0  # equal or worse priorities never preempt


def test_fcfs_ignores_priorities():
    sched = scheduler(max_num_seqs=1)
    low, high = prioritized(5, 2, start=100), prioritized(0, 2, start=200)
    sched.add(low)
    sched.add(high)
    assert planned(step(sched)) == [(low, 2)] and list(sched.waiting) == [high]


def test_a_waiting_request_of_higher_priority_takes_the_slot_of_the_worst_running_sequence():
    sched = scheduler(max_num_seqs=3, policy="priority")
    running = [prioritized(p, 3, start=100 + 10 * i) for i, p in enumerate((1, 2, 2))]
    for seq in running:
        sched.add(seq)
    step(sched)
    same = prioritized(1, 3, start=200)  # as good as the best running one, not better than the worst: preempts
    high = prioritized(0, 3, start=300)
    sched.add(same)
    sched.add(high)
    # both 2s are worse than 0: the later one goes first; then `same` (1) is strictly better than the other 2
    assert planned(step(sched)) == [(running[0], 1), (high, 3), (same, 3)]
    assert sched.num_preemptions == 2 and sched.running == [high, running[0], same]
    assert list(sched.waiting) == [running[1], running[2]]  # ranked: their tokens are kept for the recompute
    assert all(seq.block_table == [] and seq.num_output_tokens == 1 for seq in running[1:])
    equal = prioritized(1, 3, start=400)
    sched.add(equal)  # ties and worse wait: nothing running has a worse priority than 1 now
    assert planned(step(sched)) == [(high, 1), (running[0], 1), (same, 1)] and sched.num_preemptions == 2


def test_a_higher_priority_request_preempts_for_kv_blocks_and_takes_the_budget_they_had_this_step():
    sched = scheduler(num_blocks=6, max_num_batched_tokens=12, policy="priority", enable_prefix_caching=False)
    low, long_low = prioritized(1, 4, start=100), prioritized(1, 12, start=200)
    sched.add(low)
    sched.add(long_low)
    step(sched)  # low: 1 block + its first sample; long_low's first 8-token chunk: 2 blocks
    assert sched.block_manager.num_free_blocks == 3 and long_low.num_computed_tokens == 8
    high = prioritized(0, 16, start=300)  # 7 tokens of budget are left: 2 blocks, and 1 is free
    sched.add(high)
    # long_low was scheduled for its last 4 prompt tokens before high was considered: preempted, they go to high
    assert planned(step(sched)) == [(low, 1), (high, 11)]
    assert list(sched.waiting) == [long_low] and sched.num_preemptions == 1
    assert long_low.num_computed_tokens == 0 and long_low.block_table == []


def test_out_of_blocks_the_worst_ranked_running_sequence_is_preempted_not_the_newest():
    sched = scheduler(num_blocks=4, max_num_batched_tokens=32, policy="priority")
    low, high = prioritized(1, 7, start=100), prioritized(0, 7, start=200)
    sched.add(low)
    step(sched)
    sched.add(high)
    step(sched)  # high arrived last; both hold two blocks, the pool is full
    step(sched)
    # low's 9th token comes first in arrival but high ranks first: low needs no block this step, high does
    assert planned(step(sched)) == [(high, 1)] and sched.running == [high] and list(sched.waiting) == [low]


def test_preempted_low_priority_requests_resume_and_finish_with_every_token_and_block_back():
    """A stream of high-priority arrivals into an engine full of low-priority choices (n=2, so siblings too): the
    preempted ones are recomputed and finish with all their tokens; the pool ends whole."""
    max_tokens = 12
    sched = scheduler(num_blocks=24, max_num_seqs=4, max_num_batched_tokens=16, policy="priority")
    lows = []
    for i in range(3):
        first = prioritized(5, 6, start=100 + 20 * i, n=2)
        lows += [first, Sequence(first.request, 1, first.generator)]
        first.request.sequences.append(lows[-1])
    for seq in lows:
        sched.add(seq)
    highs = [prioritized(0, 5, start=500 + 20 * i) for i in range(4)]
    finished, high_waits = [], []
    for tick in range(400):
        if tick % 6 == 3 and highs:
            high_waits.append([highs[0], 0])
            sched.add(highs.pop(0))
        scheduled = step(sched)
        for entry in high_waits:
            if entry[0].num_output_tokens == 0:
                entry[1] += 1
        for seq in list(sched.running):
            if seq.num_output_tokens == max_tokens:
                sched.finish(seq)
                finished.append(seq)
        if not sched.has_work() and not highs:
            break
    assert sched.num_preemptions > 0
    assert len(finished) == 10 and all(seq.output_token_ids == [SAMPLED_TOKEN] * max_tokens for seq in finished)
    assert all(waited <= 1 for _, waited in high_waits), high_waits  # each sampled its first token next step
    assert sched.block_manager.num_free_blocks == 24 and not sched.running and not sched.waiting
