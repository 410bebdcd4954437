"""Kernel tests run natively on CUDA, else in Triton's interpreter. The interpreter is chosen when a kernel is
decorated, i.e. when `tritonllm.kernels` is first imported, so it is set here, before any test module imports it
(pytest collects this directory before the tests/test_*.py modules that import the engine)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if ("tritonllm.kernels" in sys.modules or "triton" in sys.modules) and os.environ["TRITON_INTERPRET"] == "1":
        raise RuntimeError("kernels (or triton) was imported before tests/kernels/conftest.py could enable TRITON_INTERPRET; "
                           "run the kernel tests on their own: pytest tests/kernels")

@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
