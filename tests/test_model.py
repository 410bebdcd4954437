"""Our Llama forward pass against transformers' implementation of the same checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM as HFLlama

from backend.layers.attention import AttentionMetadata, PrefillChunk
from backend.models.llama import LlamaForCausalLM

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land far away, there lived"]


def prefill_logits(model: LlamaForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """Logits of every position of one prompt, computed in one prefill through the paged attention path."""
    arch, n = model.arch, len(token_ids)
    shape = (n, 1, arch.num_kv_heads, arch.head_dim)  # n blocks of one token
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(arch.num_layers)]
    positions = torch.arange(n)
    meta = AttentionMetadata(positions, 0, None, None, [PrefillChunk(0, n, n, positions)])
    return model.compute_logits(model(torch.tensor(token_ids), positions, meta, caches))


@pytest.fixture(scope="module")
def reference(default_model_dir):
    return (AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(default_model_dir))


def test_default_model_logits_match_transformers(default_model_dir, reference):
    hf_model, tokenizer = reference
    ours = LlamaForCausalLM.from_pretrained(default_model_dir, torch.float32, torch.device("cpu"))
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            expected = hf_model(torch.tensor([ids])).logits[0]
        assert (prefill_logits(ours, ids) - expected).abs().max().item() <= 1e-3


@pytest.mark.parametrize("rope_scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_random_llama_checkpoint_matches_transformers(tmp_path, rope_scaling):
    """Any HF-format Llama directory loads: GQA, untied lm_head, rope scaling variants."""
    torch.manual_seed(0)
    rope = {"rope_theta": 500000.0, "rope_type": "default", **(rope_scaling or {})}
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, rope_parameters=rope)
    hf_model = HFLlama(config).eval()
    hf_model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved.get("rope_parameters", saved.get("rope_scaling")) is not None
    ours = LlamaForCausalLM.from_pretrained(tmp_path, torch.float32, torch.device("cpu"))
    ids = torch.randint(0, 300, (200,)).tolist()  # long enough for the scaled frequencies to matter
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0]
    assert (prefill_logits(ours, ids) - expected).abs().max().item() <= 1e-3


def test_unsupported_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="Llama-family"):
        LlamaForCausalLM.from_pretrained(tmp_path, torch.float32, torch.device("cpu"))
