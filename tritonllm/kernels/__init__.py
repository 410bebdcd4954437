"""The engine's one entry point to its custom ops.

Each op runs its OpenAI-Triton kernel when the tensors are on CUDA; on the CPU, float32 tensors go to the CPU ops
(`tritonllm/kernels/cpu`, C compiled for this machine) where those could be built and the op has one, anything else to the
torch reference. `force` overrides that (initially TRITONLLM_FORCE_KERNELS, read at import): "1" = always the
Triton kernels (on CPU that needs TRITON_INTERPRET=1 set before this package is imported, as the tests do),
"0" = always the references (to compare against)."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from tritonllm.kernels import cpu
from tritonllm.kernels.activation import silu_and_mul_reference, silu_and_mul_triton
from tritonllm.kernels.decode_attention import paged_decode_attention_reference, paged_decode_attention_triton
from tritonllm.kernels.kv_cache import store_kv_cache_reference, store_kv_cache_triton
from tritonllm.kernels.lora import lora_delta_reference, lora_delta_triton
from tritonllm.kernels.prefill_attention import prefill_attention_reference, prefill_attention_triton
from tritonllm.kernels.rms_norm import rms_norm_reference, rms_norm_triton
from tritonllm.kernels.rotary import rotary_embedding_reference, rotary_embedding_triton
from tritonllm.kernels.sampling import (apply_logit_bias_reference, apply_logit_bias_triton, apply_penalties_reference,
                              apply_penalties_triton, apply_token_bitmask_reference, apply_token_bitmask_triton,
                              filter_probs_reference, filter_probs_triton, sample_tokens_reference)


_forced = os.environ.get("TRITONLLM_FORCE_KERNELS", "")  # not read per call: ops run hundreds of times a step


def force(mode: str) -> None:
    """"1": the kernels everywhere, "0": the references everywhere, "": by device."""
    global _forced
    _forced = mode


def _dispatch(kernel: Callable, reference: Callable, cpu_op: Callable | None = None) -> Callable:
    """An op choosing per call by the device (and, on the CPU, the dtype) of its first tensor argument."""
    def op(first: torch.Tensor, *args, **kwargs):
        if _forced == "1" or first.is_cuda and _forced != "0":
            return kernel(first, *args, **kwargs)
        if cpu_op is not None and _forced != "0" and first.dtype == torch.float32 and cpu.available():
            return cpu_op(first, *args, **kwargs)
        return reference(first, *args, **kwargs)

    op.__name__ = reference.__name__.removesuffix("_reference")
    op.__doc__ = reference.__doc__
    return op


rms_norm = _dispatch(rms_norm_triton, rms_norm_reference, cpu.rms_norm)
rotary_embedding = _dispatch(rotary_embedding_triton, rotary_embedding_reference, cpu.rotary_embedding)
silu_and_mul = _dispatch(silu_and_mul_triton, silu_and_mul_reference, cpu.silu_and_mul)
store_kv_cache = _dispatch(store_kv_cache_triton, store_kv_cache_reference, cpu.store_kv_cache)
paged_decode_attention = _dispatch(paged_decode_attention_triton, paged_decode_attention_reference, cpu.paged_decode_attention)
prefill_attention = _dispatch(prefill_attention_triton, prefill_attention_reference, cpu.prefill_attention)
apply_penalties = _dispatch(apply_penalties_triton, apply_penalties_reference)
apply_logit_bias = _dispatch(apply_logit_bias_triton, apply_logit_bias_reference)
apply_token_bitmask = _dispatch(apply_token_bitmask_triton, apply_token_bitmask_reference)
filter_probs = _dispatch(filter_probs_triton, filter_probs_reference)
lora_delta = _dispatch(lora_delta_triton, lora_delta_reference)
sample_tokens = _dispatch(sample_tokens_reference, sample_tokens_reference, cpu.sample_tokens)  # torch on CUDA

__all__ = ["force", "rms_norm", "rotary_embedding", "silu_and_mul", "store_kv_cache", "paged_decode_attention",
           "prefill_attention", "apply_penalties", "apply_logit_bias", "apply_token_bitmask", "filter_probs",
           "lora_delta", "sample_tokens"]
