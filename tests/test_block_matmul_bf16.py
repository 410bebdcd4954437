"""Prompt rows' projections in bf16 straight from a GGUF's blocks (kernels/cpu/block_matmul_bf16.c), on AMX tiles and
as AVX512-BF16 dot products: every kind of block the fp32-activation kernels read (and the int8-activation ones' row
groups), against gguf's dequantization
rounded to bf16, to the bit where the sum is one product; a row alike in any batch; a fused projection's parts side
by side; bad inputs refused. On a CPU without AVX512-BF16 the op is absent, and what the engine does instead is
tested in tests/test_prefill_dtype.py; on one without AMX tiles their runs are skipped."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Type
from gguf import quants

from gguf_models import random_blocks
from tritonllm.kernels import cpu
from tritonllm.model_files import cpu_ops_dir

GGUF_KINDS = {"q8_0": Type.Q8_0, "q5_0": Type.Q5_0, "q4_k": Type.Q4_K, "q5_k": Type.Q5_K, "q6_k": Type.Q6_K}


@pytest.fixture(scope="module", autouse=True)
def _bf16_ops():
    assert cpu.load(cpu_ops_dir())  # the test machines have a C compiler
    if not cpu.has_bf16_ops():
        pytest.skip("no AVX512-BF16 on this CPU: prompts take oneDNN's bf16 path over a copy")


@pytest.fixture(params=[True, False], ids=["amx", "avx512-bf16"])
def tiles(request) -> bool:
    if request.param and not cpu.has_amx_tiles():
        pytest.skip("no AMX tiles on this CPU (or OS): the op runs as dot products")
    return request.param


def block_matmul(tiles: bool):
    return lambda x, parts: cpu.block_matmul_bf16(x, parts, tiles)


def _blocks(kind: str, rows: int, width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks of `kind` as the fp32-activation ops take them, and the float32 weights they stand for."""
    generator = torch.Generator().manual_seed(seed)
    if kind in ("int4", "int5", "int4_groups", "int5_groups"):  # our repacks: w = d·q + m per 32 (Q4_0/Q4_1, Q5_1)
        q = torch.randint(0, 32 if kind.startswith("int5") else 16, (rows, width), dtype=torch.uint8,
                          generator=generator)
        d = (torch.rand(rows, width // 32, generator=generator) * 0.02).half().float()
        m = (-torch.rand(rows, width // 32, generator=generator) * 0.1).half().float()
        dense = d.repeat_interleave(32, 1) * q + m.repeat_interleave(32, 1)
        pack = {"int4": cpu.pack_q4, "int5": cpu.pack_q5_1, "int4_groups": cpu.pack_q4_rows,
                "int5_groups": cpu.pack_q5_rows}[kind]
        return pack(q, d, m), dense
    if kind in ("q8_0_groups", "q6_k_groups", "q4_k_groups"):
        blocks, dense = _blocks(kind.removesuffix("_groups"), rows, width, seed)
        pack = {"q8_0_groups": cpu.pack_q8_rows, "q6_k_groups": cpu.pack_q6_k_rows, "q4_k_groups": cpu.pack_q4_k_rows}
        return pack[kind](blocks), dense
    raw = random_blocks(GGUF_KINDS[kind], rows, width, np.random.default_rng(seed))
    dense = torch.from_numpy(quants.dequantize(raw, GGUF_KINDS[kind]).reshape(rows, width).astype(np.float32))
    block_bytes, block_inputs = cpu.BLOCK_BYTES[kind]
    return torch.from_numpy(raw.reshape(rows, width // block_inputs, block_bytes)), dense


# and the int8-activation ops' row groups (int4-q8's prompt rows on bf16 hardware read them)
KINDS = ["int4", "int5", *GGUF_KINDS, "int4_groups", "int5_groups", "q8_0_groups", "q6_k_groups", "q4_k_groups"]


@pytest.mark.parametrize("kind", KINDS)
# 48 rows: a last task of 16; 600 tokens: more than one chunk of 512
@pytest.mark.parametrize("rows, tokens", [(16, 1), (48, 37), (96, 70), (32, 600)])
def test_each_kind_is_its_weights_rounded_to_bf16_summed_in_float32(kind, rows, tokens, tiles):
    block_matmul_bf16 = block_matmul(tiles)
    width = 512
    blocks, dense = _blocks(kind, rows, width)
    x = torch.randn(tokens, width)
    out = block_matmul_bf16(x, [(kind, blocks, rows)])
    expected = x.bfloat16().double() @ dense.bfloat16().double().T
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    # each weight read back (a one-hot row sums one product): the file's number rounded to bf16, to the bit
    assert torch.equal(block_matmul_bf16(torch.eye(width), [(kind, blocks, rows)]).T, dense.bfloat16().float())


@pytest.mark.parametrize("kind", ["int4", "q4_k", "q6_k", "int4_groups", "int5_groups", "q6_k_groups", "q4_k_groups"])
def test_a_row_does_not_depend_on_the_batch(kind, tiles):
    block_matmul_bf16 = block_matmul(tiles)
    blocks, _ = _blocks(kind, 80, 768)
    x = torch.randn(75, 768)
    together = block_matmul_bf16(x, [(kind, blocks, 80)])
    for size in (1, 5, 33):
        for start in range(0, len(x) - size + 1, 13):
            assert torch.equal(block_matmul_bf16(x[start:start + size], [(kind, blocks, 80)]),
                               together[start:start + size])


def test_a_fused_projections_parts_run_side_by_side(tiles):
    """A Q4_K_M qkv: q and k Q4_K, v Q6_K, each part's outputs in its columns."""
    block_matmul_bf16 = block_matmul(tiles)
    parts = [("q4_k", *_blocks("q4_k", 64, 512, 1)), ("q4_k", *_blocks("q4_k", 32, 512, 2)),
             ("q6_k", *_blocks("q6_k", 32, 512, 3))]
    x = torch.randn(20, 512)
    fused = block_matmul_bf16(x, [(kind, blocks, len(dense)) for kind, blocks, dense in parts])
    alone = [block_matmul_bf16(x, [(kind, blocks, len(dense))]) for kind, blocks, dense in parts]
    assert torch.equal(fused, torch.cat(alone, dim=1))


def test_blocks_of_the_wrong_shape_or_kind_are_refused():
    block_matmul_bf16 = cpu.block_matmul_bf16
    blocks, _ = _blocks("q4_k", 32, 512)
    x = torch.randn(4, 512)
    with pytest.raises(ValueError, match="weights"):  # Q4_K's bytes read as Q6_K's
        block_matmul_bf16(x, [("q6_k", blocks, 32)])
    with pytest.raises(ValueError, match="not multiples"):
        block_matmul_bf16(torch.randn(4, 500), [("q4_k", blocks, 32)])
    q4, _ = _blocks("int4", 24, 512)
    with pytest.raises(ValueError, match="not multiples"):  # rows in whole tiles of 16
        block_matmul_bf16(x, [("int4", q4, 24)])
