"""Causal prefill attention on the CPU's bf16 matrix units, for prompts computed in bfloat16
(engine/layers/row_dtype.py): the CPU ops' bf16 kernel (kernels/cpu/attention_bf16.c: AMX tiles, or AVX512-BF16
dot products) where the library and the head size allow it, else torch's flash-attention kernel (AMX or AVX512-BF16
through oneDNN) over K/V gathered from the paged cache. Same inputs and meaning as prefill_attention_reference;
either way a position's result does not depend on how its prompt was cut into chunks or on what else ran in the
step. An 8,000-token prompt of the default model (2 threads) spent 2.9 s in the kernel against 4.5 s in the flash
path on a Xeon with AMX, 6.8 s against 20.1 s on a Zen 4 (dot products).

The flash path: a chunk can start anywhere, and the flash kernel's online softmax sums in an order set by where its
keys start and how many there are; so that a position's result does not depend on how its prompt was cut into chunks
(or on what else ran in the step), every position attends in two fixed calls: to the whole segments of SEGMENT keys
before its own (keys from 0, a multiple of SEGMENT of them) and to its own segment under a causal mask (SEGMENT
keys, zeros past the context), merged by their log-sum-exps. The kernel sums a query row alike in any whole tile of
32 or 64 rows, but otherwise in a tail tile of a few rows or alone, so each call's rows start at a multiple of
ROW_TILE in the segment and are a multiple of it (zero rows before the chunk's first query and after its last). With
two threads the kernel's first calls in a process were seen to give other bits than every later call (1 to 6
processes in 10), never after `warm_up` had run the same calls."""

from __future__ import annotations

import functools

import torch

from tritonllm.kernels import cpu

SEGMENT = 512  # keys: the flash kernel's KV split for 512 keys or more, so every call's splits fall alike
ROW_TILE = 32  # the kernel's query tiles: 32 rows below 192, 64 from there to 767 (a segment holds at most 512)
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@functools.cache
def _causal_mask() -> torch.Tensor:
    """[SEGMENT, SEGMENT] bf16, 0 where row i may see key j (j <= i), -inf elsewhere."""
    allowed = torch.ones(SEGMENT, SEGMENT, dtype=torch.bool).tril()
    return torch.zeros(SEGMENT, SEGMENT, dtype=torch.bfloat16).masked_fill_(~allowed, float("-inf"))


def _gather(cache: torch.Tensor, table: torch.Tensor, context_len: int, padded: int) -> torch.Tensor:
    """The context's keys (values) as [1, kv_heads, padded, head_dim] bf16, zeros past context_len."""
    block_size, kv_heads, head_dim = cache.shape[1:]
    blocks = -(-context_len // block_size)
    out = torch.zeros(padded, kv_heads, head_dim, dtype=torch.bfloat16)
    out[:context_len] = cache.index_select(0, table[:blocks]).flatten(0, 1)[:context_len]
    return out.permute(1, 0, 2).unsqueeze(0)


def _rows(rows: torch.Tensor, before: int, total: int) -> torch.Tensor:
    """rows [..., n, dim] with `before` zero rows ahead of them and zero rows after, `total` in all."""
    out = rows.new_zeros(*rows.shape[:-2], total, rows.shape[-1])
    out[..., before:before + rows.shape[-2], :] = rows
    return out


def prefill_attention_bf16(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           query_starts: torch.Tensor, query_lens: torch.Tensor, context_lens: torch.Tensor,
                           block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    out = cpu.prefill_attention_bf16(q, k_cache, v_cache, query_starts, query_lens, context_lens, block_tables, scale)
    if out is not None:
        return out
    return prefill_attention_flash(q, k_cache, v_cache, query_starts, query_lens, context_lens, block_tables, scale)


def prefill_attention_flash(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            query_starts: torch.Tensor, query_lens: torch.Tensor, context_lens: torch.Tensor,
                            block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    mask = _causal_mask()
    for chunk, (start, query_len, context_len) in enumerate(
            zip(query_starts.tolist(), query_lens.tolist(), context_lens.tolist())):
        offset = context_len - query_len  # the context position of the chunk's first query
        padded = -(-context_len // SEGMENT) * SEGMENT
        keys = _gather(k_cache, block_tables[chunk], context_len, padded)
        values = _gather(v_cache, block_tables[chunk], context_len, padded)
        queries = q[start:start + query_len].to(torch.bfloat16).transpose(0, 1).unsqueeze(0)  # [1, heads, n, dim]
        first = offset
        while first < context_len:  # the chunk's queries, one segment at a time
            segment = first // SEGMENT * SEGMENT
            last = min(context_len, segment + SEGMENT)
            tile_start = (first - segment) // ROW_TILE * ROW_TILE  # in the segment
            before = first - segment - tile_start
            total = -(-(last - segment - tile_start) // ROW_TILE) * ROW_TILE
            query = _rows(queries[:, :, first - offset:last - offset], before, total)
            own_mask = _rows(mask[first - segment:last - segment], before, total)
            own, own_lse = _flash(query, keys[:, :, segment:segment + SEGMENT], values[:, :, segment:segment + SEGMENT],
                                  0.0, False, attn_mask=own_mask, scale=scale)
            result = own.float()
            if segment:
                earlier, earlier_lse = _flash(query, keys[:, :, :segment], values[:, :, :segment], 0.0, False,
                                              scale=scale)
                lse = torch.logaddexp(earlier_lse, own_lse)
                result = (earlier.float() * (earlier_lse - lse).exp().unsqueeze(-1)
                          + result * (own_lse - lse).exp().unsqueeze(-1))
            rows = result[0, :, before:before + last - first]
            out[start + first - offset:start + last - offset] = rows.transpose(0, 1)
            first = last
    return out


def warm_up(heads: int, kv_heads: int, head_dim: int) -> None:
    """The flash path's calls for a prompt of 1,300 tokens cut three ways, on random numbers (see the module's
    doc)."""
    generator = torch.Generator().manual_seed(0)
    tokens, block_size = 1300, 16
    blocks = -(-tokens // block_size)
    k_cache, v_cache = (torch.randn(blocks, block_size, kv_heads, head_dim, generator=generator) for _ in range(2))
    table = torch.arange(blocks, dtype=torch.int32).view(1, blocks)
    q = torch.randn(tokens, heads, head_dim, generator=generator)
    for chunk in (tokens, 512, 100):
        for start in range(0, tokens, chunk):
            end = min(tokens, start + chunk)
            prefill_attention_flash(q[start:end], k_cache, v_cache, torch.tensor([0]), torch.tensor([end - start]),
                                    torch.tensor([end]), table, head_dim ** -0.5)
