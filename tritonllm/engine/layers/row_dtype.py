"""The dtype a forward's rows compute their matmuls in (the `prefill_dtype` and `decode_dtype` settings).

float32 is exact: a prompt token's K/V and hidden states are the bits decoding it would give (int4-q8's kernels
quantize float32 rows to two levels of int8 codes, near-exact). bfloat16 (prompt rows) runs the projections and
attention on the CPU's bf16 matrix units (AMX, AVX512-BF16): their inputs rounded to bf16, products summed in fp32;
the residual stream, norms, the KV cache and the LM head stay as they are. int8 (prompt or decode rows of weights
whose kernels quantize their inputs to int8 codes, int4-q8) gives the projections one level of codes where float32
rows take two: llama.cpp's numerics, half the integer work; attention stays float32. Where a step's decode rows and
prompt rows differ in dtype the model runs them as two forwards, each inside `computing_rows`, so a decode row never
depends on whether a prompt was batched with it. Like torch.autocast, the setting is the running thread's: the core
thread, the only one that runs forwards."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

_dtype = torch.float32


def matmul_dtype() -> torch.dtype:
    """What the projections and attention of the forward now running compute in."""
    return _dtype


def activation_levels() -> int:
    """Levels of int8 codes the int8-activation kernels quantize this forward's inputs to: one for int8 rows, else
    two."""
    return 1 if _dtype == torch.int8 else 2


@contextmanager
def computing_rows(dtype: torch.dtype) -> Iterator[None]:
    global _dtype
    outer, _dtype = _dtype, dtype
    try:
        yield
    finally:
        _dtype = outer
