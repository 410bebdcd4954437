"""`triton` and `triton.language` (as `tl`) for the kernel modules, imported only where a kernel can be launched: on
CUDA, or on the CPU under TRITON_INTERPRET=1 (the kernel tests). On a CPU host the engine runs the CPU ops and the
torch references beside the kernels, and importing OpenAI-Triton would only cost its compiler library's pages (about
70 MiB resident in every engine process); there `triton.jit` keeps the kernel unlaunchable and any other use
raises, naming why."""

from __future__ import annotations

import os

import torch

_WHY = "OpenAI-Triton kernels run on CUDA, or on the CPU with TRITON_INTERPRET=1 set before tritonllm.kernels is imported"


class _UnlaunchableKernel:
    def __init__(self, function):
        self.__name__ = function.__name__

    def __getitem__(self, grid):
        raise RuntimeError(f"{self.__name__}: {_WHY}")


class _Absent:
    """triton or triton.language where no kernel can run: decorating a kernel works, anything else raises."""

    def jit(self, function) -> _UnlaunchableKernel:
        return _UnlaunchableKernel(function)

    def __getattr__(self, name: str):
        raise RuntimeError(f"triton.{name}: {_WHY}")


if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    import triton
    import triton.language as tl
else:
    triton = tl = _Absent()

__all__ = ["triton", "tl"]
