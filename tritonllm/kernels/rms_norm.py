"""RMSNorm, optionally fused with the residual add that precedes it (one pass over the hidden state)."""

from __future__ import annotations

import torch

from tritonllm.kernels.openai_triton import tl, triton


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, hidden, eps,
                     x_stride, residual_stride, out_stride, new_residual_stride,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # rounded to the input dtype first: the same sum an eager `x + residual` produces
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
             .to(tl.float32)).to(x.dtype)
        tl.store(new_residual_ptr + row * new_residual_stride + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    normed = x32 * tl.rsqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    # HF order: normalize in fp32, round to the dtype, then scale by the weight
    out = weight.to(tl.float32) * normed.to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(x.dtype), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    out = torch.empty_like(x2)
    new_residual = torch.empty_like(x2) if residual is not None else out  # unused without a residual
    residual2 = residual.reshape(-1, hidden) if residual is not None else x2
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, residual2, weight, out, new_residual, hidden, eps,
            x2.stride(0), residual2.stride(0), out.stride(0), new_residual.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden))
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), new_residual.view(x.shape)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    if residual is not None:
        x = x + residual
    out = weight * torch.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)  # normalized in fp32
    return out if residual is None else (out, x)
