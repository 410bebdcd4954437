"""Checkpoint tensors → the models' parameters: reading an HF directory's safetensors, renaming them to our
modules' names and fusing them (q/k/v into qkv, gate/up into gate_up, experts stacked), and the converted GGUF's
blocks for the int4 weight formats; or reading a GGUF file itself (gguf_checkpoint): its blocks where the kernels
run them, dequantized tensors for the rest, and no dense copy of what has blocks; or an HF directory's projections
quantized at load to llama.cpp's blocks (quantized_checkpoint), likewise without a dense copy.

Experts load from any of the checkpoint layouts: Mixtral's per-expert `block_sparse_moe.experts.E.w1/w2/w3`,
Qwen3-MoE's per-expert `mlp.experts.E.gate_proj/up_proj/down_proj`, or the fused 3-D `mlp.experts.gate_up_proj`
/ `down_proj` that transformers 5 uses in memory."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from tritonllm.engine.layers.linear import (BlockWeight, Int5Weight, MixedWeight, Q4Weight, Q5Weight, Q8Weight,
                                           SuperBlockWeight)
from tritonllm.kernels.cpu import super_blocks
from tritonllm.model_files import BLOCKS_FILE, GGUF_HEADS, GGUF_PROJECTIONS, UNCOVERED_METADATA, llama_rotary_order
from tritonllm.engine.models.architecture import ModelArchitecture

log = logging.getLogger(__name__)
QUANTIZED_CHUNK = 1 << 20  # weights quantized at once (quantized_checkpoint)


def checkpoint_state(model_dir: Path, arch: ModelArchitecture) -> dict[str, torch.Tensor]:
    """The directory's weights as a state dict of LlamaForCausalLM (float32), for any supported architecture."""
    return _fuse_checkpoint(_Safetensors(model_dir), arch)


@dataclass(frozen=True)
class GgufBlocks:
    """A converted GGUF's blocks that the kernels run: per layer, its fused projections' (as projection_weights
    orders them; a MixedWeight for one whose parts differ in kind, None for one without blocks), the LM head's (or
    the tied embedding's) and the embedding's (looked up in them: layers/embedding.py). An HF checkpoint quantized
    at load has them too (quantized_checkpoint)."""

    layers: dict[int, list[BlockWeight | MixedWeight | None]]
    head: BlockWeight | None
    embedding: BlockWeight | None


def read_gguf_blocks(model_dir: Path, arch: ModelArchitecture) -> GgufBlocks | None:
    """The converted GGUF's blocks, or None when it has none. Logs, once a load, each GGUF type that runs dense (no
    kernel of its own here yet)."""
    path = Path(model_dir) / BLOCKS_FILE
    if not path.is_file() or arch.is_moe:
        return None
    with safe_open(str(path), framework="pt") as handle:
        names = set(handle.keys())
        _log_uncovered(json.loads(handle.metadata().get(UNCOVERED_METADATA, "{}")))

        def weight(key: str) -> BlockWeight | None:
            if f"{key}.q8_0" in names:
                return Q8Weight(handle.get_tensor(f"{key}.q8_0"))
            if f"{key}.q5_0" in names:
                return Q5Weight(handle.get_tensor(f"{key}.q5_0"))
            if f"{key}.int5_codes" in names:
                return Int5Weight(*(handle.get_tensor(f"{key}.int5_{p}") for p in ("codes", "scales", "mins")))
            for kind in super_blocks.DEQUANTIZE:
                if f"{key}.{kind}" in names:
                    return SuperBlockWeight(kind, handle.get_tensor(f"{key}.{kind}"))
            return Q4Weight(*(handle.get_tensor(f"{key}.{p}") for p in "qdm")) if f"{key}.q" in names else None

        mixed = []  # fused projections whose parts have blocks of different kinds, or some none
        layers = {i: [_fused_blocks([weight(f"model.layers.{i}.{name}.weight") for name in names], rows, mixed)
                      for _, names, rows in _fused_projections(arch)]
                  for i in range(arch.num_layers)}
        head = weight("model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight")
    return _gguf_blocks(layers, head, head if arch.tie_word_embeddings else None, mixed)


def gguf_checkpoint(gguf_path: Path, arch: ModelArchitecture, model_type: str
                    ) -> tuple[dict[str, torch.Tensor], GgufBlocks | None]:
    """A llama or qwen3 GGUF file as (state dict of LlamaForCausalLM, its blocks), read tensor by tensor. Where
    every part of a fused projection (and the LM head) has blocks the kernels run, each checked to dequantize to
    exactly `gguf.quants.dequantize`'s numbers, its weight in the state is a meta tensor: no dense copy is made.
    The rest (norms, the embedding, projections of a type without a kernel) are `gguf.quants.dequantize`'s float32
    numbers, as transformers' conversion gives them."""
    from tritonllm.gguf_blocks import checked_blocks
    from tritonllm.gguf_file import read_gguf

    tensors = {tensor.name: tensor for tensor in read_gguf(gguf_path).tensors()}
    uncovered: dict[str, list[int]] = {}

    def shape(name: str) -> list[int]:
        return [int(n) for n in reversed(tensors[name].shape)]  # GGUF lists the fastest dimension first

    def read(name: str, order=lambda x: x) -> tuple[BlockWeight | None, np.ndarray | None]:
        """A tensor's blocks and, where it has none the kernels run, its dequantized weights."""
        tensor = tensors[name]
        rows = shape(name)[0] if len(tensor.shape) > 1 else 1
        found, dense = checked_blocks(tensor.data, tensor.tensor_type, rows, order)
        tensor.drop_pages()  # what it gives is a copy
        if found is None:
            dense = dense.reshape(shape(name))
            if len(tensor.shape) > 1:
                count = uncovered.setdefault(tensor.tensor_type.name, [0, 0])
                count[0], count[1] = count[0] + 1, count[1] + dense.size
            return None, dense
        return _block_weight(found), dense

    def vector(name: str) -> torch.Tensor:
        return _tensor(read(name)[1])

    state = {"norm.weight": vector("output_norm.weight")}
    gguf_head = {ours: theirs for theirs, ours in GGUF_HEADS.items()}
    embedding, dense = read(gguf_head["model.embed_tokens.weight"])
    state["embed_tokens.weight"] = (_tensor(dense) if embedding is None
                                    else torch.empty(shape(gguf_head["model.embed_tokens.weight"]), device="meta"))
    head = embedding
    if not arch.tie_word_embeddings:
        head, dense = read(gguf_head["lm_head.weight"])
        state["lm_head.weight"] = (_tensor(dense) if head is None
                                   else torch.empty(shape(gguf_head["lm_head.weight"]), device="meta"))
    gguf_names = {ours: theirs for theirs, ours in GGUF_PROJECTIONS.items()}
    mixed, layers = [], {}
    for i in range(arch.num_layers):
        p = f"layers.{i}"
        state[f"{p}.input_layernorm.weight"] = vector(f"blk.{i}.attn_norm.weight")
        state[f"{p}.post_attention_layernorm.weight"] = vector(f"blk.{i}.ffn_norm.weight")
        if arch.qk_norm:
            state[f"{p}.self_attn.q_norm.weight"] = vector(f"blk.{i}.attn_q_norm.weight")
            state[f"{p}.self_attn.k_norm.weight"] = vector(f"blk.{i}.attn_k_norm.weight")
        layers[i] = []
        for fused_name, names, rows in _fused_projections(arch):
            parts = []
            for name in names:
                theirs = gguf_names[name]
                order = (llama_rotary_order(theirs, arch.num_heads, arch.num_kv_heads) if model_type == "llama"
                         else lambda x: x)
                parts.append(read(f"blk.{i}.{theirs}.weight", order))
            blocks = [block for block, _ in parts]
            state[f"{p}.{fused_name}.weight"] = (
                torch.empty(sum(rows), shape(f"blk.{i}.{gguf_names[names[0]]}.weight")[1], device="meta")
                if all(block is not None for block in blocks)  # runs from its blocks alone
                else torch.cat([_tensor(d) if b is None else b.dequantize() for b, d in parts]))
            layers[i].append(_fused_blocks(blocks, rows, mixed))
    _log_uncovered(uncovered)
    return state, _gguf_blocks(layers, head, embedding, mixed)


def quantized_checkpoint(model_dir: Path, arch: ModelArchitecture, quantization: str
                         ) -> tuple[dict[str, torch.Tensor], GgufBlocks]:
    """An HF directory's weights as checkpoint_state gives them, with every projection quantized at load to
    `quantization`'s blocks (config.QUANTIZATIONS) by llama.cpp's reference quantizer (gguf_blocks.quantized_blocks),
    and the LM head (or the tied embedding, as the head) to Q8_0 (llama.cpp's head is Q6_K, Q8_0 where the width is
    no multiple of 256; gguf has no Q6_K quantizer): 8.5 bits a weight where the logits are most sensitive. Each
    projection is quantized as it is read, and its weight in the state is a meta tensor: no dense copy of it stays
    (the embedding stays float32: it is looked up)."""
    from gguf import GGMLQuantizationType

    if arch.is_moe:
        raise ValueError(f"quantization {quantization} covers dense models (llama, qwen3): this model's experts are "
                         "not quantized at load; leave quantization none")
    from tritonllm.gguf_blocks import quantization_type

    qtype = GGMLQuantizationType[quantization.upper()]
    blocks: dict[str, BlockWeight] = {}
    fallen_back: list[str] = []  # what llama-quantize would quantize to another type (its blocks do not fit)

    def quantized(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        weight = _concatenated(name, parts)
        if not name.endswith(".weight"):  # a bias
            return weight
        fitting = quantization_type(qtype, weight.shape[1])
        if fitting != qtype:
            fallen_back.append(name)
        blocks[name] = _quantized(name, weight, fitting)
        return torch.empty(weight.shape, device="meta")

    state = _fuse_checkpoint(_Safetensors(model_dir), arch, quantized)
    if fallen_back:
        log.info("quantization %s: %d projections whose inputs are no multiple of 256 are %s, as llama-quantize "
                 "falls back (e.g. %s)", quantization, len(fallen_back),
                 quantization_type(qtype, 1).name.lower(), fallen_back[0])
    head_name = "embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
    head = _quantized(head_name, state[head_name], GGMLQuantizationType.Q8_0)
    if not arch.tie_word_embeddings:
        state[head_name] = torch.empty(state[head_name].shape, device="meta")
    layers = {i: [blocks[f"layers.{i}.{fused_name}.weight"] for fused_name, _, _ in _fused_projections(arch)]
              for i in range(arch.num_layers)}
    # what stays dense as copies of its own: a tensor read from safetensors may be a view of the file's mapping,
    # which would keep all of the file mapped (and its pages read resident)
    return {name: t if t.is_meta else t.clone() for name, t in state.items()}, GgufBlocks(layers, head, None)


def _quantized(name: str, weight: torch.Tensor, qtype) -> BlockWeight:
    """The weight's blocks, quantized a run of rows at a time (the quantizer's temporaries are several times the
    weights it is given: an embedding's whole would be hundreds of MB)."""
    from tritonllm.gguf_blocks import quantized_blocks

    rows = max(1, QUANTIZED_CHUNK // weight.shape[1])
    try:
        parts = [_block_weight(quantized_blocks(chunk.numpy(), qtype)) for chunk in weight.split(rows)]
        return parts[0] if len(parts) == 1 else type(parts[0]).concat(parts)
    except ValueError as error:
        raise ValueError(f"quantization {qtype.name.lower()}: {name} [{weight.shape[0]} x {weight.shape[1]}] "
                         f"cannot be quantized: {error}") from None


def _block_weight(found) -> BlockWeight:
    """gguf_blocks's blocks as the kernels' weights (torch tensors)."""
    from tritonllm.gguf_blocks import Int4Blocks, Int5Blocks, Q5Blocks, Q8Blocks, SuperBlocks

    if isinstance(found, (Int4Blocks, Int5Blocks)):
        kind = Q4Weight if isinstance(found, Int4Blocks) else Int5Weight
        return kind(*(_tensor(a) for a in (found.q, found.d, found.m)))
    if isinstance(found, Q8Blocks):
        return Q8Weight(_tensor(found.blocks))
    if isinstance(found, Q5Blocks):
        return Q5Weight(_tensor(found.blocks))
    assert isinstance(found, SuperBlocks)
    return SuperBlockWeight(found.kind, _tensor(found.blocks))


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A numpy array as a torch tensor of its own (a GGUF's float32 tensors are read-only views of the file)."""
    return torch.from_numpy(np.ascontiguousarray(array) if array.flags.writeable else np.array(array))


def _fused_projections(arch: ModelArchitecture) -> list[tuple[str, list[str], list[int]]]:
    """One layer's fused projections (as projection_weights orders them): our name, their parts' HF names and
    rows."""
    q_rows, kv_rows = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return [("self_attn.qkv_proj", [f"self_attn.{p}_proj" for p in "qkv"], [q_rows, kv_rows, kv_rows]),
            ("self_attn.o_proj", ["self_attn.o_proj"], [arch.hidden_size]),
            ("mlp.gate_up_proj", [f"mlp.{p}_proj" for p in ("gate", "up")], [arch.intermediate_size] * 2),
            ("mlp.down_proj", ["mlp.down_proj"], [arch.hidden_size])]


def _fused_blocks(parts: list[BlockWeight | None], rows: list[int],
                  mixed: list) -> BlockWeight | MixedWeight | None:
    """The parts' blocks as one, or as runs of one kind each (a run without blocks runs dense; such a projection
    is added to `mixed`)."""
    runs: list[tuple[list[BlockWeight | None], int]] = []
    for part, part_rows in zip(parts, rows):
        if runs and _kind(runs[-1][0][0]) == _kind(part):
            runs[-1] = (runs[-1][0] + [part], runs[-1][1] + part_rows)
        else:
            runs.append(([part], part_rows))
    joined = [None if run[0] is None else type(run[0]).concat(run) for run, _ in runs]
    if len(runs) == 1:
        return joined[0]
    mixed.append(parts)
    return MixedWeight(tuple(joined), tuple(part_rows for _, part_rows in runs))


def _kind(weight: BlockWeight | None) -> tuple:
    """What parts must share to run as one kernel's weights: their class (and a super-block's type)."""
    return type(weight), getattr(weight, "kind", None)


def _gguf_blocks(layers: dict[int, list[BlockWeight | MixedWeight | None]], head: BlockWeight | None,
                 embedding: BlockWeight | None, mixed: list) -> GgufBlocks | None:
    if mixed:
        log.info("%d fused projections (qkv, gate_up) mix kinds of blocks: they run part by part", len(mixed))
    has_blocks = head is not None or any(w is not None for ws in layers.values() for w in ws)
    return GgufBlocks(layers, head, embedding) if has_blocks else None


def _log_uncovered(uncovered: dict[str, list[int]]) -> None:
    """Once a load, each GGUF type that runs dense (no kernel of its own here yet), with its count and weights."""
    for qtype, (tensors, weights) in uncovered.items():
        log.warning("GGUF type %s: %d tensors (%.1fM weights) have no kernel here: they run dequantized (float16 "
                    "weights, 16 bits each, with the int4 formats; float32 or float16 otherwise)", qtype, tensors,
                    weights / 1e6)


class _Safetensors(Mapping[str, torch.Tensor]):
    """A directory's safetensors tensors by name, each read from its file when asked for: a load that converts
    them one by one never holds the checkpoint twice."""

    def __init__(self, model_dir: Path):
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
        self.handles = {}
        for file in files:
            handle = safe_open(str(file), framework="pt")
            self.handles.update({name: handle for name in handle.keys()})

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.handles[name].get_tensor(name)

    def __contains__(self, name: object) -> bool:  # (Mapping's would read the tensor)
        return name in self.handles

    def __iter__(self) -> Iterator[str]:
        return iter(self.handles)

    def __len__(self) -> int:
        return len(self.handles)


class _Checkpoint:
    """Tensors by their name with or without the `model.` prefix (both occur)."""

    def __init__(self, weights: Mapping[str, torch.Tensor]):
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


def _concatenated(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _fuse_checkpoint(weights: Mapping[str, torch.Tensor], arch: ModelArchitecture,
                     fuse: Callable[[str, list[torch.Tensor]], torch.Tensor] = _concatenated
                     ) -> dict[str, torch.Tensor]:
    """Rename HF checkpoint tensors to our modules' names, concatenating q/k/v and gate/up (stacking the
    experts); `fuse(name, parts)` makes each dense projection's weight and bias (of its parts' output rows)."""
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
            name = f"{p}.self_attn.qkv_proj.{suffix}"
            state[name] = fuse(name, [take(f"{p}.self_attn.{n}_proj.{suffix}") for n in "qkv"])
            name = f"{p}.self_attn.o_proj.{suffix}"
            state[name] = fuse(name, [take(name)])
        if arch.qk_norm:
            for norm in ("q_norm", "k_norm"):
                state[f"{p}.self_attn.{norm}.weight"] = take(f"{p}.self_attn.{norm}.weight")
        if i in arch.moe_layers:
            state.update({f"{p}.mlp.{name}": tensor
                          for name, tensor in _expert_weights(checkpoint, p, arch.num_experts).items()})
            continue
        for suffix in (("weight", "bias") if arch.mlp_bias else ("weight",)):
            name = f"{p}.mlp.gate_up_proj.{suffix}"
            state[name] = fuse(name, [take(f"{p}.mlp.gate_proj.{suffix}"), take(f"{p}.mlp.up_proj.{suffix}")])
            name = f"{p}.mlp.down_proj.{suffix}"
            state[name] = fuse(name, [take(name)])
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
