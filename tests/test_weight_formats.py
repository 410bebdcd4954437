"""Weight formats against float32: logits within a stated tolerance, the same greedy text over a prompt set,
seeded output that does not depend on the batch; int4 serving the GGUF's own Q4_1 weights; what `auto` may
choose."""

from __future__ import annotations

import pytest
import torch

from backend.config import EngineConfig
from backend.engine.model_runner import load_model
from backend.interface.parameters import SamplingParams
from backend.layers import linear
from backend.llm_engine import LLMEngine
from backend.models import registry
from backend.models.weights import read_q4_1_blocks
from engine_helpers import generate, prefill_logits

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,", "1, 2, 3, 4,"]
# max |Δlogit| against float32 (logits span about ±27 here): bf16 activations round every layer's input to an
# 8-bit mantissa; int8 re-quantizes the 4-bit weights per output channel; int4 with fp32 activations computes
# with exactly the checkpoint's weights.
LOGIT_TOLERANCE = {"bfloat16": 2.0, "int8": 2.5, "int4": {torch.float32: 1e-3, torch.bfloat16: 2.0}}


@pytest.fixture(scope="module")
def reference(default_model_dir):
    model, _ = load_model(EngineConfig(weight_format="float32", dtype="float32"), default_model_dir, torch.device("cpu"))
    return model


@pytest.fixture(scope="module")
def tokenizer_ids(default_model_dir):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    return [tokenizer.encode(prompt) for prompt in PROMPTS]


@pytest.mark.parametrize("weight_format", ["bfloat16", "int8", "int4"])
def test_logits_stay_close_to_float32(weight_format, reference, tokenizer_ids, default_model_dir):
    model, description = load_model(EngineConfig(weight_format=weight_format), default_model_dir, torch.device("cpu"))
    tolerance = LOGIT_TOLERANCE[weight_format]
    if isinstance(tolerance, dict):
        tolerance = tolerance[model.embed_tokens.weight.dtype]
    for ids in tokenizer_ids:
        ours, expected = prefill_logits(model, ids), prefill_logits(reference, ids)
        difference = (ours - expected).abs().max().item()
        print(f"{description}: max |Δlogit| {difference:.2e} over {len(ids)} positions")
        assert difference <= tolerance
        assert (ours.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


@pytest.fixture(scope="module", params=["float32", "bfloat16", "int8", "int4"])
def format_engine(request, default_model_dir):
    return LLMEngine(EngineConfig(model_path=str(default_model_dir), weight_format=request.param,
                                  kv_cache_memory=32 << 20))


@pytest.fixture(scope="module")
def float32_greedy(default_model_dir):
    engine = LLMEngine(EngineConfig(model_path=str(default_model_dir), weight_format="float32", dtype="float32",
                                    kv_cache_memory=32 << 20))
    return [r.token_ids() for r in generate(engine, PROMPTS, SamplingParams(max_tokens=8, temperature=0))]


def test_greedy_text_agrees_with_float32(format_engine, float32_greedy):
    ours = [r.token_ids() for r in generate(format_engine, PROMPTS, SamplingParams(max_tokens=8, temperature=0))]
    same = sum(a == b for a, b in zip(ours, float32_greedy))
    print(f"{format_engine.core.runner.weight_format}: {same}/{len(PROMPTS)} greedy continuations identical")
    assert same >= len(PROMPTS) - 1


def test_seeded_output_does_not_depend_on_the_batch(format_engine):
    seeded = SamplingParams(max_tokens=10, temperature=0.8, seed=11, ignore_eos=True)
    [alone] = generate(format_engine, [PROMPTS[2]], seeded)
    others = [SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)] * 5
    together = generate(format_engine, [PROMPTS[2], *PROMPTS, PROMPTS[0]], [seeded, *others, seeded])
    assert together[0].token_ids() == alone.token_ids()


def test_int4_computes_with_the_ggufs_own_q4_1_weights(default_model_dir):
    """Q4_1's w = d·q + m as the int4 kernel's (q − 8)·scale + zero: the layer's outputs are the dequantized
    checkpoint's, to float32 rounding."""
    model = registry.from_pretrained(default_model_dir, torch.float32, torch.device("cpu"))  # as loaded
    blocks = read_q4_1_blocks(default_model_dir, model.arch)
    assert blocks is not None  # the default model is a Q4_1 GGUF: prepare kept its blocks
    qkv = blocks[0][0]
    dequantized = qkv.d.float().repeat_interleave(32, 1) * qkv.q + qkv.m.float().repeat_interleave(32, 1)
    assert torch.equal(dequantized, model.projection_weights(0)[0])  # the dense checkpoint is those numbers
    x = torch.randn(3, dequantized.shape[1])
    int4 = linear.Int4Projection(qkv, None, torch.float32)
    torch.testing.assert_close(int4(x), x @ dequantized.T, atol=1e-4, rtol=1e-4)


def test_auto_considers_only_exact_or_near_exact_formats(monkeypatch):
    def formats(bf16_hardware: bool, has_q4: bool) -> set[str]:
        monkeypatch.setattr(linear, "cpu_has_bf16", lambda: bf16_hardware)
        return {choice.weight_format for choice in linear.candidates("auto", None, has_q4)}

    assert formats(False, True) == {"float32"}  # bf16 activations only with bf16 hardware
    assert formats(True, True) == {"float32", "bfloat16", "int4"}  # int8 re-quantizes: never automatic
    assert formats(True, False) == {"float32", "bfloat16"}  # int4 only serves a checkpoint's own Q4_1 weights
    assert {c.dtype for c in linear.candidates("auto", torch.float32, True)} == {torch.float32}
    with pytest.raises(ValueError, match="Q4_1"):
        linear.candidates("int4", None, has_q4=False)
    with pytest.raises(ValueError, match="weight_format"):
        linear.candidates("fp8", None, has_q4=True)
