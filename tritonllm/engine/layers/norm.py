"""RMSNorm, optionally fused with the residual add before it (the kernel does both in one pass)."""

from __future__ import annotations

import torch
from torch import nn

from tritonllm import kernels


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x) over the last dimension; with a residual, (norm(x + residual), x + residual) in one pass."""
        return kernels.rms_norm(x, self.weight, self.eps, residual)
