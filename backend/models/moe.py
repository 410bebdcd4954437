"""Mixtral / Qwen3-MoE sparse mixture-of-experts MLP: a router picks `top_k` of `num_experts` SwiGLU experts per
token.

Expert weights are stacked ([experts, 2 * intermediate, hidden] gate|up and [experts, hidden, intermediate]
down), loaded from any of the checkpoint layouts: Mixtral's per-expert `block_sparse_moe.experts.E.w1/w2/w3`,
Qwen3-MoE's per-expert `mlp.experts.E.gate_proj/up_proj/down_proj`, or the fused 3-D
`mlp.experts.gate_up_proj` / `down_proj` that transformers 5 uses in memory."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import kernels


class SparseMoeMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts_gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.experts_down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [tokens, hidden] → (output [tokens, hidden], chosen expert ids [tokens, top_k], most likely first)."""
        # softmax over all experts in float32, keep the top k, renormalize them to sum to one (Mixtral;
        # Qwen3-MoE's norm_topk_prob) or keep their probabilities as they are
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        # Group the (token, choice) pairs by expert: one matmul pair per expert that has tokens, not per token.
        flat_ids = expert_ids.flatten()
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.experts_down.shape[0]).tolist()
        flat_weights = weights.flatten()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start:start + count]
            start += count
            tokens = pairs // self.top_k
            activated = kernels.silu_and_mul(F.linear(x[tokens], self.experts_gate_up[expert]))
            expert_out = F.linear(activated, self.experts_down[expert]) * flat_weights[pairs, None]
            out.index_add_(0, tokens, expert_out)
        return out, expert_ids


def expert_weights(take: Callable[[str], torch.Tensor], has: Callable[[str], bool], layer: str,
                   num_experts: int) -> dict[str, torch.Tensor]:
    """One layer's router and stacked expert tensors, named as SparseMoeMLP's, from any of the checkpoint layouts.
    layer: the checkpoint prefix of the decoder layer, e.g. "layers.3"."""
    fused = f"{layer}.mlp.experts.gate_up_proj"
    if has(fused):
        return {"router.weight": take(f"{layer}.mlp.gate.weight"), "experts_gate_up": take(fused),
                "experts_down": take(f"{layer}.mlp.experts.down_proj")}
    experts = range(num_experts)
    if has(f"{layer}.mlp.gate.weight"):  # Qwen3-MoE's hub layout, one set per expert
        per_expert = f"{layer}.mlp.experts"
        return {
            "router.weight": take(f"{layer}.mlp.gate.weight"),
            "experts_gate_up": torch.stack([torch.cat([take(f"{per_expert}.{e}.gate_proj.weight"),
                                                       take(f"{per_expert}.{e}.up_proj.weight")]) for e in experts]),
            "experts_down": torch.stack([take(f"{per_expert}.{e}.down_proj.weight") for e in experts]),
        }
    moe = f"{layer}.block_sparse_moe"
    # Mixtral's hub layout: w1 = gate, w3 = up, w2 = down, one set per expert
    return {
        "router.weight": take(f"{moe}.gate.weight"),
        "experts_gate_up": torch.stack([torch.cat([take(f"{moe}.experts.{e}.w1.weight"),
                                                   take(f"{moe}.experts.{e}.w3.weight")])
                                        for e in experts]),
        "experts_down": torch.stack([take(f"{moe}.experts.{e}.w2.weight") for e in experts]),
    }
