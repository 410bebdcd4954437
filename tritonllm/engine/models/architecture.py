"""`ModelArchitecture`: the shape of a decoder-only model as the engine needs it (layers, heads, KV size, vocabulary,
context), read from an HF config.json. Each model class (models/registry.py) adds what its architecture has
beyond Llama's fields."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelArchitecture:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    attention_bias: bool  # q, k, v and o projections
    mlp_bias: bool
    qk_norm: bool = False  # Qwen3: RMSNorm over each query and key head before the rotation
    moe_layers: frozenset[int] = frozenset()  # layers whose MLP is a mixture of experts (none: a dense model)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's
    norm_topk_prob: bool = True  # renormalize the chosen experts' weights to sum to one (Mixtral always does)

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @property
    def attention_equivalent(self) -> int:
        """Context tokens whose attention costs a token as many multiply-adds as its projections (qkv, o and the
        MLP's, averaged over the layers: an MoE layer's active experts): the scheduler's exchange rate."""
        attention = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim * self.hidden_size \
            + self.num_heads * self.head_dim * self.hidden_size
        moe = len(self.moe_layers)
        mlp = 3 * self.hidden_size * ((self.num_layers - moe) * self.intermediate_size
                                      + moe * self.num_experts_per_tok * self.moe_intermediate_size) / self.num_layers
        return round((attention + mlp) / (2 * self.num_heads * self.head_dim))  # QK and PV: 2 per context token

    @classmethod
    def from_hf_config(cls, config: dict) -> "ModelArchitecture":
        """The fields every supported architecture shares (a dense Llama's), with transformers' defaults."""
        # transformers 5 writes rope settings as `rope_parameters`; older checkpoints use rope_theta/rope_scaling
        rope = dict(config.get("rope_parameters") or {})
        rope_theta = rope.pop("rope_theta", config.get("rope_theta", 10000.0))
        scaling = config.get("rope_scaling") or rope
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        heads = config["num_attention_heads"]
        max_positions = config.get("max_position_embeddings", 2048)
        # Attention here has no sliding window; up to the window's length full attention is the same thing.
        window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
        max_positions = min(max_positions, window or max_positions)
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            max_position_embeddings=max_positions,
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            attention_bias=config.get("attention_bias", False),
            mlp_bias=config.get("mlp_bias", False),
        )


def read_hf_config(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def num_experts(config: dict) -> int:
    """A MoE config's expert count: transformers 5 writes `num_local_experts` for Mixtral and Qwen3-MoE alike,
    Qwen3-MoE's hub configs `num_experts`."""
    return config.get("num_local_experts") or config["num_experts"]
