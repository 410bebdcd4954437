"""Llama: the decoder the other architectures here build on, over a flat batch of tokens with a paged KV cache.

Grouped-query attention with rotary embeddings, a SwiGLU MLP (or, where the architecture says so, a sparse
mixture of experts), RMSNorm before each, optionally tied embeddings. Projections are fused (qkv, gate_up) at load
time: fewer, larger matmuls."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tritonllm import kernels
from tritonllm.kernels import cpu as cpu_ops
from tritonllm.engine.layers.attention import AttentionMetadata, paged_attention
from tritonllm.engine.layers.embedding import BlockEmbedding
from tritonllm.engine.layers.linear import Choice
from tritonllm.engine.layers.lora import LayerLora
from tritonllm.engine.layers.row_dtype import activation_levels, computing_rows, matmul_dtype
from tritonllm.engine.layers.moe import SparseMoeMLP
from tritonllm.engine.layers.norm import RMSNorm
from tritonllm.engine.layers.rotary import RotaryEmbedding
from tritonllm.engine.models.architecture import ModelArchitecture
from tritonllm.engine.models.weights import GgufBlocks, checkpoint_state, gguf_checkpoint, quantized_checkpoint


class LlamaAttention(nn.Module):
    PROJECTIONS = ("qkv_proj", "o_proj")  # the nn.Linear attributes that take the weight format

    def __init__(self, arch: ModelArchitecture):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        q_size, kv_size = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        self.split = [q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(arch.hidden_size, q_size + 2 * kv_size, bias=arch.attention_bias)
        self.o_proj = nn.Linear(q_size, arch.hidden_size, bias=arch.attention_bias)
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
    PROJECTIONS = ("gate_up_proj", "down_proj")

    def __init__(self, arch: ModelArchitecture):
        super().__init__()
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=arch.mlp_bias)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias)

    def forward(self, x: torch.Tensor, lora: LayerLora | None) -> tuple[torch.Tensor, None]:
        """(output, None): a dense MLP routes nowhere (SparseMoeMLP's signature, which returns the expert ids)."""
        activated = kernels.silu_and_mul(_project(self.gate_up_proj, "gate_up_proj", x, lora))
        return _project(self.down_proj, "down_proj", activated, lora), None


def _rows_of(lora: list[LayerLora] | None, rows: slice) -> list[LayerLora] | None:
    """Each layer's adapters for some of the batch's rows."""
    return None if lora is None else [replace(layer, token_slots=layer.token_slots[rows]) for layer in lora]


def _project(linear: nn.Linear, name: str, x: torch.Tensor, lora: LayerLora | None) -> torch.Tensor:
    """linear(x), plus each token's LoRA update when the batch uses adapters."""
    out = linear(x)
    return out if lora is None else out + lora.delta(name, x)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchitecture, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = LlamaAttention(arch)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = (SparseMoeMLP(arch.hidden_size, arch.moe_intermediate_size, arch.num_experts,
                                 arch.num_experts_per_tok, arch.norm_topk_prob)
                    if index in arch.moe_layers else LlamaMLP(arch))

    def forward(self, rope, hidden, residual, meta, k_cache, v_cache, lora):
        """Returns (this layer's MLP output, the residual stream before it, the expert ids each token was routed
        to: [tokens, top_k], None in a dense layer); the first two summed are the layer's output. Carrying them
        apart lets each residual add fuse into the norm that follows it."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, meta, k_cache, v_cache, lora)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden, expert_ids = self.mlp(hidden, lora)
        return hidden, residual, expert_ids


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArchitecture):
        super().__init__()
        self.arch = arch
        # given its (uninitialized) weight: load_state_dict assigns the real one, and initializing a meta tensor
        # normally runs a torch ref that imports torch._dynamo and with it OpenAI-Triton (openai_triton.py)
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size,
                                         _weight=torch.empty(arch.vocab_size, arch.hidden_size))
        self.rotary: RotaryEmbedding | None = None  # set by from_pretrained on the model's device
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = (None if arch.tie_word_embeddings
                        else nn.Linear(arch.hidden_size, arch.vocab_size, bias=False))
        # a step's layers in one call of the CPU ops (set by use_weight_format): every projection in blocks, a plain
        # dense decoder
        self.layers_in_one_call = False
        self.prefill_dtype = torch.float32  # what prompt rows compute in (use_weight_format)
        self.decode_dtype = torch.float32  # what decode rows and the LM head compute in (use_weight_format)
        self._layer_array: tuple[tuple[int, ...], object] | None = None  # (the KV caches' addresses, the layer array)

    @classmethod
    def architecture(cls, config: dict) -> ModelArchitecture:
        """This model's architecture from its HF config.json; subclasses add their own fields."""
        return ModelArchitecture.from_hf_config(config)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], lora: list[LayerLora] | None = None,
                record_routing: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, positions: [tokens] → (final hidden states [tokens, hidden] before the last norm, routing).
        lora: per layer, the adapters of the batch's tokens (None: no token uses one).
        routing: with record_routing on a model with MoE layers, the expert ids each token was routed to,
        [tokens, MoE layers, top_k] most likely first; else None. Where prefill_dtype and decode_dtype differ, a
        step's decode rows and prompt rows run as two forwards (_decodes_then_prompts)."""
        if meta.prefill is not None and self.prefill_dtype != self.decode_dtype:
            return self._decodes_then_prompts(input_ids, positions, meta, kv_caches, lora, record_routing)
        with computing_rows(self.decode_dtype):
            return self._layers(input_ids, positions, meta, kv_caches, lora, record_routing)

    def _layers(self, input_ids, positions, meta: AttentionMetadata, kv_caches, lora, record_routing
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden, residual = self.embed_tokens(input_ids), None
        rope = self.rotary.for_positions(positions)
        if (self.layers_in_one_call and lora is None and hidden.dtype == torch.float32
                and (meta.prefill is None or matmul_dtype() != torch.bfloat16)):
            hidden, residual = self._layers_in_one_call(hidden, rope, meta, kv_caches)
            return residual + hidden, None
        routed = []
        for index, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            hidden, residual, expert_ids = layer(rope, hidden, residual, meta, k_cache, v_cache,
                                                 None if lora is None else lora[index])
            if record_routing and expert_ids is not None:
                routed.append(expert_ids)
        return residual + hidden, torch.stack(routed, dim=1) if routed else None

    def _decodes_then_prompts(self, input_ids, positions, meta: AttentionMetadata, kv_caches, lora, record_routing
                              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A step with prompt rows: its decode rows in decode_dtype, then its prompt rows in prefill_dtype, as two
        forwards (a row attends to its own sequence only), so that neither depends on the other."""
        decodes = meta.num_decode_tokens
        prompt_meta = replace(meta, slot_mapping=meta.slot_mapping[decodes:], num_decode_tokens=0,
                              decode_block_tables=None, decode_context_lens=None)
        prompt_lora = _rows_of(lora, slice(decodes, None))
        with computing_rows(self.prefill_dtype):
            prompt_hidden, prompt_routing = self._layers(input_ids[decodes:], positions[decodes:], prompt_meta,
                                                         kv_caches, prompt_lora, record_routing)
        if not decodes:
            return prompt_hidden, prompt_routing
        decode_meta = replace(meta, slot_mapping=meta.slot_mapping[:decodes], prefill=None)
        with computing_rows(self.decode_dtype):
            hidden, routing = self._layers(input_ids[:decodes], positions[:decodes], decode_meta, kv_caches,
                                           _rows_of(lora, slice(None, decodes)), record_routing)
        return (torch.cat([hidden, prompt_hidden]),
                None if routing is None else torch.cat([routing, prompt_routing]))

    def _layers_in_one_call(self, hidden, rope, meta: AttentionMetadata, kv_caches
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer through the CPU ops' llama_forward: the layers' own ops in their order, without ~10 Python
        dispatches a layer (the same numbers, to the bit), decode rows and prompt chunks alike."""
        caches_at = tuple(cache.data_ptr() for caches in kv_caches for cache in caches)  # (every layer's: any may move)
        if self._layer_array is None or self._layer_array[0] != caches_at:
            self._layer_array = (caches_at, cpu_ops.decoder_layers([
                {"input_norm": layer.input_layernorm.weight, "post_attention_norm": layer.post_attention_layernorm.weight,
                 "qkv": layer.self_attn.qkv_proj.block_parts(), "o": layer.self_attn.o_proj.block_parts(),
                 "gate_up": layer.mlp.gate_up_proj.block_parts(), "down": layer.mlp.down_proj.block_parts(),
                 "k_cache": k_cache, "v_cache": v_cache}
                for layer, (k_cache, v_cache) in zip(self.layers, kv_caches)]))
        arch, batch = self.arch, meta.prefill
        decodes = meta.num_decode_tokens > 0
        chunks = None if batch is None else (batch.query_starts, batch.query_lens, batch.context_lens,
                                             batch.block_tables.to(torch.int64))
        return cpu_ops.llama_forward(self._layer_array[1], hidden, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                                     arch.intermediate_size, arch.rms_norm_eps, self.layers[0].self_attn.scale, *rope,
                                     meta.slot_mapping, kv_caches[0][0].shape[1],
                                     meta.decode_block_tables if decodes else None,
                                     meta.decode_context_lens if decodes else None, chunks,
                                     kv_caches[0][0].dtype == torch.float16,
                                     activation_levels() if self.int8_activations else 0)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits_of_normed(self.final_norm(hidden))

    @torch.inference_mode()
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """forward()'s output → the hidden states the LM head reads (what return_hidden_states returns)."""
        return self.norm(hidden)

    @torch.inference_mode()
    def logits_of_normed(self, normed: torch.Tensor) -> torch.Tensor:
        """The LM head over hidden states after the final norm (computed as decode rows are, whatever the rows)."""
        if self.lm_head is None:  # tied, in its loaded form
            return F.linear(normed, self.embed_tokens.weight).float()
        with computing_rows(self.decode_dtype):
            return self.lm_head(normed).float()

    def _projections(self, layer: int) -> list[tuple[nn.Module, str]]:
        """(owner, attribute) of one layer's projections that take the weight format, in the block reader's order."""
        owners = (self.layers[layer].self_attn, self.layers[layer].mlp)
        return [(owner, name) for owner in owners for name in owner.PROJECTIONS]

    def projection_weights(self, layer: int) -> list[torch.Tensor]:
        """One layer's dense projection weights."""
        return [getattr(owner, name).weight for owner, name in self._projections(layer)]

    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.inference_mode()
    def use_weight_format(self, choice: Choice, blocks: GgufBlocks | None,
                          prefill_dtype: torch.dtype = torch.float32, decode_dtype: torch.dtype = torch.float32,
                          last_use: bool = False) -> None:
        """Replace every dense projection and the LM head by `choice`'s (the weights are fp32 here);
        blocks: the GGUF's blocks of projection_weights(layer) and of the head, for int4 and int4-q8;
        prefill_dtype bfloat16: prompt rows run on the blocks (the CPU ops' bf16 op), else on bf16 copies (2 bytes a
        weight). decode_dtype int8: decode rows and the LM head take one level of int8 codes (int4-q8). last_use: a layer's blocks are let go once its projections are made (a format that repacks them,
        int4-q8, then holds one layer's twice at most, not the model's)."""
        for index in range(len(self.layers)):
            owners = self._projections(index)
            for (owner, name), weight in zip(owners, blocks.layers[index] if blocks else [None] * len(owners)):
                linear = getattr(owner, name)
                projection = choice.make(linear.weight, linear.bias, weight)
                if prefill_dtype == torch.bfloat16:
                    dense = weight.dequantize if linear.weight.is_meta else lambda: linear.weight  # (called here)
                    projection.run_prompts_in_bf16(dense)
                setattr(owner, name, projection)
            if blocks and last_use:
                blocks.layers[index] = None
        self.prefill_dtype, self.decode_dtype = prefill_dtype, decode_dtype
        self.lm_head = choice.make_head(self.head_weight(), blocks.head if blocks and choice.blocks else None)
        if blocks and blocks.embedding is not None and choice.runs_blocks_alone:
            self.embed_tokens = BlockEmbedding(blocks.embedding)  # no dense copy of it
        arch = self.arch
        self.int8_activations = choice.int8_activations  # what llama_forward's projections run with
        every_in_blocks = all(getattr(owner, name).block_parts() is not None
                              for index in range(len(self.layers)) for owner, name in self._projections(index))
        self.layers_in_one_call = (choice.kernel == "cpu_ops" and every_in_blocks and not arch.qk_norm
                                    and not arch.attention_bias and not arch.mlp_bias and not arch.moe_layers)

    def dequantize_projections(self, blocks: GgufBlocks) -> None:
        """Give the projections (and the LM head) loaded as blocks alone (meta weights) their dense weights, for a
        format that multiplies dense weights."""
        for index in range(len(self.layers)):
            for (owner, name), weight in zip(self._projections(index), blocks.layers[index]):
                linear = getattr(owner, name)
                if linear.weight.is_meta:
                    linear.weight = nn.Parameter(weight.dequantize(), requires_grad=False)
        if self.lm_head is not None and self.lm_head.weight.is_meta:
            self.lm_head.weight = nn.Parameter(blocks.head.dequantize(), requires_grad=False)
        if self.embed_tokens.weight.is_meta:
            self.embed_tokens.weight = nn.Parameter(blocks.embedding.dequantize(), requires_grad=False)

    @classmethod
    def from_pretrained(cls, model_dir: Path, config: dict, dtype: torch.dtype,
                        device: torch.device) -> "LlamaForCausalLM":
        """This model with the weights of an HF-format directory whose config.json is `config`."""
        arch = cls.architecture(config)
        return cls._with_state(arch, checkpoint_state(Path(model_dir), arch), dtype, device)

    @classmethod
    def from_gguf(cls, gguf_path: Path, config: dict) -> tuple["LlamaForCausalLM", GgufBlocks | None]:
        """This model (float32, on the CPU) with a GGUF file's tensors (config: the file's, as transformers reads
        its metadata), and the file's blocks: a projection (or LM head) whose blocks the kernels run has them only
        (its weight is on the meta device; dequantize_projections gives it one)."""
        arch = cls.architecture(config)
        state, blocks = gguf_checkpoint(gguf_path, arch, config["model_type"])
        return cls._with_state(arch, state, None, torch.device("cpu")), blocks

    @classmethod
    def from_quantized(cls, model_dir: Path, config: dict, quantization: str
                       ) -> tuple["LlamaForCausalLM", GgufBlocks]:
        """This model (float32, on the CPU) with an HF directory's weights, its projections and LM head quantized at
        load to llama.cpp's blocks (weights.quantized_checkpoint): those have their blocks only, as from_gguf's."""
        arch = cls.architecture(config)
        state, blocks = quantized_checkpoint(Path(model_dir), arch, quantization)
        return cls._with_state(arch, state, None, torch.device("cpu")), blocks

    @classmethod
    def _with_state(cls, arch: ModelArchitecture, state: dict[str, torch.Tensor], dtype: torch.dtype | None,
                    device: torch.device) -> "LlamaForCausalLM":
        """The model with `state`'s tensors, moved to `dtype` on `device` (None: as they are, meta ones too)."""
        with torch.device("meta"):
            model = cls(arch)
        model.load_state_dict(state, strict=True, assign=True)
        model = (model if dtype is None else model.to(device=device, dtype=dtype)).eval()
        model.rotary = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta,
                                       arch.rope_scaling, device)
        return model
