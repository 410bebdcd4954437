"""int8 rows: int4-q8's kernels with one level of int8 codes for their inputs (llama.cpp's numerics) where float32
rows take two. prefill_dtype=int8 gives them to the prompt rows, decode_dtype=int8 to the decode rows and the LM head
(and to the prompt rows too unless prefill_dtype says otherwise). The engine's output close to float32 rows' (not as
close as bf16 prompts': 1 of the 4 prompts' 8-token greedy continuations changes, so auto never takes it), a prompt
token given the bits decoding it gives where both kinds of rows are int8, and a sequence's output independent of how
a prompt is cut into chunks or what it is batched with; refused for weights whose kernels take float32 inputs."""

from __future__ import annotations

import pytest
import torch

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.core.model_runner import load_model
from tritonllm.engine.llm_engine import LLMEngine
from engine_helpers import (assert_a_long_prompt_does_not_depend_on_its_chunks_or_its_batch, decode_hidden,
                            prefill_hidden, prefill_logits)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,", "1, 2, 3, 4,"]


def assert_close_to_two_levels(logits: torch.Tensor, expected: torch.Tensor, agreeing: list[bool]) -> None:
    difference = (logits - expected).abs().max().item()
    print(f"max |Δlogit| {difference:.3f}")
    assert 0 < difference < 1.5  # not the two-level rows' bits; 0.70 to 1.25 here (logits span about ±27)
    agreeing += (logits.argmax(-1) == expected.argmax(-1)).tolist()


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
        assert_close_to_two_levels(prefill_logits(ours, ids), prefill_logits(exact, ids), agreeing)
    assert sum(agreeing) / len(agreeing) >= 0.9


def test_int8_decodes_are_int8_prompts_arithmetic_and_stay_close_to_float32(default_model_dir):
    """With both kinds of rows int8 a prompt token gets the bits decoding it gives, and they are int8 prompt rows'
    bits (a model whose decodes kept two levels would give float32 rows' there); the logits stay near float32's."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    cpu = torch.device("cpu")
    exact, _ = load_model(EngineConfig(weight_format="int4-q8"), default_model_dir, cpu)
    int8_prompts, _ = load_model(EngineConfig(weight_format="int4-q8", prefill_dtype="int8"), default_model_dir, cpu)
    ours, description = load_model(EngineConfig(decode_dtype="int8"), default_model_dir, cpu)
    assert description.startswith("int4-q8") and description.endswith("int8 prompts, int8 decodes")
    agreeing = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        decoded = decode_hidden(ours, ids)
        assert torch.equal(prefill_hidden(ours, ids), decoded)
        assert torch.equal(prefill_hidden(int8_prompts, ids), decoded)
        assert_close_to_two_levels(ours.compute_logits(decoded), exact.compute_logits(decode_hidden(exact, ids)),
                                   agreeing)
    assert sum(agreeing) / len(agreeing) >= 0.9


@pytest.fixture(scope="module", params=[("int8", "float32"), ("auto", "int8"), ("float32", "int8")],
                ids=["int8 prompts", "int8 rows", "int8 decodes"])
def int8_engines(request, default_model_dir):
    """Two engines with int8 rows of one kind or both, cutting prompts into different chunks."""
    prefill, decode = request.param

    def engine(budget: int) -> LLMEngine:
        return LLMEngine(EngineConfig(model_path=str(default_model_dir), weight_format="int4-q8",
                                      prefill_dtype=prefill, decode_dtype=decode, max_num_batched_tokens=budget,
                                      kv_cache_memory=64 << 20))
    return engine(512), engine(300)


def test_an_outputs_tokens_do_not_depend_on_its_prompts_chunks_or_its_batch(int8_engines):
    assert_a_long_prompt_does_not_depend_on_its_chunks_or_its_batch(*int8_engines, PROMPTS)


def test_int8_rows_take_int4_q8_weights_and_are_refused_for_weights_with_float32_inputs(default_model_dir):
    _, description = load_model(EngineConfig(prefill_dtype="int8"), default_model_dir, torch.device("cpu"))
    assert description.startswith("int4-q8") and description.endswith("int8 prompts")
    for setting in ("prefill_dtype", "decode_dtype"):
        with pytest.raises(ValueError, match=f"{setting}=int8 is for weights whose kernels quantize"):
            load_model(EngineConfig(weight_format="int4", **{setting: "int8"}), default_model_dir,
                       torch.device("cpu"))
