"""SwiGLU's activation: silu(gate) * up over the fused gate_up projection's output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tritonllm.kernels.openai_triton import tl, triton


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, width, x_stride, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + width + cols, mask=mask, other=0.0)
    gate32 = gate.to(tl.float32)
    # rounded between the two steps like eager F.silu(gate) * up
    silu = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype)
    tl.store(out_ptr + row * out_stride + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


_BLOCK = 1024


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    width = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty(x2.shape[0], width, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(width, _BLOCK))](
            x2, out, width, x2.stride(0), out.stride(0), BLOCK=_BLOCK)
    return out.view(*x.shape[:-1], width)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
