"""Tiny random models of every registered architecture (transformers' own classes, fixed seed) with the SmolLM2
tokenizer beside them, for the tests that compare the engine with transformers."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, MixtralConfig, PretrainedConfig, Qwen3Config,
                          Qwen3MoeConfig)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# SmolLM2's vocabulary size, so its tokenizer files serve these models too
_SHAPE = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512)
TOP_K = 2  # experts per token of the MoE models

TINY_CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    # a bias on every projection (o_proj's included)
    "llama": lambda: LlamaConfig(**_SHAPE, num_hidden_layers=2, attention_bias=True, mlp_bias=True),
    # q/k head norms, head_dim twice hidden_size / heads, tied embeddings (as the small Qwen3 checkpoints)
    "qwen3": lambda: Qwen3Config(**_SHAPE, num_hidden_layers=2, head_dim=32, tie_word_embeddings=True),
    "mixtral": lambda: MixtralConfig(**_SHAPE, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=TOP_K),
    # Qwen3-MoE without renormalized top-k weights, q/k head norms, and a dense layer between two MoE ones
    "qwen3_moe": lambda: Qwen3MoeConfig(**_SHAPE, num_hidden_layers=3, num_experts=4, num_experts_per_tok=TOP_K,
                                        moe_intermediate_size=32, head_dim=16, norm_topk_prob=False,
                                        mlp_only_layers=[1]),
}
MOE_TYPES = ("mixtral", "qwen3_moe")


def tiny_config(model_type: str) -> PretrainedConfig:
    return TINY_CONFIGS[model_type]()


def num_moe_layers(model_type: str) -> int:
    config = tiny_config(model_type)
    return config.num_hidden_layers - len(getattr(config, "mlp_only_layers", []))


def write_tiny_model(directory: Path, tokenizer_dir: Path, model_type: str, seed: int = 0) -> Path:
    """Save a random model of that type (in the layout the installed transformers writes) with SmolLM2's tokenizer."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            # transformers starts biases at zero and norm weights at one: a loader that dropped or swapped them
            # would go unnoticed
            if name.endswith(".bias"):
                parameter.normal_(0.0, 0.1)
            elif name.endswith("norm.weight"):
                parameter.normal_(1.0, 0.2)
        # The default init (std 0.02) leaves the routers near-uniform: scale them so routing is clear-cut per token.
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):  # a MoE layer's router (dense layers have none)
                layer.mlp.gate.weight.normal_(0.0, 1.0)
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, directory / name)
    return directory


# A Qwen3-2507-thinking style template (ChatML): the generation prompt opens the reasoning, or with
# `enable_thinking: false` closes an empty one, as Qwen3's own template does.
THINKING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


def write_thinking_model(directory: Path, tokenizer_dir: Path) -> Path:
    """The tiny random Qwen3 with THINKING_TEMPLATE as its chat template."""
    write_tiny_model(directory, tokenizer_dir, "qwen3")
    (directory / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return directory
