"""RMSNorm, rotary embedding, SiLU-and-mul and the KV cache store against their torch references."""

from __future__ import annotations

import pytest
import torch

from tritonllm.kernels.activation import silu_and_mul_reference, silu_and_mul_triton
from tritonllm.kernels.kv_cache import store_kv_cache_reference, store_kv_cache_triton
from tritonllm.kernels.rms_norm import rms_norm_reference, rms_norm_triton
from tritonllm.kernels.rotary import rotary_embedding_reference, rotary_embedding_triton
from kernel_cases import DEVICE, DTYPES, TOLERANCES


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hidden", [(1, 64), (3, 100), (5, 576)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, tokens, hidden, with_residual):
    x = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    weight = torch.randn(hidden, device=DEVICE).to(dtype)
    residual = torch.randn(tokens, hidden, device=DEVICE).to(dtype) if with_residual else None
    ours = rms_norm_triton(x, weight, 1e-6, residual)
    expected = rms_norm_reference(x, weight, 1e-6, residual)
    if with_residual:
        torch.testing.assert_close(ours[1], expected[1], atol=0, rtol=0)  # the same rounded sum
        ours, expected = ours[0], expected[0]
    torch.testing.assert_close(ours, expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, width", [(1, 64), (4, 70), (3, 1100)])  # 1100: more than one column block
def test_silu_and_mul(dtype, tokens, width):
    x = torch.randn(tokens, 2 * width, device=DEVICE).to(dtype)
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_reference(x), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3), (16, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tokens", [1, 5])
def test_rotary_embedding_in_place_on_strided_views(dtype, heads, kv_heads, head_dim, tokens):
    # q and k as the model has them: views into one fused qkv projection
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=DEVICE).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    max_pos = 40
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float32), torch.rand(head_dim // 2)).to(DEVICE)
    cos, sin = angles.cos(), angles.sin()
    positions = torch.randint(0, max_pos, (tokens,), device=DEVICE)
    q_ref, k_ref = q.clone(), k.clone()
    expected_first = q_ref[..., :head_dim // 2].float() * cos[positions].unsqueeze(1) \
        - q_ref[..., head_dim // 2:].float() * sin[positions].unsqueeze(1)  # the rotation's definition
    rotary_embedding_triton(q, k, cos[positions], sin[positions])
    rotary_embedding_reference(q_ref, k_ref, cos[positions], sin[positions])
    torch.testing.assert_close(q_ref[..., :head_dim // 2].float(), expected_first, **TOLERANCES[dtype])
    torch.testing.assert_close(q, q_ref, **TOLERANCES[dtype])
    torch.testing.assert_close(k, k_ref, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads, head_dim", [(1, 64), (3, 64), (8, 128)])
def test_store_kv_cache(dtype, kv_heads, head_dim):
    blocks, block_size = 6, 16
    slots = torch.tensor([0, 15, 16, 17, 95, 40], device=DEVICE)  # first/last of a block, the pool's last slot
    kv = torch.randn(2, len(slots), kv_heads, head_dim, device=DEVICE).to(dtype)
    caches = torch.zeros(2, blocks, block_size, kv_heads, head_dim, device=DEVICE, dtype=dtype)
    expected = caches.clone()
    store_kv_cache_triton(kv[0], kv[1], caches[0], caches[1], slots)
    store_kv_cache_reference(kv[0], kv[1], expected[0], expected[1], slots)
    torch.testing.assert_close(caches, expected, atol=0, rtol=0)  # a copy: bit exact
