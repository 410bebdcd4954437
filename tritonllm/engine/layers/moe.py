"""The sparse mixture-of-experts MLP of Mixtral and Qwen3-MoE: a router picks `top_k` of `num_experts` SwiGLU
experts per token.

Expert weights are stacked ([experts, 2 * intermediate, hidden] gate|up and [experts, hidden, intermediate]
down); models/weights.py reads them from any of the checkpoint layouts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tritonllm import kernels
from tritonllm.engine.layers.lora import LayerLora


class SparseMoeMLP(nn.Module):
    PROJECTIONS = ()  # none takes the weight format: the router and the stacked experts stay in the model's dtype

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts_gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.experts_down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, lora: LayerLora | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [tokens, hidden] → (output [tokens, hidden], chosen expert ids [tokens, top_k], most likely first).
        lora is never set here: adapters cover dense models only (ModelRunner refuses them on a MoE model); the
        argument keeps the signature of the dense MLP's, so a decoder layer calls either the same way."""
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
