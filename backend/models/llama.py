"""Llama-family forward pass over a flat batch of tokens with a paged KV cache.

RMSNorm, rotary embeddings (default, linear and llama3 rope scaling), grouped-query attention, SwiGLU MLP,
optionally tied embeddings. Projections are fused (qkv, gate_up) at load time: fewer, larger matmuls.
Mixtral is the same model with a sparse mixture-of-experts MLP (models/moe.py) in every layer; Qwen3-MoE adds an
RMSNorm over each query and key head and may keep some layers dense."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

import kernels
from backend.layers.attention import AttentionMetadata, paged_attention
from backend.layers.linear import Choice, Q4Weight
from backend.layers.lora import LayerLora
from backend.model_files import Q4_1_FILE
from backend.models.moe import SparseMoeMLP, expert_weights


@dataclass
class LlamaArchitecture:
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
    attention_bias: bool
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

    @classmethod
    def from_config_file(cls, path: Path) -> "LlamaArchitecture":
        config = json.loads(Path(path).read_text())
        model_type = config.get("model_type", "llama")
        if model_type not in ("llama", "mixtral", "qwen3_moe"):
            raise ValueError(f"unsupported model_type {model_type!r}: this engine runs Llama-family models, "
                             "Mixtral and Qwen3-MoE")
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
            qk_norm=model_type == "qwen3_moe",
            **({} if model_type == "llama" else _moe_fields(config, model_type)),
        )


def _moe_fields(config: dict, model_type: str) -> dict:
    """LlamaArchitecture's mixture-of-experts fields from a Mixtral or Qwen3-MoE config."""
    num_experts = config.get("num_local_experts") or config.get("num_experts")  # Mixtral / Qwen3-MoE hub name
    layers = range(config["num_hidden_layers"])
    if model_type == "qwen3_moe":
        dense = set(config.get("mlp_only_layers") or [])
        step = config.get("decoder_sparse_step", 1)
        moe_layers = frozenset(i for i in layers if i not in dense and (i + 1) % step == 0)
    else:
        moe_layers = frozenset(layers)
    return {"moe_layers": moe_layers, "num_experts": num_experts, "num_experts_per_tok": config["num_experts_per_tok"],
            "moe_intermediate_size": config.get("moe_intermediate_size") or config["intermediate_size"],
            "norm_topk_prob": config.get("norm_topk_prob", True)}


def rope_inverse_frequencies(arch: LlamaArchitecture) -> torch.Tensor:
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = arch.rope_scaling
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


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with a residual, (norm(x + residual), x + residual) in one pass."""
        return kernels.rms_norm(x, self.weight, self.eps, residual)


class RotaryEmbedding:
    """Neox-style rotation (first half / second half of each head), cos/sin tables precomputed per position.

    Not an nn.Module on purpose: the tables stay float32 whatever dtype the weights are cast to."""

    def __init__(self, arch: LlamaArchitecture, device: torch.device | str = "cpu"):
        positions = torch.arange(arch.max_position_embeddings, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, rope_inverse_frequencies(arch).to(device))
        self.cos, self.sin = freqs.cos(), freqs.sin()

    def for_positions(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's (cos, sin) rows: gathered once per step, shared by every layer."""
        return self.cos[positions], self.sin[positions]


class LlamaAttention(nn.Module):
    def __init__(self, arch: LlamaArchitecture):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        q_size, kv_size = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        self.split = [q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(arch.hidden_size, q_size + 2 * kv_size, bias=arch.attention_bias)
        self.o_proj = nn.Linear(q_size, arch.hidden_size, bias=False)
        self.scale = arch.head_dim ** -0.5
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None

    def forward(self, rope, hidden, meta, k_cache, v_cache, lora: LayerLora | None):
        tokens = hidden.shape[0]
        q, k, v = _project(self.qkv_proj, "qkv_proj", hidden, lora).split(self.split, dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        kernels.rotary_embedding(q, k, *rope)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return _project(self.o_proj, "o_proj", out.reshape(tokens, -1), lora)


class LlamaMLP(nn.Module):
    def __init__(self, arch: LlamaArchitecture):
        super().__init__()
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=arch.mlp_bias)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias)

    def forward(self, x: torch.Tensor, lora: LayerLora | None) -> torch.Tensor:
        activated = kernels.silu_and_mul(_project(self.gate_up_proj, "gate_up_proj", x, lora))
        return _project(self.down_proj, "down_proj", activated, lora)


def _project(linear: nn.Linear, name: str, x: torch.Tensor, lora: LayerLora | None) -> torch.Tensor:
    """linear(x), plus each token's LoRA update when the batch uses adapters."""
    out = linear(x)
    return out if lora is None else out + lora.delta(name, x)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArchitecture, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = LlamaAttention(arch)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = (SparseMoeMLP(arch.hidden_size, arch.moe_intermediate_size, arch.num_experts,
                                 arch.num_experts_per_tok, arch.norm_topk_prob)
                    if index in arch.moe_layers else LlamaMLP(arch))

    def forward(self, rope, hidden, residual, meta, k_cache, v_cache, lora):
        """Returns (this layer's MLP output, the residual stream before it, a MoE layer's chosen expert ids per
        token [tokens, top_k] or None); the first two's sum is the layer's output. Carrying them apart lets
        each residual add fuse into the norm that follows it."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, meta, k_cache, v_cache, lora)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        if not isinstance(self.mlp, SparseMoeMLP):
            return self.mlp(hidden, lora), residual, None
        hidden, expert_ids = self.mlp(hidden)  # LoRA is for dense models only (ModelRunner refuses it here)
        return hidden, residual, expert_ids


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: LlamaArchitecture):
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.rotary: RotaryEmbedding | None = None  # set by from_pretrained on the model's device
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = (None if arch.tie_word_embeddings
                        else nn.Linear(arch.hidden_size, arch.vocab_size, bias=False))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                lora: list[LayerLora] | None = None,
                record_routing: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, positions: [tokens] → (final hidden states [tokens, hidden] before the last norm, and with
        record_routing on a MoE model the expert ids each token was routed to [tokens, MoE layers, top_k], else
        None). lora: per layer, the adapters of the batch's tokens (None: no token uses one)."""
        hidden, residual = self.embed_tokens(input_ids), None
        rope = self.rotary.for_positions(positions)
        routed = []
        for index, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            hidden, residual, expert_ids = layer(rope, hidden, residual, meta, k_cache, v_cache,
                                                 None if lora is None else lora[index])
            if expert_ids is not None and record_routing:
                routed.append(expert_ids)
        return residual + hidden, torch.stack(routed, dim=1) if routed else None

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits_of_normed(self.final_norm(hidden))

    @torch.inference_mode()
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """forward()'s output → the hidden states the LM head reads (what return_hidden_states returns)."""
        return self.norm(hidden)

    @torch.inference_mode()
    def logits_of_normed(self, normed: torch.Tensor) -> torch.Tensor:
        """The LM head over hidden states after the final norm."""
        if self.lm_head is None:  # tied, in its loaded form
            return F.linear(normed, self.embed_tokens.weight).float()
        return self.lm_head(normed).float()

    def projection_weights(self, layer: int) -> list[torch.Tensor]:
        """One layer's dense projection weights (what choose_format times)."""
        attn, mlp = self.layers[layer].self_attn, self.layers[layer].mlp
        return [attn.qkv_proj.weight, attn.o_proj.weight] + \
            ([mlp.gate_up_proj.weight, mlp.down_proj.weight] if isinstance(mlp, LlamaMLP) else [])

    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.inference_mode()
    def use_weight_format(self, choice: Choice, q4: dict[int, list[Q4Weight]] | None) -> None:
        """Replace every dense projection and the LM head by `choice`'s (the weights are fp32 here);
        q4: per layer, the Q4_1 blocks of projection_weights(layer), for int4."""
        for index, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            owners = [(attn, "qkv_proj"), (attn, "o_proj")]
            if isinstance(mlp, LlamaMLP):
                owners += [(mlp, "gate_up_proj"), (mlp, "down_proj")]
            for (owner, name), blocks in zip(owners, q4[index] if q4 else [None] * len(owners)):
                linear = getattr(owner, name)
                setattr(owner, name, choice.make(linear.weight, linear.bias, blocks))
        self.lm_head = choice.make_head(self.head_weight())

    @classmethod
    def from_pretrained(cls, model_dir: Path, dtype: torch.dtype, device: torch.device) -> "LlamaForCausalLM":
        arch = LlamaArchitecture.from_config_file(Path(model_dir) / "config.json")
        with torch.device("meta"):
            model = cls(arch)
        weights = _read_safetensors(Path(model_dir))
        state = _fuse_checkpoint(weights, arch)
        model.load_state_dict(state, strict=True, assign=True)
        model = model.to(device=device, dtype=dtype).eval()
        model.rotary = RotaryEmbedding(arch, device)
        return model


def read_q4_1_blocks(model_dir: Path, arch: LlamaArchitecture) -> dict[int, list[Q4Weight]] | None:
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


def _fuse_checkpoint(weights: dict[str, torch.Tensor], arch: LlamaArchitecture) -> dict[str, torch.Tensor]:
    """Rename HF Llama (Mixtral, Qwen3-MoE) checkpoint tensors to this module's names, concatenating q/k/v and
    gate/up (stacking the experts)."""
    def key_of(name: str) -> str | None:
        return next((key for key in (name, f"model.{name}") if key in weights), None)

    def take(name: str) -> torch.Tensor:
        key = key_of(name)
        if key is None:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        return weights[key].float()

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
        state[f"{p}.self_attn.o_proj.weight"] = take(f"{p}.self_attn.o_proj.weight")
        if arch.qk_norm:
            for norm in ("q_norm", "k_norm"):
                state[f"{p}.self_attn.{norm}.weight"] = take(f"{p}.self_attn.{norm}.weight")
        if i in arch.moe_layers:
            state.update({f"{p}.mlp.{name}": tensor for name, tensor in
                          expert_weights(take, lambda name: key_of(name) is not None, p, arch.num_experts).items()})
            continue
        for suffix in (("weight", "bias") if arch.mlp_bias else ("weight",)):
            state[f"{p}.mlp.gate_up_proj.{suffix}"] = torch.cat(
                [take(f"{p}.mlp.gate_proj.{suffix}"), take(f"{p}.mlp.up_proj.{suffix}")])
            state[f"{p}.mlp.down_proj.{suffix}"] = take(f"{p}.mlp.down_proj.{suffix}")
    return state
