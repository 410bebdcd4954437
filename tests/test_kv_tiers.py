"""The KV cache's lower tiers, through the engine on a tiny random model with a device pool of a few blocks, so
that prefixes are evicted: a prefix found in host memory gives the output a cold run gives (seeded sampling,
float32 and float16 KV), to the bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.layers import linear
from tritonllm.engine.llm_engine import LLMEngine
from tritonllm.interface.parameters import SamplingParams
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
    monkeypatch.setattr(linear, "_onednn_available", lambda: False)


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
