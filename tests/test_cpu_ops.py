"""The CPU ops (tritonllm/kernels/cpu, C built for this machine) against their torch references: the same results to
float32 rounding, each token's row the same to the bit whatever it is batched with, one OpenMP runtime; on an
AVX-512 CPU, the AVX2 build (what most small cloud boxes run) passes the same tests."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Type
from gguf import quants

from tritonllm import kernels
from tritonllm.model_files import cpu_ops_dir
from tritonllm.kernels import cpu
from tritonllm.kernels.cpu import super_blocks
from tritonllm.kernels.activation import silu_and_mul_reference
from tritonllm.kernels.decode_attention import paged_decode_attention_reference
from tritonllm.kernels.kv_cache import store_kv_cache_reference
from tritonllm.kernels.prefill_attention import prefill_attention_reference
from tritonllm.kernels.rms_norm import rms_norm_reference
from tritonllm.kernels.rotary import rotary_embedding_reference
from tritonllm.kernels.sampling import sample_tokens_reference
from gguf_models import random_blocks

CLOSE = {"atol": 2e-5, "rtol": 2e-5}
CACHE_DTYPES = [torch.float32, torch.float16]  # the KV cache's (kv_cache_dtype auto on the CPU, float16)


@pytest.fixture(scope="module", autouse=True)
def _built():
    assert cpu.load(cpu_ops_dir())  # the test machines have a C compiler


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _q4(rows: int, width: int):
    """Random Q4_1 blocks and the float32 weights they stand for (w = d·q + m per block of 32)."""
    q = torch.randint(0, 16, (rows, width), dtype=torch.uint8)
    d = (torch.rand(rows, width // 32) * 0.02).half()
    m = (-torch.rand(rows, width // 32) * 0.1).half()
    dense = d.float().repeat_interleave(32, 1) * q + m.float().repeat_interleave(32, 1)
    return cpu.pack_q4(q, d, m), dense


@pytest.mark.parametrize("rows, width", [(4, 32), (7, 96), (960, 576), (577, 1536)])  # 7, 577: a partial row tile
@pytest.mark.parametrize("tokens", [1, 3, 5, 70])  # 70: more than one token chunk
def test_q4_matmul_is_the_dequantized_weights_in_float32(rows, width, tokens):
    packed, dense = _q4(rows, width)
    x = torch.randn(tokens, width)
    torch.testing.assert_close(cpu.q4_matmul(x, packed), x @ dense.T, atol=1e-4, rtol=1e-4)


def test_q4_matmul_rows_do_not_depend_on_the_batch():
    packed, _ = _q4(131, 576)
    x = torch.randn(37, 576)
    x[5] *= 50  # a loud token changes nothing for the others (no batch-wide scale)
    together = cpu.q4_matmul(x, packed)
    for size in (1, 2, 3, 4, 9):
        for start in range(0, len(x) - size + 1, 7):
            assert torch.equal(cpu.q4_matmul(x[start:start + size], packed), together[start:start + size])


def _q5_1(rows: int, width: int):
    """Random int5 blocks (as a GGUF's Q5_K: d an fp16 times a 6-bit scale, m minus another) as q5_1_matmul's, and
    the float32 weights they stand for (w = d·q + m per block of 32, q in 0..31)."""
    q = torch.randint(0, 32, (rows, width), dtype=torch.uint8)
    d = (torch.rand(rows, width // 32) * 1e-3).half().float() * torch.randint(0, 64, (rows, width // 32))
    m = -(torch.rand(rows, width // 32) * 1e-3).half().float() * torch.randint(0, 64, (rows, width // 32))
    return cpu.pack_q5_1(q, d, m), d.repeat_interleave(32, 1) * q + m.repeat_interleave(32, 1)


@pytest.mark.parametrize("rows, width", [(4, 32), (7, 96), (577, 576)])
@pytest.mark.parametrize("tokens", [1, 5, 70])
def test_q5_1_matmul_is_the_dequantized_weights_in_float32(rows, width, tokens):
    packed, dense = _q5_1(rows, width)
    assert packed.shape == (rows, width // 32, 28)
    x = torch.randn(tokens, width)
    torch.testing.assert_close(cpu.q5_1_matmul(x, packed), x @ dense.T, atol=1e-4, rtol=1e-4)
    assert torch.equal(cpu.q5_1_matmul(torch.eye(width), packed).T, dense)  # each weight read back, to the bit


def test_q5_1_matmul_rows_do_not_depend_on_the_batch():
    packed, _ = _q5_1(131, 576)
    x = torch.randn(37, 576)
    together = cpu.q5_1_matmul(x, packed)
    for size in (1, 3, 9):
        for start in range(0, len(x) - size + 1, 7):
            assert torch.equal(cpu.q5_1_matmul(x[start:start + size], packed), together[start:start + size])


def _q8(rows: int, width: int) -> torch.Tensor:
    """Float32 weights that are Q8_0 blocks: w = d·q, q in -127..127 reaching ±127 in each block (as llama.cpp
    scales them), d an fp16 per block of 32."""
    q = torch.randint(-127, 128, (rows, width // 32, 32))
    q[..., 0] = torch.where(torch.rand(rows, width // 32) < 0.5, -127, 127)
    d = (torch.rand(rows, width // 32, 1) * 0.02).half().float()
    return (q * d).reshape(rows, width)


@pytest.mark.parametrize("rows, width", [(4, 32), (7, 96), (577, 576)])
@pytest.mark.parametrize("tokens", [1, 5, 70])
def test_q8_matmul_is_the_dequantized_weights_in_float32(rows, width, tokens):
    dense = _q8(rows, width)
    packed = cpu.pack_q8_exact(dense)
    assert packed is not None and packed.shape == (rows, width // 32, 34)
    x = torch.randn(tokens, width)
    torch.testing.assert_close(cpu.q8_matmul(x, packed), x @ dense.T, atol=1e-4, rtol=1e-4)


def test_q8_matmul_rows_do_not_depend_on_the_batch():
    packed = cpu.pack_q8_exact(_q8(131, 576))
    x = torch.randn(37, 576)
    together = cpu.q8_matmul(x, packed)
    for size in (1, 3, 9):
        for start in range(0, len(x) - size + 1, 7):
            assert torch.equal(cpu.q8_matmul(x[start:start + size], packed), together[start:start + size])


def _super_blocks(qtype, rows: int, width: int):
    """Random Q4_K, Q5_K or Q6_K super-blocks as a GGUF stores them (the kernels' own layout) and `gguf.quants.dequantize`'s
    float32 weights of them."""
    raw = random_blocks(qtype, rows, width, np.random.default_rng(rows + width))
    dense = torch.from_numpy(quants.dequantize(raw, qtype).reshape(rows, width).astype(np.float32))
    return torch.from_numpy(raw.reshape(rows, width // 256, -1)), dense


SUPER_BLOCK_OPS = {Type.Q4_K: (cpu.q4_k_matmul, super_blocks.dequantize_q4_k),
                   Type.Q5_K: (cpu.q5_k_matmul, super_blocks.dequantize_q5_k),
                   Type.Q6_K: (cpu.q6_k_matmul, super_blocks.dequantize_q6_k)}


@pytest.mark.parametrize("qtype", SUPER_BLOCK_OPS, ids=lambda t: t.name)
@pytest.mark.parametrize("rows, width", [(4, 256), (7, 768), (577, 1536)])
@pytest.mark.parametrize("tokens", [1, 5, 70])
def test_super_block_matmuls_are_ggufs_dequantized_weights_in_float32(qtype, rows, width, tokens):
    op, reference = SUPER_BLOCK_OPS[qtype]
    blocks, dense = _super_blocks(qtype, rows, width)
    assert torch.equal(reference(blocks), dense)  # the torch reference reads the layout as gguf does
    x = torch.randn(tokens, width)
    torch.testing.assert_close(op(x, blocks), x @ dense.T, atol=1e-4, rtol=1e-4)
    assert torch.equal(op(torch.eye(width), blocks).T, dense)  # each weight read back, to the bit


@pytest.mark.parametrize("qtype", SUPER_BLOCK_OPS, ids=lambda t: t.name)
def test_super_block_matmul_rows_do_not_depend_on_the_batch(qtype):
    op, _ = SUPER_BLOCK_OPS[qtype]
    blocks, _ = _super_blocks(qtype, 131, 512)
    x = torch.randn(37, 512)
    together = op(x, blocks)
    for size in (1, 3, 9):
        for start in range(0, len(x) - size + 1, 7):
            assert torch.equal(op(x[start:start + size], blocks), together[start:start + size])


def _q8_activations(x: torch.Tensor, levels: int = 2):
    """Each token's inputs per block of 32 as the ops' two-level int8 codes: q1 = round(x · 127 / absmax) (llama.cpp's
    Q8_1, ties to even), q2 = round(256 · (x · 127 / absmax - q1)) within ±127 (one level: 0); the codes 256 q1 + q2,
    the scale dx / 256 = absmax / (127 · 256) and sx = dx / 256 · Σ codes, in float32 as the op computes them."""
    blocks = x.reshape(x.shape[0], -1, 32)
    absmax = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(absmax > 0, torch.tensor(127.0) / absmax, torch.tensor(0.0))
    scaled = blocks * inverse
    first = torch.round(scaled)
    second = torch.round((scaled - first) * 256).clamp(-127, 127) * (levels == 2)
    codes = 256 * first + second
    scales = absmax / (127 * 256)
    return codes, scales, scales * codes.sum(dim=-1, keepdim=True)


def _q8_activation_reference(x: torch.Tensor, codes_w: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                             block: int = 32, levels: int = 2):
    """Σ_b dw·(dx / 256)·(Σ code products) (+ mw·sx), weight scales d per `block` inputs (32, or Q6_K's 16), in
    float64: the int8-activation ops' numerics up to float32 rounding of the scaled sums."""
    codes, scales, sums = (t.double() for t in _q8_activations(x, levels))
    codes = codes.reshape(x.shape[0], -1, block)
    products = torch.einsum("tbk,nbk->tnb", codes, codes_w.double().reshape(codes_w.shape[0], -1, block))
    y = (products * (scales[..., 0].repeat_interleave(32 // block, 1)[:, None, :] * d.double()[None])).sum(-1)
    return y if m is None else y + sums[..., 0] @ m.double().T


def _assert_within_the_codes_step(ours: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, levels: int) -> None:
    """Against fp32 activations: off by at most Σ |w| · dx / 256 (each input to within its block's dx / 256; a
    second code clamped at ±127 from 128 by as much); with one level Σ |w| · dx / 2."""
    step = x.reshape(x.shape[0], -1, 32).abs().amax(-1).double().repeat_interleave(32, 1) / (127 * 256)
    step = step if levels == 2 else step * 128
    bound = step @ dense.double().abs().T
    error = (ours.double() - x.double() @ dense.double().T).abs()
    assert (error <= bound + 1e-5).all(), (error - bound).max()


@pytest.mark.parametrize("levels", [2, 1])
@pytest.mark.parametrize("bits", [4, 5])
@pytest.mark.parametrize("rows, width", [(4, 32), (7, 96), (960, 576), (577, 1536)])
@pytest.mark.parametrize("tokens", [1, 3, 5, 70])
def test_q4_q8_and_q5_q8_matmuls_are_scale_min_blocks_by_int8_activations(bits, rows, width, tokens, levels):
    q = torch.randint(0, 1 << bits, (rows, width), dtype=torch.uint8)
    d, m = (torch.rand(rows, width // 32) * 0.02).half(), (-torch.rand(rows, width // 32) * 0.1).half()
    packed = (cpu.pack_q4_rows if bits == 4 else cpu.pack_q5_rows)(q, d, m)
    x = torch.randn(tokens, width)
    if width > 32:
        x[-1, -32:] = 0  # an all-zero block: dx = 0, codes 0
    ours = (cpu.q4_q8_matmul if bits == 4 else cpu.q5_q8_matmul)(x, packed, rows, levels)
    expected = _q8_activation_reference(x, q, d.float(), m.float(), levels=levels)
    torch.testing.assert_close(ours.double(), expected, atol=1e-4, rtol=1e-4)
    dense = d.float().repeat_interleave(32, 1) * q + m.float().repeat_interleave(32, 1)
    _assert_within_the_codes_step(ours, x, dense, levels)


@pytest.mark.parametrize("levels", [2, 1])
@pytest.mark.parametrize("rows, width", [(4, 32), (577, 576)])
@pytest.mark.parametrize("tokens", [1, 70])
def test_q8_q8_matmul_is_q8_0_blocks_by_int8_activations(rows, width, tokens, levels):
    dense = _q8(rows, width)
    packed = cpu.pack_q8_exact(dense)
    blocks = dense.reshape(rows, -1, 32)
    d = packed[..., :2].contiguous().view(torch.float16)[..., 0].float()
    codes_w = torch.where(d[..., None] == 0, 0.0, blocks / d[..., None]).reshape(rows, width)
    x = torch.randn(tokens, width)
    ours = cpu.q8_q8_matmul(x, cpu.pack_q8_rows(packed), rows, levels)
    torch.testing.assert_close(ours.double(), _q8_activation_reference(x, codes_w, d, None, levels=levels),
                               atol=1e-4, rtol=1e-4)
    _assert_within_the_codes_step(ours, x, dense, levels)


# a K-quant's row groups: (pack, op, bytes and inputs a unit, the reference's weight codes and scales, their span)
SUPER_BLOCK_ROWS = {
    Type.Q6_K: (cpu.pack_q6_k_rows, cpu.q6_q8_matmul, cpu.Q6_GROUP_BYTES, 32,
                lambda blocks: (*super_blocks.q6_k_codes(blocks), None), 16),  # w = d' · (q − 32) per 16 inputs
    Type.Q4_K: (cpu.pack_q4_k_rows, cpu.q4_k_q8_matmul, cpu.Q4_K_GROUP_BYTES, 256,
                super_blocks.q4_k_scale_min, 32),  # w = d'·q + m' per 32, exact
}


@pytest.mark.parametrize("levels", [2, 1])
@pytest.mark.parametrize("qtype", SUPER_BLOCK_ROWS, ids=lambda t: t.name)
@pytest.mark.parametrize("rows, width", [(4, 256), (17, 512), (577, 1536)])
@pytest.mark.parametrize("tokens", [1, 3, 5, 9, 70])
def test_q6_q8_and_q4_k_q8_matmuls_are_k_quant_blocks_by_int8_activations(qtype, rows, width, tokens, levels):
    pack, op, unit_bytes, unit_inputs, codes_and_scales, span = SUPER_BLOCK_ROWS[qtype]
    blocks, dense = _super_blocks(qtype, rows, width)
    packed = pack(blocks)
    assert packed.shape == (-(-rows // 16), width // unit_inputs, unit_bytes)
    codes, d, m = codes_and_scales(blocks)
    x = torch.randn(tokens, width)
    x[-1, :32] = 0  # an all-zero block: dx = 0, codes 0
    ours = op(x, packed, rows, levels)
    expected = _q8_activation_reference(x, codes, d, m, block=span, levels=levels)
    torch.testing.assert_close(ours.double(), expected, atol=1e-4, rtol=1e-4)
    _assert_within_the_codes_step(ours, x, dense, levels)


@pytest.mark.parametrize("levels", [2, 1])
@pytest.mark.parametrize("op", ["q4_q8_matmul", "q5_q8_matmul", "q8_q8_matmul", "q6_q8_matmul", "q4_k_q8_matmul"])
def test_int8_activation_rows_do_not_depend_on_the_batch(op, levels):
    width = 512 if op in ("q6_q8_matmul", "q4_k_q8_matmul") else 576
    if op in ("q4_q8_matmul", "q5_q8_matmul"):  # 131 rows: a last group of 3 real rows and 13 padding ones
        q = torch.randint(0, 16 if op == "q4_q8_matmul" else 32, (131, 576), dtype=torch.uint8)
        pack = cpu.pack_q4_rows if op == "q4_q8_matmul" else cpu.pack_q5_rows
        packed = pack(q, torch.rand(131, 18).half(), torch.rand(131, 18).half())
    elif op == "q8_q8_matmul":
        packed = cpu.pack_q8_rows(cpu.pack_q8_exact(_q8(131, 576)))
    elif op == "q6_q8_matmul":
        packed = cpu.pack_q6_k_rows(_super_blocks(Type.Q6_K, 131, 512)[0])
    else:
        packed = cpu.pack_q4_k_rows(_super_blocks(Type.Q4_K, 131, 512)[0])
    x = torch.randn(37, width)
    x[5] *= 50  # a loud token changes nothing for the others: each token's blocks have their own scales
    together = getattr(cpu, op)(x, packed, 131, levels)
    for size in (1, 2, 3, 4, 5, 9):
        for start in range(0, len(x) - size + 1, 7):
            assert torch.equal(getattr(cpu, op)(x[start:start + size], packed, 131, levels),
                               together[start:start + size])


def test_row_groups_are_packed_alike_in_any_number_of_steps(monkeypatch):
    """A vocabulary-sized head is packed a few row groups at a time (its temporaries would be several times its
    bytes): the same bytes as in one step, a last partial group's padding rows included."""
    q = torch.randint(0, 16, (131, 96), dtype=torch.uint8)
    d, m = torch.rand(131, 3).half(), torch.rand(131, 3).half()
    q8_blocks, q6_k_blocks = cpu.pack_q8_exact(_q8(131, 96)), _super_blocks(Type.Q6_K, 131, 256)[0]
    whole = (cpu.pack_q4_rows(q, d, m), cpu.pack_q8_rows(q8_blocks), cpu.pack_q6_k_rows(q6_k_blocks),
             cpu.pack_q5_rows(q * 2, d, m))
    monkeypatch.setattr(cpu, "PACKED_ROWS", 32)
    assert torch.equal(cpu.pack_q4_rows(q, d, m), whole[0]) and torch.equal(cpu.pack_q8_rows(q8_blocks), whole[1])
    assert torch.equal(cpu.pack_q6_k_rows(q6_k_blocks), whole[2]) and torch.equal(cpu.pack_q5_rows(q * 2, d, m), whole[3])
    q4_k_blocks = _super_blocks(Type.Q4_K, 131, 256)[0]
    monkeypatch.setattr(cpu, "PACKED_ROWS", 1024)
    whole_q4_k = cpu.pack_q4_k_rows(q4_k_blocks)
    monkeypatch.setattr(cpu, "PACKED_ROWS", 32)
    assert torch.equal(cpu.pack_q4_k_rows(q4_k_blocks), whole_q4_k)
    assert whole[0].shape == (9, 3, cpu.Q4_GROUP_BYTES)


def test_only_weights_that_are_q8_0_blocks_to_the_bit_are_packed_as_q8_0():
    dense = _q8(64, 128)
    dense[3, 0:32] = 0  # an all-zero block is one (d = 0)
    assert cpu.pack_q8_exact(dense) is not None
    assert cpu.pack_q8_exact(torch.randn(64, 128)) is None  # an fp32 weight
    nudged = dense.clone()
    nudged[10, 40] += 1e-3  # one weight off its block's grid
    assert cpu.pack_q8_exact(nudged) is None
    assert cpu.pack_q8_exact(_q8(4, 64)[:, :48]) is None  # not whole blocks


def test_the_default_models_int4_lm_head_runs_as_its_q8_0_blocks(default_model_dir):
    """The GGUF's tied embedding is Q8_0: the int4 format's LM head is those blocks, and gives the float32 head's
    logits (to float32 rounding); the embedding is looked up in them, to the converted checkpoint's bits."""
    from safetensors import safe_open

    from tritonllm.engine.config import EngineConfig
    from tritonllm.engine.layers.embedding import BlockEmbedding
    from tritonllm.engine.layers.linear import Q8Projection
    from tritonllm.engine.llm_engine import LLMEngine

    model = LLMEngine(EngineConfig(model_path=str(default_model_dir), weight_format="int4",
                                   kv_cache_memory=16 << 20)).core.runner.model
    assert isinstance(model.lm_head, Q8Projection) and isinstance(model.embed_tokens, BlockEmbedding)
    with safe_open(str(default_model_dir / "model.safetensors"), framework="pt") as checkpoint:
        tied = checkpoint.get_tensor("model.embed_tokens.weight").float()
    assert torch.equal(model.embed_tokens(torch.arange(len(tied))), tied)
    hidden = torch.randn(3, tied.shape[1])
    torch.testing.assert_close(model.lm_head(hidden), hidden @ tied.float().T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tokens, hidden", [(1, 64), (3, 100), (5, 576)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(tokens, hidden, with_residual):
    x, weight = torch.randn(tokens, hidden), torch.randn(hidden)
    residual = torch.randn(tokens, hidden) if with_residual else None
    ours, expected = cpu.rms_norm(x, weight, 1e-6, residual), rms_norm_reference(x, weight, 1e-6, residual)
    if with_residual:
        assert torch.equal(ours[1], expected[1])  # the same rounded sum
        ours, expected = ours[0], expected[0]
    torch.testing.assert_close(ours, expected, **CLOSE)


@pytest.mark.parametrize("tokens, width", [(1, 64), (4, 70), (3, 1536)])
def test_silu_and_mul(tokens, width):
    x = torch.randn(tokens, 2 * width) * 6  # far into both tails of the sigmoid
    torch.testing.assert_close(cpu.silu_and_mul(x), silu_and_mul_reference(x), **CLOSE)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 128), (16, 2, 80)])
@pytest.mark.parametrize("tokens", [1, 5])
def test_rotary_embedding_in_place_on_strided_views(heads, kv_heads, head_dim, tokens):
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    angles = torch.rand(tokens, head_dim // 2) * 6
    q_ref, k_ref = q.clone(), k.clone()
    cpu.rotary_embedding(q, k, angles.cos(), angles.sin())
    rotary_embedding_reference(q_ref, k_ref, angles.cos(), angles.sin())
    torch.testing.assert_close(q, q_ref, **CLOSE)
    torch.testing.assert_close(k, k_ref, **CLOSE)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 36])  # 36: rows of 108 floats, not whole vectors of 8
def test_store_kv_cache_from_strided_views(cache_dtype, head_dim):
    """float16 caches get each value rounded to nearest even, as torch rounds it: the same bits."""
    kv_heads, tokens = 3, 6
    qkv = torch.randn(tokens, (9 + 2 * kv_heads) * head_dim)
    _, k, v = qkv.split([9 * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    k, v = k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    caches = [torch.zeros(8, 16, kv_heads, head_dim, dtype=cache_dtype) for _ in range(4)]
    slots = torch.tensor([0, 17, 127, 33, 64, 5])
    cpu.store_kv_cache(k, v, caches[0], caches[1], slots)
    store_kv_cache_reference(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


# 72: a head that is not whole AVX-512 vectors
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 128), (8, 2, 80), (6, 2, 72)])
def test_paged_decode_attention(heads, kv_heads, head_dim, cache_dtype):
    seqs, block_size, blocks = 5, 16, 40
    k_cache, v_cache = (torch.randn(blocks, block_size, kv_heads, head_dim).to(cache_dtype) for _ in range(2))
    tables = torch.randperm(blocks)[:seqs * 7].view(seqs, 7)
    wide = torch.zeros(seqs + 2, 9, dtype=torch.int64)  # the runner's tables are views of a wider buffer
    wide[:seqs, :7] = tables
    lens = torch.tensor([1, 16, 17, 100, 112], dtype=torch.int32)
    q = torch.randn(seqs, heads + 2 * kv_heads, head_dim)[:, :heads] * 3  # strided rows, as split from qkv
    ours = cpu.paged_decode_attention(q, k_cache, v_cache, wide[:seqs, :7], lens, head_dim ** -0.5)
    torch.testing.assert_close(ours, paged_decode_attention_reference(q, k_cache, v_cache, tables, lens,
                                                                      head_dim ** -0.5), **CLOSE)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 128), (6, 2, 72)])
def test_paged_prefill_attention(heads, kv_heads, head_dim, cache_dtype):
    """Chunks of fresh prompts and chunks after a cached prefix (their queries are the context's last positions)."""
    block_size, blocks = 16, 60
    k_cache, v_cache = (torch.randn(blocks, block_size, kv_heads, head_dim).to(cache_dtype) for _ in range(2))
    query_lens = torch.tensor([1, 37, 16, 5], dtype=torch.int32)
    context_lens = torch.tensor([1, 37, 80, 150], dtype=torch.int32)  # the last two follow 64 and 145 cached
    query_starts = torch.cumsum(query_lens, 0, dtype=torch.int32) - query_lens
    tables = torch.randperm(blocks)[:4 * 10].view(4, 10)
    wide = torch.zeros(6, 12, dtype=torch.int64)  # the runner's tables are views of a wider buffer
    wide[:4, :10] = tables
    rows = int(query_lens.sum())
    q = torch.randn(rows, heads + 2 * kv_heads, head_dim)[:, :heads] * 3  # strided rows, as split from qkv
    ours = cpu.prefill_attention(q, k_cache, v_cache, query_starts, query_lens, context_lens, wide[:4, :10],
                                 head_dim ** -0.5)
    torch.testing.assert_close(ours, prefill_attention_reference(q, k_cache, v_cache, query_starts, query_lens,
                                                                 context_lens, tables, head_dim ** -0.5), **CLOSE)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_a_prefill_row_equals_the_same_position_decoded(cache_dtype):
    """Prefill and decode rows run the same attention: a position's output does not depend on how it was batched."""
    k_cache, v_cache = (torch.randn(20, 16, 3, 64).to(cache_dtype) for _ in range(2))
    tables = torch.randperm(20)[:8].view(1, 8)
    q = torch.randn(40, 9, 64)
    prefill = cpu.prefill_attention(q, k_cache, v_cache, torch.tensor([0], dtype=torch.int32),
                                    torch.tensor([40], dtype=torch.int32), torch.tensor([100], dtype=torch.int32),
                                    tables, 0.125)
    for row in (0, 17, 39):
        decoded = cpu.paged_decode_attention(q[row:row + 1], k_cache, v_cache, tables,
                                             torch.tensor([60 + row + 1], dtype=torch.int32), 0.125)
        assert torch.equal(decoded[0], prefill[row])


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (6, 2, 72)])
def test_prefill_rows_do_not_depend_on_chunking_or_tiles(heads, kv_heads, head_dim, cache_dtype):
    """The prefill op reads K/V in tiles of query positions: a prompt's rows (140 after a 10-token cached prefix:
    whole and partial query and key tiles) come out the same to the bit as one chunk, as two chunks batched after
    another sequence's, and as decode rows."""
    k_cache, v_cache = (torch.randn(30, 16, kv_heads, head_dim).to(cache_dtype) for _ in range(2))
    tables = torch.randperm(30).view(3, 10)
    q = torch.randn(140, heads, head_dim) * 3
    i32 = lambda *values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    whole = cpu.prefill_attention(q, k_cache, v_cache, i32(0), i32(140), i32(150), tables[:1], head_dim ** -0.5)
    other = torch.randn(21, heads, head_dim)  # another sequence's chunk first: the prompt's rows start at 21
    split = cpu.prefill_attention(torch.cat([other, q]), k_cache, v_cache, i32(0, 21, 64), i32(21, 43, 97),
                                  i32(45, 53, 150), tables[[2, 0, 0]], head_dim ** -0.5)[21:]
    decoded = cpu.paged_decode_attention(q, k_cache, v_cache, tables[:1].expand(140, -1),
                                         torch.arange(11, 151, dtype=torch.int32), head_dim ** -0.5)
    assert torch.equal(whole, split) and torch.equal(whole, decoded)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (6, 2, 72)])
def test_rows_past_a_key_split_do_not_depend_on_how_the_splits_were_shared_out(heads, kv_heads, head_dim,
                                                                               cache_dtype):
    """Past 512 positions a row's softmax is folded from partials over fixed ranges of 512 positions: one task
    walking a row's ranges (a long chunk, a batch of decodes) and a task per range (a lone decode, a small chunk:
    too few tasks for the threads) give its 1,300-position rows the same bits."""
    k_cache, v_cache = (torch.randn(90, 16, kv_heads, head_dim).to(cache_dtype) for _ in range(2))
    tables = torch.randperm(90)[:82].view(1, 82)
    q = torch.randn(320, heads, head_dim) * 3  # positions 980 .. 1299
    scale, i32 = head_dim ** -0.5, lambda *values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    chunk = cpu.prefill_attention(q, k_cache, v_cache, i32(0), i32(320), i32(1300), tables, scale)
    small_chunk = cpu.prefill_attention(q[-4:], k_cache, v_cache, i32(0), i32(4), i32(1300), tables, scale)
    batched = cpu.paged_decode_attention(q, k_cache, v_cache, tables.expand(320, -1),
                                         torch.arange(981, 1301, dtype=torch.int32), scale)
    alone = [cpu.paged_decode_attention(q[row:row + 1], k_cache, v_cache, tables, i32(981 + row), scale)[0]
             for row in (0, 43, 319)]
    assert torch.equal(chunk, batched) and torch.equal(chunk[-4:], small_chunk)
    assert all(torch.equal(chunk[row], decoded) for row, decoded in zip((0, 43, 319), alone))
    torch.testing.assert_close(chunk, prefill_attention_reference(q, k_cache, v_cache, i32(0), i32(320), i32(1300),
                                                                  tables, scale), **CLOSE)


def test_the_engine_ops_use_them_on_float32_cpu_tensors(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu._library, "silu_and_mul", lambda *args: calls.append(args))
    kernels.silu_and_mul(torch.randn(2, 8))
    assert len(calls) == 1
    kernels.silu_and_mul(torch.randn(2, 8, dtype=torch.bfloat16))  # not float32: the reference
    assert len(calls) == 1


def test_one_openmp_runtime_in_the_process():
    """The library links the libgomp torch loaded: one thread team, not two spinning against each other."""
    mapped = {Path(line.split()[-1]).resolve() for line in Path("/proc/self/maps").read_text().splitlines()
              if "libgomp" in line or "libiomp" in line}
    assert len(mapped) == 1, mapped


@pytest.mark.parametrize("weight_format, kv_cache_dtype, prefill_dtype", [
    ("int4", "auto", "float32"), ("int4", "float16", "float32"), ("int4-q8", "auto", "float32"),
    ("int4-q8", "auto", "int8")])
def test_a_step_in_one_call_equals_the_layers_op_by_op(default_model_dir, weight_format, kv_cache_dtype,
                                                       prefill_dtype):
    """The default model with int4 weights (fp32 or int8 activations) runs its steps through llama_forward: prompts
    cut into chunks of a few tokens, batched with other sequences' decodes (int8 prompts: as their own forward, one
    level of codes). The same requests op by op give the same hidden states, to the bit (and so the same tokens)."""
    from tritonllm.engine.config import EngineConfig
    from tritonllm.interface.parameters import SamplingParams
    from tritonllm.engine.llm_engine import LLMEngine
    from engine_helpers import generate

    engines = [LLMEngine(EngineConfig(model_path=str(default_model_dir), weight_format=weight_format, dtype="float32",
                                      kv_cache_memory=32 << 20, kv_cache_dtype=kv_cache_dtype,
                                      prefill_dtype=prefill_dtype, max_num_batched_tokens=8)) for _ in range(2)]
    assert engines[0].core.runner.model.layers_in_one_call
    engines[1].core.runner.model.layers_in_one_call = False
    batches = []
    engines[0].core.runner.model.forward = _recording(engines[0].core.runner.model.forward, batches)
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True, return_hidden_states=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"]
    fused, op_by_op = (generate(engine, prompts, params) for engine in engines)
    assert any(meta.prefill is not None and meta.num_decode_tokens for meta in batches)  # chunks beside decodes
    for one, other in zip(fused, op_by_op):
        assert one.token_ids() == other.token_ids()
        states = [[h for o in result.outputs for c in o.choices for h in c.hidden_states] for result in (one, other)]
        assert len(states[0]) == 6 and all(torch.equal(a, b) for a, b in zip(*states))


def test_the_one_call_forward_writes_each_layers_own_caches(default_model_dir):
    """A caller's caches may keep the first layer's tensor and change the others': the forward writes the new ones."""
    from tritonllm.engine.config import EngineConfig
    from tritonllm.engine.core.model_runner import load_model
    from tritonllm.engine.layers.attention import AttentionMetadata, PrefillBatch

    model, _ = load_model(EngineConfig(weight_format="int4"), default_model_dir, torch.device("cpu"))
    assert model.layers_in_one_call
    arch, n = model.arch, 6
    shape = (n, 1, arch.num_kv_heads, arch.head_dim)

    def fresh():
        return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(arch.num_layers)]

    positions, length = torch.arange(n), torch.tensor([n], dtype=torch.int32)
    meta = AttentionMetadata(positions, 0, None, None,
                             PrefillBatch(torch.zeros(1, dtype=torch.int32), length, length, positions[None]))
    first = fresh()
    model(torch.arange(100, 100 + n), positions, meta, first)
    second = [first[0]] + fresh()[1:]
    model(torch.arange(100, 100 + n), positions, meta, second)
    assert all(k.abs().sum() > 0 and torch.equal(k, k_first) for (k, _), (k_first, _) in zip(second, first))


def _recording(forward, batches: list):
    """forward, noting each step's attention metadata"""
    def recorded(input_ids, positions, meta, *args, **kwargs):
        batches.append(meta)
        return forward(input_ids, positions, meta, *args, **kwargs)
    return recorded


@pytest.mark.parametrize("vocab", [5, 1000, 49152, 49157])  # 49157: a partial vector and chunk at the end
def test_sample_tokens_greedy_rows_are_the_first_argmax_and_the_normalizer_is_logsumexp(vocab):
    logits = torch.randn(6, vocab) * 4
    logits[1, vocab // 2:] = logits[1].max()  # ties: the first maximal entry, as torch.argmax
    raw = logits + torch.randn(6, vocab)  # before adjustment: the normalizer is the raw logits'
    tokens, normalizers = cpu.sample_tokens(logits, raw, torch.zeros(6), torch.rand(6))
    assert torch.equal(tokens, logits.argmax(dim=-1))
    torch.testing.assert_close(normalizers, torch.logsumexp(raw, dim=-1), atol=2e-5, rtol=2e-6)
    _, own = cpu.sample_tokens(logits, logits, torch.zeros(6), torch.rand(6))
    torch.testing.assert_close(own, torch.logsumexp(logits, dim=-1), atol=2e-5, rtol=2e-6)


@pytest.mark.parametrize("vocab", [7, 1000, 49157])
def test_sample_tokens_draws_are_the_inverse_cdf_of_the_tempered_softmax(vocab):
    """Each drawn token is where u · total falls in the running sum of exp((l - max) / T), computed here in
    float64: the reference's token, or a neighbour only when u · total lies within rounding of their boundary."""
    rows = 300
    logits = torch.randn(rows, vocab) * 3
    inverse_temperatures = 1 / (0.2 + 1.5 * torch.rand(rows))
    uniforms = torch.rand(rows)
    uniforms[:3] = torch.tensor([0.0, 1 - 2 ** -24, 0.5])
    tokens, _ = cpu.sample_tokens(logits, logits, inverse_temperatures, uniforms)
    reference, _ = sample_tokens_reference(logits, logits, inverse_temperatures, uniforms)
    shifted = logits.double() - logits.double().amax(dim=-1, keepdim=True)
    cdf = (shifted * inverse_temperatures.double()[:, None]).exp().cumsum(dim=-1)
    targets = uniforms.double() * cdf[:, -1]
    below = torch.where(tokens > 0, cdf.gather(1, (tokens - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    at = cdf.gather(1, tokens[:, None])[:, 0]
    slack = 1e-5 * cdf[:, -1]
    assert bool(((below <= targets + slack) & (targets <= at + slack)).all())
    assert (tokens == reference).float().mean() > 0.98


def test_sample_tokens_never_draws_a_banned_token():
    logits = torch.full((4, 3000), float("-inf"))
    logits[:, [3, 17, 1500]] = torch.tensor([1.0, 2.0, 5.0])  # the most likely before a banned tail
    for u in (0.0, 0.3, 1 - 2 ** -24):
        tokens, _ = cpu.sample_tokens(logits, logits, torch.full((4,), 1 / 0.7), torch.full((4,), u))
        assert set(tokens.tolist()) <= {3, 17, 1500}


def test_sample_tokens_follow_the_distribution_and_rows_do_not_depend_on_the_batch():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.25])
    logits = probs.log().expand(20000, 5).contiguous()
    uniforms = torch.rand(20000)
    tokens, _ = cpu.sample_tokens(logits, logits, torch.ones(20000), uniforms)
    counts = torch.bincount(tokens, minlength=5).float() / 20000
    assert counts[0] == 0 and counts[2] == 0 and torch.allclose(counts, probs, atol=0.02)
    wide = torch.randn(9, 49152) * 3
    inverse_temperatures, uniforms = torch.tensor([0.0, 1.4, 1.0] * 3), torch.rand(9)
    together = cpu.sample_tokens(wide, wide, inverse_temperatures, uniforms)
    for row in range(9):
        alone = cpu.sample_tokens(wide[row:row + 1], wide[row:row + 1], inverse_temperatures[row:row + 1],
                                  uniforms[row:row + 1])
        assert alone[0].item() == together[0][row].item() and torch.equal(alone[1], together[1][row:row + 1])


def test_the_bindings_refuse_tensors_the_c_would_misread():
    """The C ops read raw memory: a wrong dtype, shape, device or layout raises in Python before any is read."""
    packed, _ = _q4(8, 64)
    x = torch.randn(3, 64)
    misread = [lambda: cpu.q4_matmul(x.double(), packed), lambda: cpu.q4_matmul(x.to(torch.bfloat16), packed),
               lambda: cpu.q4_matmul(torch.randn(3, 96), packed),  # more inputs than the weights have
               lambda: cpu.q4_matmul(torch.randn(3, 48), packed),  # not whole blocks
               lambda: cpu.q4_matmul(x[:, None], packed),
               lambda: cpu.q8_matmul(x, packed),  # int4 blocks read as Q8_0 ones
               lambda: cpu.q6_k_matmul(torch.randn(3, 256), _super_blocks(Type.Q4_K, 8, 256)[0]),  # Q4_K as Q6_K
               lambda: cpu.q4_k_matmul(x, packed),  # not whole super-blocks
               lambda: cpu.dequantize_blocks("q6_k", _super_blocks(Type.Q4_K, 8, 256)[0]),  # Q4_K as Q6_K
               lambda: cpu.dequantize_blocks("q4_k", _super_blocks(Type.Q4_K, 8, 512)[0][:, ::2]),  # strided
               lambda: cpu.q4_matmul(x, torch.cat([packed, packed], dim=-1)[..., :24]),  # strided weights
               lambda: cpu.q4_q8_matmul(x, cpu.pack_q4_rows(*_q4_parts(8, 64)), 40),  # rows it does not hold
               lambda: cpu.rms_norm(x, torch.ones(32), 1e-6),
               lambda: cpu.rms_norm(x, torch.ones(64), 1e-6, residual=torch.randn(2, 64)),
               lambda: cpu.silu_and_mul(x.half()),
               lambda: cpu.sample_tokens(x, x, torch.ones(3), torch.rand(2)),
               lambda: cpu.paged_decode_attention(torch.randn(2, 4, 64), torch.zeros(4, 16, 2, 32),
                                                  torch.zeros(4, 16, 2, 32), torch.zeros(2, 4, dtype=torch.int64),
                                                  torch.ones(2, dtype=torch.int32), 0.1)]
    for call in misread:
        with pytest.raises(ValueError):
            call()


def _q4_parts(rows: int, width: int):
    q = torch.randint(0, 16, (rows, width), dtype=torch.uint8)
    return q, torch.rand(rows, width // 32), torch.rand(rows, width // 32)


def test_a_cpu_they_are_not_written_for_runs_the_references_with_one_log_line(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu.platform, "machine", lambda: "aarch64")
    with caplog.at_level(logging.WARNING, logger=cpu.__name__):
        assert cpu.build(tmp_path) is None
    assert [r.getMessage() for r in caplog.records] == [
        "the CPU ops are x86 code (AVX2 and AVX-512 intrinsics): on this aarch64 CPU the torch reference ops run "
        "(slower)"]
    caplog.clear()
    monkeypatch.setattr(cpu.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu, "MARCH", "native")
    monkeypatch.setattr(cpu, "_cpu_flags", lambda: "flags\t\t: fpu sse sse2 avx")  # an x86 CPU before AVX2
    with caplog.at_level(logging.WARNING, logger=cpu.__name__):
        assert cpu.build(tmp_path) is None
    assert len(caplog.records) == 1 and "AVX2 and FMA" in caplog.records[0].getMessage()
    assert not list(tmp_path.iterdir())  # no compiler was run


def _rerun_for(march: str, selection: str = "") -> None:
    """This module's tests (those `selection` selects, with pytest's -k), again, on the library built for `march`."""
    selected = f"({selection}) and not _build_passes" if selection else "not _build_passes"
    rerun = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", selected],
                           env={**os.environ, "TRITONLLM_CPU_MARCH": march},
                           capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert rerun.returncode == 0, rerun.stdout[-4000:] + rerun.stderr[-2000:]
    assert list(cpu_ops_dir().glob(f"cpu_ops-{march}-*.so"))


@pytest.mark.skipif(" avx512f" not in cpu._cpu_flags(), reason="without AVX-512 the native build is the AVX2 one")
def test_the_avx2_build_passes_these_tests_too():
    """The AVX2 code paths (8-lane vectors) are another body of code than the AVX-512 ones: build the library for
    x86-64-v3 and run this module again on it."""
    _rerun_for("x86-64-v3")


@pytest.mark.skipif(" avx512_vnni" not in cpu._cpu_flags(), reason="without VNNI the native build is this one")
def test_the_avx512_build_passes_the_int8_activation_tests_without_vnni():
    """With AVX512-VNNI the int8-activation ops sum code products with vpdpbusd; AVX-512 CPUs without it (Skylake-X,
    Cascade Lake has it) take the vpmaddubsw code: build for x86-64-v4 (AVX-512 F, BW, DQ, VL) and run those."""
    _rerun_for("x86-64-v4", "q8")
