"""Batched logit adjustments before sampling, one launch for the whole batch, each row with its own parameters:
repetition/frequency/presence penalties, logit bias, and a token bitmask (for constrained decoding)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # vocabulary entries per program


@triton.jit
def _penalties_kernel(logits_ptr, counts_ptr, prompt_mask_ptr, repetition_ptr, frequency_ptr, presence_ptr,
                      out_ptr, vocab, logits_stride, counts_stride, prompt_mask_stride, out_stride,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab
    logits = tl.load(logits_ptr + row * logits_stride + cols, mask=mask, other=0.0)
    counts = tl.load(counts_ptr + row * counts_stride + cols, mask=mask, other=0.0)
    in_prompt = tl.load(prompt_mask_ptr + row * prompt_mask_stride + cols, mask=mask, other=0) != 0
    repetition = tl.load(repetition_ptr + row)
    generated = counts > 0
    # div_rn: correctly rounded like torch (plain `/` may lower to an approximate division)
    penalized = tl.where(logits > 0, tl.math.div_rn(logits, repetition), logits * repetition)
    logits = tl.where(in_prompt | generated, penalized, logits)
    logits = logits - tl.load(frequency_ptr + row) * counts
    logits = logits - tl.load(presence_ptr + row) * generated.to(logits.dtype)
    tl.store(out_ptr + row * out_stride + cols, logits, mask=mask)


def apply_penalties_triton(logits: torch.Tensor, output_counts: torch.Tensor, prompt_mask: torch.Tensor,
                           repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    rows, vocab = logits.shape
    out = torch.empty_like(logits)
    if rows:
        _penalties_kernel[(rows, triton.cdiv(vocab, _BLOCK))](
            logits, output_counts, prompt_mask, repetition, frequency, presence, out, vocab, logits.stride(0),
            output_counts.stride(0), prompt_mask.stride(0), out.stride(0), BLOCK=_BLOCK)
    return out


def apply_penalties_reference(logits: torch.Tensor, output_counts: torch.Tensor, prompt_mask: torch.Tensor,
                              repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """Per-row penalties on logits [rows, vocab]. output_counts: how often each token was generated;
    prompt_mask: tokens present in the prompt. Repetition (HF/vLLM rule) covers prompt and output: positive
    logits are divided by it, negative ones multiplied. Frequency and presence (OpenAI's formula) cover the
    output only: logit -= frequency * count + presence * (count > 0)."""
    seen = prompt_mask | (output_counts > 0)
    repetition = repetition.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    logits = logits - frequency.unsqueeze(1) * output_counts
    return logits - presence.unsqueeze(1) * (output_counts > 0).to(logits.dtype)


@triton.jit
def _logit_bias_kernel(logits_ptr, rows_ptr, token_ids_ptr, biases_ptr, logits_stride, entries,
                       BLOCK: tl.constexpr):
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = index < entries
    targets = (logits_ptr + tl.load(rows_ptr + index, mask=mask, other=0) * logits_stride
               + tl.load(token_ids_ptr + index, mask=mask, other=0))
    # (row, token) pairs are distinct (a request's bias is a dict): plain read-modify-write is race-free
    tl.store(targets, tl.load(targets, mask=mask) + tl.load(biases_ptr + index, mask=mask), mask=mask)


def apply_logit_bias_triton(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                            biases: torch.Tensor) -> None:
    if len(rows):
        _logit_bias_kernel[(triton.cdiv(len(rows), _BLOCK),)](
            logits, rows, token_ids, biases, logits.stride(0), len(rows), BLOCK=_BLOCK)


def apply_logit_bias_reference(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                               biases: torch.Tensor) -> None:
    """In place: logits[rows[i], token_ids[i]] += biases[i]; the (row, token) pairs are distinct."""
    logits.index_put_((rows, token_ids), biases.to(logits.dtype), accumulate=True)


@triton.jit
def _token_bitmask_kernel(logits_ptr, bitmask_ptr, vocab, logits_stride, bitmask_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab
    words = tl.load(bitmask_ptr + row * bitmask_stride + cols // 32, mask=mask, other=0)
    allowed = ((words >> (cols % 32)) & 1) != 0
    tl.store(logits_ptr + row * logits_stride + cols, float("-inf"), mask=mask & ~allowed)


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    rows, vocab = logits.shape
    if rows:
        _token_bitmask_kernel[(rows, triton.cdiv(vocab, _BLOCK))](
            logits, bitmask, vocab, logits.stride(0), bitmask.stride(0), BLOCK=_BLOCK)


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: bitmask [rows, ceil(vocab / 32)] int32 holds one bit per token (bit t % 32 of word t // 32);
    tokens whose bit is clear get -inf."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(1)[:, :logits.shape[1]].bool()
    logits.masked_fill_(~allowed, float("-inf"))
