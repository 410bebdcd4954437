"""Mixture-of-experts models in the engine (no Triton): the experts each generated token of tiny random Mixtral and
Qwen3-MoE models was routed to (return_routed_experts) against transformers' routers, and the expert checkpoint
layouts. Their logits and greedy tokens are compared with transformers in test_architectures.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from tritonllm.engine.config import EngineConfig
from tritonllm.interface.parameters import SamplingParams
from tritonllm.engine.llm_engine import LLMEngine
from tritonllm.engine.models import registry
from engine_helpers import generate
from tiny_models import MOE_TYPES, TOP_K, num_moe_layers, tiny_config, write_tiny_model

PROMPTS = ["The capital of France is", "Write a short story about a lighthouse keeper and a storm. " * 3]


@pytest.fixture(scope="module", params=MOE_TYPES)
def model_type(request) -> str:
    return request.param


def _router_top_k(reference: PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """[positions, MoE layers, top_k]: transformers' router choice at every position, most likely first."""
    with torch.no_grad():
        out = reference(torch.tensor([token_ids]), output_router_logits=True)
    return torch.stack([logits.topk(TOP_K, dim=-1).indices for logits in out.router_logits], dim=1)


def test_routed_experts_match_transformers_router(tiny_engine, tiny_reference, model_type):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, return_routed_experts=True)
    results = generate(tiny_engine, PROMPTS, params)  # batched: one decodes while the other still prefills
    for result in results:
        prompt_ids = tiny_engine.tokenizer.encode(result.request.prompt)
        token_ids = prompt_ids + result.token_ids()
        routed = [row for output in result.outputs for choice in output.choices for row in choice.routed_experts]
        assert len(routed) == 8 and all(row.shape == (num_moe_layers(model_type), TOP_K) for row in routed)
        # the generated token j came from the logits at position prompt_len - 1 + j
        expected_routing = _router_top_k(tiny_reference, token_ids)[len(prompt_ids) - 1:-1]
        assert torch.equal(torch.stack(routed), expected_routing)


def test_routing_is_returned_only_to_the_sequences_that_ask(tiny_engine):
    asking = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, return_routed_experts=True)
    plain = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with_routing, without = generate(tiny_engine, PROMPTS[:1] * 2, [asking, plain])
    assert sum(len(c.routed_experts) for o in with_routing.outputs for c in o.choices) == 3
    assert all(not c.routed_experts for o in without.outputs for c in o.choices)
    assert with_routing.token_ids() == without.token_ids()


def test_fused_expert_layout_loads_like_the_hub_layout(tmp_path_factory, default_model_dir, tmp_path):
    """transformers 5 keeps experts as 3-D gate_up_proj / down_proj tensors in memory; checkpoints in that
    layout load to the same weights as the per-expert w1/w2/w3 one save_pretrained writes for Mixtral."""
    mixtral_dir = write_tiny_model(tmp_path_factory.mktemp("hub") / "tiny-mixtral", default_model_dir, "mixtral")
    hub = load_file(mixtral_dir / "model.safetensors")
    fused = {key: tensor for key, tensor in hub.items() if ".block_sparse_moe." not in key}
    for layer in range(tiny_config("mixtral").num_hidden_layers):
        moe, mlp = f"model.layers.{layer}.block_sparse_moe", f"model.layers.{layer}.mlp"
        experts = range(tiny_config("mixtral").num_local_experts)
        fused[f"{mlp}.gate.weight"] = hub[f"{moe}.gate.weight"]
        fused[f"{mlp}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([hub[f"{moe}.experts.{e}.w1.weight"], hub[f"{moe}.experts.{e}.w3.weight"]]) for e in experts])
        fused[f"{mlp}.experts.down_proj"] = torch.stack([hub[f"{moe}.experts.{e}.w2.weight"] for e in experts])
    save_file(fused, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((mixtral_dir / "config.json").read_text())
    from_hub = registry.from_pretrained(mixtral_dir, torch.float32, torch.device("cpu")).state_dict()
    from_fused = registry.from_pretrained(tmp_path, torch.float32, torch.device("cpu")).state_dict()
    assert from_hub.keys() == from_fused.keys()
    assert all(torch.equal(from_hub[name], from_fused[name]) for name in from_hub)


def test_lora_on_a_moe_model_is_refused_at_start(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="dense models only"):
        LLMEngine(EngineConfig(model_path=str(tiny_dir), kv_cache_memory=4 << 20, lora_dir=str(tmp_path)))
