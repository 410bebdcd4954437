"""Every registered architecture against transformers on a tiny random checkpoint of its own (no hub download):
the logits of one prefill, greedy generation through LLMEngine; the registry refuses what it does not know, and a
checkpoint read as the wrong architecture misses."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from tritonllm.interface.parameters import SamplingParams
from tritonllm.engine.models import registry
from engine_helpers import generate, prefill_logits
from tiny_models import TINY_CONFIGS, write_tiny_model

PROMPTS = ["The capital of France is", "Write a short story about a lighthouse keeper and a storm. " * 3]
TOLERANCE = 1e-4  # float32 on both sides
MAX_TOKENS = 8


@pytest.fixture(scope="module", params=list(TINY_CONFIGS))
def model_type(request) -> str:
    return request.param


def test_every_registered_architecture_has_a_tiny_model_here():
    assert set(TINY_CONFIGS) == set(registry.MODELS)


def _load(model_dir):
    return registry.from_pretrained(model_dir, torch.float32, torch.device("cpu"))


def _max_logit_error(ours, reference: PreTrainedModel, token_ids: list[int]) -> float:
    with torch.no_grad():
        expected = reference(torch.tensor([token_ids])).logits[0]
    return (prefill_logits(ours, token_ids) - expected).abs().max().item()


def test_logits_match_transformers(tiny_reference, tiny_engine, model_type):
    served = tiny_engine.core.runner.model
    assert type(served) is registry.MODELS[model_type]
    for prompt in PROMPTS:
        assert _max_logit_error(served, tiny_reference, tiny_engine.tokenizer.encode(prompt)) <= TOLERANCE


def test_greedy_generation_matches_transformers(tiny_engine, tiny_reference):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    results = generate(tiny_engine, PROMPTS, params)  # batched: one decodes while the other still prefills
    tiny_reference.generation_config.eos_token_id = None  # like ignore_eos
    for result in results:
        prompt_ids = tiny_engine.tokenizer.encode(result.request.prompt)
        with torch.no_grad():
            expected = tiny_reference.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS,
                                               do_sample=False)[0]
        assert prompt_ids + result.token_ids() == expected.tolist()


def test_qwen3_read_as_llama_misses_transformers(default_model_dir, tmp_path):
    """The same Qwen3 checkpoint loaded as Llama (no q/k head norms; its norm tensors are then ignored) is far
    from transformers: the comparison above would catch a Qwen3 that lost its qk_norm."""
    qwen3_dir = write_tiny_model(tmp_path / "tiny-qwen3", default_model_dir, "qwen3")
    reference = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    token_ids = list(range(100, 140))
    assert _max_logit_error(_load(qwen3_dir), reference, token_ids) <= TOLERANCE
    config = json.loads((qwen3_dir / "config.json").read_text())
    (qwen3_dir / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    as_llama = _load(qwen3_dir)
    assert type(as_llama) is registry.MODELS["llama"]
    error = _max_logit_error(as_llama, reference, token_ids)
    print(f"Qwen3 read as Llama: max |Δlogit| {error:.3g}")
    assert error > 100 * TOLERANCE


def test_unknown_model_type_is_refused_with_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'") as refused:
        _load(tmp_path)
    assert all(model_type in str(refused.value) for model_type in registry.MODELS)
