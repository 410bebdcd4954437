"""Building blocks shared by the decode and prefill attention kernels: reading a tile of keys or values
through a block table, and one step of the online (flash) softmax."""

from __future__ import annotations

from tritonllm.kernels.openai_triton import tl, triton


@triton.jit
def load_paged_tile(cache_ptr, block_table_ptr, tokens, token_mask, kv_head, block_size, block_stride,
                    slot_stride, head_stride, dims, dim_mask):
    """Rows `tokens` of a sequence's context ([N] token indices) for one kv head → [N, DIM]; masked rows are 0."""
    blocks = tl.load(block_table_ptr + tokens // block_size, mask=token_mask, other=0).to(tl.int64)
    offsets = blocks * block_stride + (tokens % block_size) * slot_stride + kv_head * head_stride
    return tl.load(cache_ptr + offsets[:, None] + dims[None, :], mask=token_mask[:, None] & dim_mask[None, :],
                   other=0.0)


@triton.jit
def online_softmax_step(q, k, v, allowed, scale, running_max, running_sum, acc):
    """Fold one key/value tile into the running softmax. q [M, DIM], k and v [N, DIM], allowed [M, N] or
    broadcastable; running_max, running_sum [M] and acc [M, DIM] are float32 (acc unnormalized)."""
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    scores = tl.where(allowed, scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    # a row with nothing allowed so far keeps max -inf: shift by 0 instead to avoid (-inf) - (-inf)
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    rescale = tl.exp(running_max - shift)
    p = tl.exp(scores - shift[:, None])
    running_sum = running_sum * rescale + tl.sum(p, axis=1)
    acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return new_max, running_sum, acc
