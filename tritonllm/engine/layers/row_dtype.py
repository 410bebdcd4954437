"""The dtype a forward's prompt rows compute their matmuls in (the `prefill_dtype` setting).

float32 is exact: a prompt token's K/V and hidden states are the bits decoding it would give. bfloat16 runs the
prompt rows' projections and attention on the CPU's bf16 matrix units (AMX, AVX512-BF16): their inputs rounded to
bf16, products summed in fp32; the residual stream, norms, the KV cache and the LM head stay as they are. int8 (for
weights whose kernels quantize their inputs to int8 codes, int4-q8) gives the prompt rows' projections one level of
codes where decode rows take two: llama.cpp's numerics, half the integer work; attention stays float32. The model
runs a step's decode rows and its prompt rows as two forwards, the second inside `computing_prompt_rows`, so a decode
row never depends on whether a prompt was batched with it. Like torch.autocast, the setting is the running thread's:
the core thread, the only one that runs forwards."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

_dtype = torch.float32


def matmul_dtype() -> torch.dtype:
    """What the projections and attention of the forward now running compute in."""
    return _dtype


def activation_levels() -> int:
    """Levels of int8 codes the int8-activation kernels quantize this forward's inputs to: one for int8 prompt rows,
    else two."""
    return 1 if _dtype == torch.int8 else 2


@contextmanager
def computing_prompt_rows(dtype: torch.dtype) -> Iterator[None]:
    global _dtype
    _dtype = dtype
    try:
        yield
    finally:
        _dtype = torch.float32
