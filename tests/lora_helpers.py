"""Small random PEFT LoRA adapters for the default model, and the merged-weights reference they must match."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _shapes(config: dict) -> dict[str, tuple[int, int]]:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def write_random_adapter(folder: Path, model_dir: Path, seed: int, rank: int = 8, alpha: float = 32.0,
                         targets: tuple[str, ...] = TARGETS, std: float = 0.02) -> Path:
    """A PEFT adapter (adapter_config.json + adapter_model.safetensors) for every layer and `targets`."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    shapes = _shapes(config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for target in targets:
            in_features, out_features = shapes[target]
            module = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{module}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * std
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none",
        "base_model_name_or_path": str(model_dir), "task_type": "CAUSAL_LM"}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def merged_model(model_dir: Path, adapter_dir: Path | None):
    """transformers' model with the adapter merged into its weights: W + B @ A * alpha / r."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter_dir is None:
        return model
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    scaling = config["lora_alpha"] / config["r"]
    from safetensors.torch import load_file

    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    with torch.no_grad():
        for key, lora_a in tensors.items():
            if ".lora_A." not in key:
                continue
            module_path = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            lora_b = tensors[key.replace(".lora_A.", ".lora_B.")]
            model.get_submodule(module_path).weight += (lora_b @ lora_a) * scaling
    return model
