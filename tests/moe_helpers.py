"""A tiny random Mixtral (transformers' own classes, fixed seed) with the SmolLM2 tokenizer beside it, for the
mixture-of-experts tests of the engine and of the stack."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import MixtralConfig, MixtralForCausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tiny_mixtral_config() -> MixtralConfig:
    # SmolLM2's vocabulary size, so its tokenizer files serve this model too
    return MixtralConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=512)


def write_tiny_mixtral(directory: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Save a random MixtralForCausalLM (what the installed transformers writes) with SmolLM2's tokenizer."""
    torch.manual_seed(seed)
    model = MixtralForCausalLM(tiny_mixtral_config())
    # The default init (std 0.02) leaves the router near-uniform: scale it so routing is clear-cut per token.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 1.0)
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, directory / name)
    return directory
