"""Qwen3-MoE: Qwen3 (q/k head norms) whose MLPs are sparse mixtures of experts, except the layers listed in
`mlp_only_layers` or left out by `decoder_sparse_step`, which stay dense; renormalizing the chosen experts'
weights is optional (`norm_topk_prob`)."""

from __future__ import annotations

from dataclasses import replace

from tritonllm.engine.models.architecture import ModelArchitecture, num_experts
from tritonllm.engine.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @classmethod
    def architecture(cls, config: dict) -> ModelArchitecture:
        dense = set(config.get("mlp_only_layers") or [])
        step = config.get("decoder_sparse_step", 1)
        moe_layers = frozenset(i for i in range(config["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)
        # missing keys take transformers' Qwen3MoeConfig defaults
        return replace(super().architecture(config), moe_layers=moe_layers, num_experts=num_experts(config),
                       num_experts_per_tok=config["num_experts_per_tok"],
                       moe_intermediate_size=config["moe_intermediate_size"],
                       norm_topk_prob=config.get("norm_topk_prob", False))
