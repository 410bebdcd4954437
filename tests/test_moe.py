"""Mixture-of-experts models in the engine (no Triton): tiny random Mixtral and Qwen3-MoE models against
transformers — logits, greedy tokens, and the experts each generated token was routed to (return_routed_experts)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from backend.config import EngineConfig
from backend.llm_engine import LLMEngine
from backend.interface.parameters import SamplingParams
from backend.llm_engine import Request
from backend.models.llama import LlamaForCausalLM
from engine_helpers import EXACT, generate
from moe_helpers import num_moe_layers, tiny_moe_config, write_tiny_moe

PROMPTS = ["The capital of France is", "Write a short story about a lighthouse keeper and a storm. " * 3]
TOP_K = tiny_moe_config("mixtral").num_experts_per_tok


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def model_type(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, default_model_dir, model_type):
    return write_tiny_moe(tmp_path_factory.mktemp(model_type) / f"tiny-{model_type}", default_model_dir, model_type)


@pytest.fixture(scope="module")
def reference(moe_dir) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(moe_dir) -> LLMEngine:
    # block_size 4 and a 16-token budget: prompts span several blocks and prefill in chunks
    return LLMEngine(EngineConfig(model_path=str(moe_dir), **EXACT, kv_cache_memory=4 << 20,
                                  block_size=4, max_num_batched_tokens=16))


def test_logits_match_transformers(engine, reference):
    prompt_ids = engine.tokenizer.encode(PROMPTS[0])
    engine.add_request(Request("logits", prompt_ids, SamplingParams(max_tokens=1, prompt_logprobs=0)))
    step = engine.core.runner.execute(engine.core.scheduler.schedule())  # the whole prompt fits one step
    ours = torch.cat([step.prompt_logits[0].logits, step.logits])
    engine.abort_request("logits")
    engine.step()
    with torch.no_grad():
        expected = reference(torch.tensor([prompt_ids])).logits[0]
    assert ours.shape == expected.shape == (len(prompt_ids), 49152)
    assert (ours - expected).abs().max().item() < 1e-4


def _router_top_k(reference: PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """[positions, MoE layers, top_k]: transformers' router choice at every position, most likely first."""
    with torch.no_grad():
        out = reference(torch.tensor([token_ids]), output_router_logits=True)
    return torch.stack([logits.topk(TOP_K, dim=-1).indices for logits in out.router_logits], dim=1)


def test_greedy_tokens_and_routed_experts_match_transformers(engine, reference, model_type):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, return_routed_experts=True)
    results = generate(engine, PROMPTS, params)  # batched: one decodes while the other still prefills
    reference.generation_config.eos_token_id = None  # like ignore_eos
    for result in results:
        prompt_ids = engine.tokenizer.encode(result.request.prompt)
        token_ids = prompt_ids + result.token_ids()
        with torch.no_grad():
            expected = reference.generate(torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False)[0]
        assert token_ids == expected.tolist()
        routed = [row for output in result.outputs for choice in output.choices for row in choice.routed_experts]
        assert len(routed) == 8 and all(row.shape == (num_moe_layers(model_type), TOP_K) for row in routed)
        # the generated token j came from the logits at position prompt_len - 1 + j
        expected_routing = _router_top_k(reference, token_ids)[len(prompt_ids) - 1:-1]
        assert torch.equal(torch.stack(routed), expected_routing)


def test_routing_is_returned_only_to_the_sequences_that_ask(engine):
    asking = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, return_routed_experts=True)
    plain = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with_routing, without = generate(engine, PROMPTS[:1] * 2, [asking, plain])
    assert sum(len(c.routed_experts) for o in with_routing.outputs for c in o.choices) == 3
    assert all(not c.routed_experts for o in without.outputs for c in o.choices)
    assert with_routing.token_ids() == without.token_ids()


def test_fused_expert_layout_loads_like_the_hub_layout(tmp_path_factory, default_model_dir, tmp_path):
    """transformers 5 keeps experts as 3-D gate_up_proj / down_proj tensors in memory; checkpoints in that
    layout load to the same weights as the per-expert w1/w2/w3 one save_pretrained writes for Mixtral."""
    mixtral_dir = write_tiny_moe(tmp_path_factory.mktemp("hub") / "tiny-mixtral", default_model_dir)
    hub = load_file(mixtral_dir / "model.safetensors")
    fused = {key: tensor for key, tensor in hub.items() if ".block_sparse_moe." not in key}
    for layer in range(tiny_moe_config("mixtral").num_hidden_layers):
        moe, mlp = f"model.layers.{layer}.block_sparse_moe", f"model.layers.{layer}.mlp"
        experts = range(tiny_moe_config("mixtral").num_local_experts)
        fused[f"{mlp}.gate.weight"] = hub[f"{moe}.gate.weight"]
        fused[f"{mlp}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([hub[f"{moe}.experts.{e}.w1.weight"], hub[f"{moe}.experts.{e}.w3.weight"]]) for e in experts])
        fused[f"{mlp}.experts.down_proj"] = torch.stack([hub[f"{moe}.experts.{e}.w2.weight"] for e in experts])
    save_file(fused, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((mixtral_dir / "config.json").read_text())
    from_hub = LlamaForCausalLM.from_pretrained(mixtral_dir, torch.float32, torch.device("cpu")).state_dict()
    from_fused = LlamaForCausalLM.from_pretrained(tmp_path, torch.float32, torch.device("cpu")).state_dict()
    assert from_hub.keys() == from_fused.keys()
    assert all(torch.equal(from_hub[name], from_fused[name]) for name in from_hub)


def test_lora_on_a_moe_model_is_refused_at_start(moe_dir, tmp_path):
    with pytest.raises(ValueError, match="dense models only"):
        LLMEngine(EngineConfig(model_path=str(moe_dir), kv_cache_memory=4 << 20, lora_dir=str(tmp_path)))
