"""The paged KV block pool without a model: reference counts, the prefix cache's hash chain and salts, LRU eviction
of freed cached blocks, free-block accounting."""

from __future__ import annotations

from tritonllm.engine.core.block_manager import BlockManager
from tritonllm.engine.core.sequence import Sequence
from tritonllm.interface.parameters import SamplingParams
from core_fakes import adapter, distinct_prompt, make_sequence

BLOCK = 4


def computed(manager: BlockManager, seq: Sequence) -> int:
    """Admit the sequence and compute its whole prompt (as its prefill would); returns the tokens it found
    cached."""
    cached = manager.allocate_cached_prefix(seq)
    assert manager.ensure_slots(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    manager.cache_full_blocks(seq)
    return cached.total


def test_two_sequences_share_a_cached_prefix_by_reference_count():
    manager = BlockManager(num_blocks=8, block_size=BLOCK)
    shared = distinct_prompt(8, start=100)
    first = make_sequence(shared + [1])
    assert computed(manager, first) == 0 and manager.num_free_blocks == 5
    second = make_sequence(shared + [2, 3])
    assert computed(manager, second) == 8
    assert second.block_table[:2] == first.block_table[:2] and second.block_table[2] != first.block_table[2]
    assert [manager.ref_counts[b] for b in second.block_table] == [2, 2, 1]
    assert manager.num_free_blocks == 4

    manager.free(first)
    assert [manager.ref_counts[b] for b in second.block_table] == [1, 1, 1]
    assert manager.num_free_blocks == 5  # only the first's own last block came back
    manager.free(second)
    assert manager.num_free_blocks == 8 and not any(manager.ref_counts)
    assert second.block_table == [] and second.num_computed_tokens == 0


def test_a_freed_cached_prefix_is_found_again_by_an_identical_prompt():
    manager = BlockManager(num_blocks=8, block_size=BLOCK)
    prompt = distinct_prompt(10, start=100)
    first = make_sequence(prompt)
    computed(manager, first)
    blocks = list(first.block_table)
    manager.free(first)
    assert manager.num_free_blocks == 8  # cached blocks that nothing holds count as free

    again = make_sequence(prompt)
    assert manager.allocate_cached_prefix(again).total == 8
    assert again.block_table == blocks[:2] and manager.num_free_blocks == 6
    assert (manager.prefix_queries, manager.prefix_hits.total) == (20, 8)


def test_the_last_prompt_token_is_always_left_to_compute():
    manager = BlockManager(num_blocks=8, block_size=BLOCK)
    prompt = distinct_prompt(8, start=100)  # exactly two full blocks
    computed(manager, make_sequence(prompt))
    # its logits are needed to sample, so the second block is recomputed rather than taken from the cache
    assert manager.allocate_cached_prefix(make_sequence(prompt)).total == 4


def test_the_hash_chain_keys_a_block_by_everything_before_it():
    manager = BlockManager(num_blocks=12, block_size=BLOCK)
    common_tail = distinct_prompt(4, start=500)
    under_a = make_sequence(distinct_prompt(4, start=100) + common_tail + [1])
    under_b = make_sequence(distinct_prompt(4, start=200) + common_tail + [1])
    computed(manager, under_a)
    assert computed(manager, under_b) == 0
    assert under_a.full_block_keys[1] != under_b.full_block_keys[1]  # same tokens, different prefixes

    # a later prompt with b's prefix gets b's second block, not a's block of the same tokens
    later = make_sequence(distinct_prompt(4, start=200) + common_tail + [2, 3])
    assert manager.allocate_cached_prefix(later).total == 8
    assert later.block_table == under_b.block_table[:2]


def test_adapters_and_cache_salts_never_share_a_prefix():
    manager = BlockManager(num_blocks=64, block_size=BLOCK)
    prompt = distinct_prompt(9, start=100)
    salts = [(None, None), (adapter("x"), None), (adapter("y"), None), (None, "x"), (None, "s"), (adapter("x"), "s")]
    owners = []
    for lora, cache_salt in salts:
        seq = make_sequence(prompt, SamplingParams(cache_salt=cache_salt), lora=lora)
        assert computed(manager, seq) == 0, (lora, cache_salt)
        owners.append(seq.block_table[:2])
    for (lora, cache_salt), blocks in zip(salts, owners):  # each finds its own
        seq = make_sequence(prompt, SamplingParams(cache_salt=cache_salt), lora=lora)
        assert manager.allocate_cached_prefix(seq).total == 8
        assert seq.block_table == blocks, (lora, cache_salt)


def test_freed_blocks_are_reused_uncached_first_then_least_recently_used():
    manager = BlockManager(num_blocks=4, block_size=BLOCK)
    older, newer = make_sequence(distinct_prompt(5, start=100)), make_sequence(distinct_prompt(5, start=200))
    computed(manager, older)  # each: one cached full block + one partial block
    computed(manager, newer)
    (older_cached, older_partial), (newer_cached, newer_partial) = older.block_table, newer.block_table
    manager.free(older)
    manager.free(newer)

    # three fresh blocks: the partial ones (latest freed first), then the least recently freed cached block
    filler = make_sequence(distinct_prompt(12, start=300))
    assert manager.ensure_slots(filler, 12)
    assert filler.block_table == [newer_partial, older_partial, older_cached]
    assert manager.allocate_cached_prefix(make_sequence(distinct_prompt(5, start=100))).total == 0  # evicted
    assert manager.allocate_cached_prefix(make_sequence(distinct_prompt(5, start=200))).total == 4  # still cached


def test_a_cache_hit_makes_a_block_recently_used():
    manager = BlockManager(num_blocks=4, block_size=BLOCK)
    first, second = make_sequence(distinct_prompt(5, start=100)), make_sequence(distinct_prompt(5, start=200))
    computed(manager, first)
    computed(manager, second)
    manager.free(first)
    manager.free(second)
    reader = make_sequence(distinct_prompt(5, start=100))
    assert manager.allocate_cached_prefix(reader).total == 4  # touch first's block: now second's is the older
    manager.free(reader)

    assert manager.ensure_slots(make_sequence(distinct_prompt(12, start=300)), 12)
    assert manager.allocate_cached_prefix(make_sequence(distinct_prompt(5, start=200))).total == 0
    assert manager.allocate_cached_prefix(make_sequence(distinct_prompt(5, start=100))).total == 4


def test_ensure_slots_grows_block_by_block_and_refuses_without_change():
    manager = BlockManager(num_blocks=3, block_size=BLOCK)
    seq = make_sequence(distinct_prompt(5, start=100))
    assert manager.ensure_slots(seq, 5) and len(seq.block_table) == 2 and manager.num_free_blocks == 1
    assert manager.ensure_slots(seq, 8) and len(seq.block_table) == 2  # still fits
    other = make_sequence(distinct_prompt(6, start=200))
    assert not manager.ensure_slots(other, 6)  # two blocks needed, one free
    assert other.block_table == [] and manager.num_free_blocks == 1
    assert manager.ensure_slots(seq, 9) and len(seq.block_table) == 3 and manager.num_free_blocks == 0
    assert manager.slot(seq, 8) == seq.block_table[2] * BLOCK


def test_prefix_caching_off_or_prompt_logprobs_asked_find_nothing():
    prompt = distinct_prompt(9, start=100)
    uncached = BlockManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=False)
    computed(uncached, make_sequence(prompt))
    assert computed(uncached, make_sequence(prompt)) == 0 and not uncached.key_to_block

    manager = BlockManager(num_blocks=8, block_size=BLOCK)
    computed(manager, make_sequence(prompt))
    # prompt logprobs need every prompt position's logits: nothing may come from the cache
    assert manager.allocate_cached_prefix(make_sequence(prompt, SamplingParams(prompt_logprobs=0))).total == 0


def test_a_prefix_computed_twice_at_once_stays_keyed_to_the_first_block():
    manager = BlockManager(num_blocks=8, block_size=BLOCK)
    prompt = distinct_prompt(5, start=100)
    first, twin = make_sequence(prompt), make_sequence(prompt)
    for seq in (first, twin):  # admitted in the same step: neither finds the other's block yet
        assert manager.allocate_cached_prefix(seq).total == 0 and manager.ensure_slots(seq, 5)
    for seq in (first, twin):
        seq.num_computed_tokens = 5
        manager.cache_full_blocks(seq)
    assert first.full_block_keys == twin.full_block_keys
    original, copy = first.block_table[0], twin.block_table[0]
    assert manager.key_to_block[first.full_block_keys[0]] == original
    manager.free(first)
    manager.free(twin)
    # the twin's copy is not cached: it goes to the front of the free blocks, the original stays findable
    fresh = make_sequence(distinct_prompt(12, start=300))
    assert manager.ensure_slots(fresh, 12) and copy in fresh.block_table and original not in fresh.block_table
    reader = make_sequence(prompt)
    assert manager.allocate_cached_prefix(reader).total == 4 and reader.block_table == [original]


_KEYS_OF_A_SALTED_ADAPTER_PROMPT = """
from tritonllm.engine.core.block_manager import BlockManager
from tritonllm.interface.parameters import SamplingParams
from core_fakes import adapter, distinct_prompt, make_sequence
manager = BlockManager(num_blocks=8, block_size=4, model=b"m")
seq = make_sequence(distinct_prompt(9, start=100), SamplingParams(cache_salt="s"), lora=adapter("x"))
manager.allocate_cached_prefix(seq)
manager.ensure_slots(seq, 9)
seq.num_computed_tokens = 9
manager.cache_full_blocks(seq)
print(",".join(key.hex() for key in seq.full_block_keys))
"""


def test_keys_are_the_same_in_every_process():
    """A key names a block in host memory or a file another process wrote: no per-process hash seed in it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).parent
    keys = [subprocess.run([sys.executable, "-c", _KEYS_OF_A_SALTED_ADAPTER_PROMPT], check=True, text=True,
                           capture_output=True, cwd=tests,
                           env={**os.environ, "PYTHONHASHSEED": seed,
                                "PYTHONPATH": f"{tests.parent}{os.pathsep}{tests}"}).stdout.strip()
            for seed in ("1", "2")]
    assert keys[0] == keys[1] and len(keys[0].split(",")) == 2


def test_keys_are_rooted_in_the_model_and_the_adapter_files():
    prompt = distinct_prompt(9, start=100)
    keys = {}
    for model, files in ((b"a", b""), (b"b", b""), (b"a", b"other weights")):
        manager = BlockManager(num_blocks=8, block_size=BLOCK, model=model)
        seq = make_sequence(prompt, lora=adapter("x", files=files))
        computed(manager, seq)
        keys[model, files] = seq.full_block_keys
    assert len({tuple(k) for k in keys.values()}) == 3  # another model, or the adapter's files changed


def test_a_model_directory_digest_follows_content_not_place_or_time(tmp_path):
    import os
    import shutil

    from tritonllm.engine.core.prefix_keys import files_digest

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 8}')
    weights = bytearray(os.urandom(3 << 20))  # large: sampled at both ends
    (model / "model.safetensors").write_bytes(weights)
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    os.utime(copy / "model.safetensors", (1, 1))
    assert files_digest(model) == files_digest(copy)
    changed = bytearray(weights)
    changed[-1] ^= 1  # retrained weights of the same size
    (copy / "model.safetensors").write_bytes(changed)
    assert files_digest(model) != files_digest(copy)
    (copy / "model.safetensors").write_bytes(weights)
    assert files_digest(model) == files_digest(copy)
    (copy / "config.json").write_text('{"hidden_size": 9}')
    assert files_digest(model) != files_digest(copy)
