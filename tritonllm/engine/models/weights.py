"""Checkpoint tensors → the models' parameters: reading an HF directory's safetensors, renaming them to our
modules' names and fusing them (q/k/v into qkv, gate/up into gate_up, experts stacked), and the converted GGUF's
Q4_1 blocks for the int4 weight format.

Experts load from any of the checkpoint layouts: Mixtral's per-expert `block_sparse_moe.experts.E.w1/w2/w3`,
Qwen3-MoE's per-expert `mlp.experts.E.gate_proj/up_proj/down_proj`, or the fused 3-D `mlp.experts.gate_up_proj`
/ `down_proj` that transformers 5 uses in memory."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from tritonllm.engine.layers.linear import Q4Weight
from tritonllm.model_files import Q4_1_FILE
from tritonllm.engine.models.architecture import ModelArchitecture


def checkpoint_state(model_dir: Path, arch: ModelArchitecture) -> dict[str, torch.Tensor]:
    """The directory's weights as a state dict of LlamaForCausalLM (float32), for any supported architecture."""
    return _fuse_checkpoint(_read_safetensors(model_dir), arch)


def read_q4_1_blocks(model_dir: Path, arch: ModelArchitecture) -> dict[int, list[Q4Weight]] | None:
    """The converted GGUF's Q4_1 blocks of every dense layer's fused projections (as projection_weights orders
    them), or None when the checkpoint has no complete set."""
    path = Path(model_dir) / Q4_1_FILE
    if not path.is_file() or arch.is_moe:
        return None
    with safe_open(str(path), framework="pt") as handle:
        names = set(handle.keys())

        def blocks(name: str) -> Q4Weight | None:
            keys = [f"model.layers.{name}.weight.{part}" for part in "qdm"]
            return Q4Weight(*(handle.get_tensor(key) for key in keys)) if keys[0] in names else None

        layers = {}
        for i in range(arch.num_layers):
            parts = [[blocks(f"{i}.self_attn.{p}_proj") for p in "qkv"], [blocks(f"{i}.self_attn.o_proj")],
                     [blocks(f"{i}.mlp.gate_proj"), blocks(f"{i}.mlp.up_proj")], [blocks(f"{i}.mlp.down_proj")]]
            if any(block is None for fused in parts for block in fused):
                return None
            layers[i] = [Q4Weight.concat(fused) for fused in parts]
    return layers


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    weights = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                weights[name] = handle.get_tensor(name)
    return weights


class _Checkpoint:
    """Tensors by their name with or without the `model.` prefix (both occur)."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.weights = weights

    def key_of(self, name: str) -> str | None:
        return next((key for key in (name, f"model.{name}") if key in self.weights), None)

    def has(self, name: str) -> bool:
        return self.key_of(name) is not None

    def take(self, name: str) -> torch.Tensor:
        key = self.key_of(name)
        if key is None:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        return self.weights[key].float()


def _fuse_checkpoint(weights: dict[str, torch.Tensor], arch: ModelArchitecture) -> dict[str, torch.Tensor]:
    """Rename HF checkpoint tensors to our modules' names, concatenating q/k/v and gate/up (stacking the
    experts)."""
    checkpoint = _Checkpoint(weights)
    take = checkpoint.take
    state = {"embed_tokens.weight": take("embed_tokens.weight"), "norm.weight": take("norm.weight")}
    if not arch.tie_word_embeddings:
        state["lm_head.weight"] = weights["lm_head.weight"].float()
    for i in range(arch.num_layers):
        p = f"layers.{i}"
        state[f"{p}.input_layernorm.weight"] = take(f"{p}.input_layernorm.weight")
        state[f"{p}.post_attention_layernorm.weight"] = take(f"{p}.post_attention_layernorm.weight")
        for suffix in (("weight", "bias") if arch.attention_bias else ("weight",)):
            state[f"{p}.self_attn.qkv_proj.{suffix}"] = torch.cat(
                [take(f"{p}.self_attn.{n}_proj.{suffix}") for n in "qkv"])
            state[f"{p}.self_attn.o_proj.{suffix}"] = take(f"{p}.self_attn.o_proj.{suffix}")
        if arch.qk_norm:
            for norm in ("q_norm", "k_norm"):
                state[f"{p}.self_attn.{norm}.weight"] = take(f"{p}.self_attn.{norm}.weight")
        if i in arch.moe_layers:
            state.update({f"{p}.mlp.{name}": tensor
                          for name, tensor in _expert_weights(checkpoint, p, arch.num_experts).items()})
            continue
        for suffix in (("weight", "bias") if arch.mlp_bias else ("weight",)):
            state[f"{p}.mlp.gate_up_proj.{suffix}"] = torch.cat(
                [take(f"{p}.mlp.gate_proj.{suffix}"), take(f"{p}.mlp.up_proj.{suffix}")])
            state[f"{p}.mlp.down_proj.{suffix}"] = take(f"{p}.mlp.down_proj.{suffix}")
    return state


def _expert_weights(checkpoint: _Checkpoint, layer: str, num_experts: int) -> dict[str, torch.Tensor]:
    """One layer's router and stacked expert tensors, named as SparseMoeMLP's, from any of the checkpoint layouts.
    layer: the checkpoint prefix of the decoder layer, e.g. "layers.3"."""
    take = checkpoint.take
    fused = f"{layer}.mlp.experts.gate_up_proj"
    if checkpoint.has(fused):
        return {"router.weight": take(f"{layer}.mlp.gate.weight"), "experts_gate_up": take(fused),
                "experts_down": take(f"{layer}.mlp.experts.down_proj")}
    experts = range(num_experts)
    if checkpoint.has(f"{layer}.mlp.gate.weight"):  # Qwen3-MoE's hub layout, one set per expert
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
