"""prefill_dtype=int8: int4-q8's prompt rows with one level of int8 codes for their inputs (llama.cpp's numerics),
decode rows with two. The engine's output close to float32 prompts' (not as close as bf16 prompts': 1 of the 4
prompts' 8-token greedy continuations changes, so auto never takes it) and independent of how a prompt is cut into
chunks or what it is batched with; refused for weights whose kernels take float32 inputs."""

from __future__ import annotations

import pytest
import torch

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.core.model_runner import load_model
from tritonllm.engine.llm_engine import LLMEngine
from engine_helpers import assert_a_long_prompt_does_not_depend_on_its_chunks_or_its_batch, prefill_logits

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,", "1, 2, 3, 4,"]


def test_int8_prompt_logits_stay_close_to_float32_prompts(default_model_dir):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    exact, _ = load_model(EngineConfig(weight_format="int4-q8", prefill_dtype="float32"), default_model_dir,
                          torch.device("cpu"))
    ours, description = load_model(EngineConfig(weight_format="int4-q8", prefill_dtype="int8"), default_model_dir,
                                   torch.device("cpu"))
    assert description.endswith("int8 prompts")
    agreeing = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        logits, expected = prefill_logits(ours, ids), prefill_logits(exact, ids)
        difference = (logits - expected).abs().max().item()
        print(f"{prompt!r}: max |Δlogit| {difference:.3f}")
        assert 0 < difference < 1.5  # not the two-level rows' bits; 0.70 to 1.25 here (logits span about ±27)
        agreeing += (logits.argmax(-1) == expected.argmax(-1)).tolist()
    assert sum(agreeing) / len(agreeing) >= 0.9


@pytest.fixture(scope="module")
def int8_engines(default_model_dir):
    """Two engines with int8 prompts, cutting prompts into different chunks."""
    def engine(budget: int) -> LLMEngine:
        return LLMEngine(EngineConfig(model_path=str(default_model_dir), weight_format="int4-q8",
                                      prefill_dtype="int8", max_num_batched_tokens=budget,
                                      kv_cache_memory=64 << 20))
    return engine(512), engine(300)


def test_an_int8_prompts_output_does_not_depend_on_its_chunks_or_its_batch(int8_engines):
    assert_a_long_prompt_does_not_depend_on_its_chunks_or_its_batch(*int8_engines, PROMPTS)


def test_int8_prompts_take_int4_q8_weights_and_are_refused_for_weights_with_float32_inputs(default_model_dir):
    _, description = load_model(EngineConfig(prefill_dtype="int8"), default_model_dir, torch.device("cpu"))
    assert description.startswith("int4-q8") and description.endswith("int8 prompts")
    with pytest.raises(ValueError, match="prefill_dtype=int8 is for weights whose kernels quantize"):
        load_model(EngineConfig(weight_format="int4", prefill_dtype="int8"), default_model_dir, torch.device("cpu"))
