"""Our Llama forward pass against transformers' implementation of the same checkpoint."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM as HFLlama

from tritonllm.engine.models import registry
from engine_helpers import prefill_logits

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land far away, there lived"]


@pytest.fixture(scope="module")
def reference(default_model_dir):
    return (AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(default_model_dir))


def test_default_model_logits_match_transformers(default_model_dir, reference):
    hf_model, tokenizer = reference
    ours = registry.from_pretrained(default_model_dir, torch.float32, torch.device("cpu"))
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            expected = hf_model(torch.tensor([ids])).logits[0]
        assert (prefill_logits(ours, ids) - expected).abs().max().item() <= 1e-3


ROPE_THETA = 10000.0
HEAD_DIM = 32
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
# rope variants a loader could wrongly apply, each written into the checkpoint's config in place of the right one
NO_ROPE = {"rope_type": "linear", "factor": 1e9}  # every rotation angle below 1e-6 rad: RoPE in effect removed
UNSCALED = {"rope_type": "default"}  # the scaling ignored
# llama3 without its smoothing: the band [original / high, original / low] narrowed to hold no wavelength, so its
# frequencies are left as they are (high_freq_factor just above low) or divided by the factor (low just below high)
BAND_UNSCALED = {**LLAMA3, "high_freq_factor": 1.001}
BAND_SCALED = {**LLAMA3, "low_freq_factor": 3.999}
TOLERANCE = 1e-4  # float32 on both sides: measured 3.5e-6


@pytest.mark.parametrize(("rope_scaling", "wrong_variants"), [
    (None, {"no rope": NO_ROPE}),
    ({"rope_type": "linear", "factor": 4.0},
     {"no rope": NO_ROPE, "unscaled": UNSCALED, "factor 2": {"rope_type": "linear", "factor": 2.0}}),
    (LLAMA3, {"no rope": NO_ROPE, "unscaled": UNSCALED, "factor 4": {**LLAMA3, "factor": 4.0},
              "band unscaled": BAND_UNSCALED, "band scaled": BAND_SCALED}),
], ids=["default", "linear", "llama3"])
def test_random_llama_checkpoint_matches_transformers(tmp_path, rope_scaling, wrong_variants):
    """Any HF-format Llama directory loads (GQA, untied lm_head, rope scaling variants) and matches transformers.
    Random weights of the default scale leave attention near-uniform, so positions would barely matter: sharp
    q/k projections make the logits depend on the rotations, and every wrong rope variant, loaded from the same
    checkpoint with its config edited, misses transformers' logits by far more than the tolerance."""
    torch.manual_seed(0)
    rope = {"rope_theta": ROPE_THETA, "rope_type": "default", **(rope_scaling or {})}
    config = LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=128 // HEAD_DIM, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, rope_parameters=rope)
    hf_model = HFLlama(config).eval()
    with torch.no_grad():
        for layer in hf_model.model.layers:  # scores of std ~5 instead of ~0.05: attention picks a few positions
            layer.self_attn.q_proj.weight.normal_(0.0, 0.2)
            layer.self_attn.k_proj.weight.normal_(0.0, 0.2)
    hf_model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rope_parameters"] == rope
    ids = torch.randint(0, 300, (256,)).tolist()  # 4x llama3's original context: the scaled frequencies matter
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0]

    def error_of(rope_parameters: dict) -> float:
        (tmp_path / "config.json").write_text(json.dumps({**saved, "rope_parameters": rope_parameters}))
        ours = registry.from_pretrained(tmp_path, torch.float32, torch.device("cpu"))
        return (prefill_logits(ours, ids) - expected).abs().max().item()

    assert error_of(rope) <= TOLERANCE
    errors = {name: error_of({"rope_theta": ROPE_THETA, **variant}) for name, variant in wrong_variants.items()}
    assert all(error > 100 * TOLERANCE for error in errors.values()), errors


def test_llama3_case_has_wavelengths_inside_and_on_both_sides_of_the_smoothing_band():
    """The llama3 case above exercises all three of its rules (frequencies kept, divided by the factor, blended);
    its band variants blend none."""
    wavelengths = 2 * math.pi * ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2) / HEAD_DIM)

    def in_band(scaling: dict) -> torch.Tensor:
        original = scaling["original_max_position_embeddings"]
        return (wavelengths >= original / scaling["high_freq_factor"]) & \
            (wavelengths <= original / scaling["low_freq_factor"])

    original = LLAMA3["original_max_position_embeddings"]
    assert in_band(LLAMA3).any()
    assert (wavelengths < original / LLAMA3["high_freq_factor"]).any()  # kept
    assert (wavelengths > original / LLAMA3["low_freq_factor"]).any()  # divided by the factor
    assert not in_band(BAND_UNSCALED).any() and not in_band(BAND_SCALED).any()

