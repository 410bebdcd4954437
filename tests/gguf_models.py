"""Tiny GGUF files of random quantized blocks, written with gguf's own writer: a llama or qwen3 decoder with real
tensor names, SmolLM2's tokenizer (copied from the default GGUF) and each tensor in the type the caller names."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Type
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFWriter, quants

from tritonllm.model_files import default_gguf_path

SHAPE = dict(hidden=256, intermediate=512, heads=4, kv_heads=2, layers=2, vocab=49152)  # K-quants: rows of 256
# each type's fp16 scale fields (byte offset in a block, typical magnitude): random bytes make valid blocks once
# those are sane numbers
_SCALES = {Type.Q4_0: [(0, 0.01)], Type.Q4_1: [(0, 0.005), (2, -0.04)], Type.Q4_K: [(0, 2e-4), (2, 1e-4)],
           Type.Q6_K: [(208, 2e-5)], Type.Q5_K: [(0, 1e-4), (2, 1e-4)], Type.Q5_0: [(0, 0.005)],
           Type.Q5_1: [(0, 0.003), (2, -0.05)], Type.Q3_K: [(108, 1e-4)]}
# (layer, GGUF name) → type; every covered type, fused projections of mixed kinds (a gate_up of Q4_1 + Q5_1, a qkv
# of Q4_K + Q5_K + Q6_K) and an uncovered down projection (Q3_K)
MIXED_TYPES = {
    (0, "attn_q"): Type.Q4_K, (0, "attn_k"): Type.Q4_K, (0, "attn_v"): Type.Q4_K, (0, "attn_output"): Type.Q4_0,
    (0, "ffn_gate"): Type.Q4_1, (0, "ffn_up"): Type.Q5_1, (0, "ffn_down"): Type.Q8_0,
    (1, "attn_q"): Type.Q4_K, (1, "attn_k"): Type.Q5_K, (1, "attn_v"): Type.Q6_K, (1, "attn_output"): Type.Q5_0,
    (1, "ffn_gate"): Type.Q6_K, (1, "ffn_up"): Type.Q6_K, (1, "ffn_down"): Type.Q3_K,
}
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def random_blocks(qtype: Type, rows: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """Random raw blocks [rows, bytes of a row] of `qtype`, their fp16 scales set to sane random values (Q8_0: gguf's
    quantization of random weights, which like llama.cpp's gives each block a code of ±127)."""
    if qtype == Type.Q8_0:
        return quants.quantize(rng.normal(0.0, 0.02, size=(rows, width)).astype(np.float32), qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, width // block_size, type_size), dtype=np.uint8)
    for offset, magnitude in _SCALES[qtype]:
        scale = (magnitude * rng.uniform(0.5, 1.5, size=raw.shape[:2])).astype(np.float16)
        raw[..., offset:offset + 2] = scale[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def _copy_tokenizer(writer: GGUFWriter) -> None:
    fields = GGUFReader(default_gguf_path()).fields
    value = lambda key: fields[key].contents()  # noqa: E731
    writer.add_tokenizer_model(value("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(value("tokenizer.ggml.pre"))
    writer.add_token_list(value("tokenizer.ggml.tokens"))
    writer.add_token_types(value("tokenizer.ggml.token_type"))
    writer.add_token_merges(value("tokenizer.ggml.merges"))
    writer.add_bos_token_id(value("tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(value("tokenizer.ggml.eos_token_id"))
    writer.add_pad_token_id(value("tokenizer.ggml.padding_token_id"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(value("tokenizer.chat_template"))


def write_tiny_gguf(path: Path, arch: str, types: dict[tuple[int, str], Type], embedding: Type = Type.Q8_0,
                    head: Type | None = None, seed: int = 0) -> Path:
    """A tiny `arch` (llama or qwen3) GGUF: projection (layer, name) in types[(layer, name)], the embedding in
    `embedding`, an untied LM head in `head` (None: tied to the embedding)."""
    rng = np.random.default_rng(seed)
    s = SHAPE
    # transformers reads no head_dim from a GGUF: Qwen3's default (128, as the real ones) or llama's hidden / heads
    head_dim = 128 if arch == "qwen3" else s["hidden"] // s["heads"]
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(s["layers"])
    writer.add_context_length(512)
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["intermediate"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(s["vocab"])
    _copy_tokenizer(writer)

    def quantized(name: str, qtype: Type, rows: int, width: int) -> None:
        writer.add_tensor(name, random_blocks(qtype, rows, width, rng), raw_dtype=qtype)

    def norm(name: str, width: int) -> None:
        writer.add_tensor(name, rng.normal(1.0, 0.2, size=width).astype(np.float32))

    quantized("token_embd.weight", embedding, s["vocab"], s["hidden"])
    norm("output_norm.weight", s["hidden"])
    if head is not None:
        quantized("output.weight", head, s["vocab"], s["hidden"])
    q_rows, kv_rows = s["heads"] * head_dim, s["kv_heads"] * head_dim
    shapes = {"attn_q": (q_rows, s["hidden"]), "attn_k": (kv_rows, s["hidden"]), "attn_v": (kv_rows, s["hidden"]),
              "attn_output": (s["hidden"], q_rows), "ffn_gate": (s["intermediate"], s["hidden"]),
              "ffn_up": (s["intermediate"], s["hidden"]), "ffn_down": (s["hidden"], s["intermediate"])}
    for layer in range(s["layers"]):
        norm(f"blk.{layer}.attn_norm.weight", s["hidden"])
        norm(f"blk.{layer}.ffn_norm.weight", s["hidden"])
        if arch == "qwen3":
            norm(f"blk.{layer}.attn_q_norm.weight", head_dim)
            norm(f"blk.{layer}.attn_k_norm.weight", head_dim)
        for name in PROJECTIONS:
            quantized(f"blk.{layer}.{name}.weight", types[layer, name], *shapes[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
