"""Device, dtypes and tolerances shared by the kernel tests."""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float32 everywhere; bfloat16 natively on CUDA only (the interpreter's bf16 tl.dot is wrong)
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# elementwise kernels: fp32 differs only by summation order; bf16 may round one ulp (2^-8 relative) apart
TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
# attention accumulates in fp32 in a different order than SDPA; bf16 also rounds p before p @ v
ATTENTION_TOLERANCES = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
