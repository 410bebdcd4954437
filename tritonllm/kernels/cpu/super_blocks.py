"""A GGUF's K-quant super-blocks as the CPU ops read them (q4_k_matmul, q5_k_matmul, q6_k_matmul: the file's bytes), in
torch: the references those kernels are tested against, and what the engine unpacks them to where another kernel
runs them (the int8-activation kernels, torch's int4 one, an embedding's rows).

- Q4_K, 144 bytes per 256 inputs: fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc and mins mn for its 8 blocks of 32,
  128 bytes of codes (blocks 2c and 2c + 1: the low and high nibbles of bytes 32c ..). w = d' · q + m' with
  d' = fl32(d · sc), m' = −fl32(dmin · mn), as gguf rounds them (d' · q is exact: 17 + 4 bits).
- Q5_K, 176 bytes per 256 inputs: Q4_K's, with 32 bytes of fifth bits (block j's: bit j of each byte) before the
  codes. w = d' · q + m' as Q4_K's (d' · q still exact: 17 + 5 bits).
- Q6_K, 210 bytes per 256 inputs: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (one per 16), fp16
  d. w = d' · (q − 32) with d' = fl32(d · sc), gguf's product."""

from __future__ import annotations

import torch

SUPER_BLOCK = 256  # a K-quant super-block's inputs
Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES = 144, 176, 210
BLOCK = 32


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of each super-block, as float32 [..., 1]."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n] → codes [..., 2n]: the low nibbles, then the high ones."""
    return torch.cat([packed & 15, packed >> 4], dim=-1)


def six_bit_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's 6-bit sc, mn [rows, in / 256, 8] int32 (gguf's get_scale_min) and fp16 d, dmin [rows,
    in / 256, 1] as float32."""
    s = blocks[..., 4:16].to(torch.int32)
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], dim=-1)
    mn = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1)
    return sc, mn, _half(blocks, 0), _half(blocks, 2)


def _scales_and_mins(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's d' = d·sc and m' = −dmin·mn [rows, in / 32] float32 (exact)."""
    sc, mn, d, dmin = six_bit_scales(blocks)
    rows = blocks.shape[0]
    return (d * sc.float()).reshape(rows, -1), -(dmin * mn.float()).reshape(rows, -1)


def q4_k_scale_min(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K super-blocks [rows, in / 256, 144] uint8 → int4 codes q [rows, in] uint8 and d', m' [rows, in / 32]
    float32 (w = d' · q + m' per block of 32)."""
    rows, count = blocks.shape[:2]
    q = _nibbles(blocks[..., 16:].reshape(rows, count, 4, 32)).reshape(rows, -1)
    return q, *_scales_and_mins(blocks)


def q5_k_scale_min(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q5_K super-blocks [rows, in / 256, 176] uint8 → int5 codes q [rows, in] uint8 and d', m' as Q4_K's."""
    rows, count = blocks.shape[:2]
    low = _nibbles(blocks[..., 48:].reshape(rows, count, 4, 32)).reshape(rows, count, 8, 32)
    fifth = (blocks[..., 16:48].reshape(rows, count, 1, 32) >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1
    return (low | (fifth << 4)).reshape(rows, -1), *_scales_and_mins(blocks)


def q6_k_codes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K super-blocks [rows, in / 256, 210] uint8 → codes q − 32 [rows, in] int8 and d' [rows, in / 16] float32
    (w = d' · code per 16 inputs)."""
    rows, count = blocks.shape[:2]
    low = _nibbles(blocks[..., :128].reshape(rows, count, 2, 64))  # [.., 2, 128]: input 128h + j's low 4 bits
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
    high = (blocks[..., 128:192].reshape(rows, count, 2, 1, 32) >> shifts) & 3
    q = (low | (high.reshape(rows, count, 2, 128) << 4)).to(torch.int8) - 32
    sc, d = q6_k_scales(blocks)
    return q.reshape(rows, -1), (d * sc.float()).reshape(rows, -1)


def q6_k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K's int8 sc [rows, in / 256, 16] (one per 16 inputs) and fp16 d [rows, in / 256, 1] as float32."""
    return blocks[..., 192:208].contiguous().view(torch.int8), _half(blocks, 208)


def _scale_min_weights(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """[rows, in] float32: d' · q, then + m', each rounded (gguf's numbers)."""
    rows = q.shape[0]
    return (q.view(rows, -1, BLOCK).float() * d[..., None] + m[..., None]).view(rows, -1)


def dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    return _scale_min_weights(*q4_k_scale_min(blocks))


def dequantize_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    return _scale_min_weights(*q5_k_scale_min(blocks))


def dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """[rows, in] float32: d' · code (gguf's numbers)."""
    q, d = q6_k_codes(blocks)
    return (q.view(q.shape[0], -1, 16).float() * d[..., None]).view(q.shape[0], -1)


# each kind (the GGUF type's name in lower case, as the kernels and llama_forward name it) → its dequantization
DEQUANTIZE = {"q4_k": dequantize_q4_k, "q5_k": dequantize_q5_k, "q6_k": dequantize_q6_k}
