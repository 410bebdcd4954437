"""Rotary position embeddings: the inverse frequencies (default, linear and llama3 scaling) and per-position
cos/sin tables, applied by `kernels.rotary_embedding` (Neox style: first half / second half of each head)."""

from __future__ import annotations

import math

import torch


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[head_dim / 2] float32; scaling: the config's rope_scaling (None: the default rotation)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        original = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= original / high) & (wavelen <= original / low)
        return torch.where(medium, blended, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")


class RotaryEmbedding:
    """cos/sin tables precomputed for every position up to max_positions.

    Not an nn.Module on purpose: the tables stay float32 whatever dtype the weights are cast to."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 device: torch.device | str = "cpu"):
        positions = torch.arange(max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, rope_inverse_frequencies(head_dim, theta, scaling).to(device))
        self.cos, self.sin = freqs.cos(), freqs.sin()

    def for_positions(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's (cos, sin) rows: gathered once per step, shared by every layer."""
        return self.cos[positions], self.sin[positions]
