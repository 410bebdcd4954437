"""Batched sampling ops, one launch for the whole batch, each row with its own parameters: logit adjustments
(repetition/frequency/presence penalties, logit bias, a token bitmask for constrained decoding), the
top-k / top-p / min-p filtering of probabilities, and the draw itself (greedy or with a temperature, with the
softmax normalizer of the raw logits that logprobs need)."""

from __future__ import annotations

import torch

from tritonllm.kernels.openai_triton import tl, triton

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


_FILTER_BLOCK = 4096  # vocabulary entries per tile; one program walks its row tile by tile
_SEARCH_STEPS = 31  # halvings of the int32 bit range of non-negative fp32: exact thresholds


@triton.jit
def _filter_probs_kernel(probs_ptr, top_k_ptr, top_p_ptr, min_p_ptr, out_ptr, vocab, probs_stride, out_stride,
                         BLOCK: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    # Non-negative fp32 values order like their int32 bit patterns, so each threshold is found exactly by a binary
    # search over bit patterns; padding lanes load -1.0 (negative bits) and are never counted.
    row = tl.program_id(0)
    probs_row = probs_ptr + row.to(tl.int64) * probs_stride
    out_row = out_ptr + row.to(tl.int64) * out_stride
    offsets = tl.arange(0, BLOCK)

    largest = tl.full([BLOCK], -1.0, tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + offsets
        largest = tl.maximum(largest, tl.load(probs_row + cols, mask=cols < vocab, other=-1.0).to(tl.float32))
    p_max = tl.max(largest, axis=0)

    top_k = tl.load(top_k_ptr + row)
    k = tl.where((top_k > 0) & (top_k < vocab), top_k, vocab)  # off: every entry passes
    top_p = tl.load(top_p_ptr + row).to(tl.float32)
    top_p = tl.where(top_p < 1.0, top_p, float("inf"))  # off: no threshold above 0 reaches the target
    min_p_threshold = tl.minimum(tl.load(min_p_ptr + row).to(tl.float32) * p_max, p_max)

    # largest t with count(p >= t) >= k (top-k) and with mass(p >= t) >= top_p (top-p): lo passes, hi fails
    k_lo = p_max.to(tl.int32, bitcast=True) * 0
    p_lo = k_lo
    k_hi = p_max.to(tl.int32, bitcast=True) + 1
    p_hi = k_hi
    for _ in range(SEARCH_STEPS):
        k_mid = k_lo + (k_hi - k_lo) // 2
        p_mid = p_lo + (p_hi - p_lo) // 2
        count = tl.zeros([BLOCK], tl.int32)
        mass = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + offsets
            p = tl.load(probs_row + cols, mask=cols < vocab, other=-1.0).to(tl.float32)
            bits = p.to(tl.int32, bitcast=True)
            count += (bits >= k_mid).to(tl.int32)
            mass += tl.where(bits >= p_mid, p, 0.0)
        k_ok = tl.sum(count, axis=0) >= k
        k_lo = tl.where(k_ok, k_mid, k_lo)
        k_hi = tl.where(k_ok, k_hi, k_mid)
        p_ok = tl.sum(mass, axis=0) >= top_p
        p_lo = tl.where(p_ok, p_mid, p_lo)
        p_hi = tl.where(p_ok, p_hi, p_mid)

    threshold = tl.maximum(tl.maximum(k_lo, p_lo), min_p_threshold.to(tl.int32, bitcast=True))
    for start in range(0, vocab, BLOCK):
        cols = start + offsets
        mask = cols < vocab
        p = tl.load(probs_row + cols, mask=mask, other=0.0)
        kept = p.to(tl.float32).to(tl.int32, bitcast=True) >= threshold
        tl.store(out_row + cols, tl.where(kept, p, 0.0).to(out_ptr.dtype.element_ty), mask=mask)


def filter_probs_triton(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                        min_p: torch.Tensor) -> torch.Tensor:
    rows, vocab = probs.shape
    out = torch.empty_like(probs)
    if rows:
        _filter_probs_kernel[(rows,)](probs, top_k, top_p, min_p, out, vocab, probs.stride(0), out.stride(0),
                                      BLOCK=_FILTER_BLOCK, SEARCH_STEPS=_SEARCH_STEPS, num_warps=8)
    return out


_CANDIDATES = 256  # the reference sorts only each row's most likely tokens unless a nucleus reaches past them


def filter_probs_reference(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                           min_p: torch.Tensor) -> torch.Tensor:
    """Per-row top-k / top-p / min-p filtering of probabilities [rows, vocab] (need not be normalized): entries
    below the row's threshold become 0, in place in the vocabulary. The threshold is the largest of: the k-th
    largest value (top_k <= 0 or >= vocab: off); the smallest value of the shortest most-likely-first prefix whose
    mass reaches top_p (>= 1: off); min_p * the largest value. Entries tied with the threshold are all kept, and
    the most likely token always is."""
    rows, vocab = probs.shape
    k_on = (top_k > 0) & (top_k < vocab)
    p_on = top_p < 1.0
    width = min(vocab, max(_CANDIDATES, int(torch.where(k_on, top_k, 0).max()) if rows else 0))
    values = probs.float().topk(width, dim=-1).values
    if width < vocab and bool((p_on & ~k_on & (values.sum(dim=-1) < top_p)).any()):
        values = probs.float().sort(dim=-1, descending=True).values  # a nucleus not cut by top-k needs the tail
        width = vocab
    # (a nucleus reaching past the window of a top-k row is below its top-k threshold: 0 does as well)
    k_threshold = values.gather(1, (top_k.long() - 1).clamp(0, width - 1).unsqueeze(1)).squeeze(1)
    reach = (values.cumsum(dim=-1) < top_p.unsqueeze(1).float()).sum(dim=-1)  # index of the entry reaching top_p
    p_threshold = values.gather(1, reach.clamp(max=width - 1).unsqueeze(1)).squeeze(1)
    p_max = values[:, 0]
    threshold = torch.maximum(torch.where(k_on, k_threshold, 0.0),
                              torch.where(p_on & (reach < width), p_threshold, 0.0))
    threshold = torch.maximum(threshold, torch.minimum(min_p.float() * p_max, p_max))
    return probs.masked_fill(probs.float() < threshold.unsqueeze(1), 0.0)


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one uniform number per row picks an index of that row's (unnormalized) probs."""
    cdf = probs.cumsum(dim=-1)
    targets = uniforms.unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def sample_tokens_reference(logits: torch.Tensor, raw: torch.Tensor, inverse_temperatures: torch.Tensor,
                            uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token from logits [rows, vocab] — its argmax where inverse_temperatures is 0, else drawn from
    softmax(logits · inverse temperature) by inverse CDF at uniforms — and log Σ exp(raw) per row (raw: the logits
    before any adjustment; may be logits itself)."""
    greedy = inverse_temperatures == 0
    scale = torch.where(greedy, 1.0, inverse_temperatures).unsqueeze(1)  # every row drawn: no host sync on CUDA
    drawn = sample_from((logits * scale).softmax(dim=-1), uniforms)
    return torch.where(greedy, logits.argmax(dim=-1), drawn), torch.logsumexp(raw, dim=-1)
