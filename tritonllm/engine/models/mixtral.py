"""Mixtral: Llama with a sparse mixture-of-experts MLP (layers/moe.py) in every layer; the chosen experts' weights
are always renormalized to sum to one."""

from __future__ import annotations

from dataclasses import replace

from tritonllm.engine.models.architecture import ModelArchitecture, num_experts
from tritonllm.engine.models.llama import LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    @classmethod
    def architecture(cls, config: dict) -> ModelArchitecture:
        return replace(super().architecture(config), moe_layers=frozenset(range(config["num_hidden_layers"])),
                       num_experts=num_experts(config), num_experts_per_tok=config["num_experts_per_tok"],
                       moe_intermediate_size=config["intermediate_size"], norm_topk_prob=True)
