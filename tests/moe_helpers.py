"""Tiny random mixture-of-experts models (transformers' own classes, fixed seed) with the SmolLM2 tokenizer beside
them, for the MoE tests of the engine and of the stack."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, MixtralConfig, PretrainedConfig, Qwen3MoeConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# SmolLM2's vocabulary size, so its tokenizer files serve these models too
_SHARED = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
               num_experts_per_tok=2, max_position_embeddings=512)


def tiny_moe_config(model_type: str) -> PretrainedConfig:
    if model_type == "mixtral":
        return MixtralConfig(**_SHARED, num_hidden_layers=2, num_local_experts=4)
    # Qwen3-MoE without renormalized top-k weights, q/k head norms, and a dense layer between two MoE ones
    return Qwen3MoeConfig(**_SHARED, num_hidden_layers=3, num_experts=4, moe_intermediate_size=32, head_dim=16,
                          norm_topk_prob=False, mlp_only_layers=[1])


def num_moe_layers(model_type: str) -> int:
    config = tiny_moe_config(model_type)
    return config.num_hidden_layers - len(getattr(config, "mlp_only_layers", []))


def write_tiny_moe(directory: Path, tokenizer_dir: Path, model_type: str = "mixtral", seed: int = 0) -> Path:
    """Save a random model of that type (in the layout the installed transformers writes) with SmolLM2's tokenizer."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_moe_config(model_type))
    # The default init (std 0.02) leaves the routers near-uniform: scale them so routing is clear-cut per token.
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):  # a MoE layer's router (dense layers have none)
                layer.mlp.gate.weight.normal_(0.0, 1.0)
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, directory / name)
    return directory
