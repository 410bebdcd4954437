"""The KV cache's lower tiers. Through the engine on a tiny random model with a device pool of a few blocks, so
that prefixes are evicted: a prefix found in host memory or in storage (after a restart too) gives the output a
cold run gives (seeded sampling, float32 and float16 KV), to the bit, and a slow storage writer never holds up a
step. The storage tier alone, on a real directory: shared by two tiers, damaged and foreign files are misses,
slow reads are misses after a bounded wait, slow writes are dropped, the files are bounded in bytes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.core.block_manager import BlockManager
from tritonllm.engine.core import kv_tiers
from tritonllm.engine.core.kv_tiers import DeviceBlocks, StorageTier, block_path, encode_block
from tritonllm.engine.core.prefix_keys import block_key, model_key, root_key
from tritonllm.engine.core.sequence import CachedTokens
from tritonllm.engine.layers import linear
from tritonllm.engine.llm_engine import LLMEngine, Request
from tritonllm.interface.parameters import SamplingParams
from core_fakes import distinct_prompt, make_sequence
from engine_helpers import Result, assert_idle, generate
from tiny_models import tiny_config, write_tiny_model

BLOCK = 16
DEVICE_BLOCKS = 12
SEEDED = SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
PROMPT = list(range(1000, 1000 + 6 * BLOCK + 5))  # six full blocks (96 tokens) and a partial one
FILLERS = [list(range(start, start + 9 * BLOCK)) for start in (3000, 4000)]  # each evicts most of the pool


@pytest.fixture(autouse=True)
def one_float32_kernel(monkeypatch):
    """float32 projections through aten's kernel only: timing would pick aten's or oneDNN's per engine, and the
    two round differently (a different weight format: the prefix keys differ too)."""
    monkeypatch.setattr(linear, "onednn_available", lambda: False)


@pytest.fixture(scope="module")
def tiny_model_dir(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), default_model_dir, "llama")


def block_bytes(kv_cache_dtype: str) -> int:
    config = tiny_config("llama")
    head_dim = config.hidden_size // config.num_attention_heads
    itemsize = 2 if kv_cache_dtype == "float16" else 4
    return 2 * config.num_hidden_layers * BLOCK * config.num_key_value_heads * head_dim * itemsize


def tiered_engine(model_dir: Path, kv_cache_dtype: str = "auto", host_blocks: int = 0, **settings) -> LLMEngine:
    """Steps of one block's tokens, so that a cold prefill and one after a cached prefix compute the prompt's
    tail in the same chunk (the same rows, the same bits)."""
    size = block_bytes(kv_cache_dtype)
    return LLMEngine(EngineConfig(model_path=str(model_dir), dtype="float32", weight_format="float32",
                                  kv_cache_dtype=kv_cache_dtype, block_size=BLOCK,
                                  kv_cache_memory=DEVICE_BLOCKS * size, kv_host_memory=host_blocks * size,
                                  max_num_batched_tokens=BLOCK, **settings))


def run(engine: LLMEngine, prompt: list[int]) -> Result:
    [result] = generate(engine, [prompt], SEEDED)
    return result


def sampled(result: Result) -> tuple[list[int], float]:
    """The tokens and their cumulative logprob: equal to the bit only if every logit was."""
    return result.token_ids(), result.outputs[-1].choices[-1].cumulative_logprob


def cached_by_tier(result: Result) -> tuple[int, int, int]:
    return result.outputs[-1].cached_by_tier


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float16"])
def test_a_prefix_evicted_to_host_memory_comes_back_bit_identical(tiny_model_dir, kv_cache_dtype):
    cold = sampled(run(tiered_engine(tiny_model_dir, kv_cache_dtype), PROMPT))
    engine = tiered_engine(tiny_model_dir, kv_cache_dtype, host_blocks=64)
    assert sampled(run(engine, PROMPT)) == cold and cached_by_tier(run(engine, PROMPT)) == (6 * BLOCK, 0, 0)
    for filler in FILLERS:  # the prompt's blocks leave the device pool for host memory
        run(engine, filler)
    again = run(engine, PROMPT)
    assert cached_by_tier(again) == (0, 6 * BLOCK, 0)
    assert again.outputs[-1].num_cached_tokens == 6 * BLOCK
    assert sampled(again) == cold
    assert cached_by_tier(run(engine, PROMPT)) == (6 * BLOCK, 0, 0)  # copied back: in the device pool again
    assert_idle(engine)


def test_without_a_host_tier_an_evicted_prefix_is_recomputed(tiny_model_dir):
    engine = tiered_engine(tiny_model_dir)
    run(engine, PROMPT)
    for filler in FILLERS:
        run(engine, filler)
    assert cached_by_tier(run(engine, PROMPT)) == (0, 0, 0)


def test_the_host_tier_is_bounded_and_drops_its_least_recently_used_blocks(tiny_model_dir):
    engine = tiered_engine(tiny_model_dir, host_blocks=4)
    run(engine, PROMPT)
    for filler in FILLERS:  # 18 blocks through a pool of 12: the host tier keeps the last 4 it was given
        run(engine, filler)
    host = engine.core.block_manager.host
    assert host.num_slots == 4 and len(host.slots) == 4
    assert cached_by_tier(run(engine, PROMPT)) == (0, 0, 0)  # the prompt's blocks were the oldest: dropped
    assert_idle(engine)


# --- the storage tier alone: files on a real directory, K/V of a made-up pool ---

MODEL = model_key(b"a model's files")


def device_pool(num_blocks: int = 8) -> DeviceBlocks:
    """Two layers' keys and values, each block filled with its own numbers."""
    caches = [(torch.randn(num_blocks, 4, 2, 8), torch.randn(num_blocks, 4, 2, 8)) for _ in range(2)]
    return DeviceBlocks(caches)


def keys_of(count: int, model: bytes = MODEL) -> list[tuple[bytes, tuple[int, ...]]]:
    chain, parent = [], root_key(model, None, None)
    for i in range(count):
        tokens = tuple(range(4 * i, 4 * i + 4))
        parent = block_key(parent, tokens)
        chain.append((parent, tokens))
    return chain


def stored(directory: Path, blocks: DeviceBlocks, chain, model: bytes = MODEL, capacity: int = 1 << 30
           ) -> StorageTier:
    storage = StorageTier(directory, capacity, model, blocks)
    for block, (key, tokens) in enumerate(chain):
        storage.offer(key, tokens, block)
    assert storage.wait_for_writes(10.0)
    return storage


def read(storage: StorageTier, chain) -> list[torch.Tensor]:
    """The K/V of the run of `chain`'s blocks the storage tier reads in time (the core polls between its steps)."""
    run = storage.start_read(chain)
    while not run.done(time.monotonic()):
        time.sleep(0.001)
    return storage.finish_read(run)


def test_blocks_written_by_one_storage_tier_are_read_by_another_sharing_the_directory(tmp_path):
    blocks, chain = device_pool(), keys_of(5)
    stored(tmp_path, blocks, chain).close()
    reader = StorageTier(tmp_path, 1 << 30, MODEL, device_pool())  # another stack, or this one restarted
    found = read(reader, chain)
    assert len(found) == 5
    for block, kv in enumerate(found):
        assert torch.equal(kv, blocks.read(block))
    assert not list(tmp_path.glob("*/.*.tmp"))  # written under a temporary name, then renamed


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1])


def _flip_a_payload_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["missing", "truncated", "corrupted", "other model", "other block"])
def test_a_missing_damaged_or_foreign_file_ends_the_run_as_a_miss(tmp_path, damage):
    blocks, chain = device_pool(), keys_of(5)
    stored(tmp_path, blocks, chain).close()
    path = block_path(tmp_path, chain[2][0])
    if damage == "missing":
        path.unlink()
    elif damage == "truncated":
        _truncate(path)
    elif damage == "corrupted":
        _flip_a_payload_byte(path)
    elif damage == "other model":  # the same tokens under another model's identity, at this key's name
        key, tokens = chain[2]
        path.write_bytes(encode_block(model_key(b"another model"), key, tokens, blocks.read(2)))
    else:  # another block's (valid) file under this key's name
        block_path(tmp_path, chain[3][0]).replace(path)
    reader = StorageTier(tmp_path, 1 << 30, MODEL, device_pool())
    assert len(read(reader, chain)) == 2
    assert not path.exists()  # a damaged file is removed, to be written again


def test_a_slow_read_is_a_miss_after_a_bounded_wait(tmp_path, monkeypatch):
    blocks, chain = device_pool(), keys_of(3)
    stored(tmp_path, blocks, chain).close()
    reader = StorageTier(tmp_path, 1 << 30, MODEL, device_pool())
    monkeypatch.setattr(kv_tiers, "read_block_file", lambda path: time.sleep(3) or path.read_bytes())
    started = time.monotonic()
    assert read(reader, chain) == []
    assert time.monotonic() - started < kv_tiers.BLOCK_READ_WAIT_SECONDS + 0.5


def test_a_slow_writer_never_holds_up_offers_it_drops_them(tmp_path, monkeypatch):
    monkeypatch.setattr(kv_tiers, "write_block_file", lambda path, data: time.sleep(1.0))
    blocks = device_pool(1)
    storage = StorageTier(tmp_path, 1 << 30, MODEL, blocks)
    offers = 3 * kv_tiers.WRITE_QUEUE_BLOCKS
    started = time.monotonic()
    for key, tokens in keys_of(offers):
        storage.offer(key, tokens, 0)
    assert time.monotonic() - started < 1.0  # 192 offers, while the writer is stuck in its first write
    assert storage.dropped_writes >= offers - kv_tiers.WRITE_QUEUE_BLOCKS - 1
    storage.close()


def test_storage_is_bounded_in_bytes_least_recently_used_out(tmp_path):
    blocks, chain = device_pool(), keys_of(5)
    size = len(encode_block(MODEL, *chain[0], blocks.read(0)))
    storage = stored(tmp_path, blocks, chain[:3], capacity=3 * size)
    assert len(read(storage, chain[:1])) == 1  # block 0 is now the most recently used
    assert storage.wait_for_writes(10.0)
    for block in (3, 4):
        storage.offer(*chain[block], block)
    assert storage.wait_for_writes(10.0)
    assert sorted(p.name for p in tmp_path.glob("*/*.kv")) == sorted(
        block_path(tmp_path, chain[i][0]).name for i in (0, 3, 4))
    storage.close()


def match(manager: BlockManager, seq) -> CachedTokens:
    """The sequence's cached prefix, once its storage read (if any) is done."""
    pending = manager.allocate_cached_prefix(seq)
    if isinstance(pending, CachedTokens):
        return pending
    while not pending.read.done(time.monotonic()):
        time.sleep(0.001)
    return manager.finish_prefix_read(seq, pending)


def test_a_lower_tier_run_takes_the_device_pools_block_where_it_still_holds_one(tmp_path):
    """The prompt's first block left the device pool, its second did not: storage gives the first, the device pool
    the second (registering storage's copy of it too would leave two blocks under one key)."""
    blocks = device_pool(4)
    manager = BlockManager(4, 4, model=MODEL, storage=StorageTier(tmp_path, 1 << 30, MODEL, blocks))
    prompt = distinct_prompt(9, start=100)
    first = make_sequence(prompt)
    assert match(manager, first).total == 0
    assert manager.ensure_slots(first, 9)
    first.num_computed_tokens = 9
    manager.cache_full_blocks(first)
    assert manager.storage.wait_for_writes(10.0)
    first_block, second_block = first.block_table[:2]
    manager.free(first)
    manager.free_blocks.move_to_end(first_block, last=False)  # the least recently used: the next one reused
    assert manager.ensure_slots(make_sequence(distinct_prompt(4, start=500)), 4)  # takes the first block
    again = make_sequence(prompt)
    assert match(manager, again).by_tier() == (4, 0, 4)
    assert again.block_table[1] == second_block
    assert all(manager.key_to_block[key] == block for block, key in enumerate(manager.block_keys) if key is not None)
    assert len(manager.key_to_block) == 2


# --- the storage tier in the engine ---

@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float16"])
def test_a_prefix_in_storage_is_found_after_a_restart_bit_identical(tiny_model_dir, tmp_path, kv_cache_dtype):
    first = tiered_engine(tiny_model_dir, kv_cache_dtype, kv_storage_dir=str(tmp_path))
    cold = run(first, PROMPT)
    first.shutdown()  # (lets the queued writes land)
    restarted = tiered_engine(tiny_model_dir, kv_cache_dtype, kv_storage_dir=str(tmp_path))
    again = run(restarted, PROMPT)
    assert cached_by_tier(cold) == (0, 0, 0) and cached_by_tier(again) == (0, 0, 6 * BLOCK)
    assert sampled(again) == sampled(cold)
    for filler in FILLERS:  # evicted from the device pool, with no host tier: storage again
        run(restarted, filler)
    assert cached_by_tier(run(restarted, PROMPT)) == (0, 0, 6 * BLOCK)
    assert_idle(restarted)
    restarted.shutdown()


def test_a_prefix_match_runs_device_then_host_then_storage(tiny_model_dir, tmp_path):
    engine = tiered_engine(tiny_model_dir, host_blocks=3, kv_storage_dir=str(tmp_path))
    run(engine, PROMPT)
    assert engine.core.block_manager.storage.wait_for_writes(10.0)
    # the filler's ten blocks take the pool's six empty ones and evict the prompt's last four, deepest first (its
    # least recently used): host memory keeps the third to the fifth; the sixth, the first to go there, is dropped
    run(engine, FILLERS[0])
    result = run(engine, PROMPT)
    assert cached_by_tier(result) == (2 * BLOCK, 3 * BLOCK, BLOCK)
    assert result.outputs[-1].num_cached_tokens == 6 * BLOCK
    assert_idle(engine)


def test_engine_steps_never_wait_for_a_slow_storage_writer(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(kv_tiers, "write_block_file", lambda path, data: time.sleep(2.0))
    monkeypatch.setattr(kv_tiers, "WRITE_QUEUE_BLOCKS", 2)
    engine = tiered_engine(tiny_model_dir, kv_storage_dir=str(tmp_path))
    engine.add_request(Request("slow-writer", list(range(2000, 2000 + 10 * BLOCK)), SEEDED))
    slowest = 0.0
    while engine.has_unfinished_requests():  # ten blocks offered while the writer sleeps 2 s a block
        started = time.monotonic()
        engine.step()
        slowest = max(slowest, time.monotonic() - started)
    assert slowest < 1.0 and engine.core.block_manager.storage.dropped_writes > 0


# --- storage reads never hold up the core: the sequence waits for its blocks, off the batch ---

OTHER = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def restarted_on_stored_prompt(model_dir: Path, directory: Path) -> tuple[Result, LLMEngine]:
    """PROMPT's cold run, and a new engine on the storage directory that run wrote its blocks to."""
    first = tiered_engine(model_dir, kv_storage_dir=str(directory))
    cold = run(first, PROMPT)
    first.shutdown()  # (lets the queued writes land)
    return cold, tiered_engine(model_dir, kv_storage_dir=str(directory))


def slow_reads(monkeypatch, seconds_a_block: float) -> list[Path]:
    """Make every block file take `seconds_a_block` to read; returns the paths read so far."""
    reads = []
    monkeypatch.setattr(kv_tiers, "read_block_file",
                        lambda path: reads.append(path) or time.sleep(seconds_a_block) or path.read_bytes())
    return reads


def run_beside_another(engine: LLMEngine, prompt: list[int]) -> tuple[Result, list[int], float]:
    """`prompt` added while another sequence decodes: its result, the other's tokens emitted before the prompt's
    first token, and the longest step."""
    engine.add_request(Request("other", list(range(5000, 5000 + 2 * BLOCK)), OTHER))
    while not engine.core.scheduler.running:
        engine.step()
    result, other_tokens, slowest = Result(Request("prompt", prompt, SEEDED)), [], 0.0
    engine.add_request(result.request)
    while engine.has_unfinished_requests():
        started = time.monotonic()
        outputs = engine.step()
        slowest = max(slowest, time.monotonic() - started)
        for output in outputs:
            if output.request_id == "prompt":
                result.outputs.append(output)
            elif not result.outputs:
                other_tokens += output.choices[0].token_ids
    return result, other_tokens, slowest


def test_a_slow_storage_read_holds_up_no_other_sequences_step(tiny_model_dir, tmp_path, monkeypatch):
    """Half a second a block, every block in time: the prompt waits the 3 s its six blocks take while the other
    sequence decodes at full speed (to its end), then runs from storage's blocks, bit-identical to its cold run."""
    cold, engine = restarted_on_stored_prompt(tiny_model_dir, tmp_path)
    slow_reads(monkeypatch, 0.5)
    monkeypatch.setattr(kv_tiers, "BLOCK_READ_WAIT_SECONDS", 5.0)
    result, other_tokens, slowest = run_beside_another(engine, PROMPT)
    assert slowest < 1.0  # (a blocking read: 3 s in one step)
    assert len(other_tokens) == OTHER.max_tokens  # steps went on while the blocks were read
    assert cached_by_tier(result) == (0, 0, 6 * BLOCK) and sampled(result) == sampled(cold)
    assert_idle(engine)
    engine.shutdown()


def test_a_storage_read_that_is_late_is_a_miss_and_the_prompt_runs_cold(tiny_model_dir, tmp_path, monkeypatch):
    """Five seconds a block, a tenth of a second allowed: the prompt computes its prefix instead of waiting."""
    cold, engine = restarted_on_stored_prompt(tiny_model_dir, tmp_path)
    slow_reads(monkeypatch, 5.0)
    started = time.monotonic()
    result = run(engine, PROMPT)
    assert time.monotonic() - started < 4.0  # not even the first block was waited for
    assert cached_by_tier(result) == (0, 0, 0) and sampled(result) == sampled(cold)
    assert_idle(engine)
    engine.shutdown()


def test_an_aborted_request_waiting_for_storage_frees_everything_and_stops_the_read(tiny_model_dir, tmp_path,
                                                                                   monkeypatch):
    _, engine = restarted_on_stored_prompt(tiny_model_dir, tmp_path)
    run(engine, PROMPT[:2 * BLOCK + 1])  # the prompt's first two blocks are in the device pool: the read starts after
    reads = slow_reads(monkeypatch, 1.0)
    monkeypatch.setattr(kv_tiers, "BLOCK_READ_WAIT_SECONDS", 5.0)
    engine.add_request(Request("waits", PROMPT, SEEDED))
    engine.step()
    [(seq, pending)] = engine.core.scheduler.loading.items()
    assert len(pending.read.chain) == 4 and not pending.read.done(time.monotonic())
    stats = engine.stats()  # it waits holding no block (the two it matched stay cached)
    assert stats.waiting == 1 and stats.running == 0 and stats.free_blocks == stats.total_blocks
    while not reads:  # the reader is in the run's first block
        time.sleep(0.01)
    engine.abort_request("waits")
    engine.step()
    assert pending.read.cancelled.is_set() and not engine.core.scheduler.loading
    assert_idle(engine)
    time.sleep(2.5)
    assert len(reads) == 1  # the block being read when it was aborted, no other
    engine.shutdown()
