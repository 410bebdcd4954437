"""Checkpoint tensors → the models' parameters: reading an HF directory's safetensors, renaming them to our
modules' names and fusing them (q/k/v into qkv, gate/up into gate_up, experts stacked), and the converted GGUF's
blocks for the int4 weight formats.

Experts load from any of the checkpoint layouts: Mixtral's per-expert `block_sparse_moe.experts.E.w1/w2/w3`,
Qwen3-MoE's per-expert `mlp.experts.E.gate_proj/up_proj/down_proj`, or the fused 3-D `mlp.experts.gate_up_proj`
/ `down_proj` that transformers 5 uses in memory."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from dataclasses import dataclass

from tritonllm.engine.layers.linear import BlockWeight, MixedWeight, Q4Weight, Q6Weight, Q8Weight
from tritonllm.model_files import BLOCKS_FILE, UNCOVERED_METADATA
from tritonllm.engine.models.architecture import ModelArchitecture

log = logging.getLogger(__name__)


def checkpoint_state(model_dir: Path, arch: ModelArchitecture) -> dict[str, torch.Tensor]:
    """The directory's weights as a state dict of LlamaForCausalLM (float32), for any supported architecture."""
    return _fuse_checkpoint(_read_safetensors(model_dir), arch)


@dataclass(frozen=True)
class GgufBlocks:
    """A converted GGUF's blocks that the kernels run: per layer, its fused projections' (as projection_weights
    orders them; a MixedWeight for one whose parts differ in kind, None for one without blocks), and the LM head's
    (or the tied embedding's)."""

    layers: dict[int, list[BlockWeight | MixedWeight | None]]
    head: BlockWeight | None


def read_gguf_blocks(model_dir: Path, arch: ModelArchitecture) -> GgufBlocks | None:
    """The converted GGUF's blocks, or None when it has none. Logs, once a load, each GGUF type that runs dense (no
    kernel of its own here yet)."""
    path = Path(model_dir) / BLOCKS_FILE
    if not path.is_file() or arch.is_moe:
        return None
    with safe_open(str(path), framework="pt") as handle:
        names = set(handle.keys())
        for qtype, (tensors, weights) in json.loads(handle.metadata().get(UNCOVERED_METADATA, "{}")).items():
            log.warning("GGUF type %s: %d tensors (%.1fM weights) have no kernel here: they run dequantized (float16 "
                        "weights, 16 bits each, with the int4 formats; float32 or float16 otherwise)", qtype, tensors,
                        weights / 1e6)

        def weight(key: str) -> BlockWeight | None:
            if f"{key}.q8_0" in names:
                return Q8Weight(handle.get_tensor(f"{key}.q8_0"))
            if f"{key}.q6_codes" in names:
                return Q6Weight(handle.get_tensor(f"{key}.q6_codes"), handle.get_tensor(f"{key}.q6_scales"))
            return Q4Weight(*(handle.get_tensor(f"{key}.{p}") for p in "qdm")) if f"{key}.q" in names else None

        def part(name: str) -> BlockWeight | None:
            return weight(f"model.layers.{name}.weight")

        mixed = []  # fused projections whose parts have blocks of different kinds, or some none

        def fused(parts: list[BlockWeight | None], rows: list[int]) -> BlockWeight | MixedWeight | None:
            """The parts' blocks as one, or as runs of one kind each (a run without blocks runs dense)."""
            runs: list[tuple[list[BlockWeight | None], int]] = []
            for part, part_rows in zip(parts, rows):
                if runs and type(runs[-1][0][0]) is type(part):
                    runs[-1] = (runs[-1][0] + [part], runs[-1][1] + part_rows)
                else:
                    runs.append(([part], part_rows))
            joined = [None if run[0] is None else type(run[0]).concat(run) for run, _ in runs]
            if len(runs) == 1:
                return joined[0]
            mixed.append(parts)
            return MixedWeight(tuple(joined), tuple(part_rows for _, part_rows in runs))

        q_rows, kv_rows = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        layers = {i: [fused([part(f"{i}.self_attn.{p}_proj") for p in "qkv"], [q_rows, kv_rows, kv_rows]),
                      fused([part(f"{i}.self_attn.o_proj")], [arch.hidden_size]),
                      fused([part(f"{i}.mlp.{p}_proj") for p in ("gate", "up")], [arch.intermediate_size] * 2),
                      fused([part(f"{i}.mlp.down_proj")], [arch.hidden_size])]
                  for i in range(arch.num_layers)}
        head = weight("model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight")
    if mixed:
        log.info("%d fused projections (qkv, gate_up) mix kinds of blocks: they run part by part", len(mixed))
    has_blocks = head is not None or any(w is not None for ws in layers.values() for w in ws)
    return GgufBlocks(layers, head) if has_blocks else None


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
