"""LoRA as the forward pass applies it: an adapter's weights per (layer, projection), how our fused projections
are made of the checkpoint's, and each layer's per-token update.

The fused qkv (gate_up) projection gets one stack of adapter slots: A is the q, k and v A matrices one above the
other, B is block-diagonal, so each sub-projection's update lands in its own slice of the fused output
(untargeted blocks stay zero)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tritonllm import kernels

# our fused projection → the checkpoint projections it concatenates, in order
FUSED_PROJECTIONS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


def projection_shapes(arch) -> dict[str, tuple[int, int]]:
    """Checkpoint projection → (in features, out features) of a Llama architecture."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    hidden, inter = arch.hidden_size, arch.intermediate_size
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


@dataclass(frozen=True)
class LoraAdapter:
    name: str  # path relative to the adapters directory: the adapter's identity (prefix cache included)
    rank: int
    # (layer, checkpoint projection) → (A [rank, in], B [out, rank] with the scaling folded in), float32 numpy:
    # read off the core's thread, they become tensors in the core's slot pool (engine/lora_slots.py)
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]
    files: bytes = b""  # its files' digest (core/prefix_keys.files_digest): its prefix-cache keys change with them


@dataclass
class LayerLora:
    """What one layer's projections need to apply the batch's adapters."""

    token_slots: torch.Tensor  # [tokens] int32: each token's slot, −1 = the base model
    active_slots: tuple[int, ...]  # the slots (≥ 0) that token_slots holds, from the host
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # fused projection → (A stack, B stack)

    def delta(self, projection: str, x: torch.Tensor) -> torch.Tensor:
        """The update each token's adapter adds to the fused projection's output for input x."""
        lora_a, lora_b = self.weights[projection]
        return kernels.lora_delta(x, lora_a, lora_b, self.token_slots, self.active_slots)
