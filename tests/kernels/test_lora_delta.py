"""The batched LoRA kernel (per-token gathered shrink/expand) against its torch reference."""

from __future__ import annotations

import pytest
import torch

from tritonllm.kernels.lora import lora_delta_reference, lora_delta_triton
from kernel_cases import DEVICE, DTYPES, TOLERANCES


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width, rank, out_width", [(576, 24, 960), (100, 8, 70), (1536, 16, 576)])
def test_lora_delta_mixes_slots_and_base_tokens(dtype, width, rank, out_width):
    slots = 3
    token_slots = torch.tensor([-1, 0, 2, 2, -1, 1, 0, 2, -1], dtype=torch.int32, device=DEVICE)
    x = torch.randn(len(token_slots), width, device=DEVICE).to(dtype)
    lora_a = (torch.randn(slots, rank, width, device=DEVICE) * 0.1).to(dtype)
    lora_b = (torch.randn(slots, out_width, rank, device=DEVICE) * 0.1).to(dtype)
    ours = lora_delta_triton(x, lora_a, lora_b, token_slots, (0, 1, 2))
    expected = lora_delta_reference(x, lora_a, lora_b, token_slots, (0, 1, 2))
    assert ours.dtype == x.dtype
    assert (ours[token_slots < 0] == 0).all()  # base tokens get no update
    assert expected[token_slots >= 0].abs().max() > 0.1  # a real update to compare
    tolerance = TOLERANCES[dtype] if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(ours, expected, **({"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32
                                                  else tolerance))


def test_lora_delta_of_an_empty_batch():
    x = torch.empty(0, 64, device=DEVICE)
    out = lora_delta_triton(x, torch.zeros(2, 8, 64, device=DEVICE), torch.zeros(2, 32, 8, device=DEVICE),
                            torch.empty(0, dtype=torch.int32, device=DEVICE), ())
    assert out.shape == (0, 32)
