"""A GGUF tensor's quantized blocks → the CPU kernels' blocks, where that is exact.

The int4 kernels (tritonllm/kernels/cpu/quant_matmul.c) compute w = d · q + m per block of 32 inputs, with 4-bit
codes q and fp32 d, m. Two GGUF types are exactly that shape:

- Q4_1: w = d · q + m (fp16 d, m widened to fp32);
- Q4_0: w = d · (q − 8) = d · q + (−8d) (−8d is exact in fp32, and d · q too: an fp16 times a 4-bit integer).

The int5 kernel computes the same with 5-bit codes, and Q5_1 is exactly its shape (w = d · q + m, fp16 d, m
widened).

Q8_0 blocks (fp16 d, 32 signed codes: w = d · q) are the Q8_0 kernel's own layout and stay as they are, and so do
Q5_0's (fp16 d, the 32 codes' fifth bits, their low nibbles: w = d · (q − 16)), the Q5_0 kernel's. Q4_K's, Q5_K's
and Q6_K's super-blocks stay as the file stores them too: their kernels decode the scales
(tritonllm/kernels/cpu/super_blocks.py says how), so a weight costs the file's 4.5, 5.5 and 6.56 bits. For the
integer kernels (int8 activations) each is repacked at load into row groups of the same numbers (linear.py).

`gguf.quants.dequantize` is the reference for every type: `kernel_blocks` returns a tensor's blocks only when they
dequantize to exactly its numbers, compared on CHECKED_ROWS rows from first to last (the sign of a zero aside:
Q4_0's d · 0 may be −0 where d · 8 − 8d is +0, and a dot product adds either the same way)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Type
from gguf import quants

from tritonllm.k_quants import SUPER_BLOCK, quantize_q4_k
from tritonllm.kernels import cpu as cpu_ops
from tritonllm.kernels.cpu import super_blocks

BLOCK = 32  # the kernels' block of inputs
INT4_TYPES = (Type.Q4_0, Type.Q4_1)
INT5_TYPES = (Type.Q5_1,)
Q8_TYPES = (Type.Q8_0,)
Q5_TYPES = (Type.Q5_0,)
SUPER_BLOCK_TYPES = tuple(Type[kind.upper()] for kind in super_blocks.DEQUANTIZE)
COVERED_TYPES = INT4_TYPES + INT5_TYPES + Q8_TYPES + Q5_TYPES + SUPER_BLOCK_TYPES
# rows of a tensor compared with gguf's dequantization at load: spread from its first row to its last (a reading
# of a type's layout that is wrong is wrong in every row; gguf's numpy dequantization of every row took 10 of the
# 16 s a 1B Q4_K_M took to load)
CHECKED_ROWS = 256


@dataclass(frozen=True)
class ScaleMinBlocks:
    """w = d · q + m per block of 32 inputs: codes q [rows, K] uint8, d and m [rows, K / 32] float32."""

    q: np.ndarray
    d: np.ndarray
    m: np.ndarray

    def dequantize(self) -> np.ndarray:
        rows = self.q.shape[0]
        q = self.q.reshape(rows, -1, BLOCK).astype(np.float32)
        return (q * self.d[..., None] + self.m[..., None]).reshape(rows, -1)

    def rows_reordered(self, order) -> "ScaleMinBlocks":
        return type(self)(order(self.q), order(self.d), order(self.m))


class Int4Blocks(ScaleMinBlocks):
    """Codes in 0..15: Q4_0, Q4_1."""


class Int5Blocks(ScaleMinBlocks):
    """Codes in 0..31: Q5_1."""


@dataclass(frozen=True)
class Q8Blocks:
    """Q8_0 blocks [rows, K / 32, 34] uint8 (fp16 d, then 32 int8 codes: w = d · q)."""

    blocks: np.ndarray
    kind: ClassVar[str] = "q8_0"

    def dequantize(self) -> np.ndarray:
        d = self.blocks[..., :2].copy().view(np.float16).astype(np.float32)
        return (self.blocks[..., 2:].view(np.int8).astype(np.float32) * d).reshape(self.blocks.shape[0], -1)

    def rows_reordered(self, order) -> "Q8Blocks":
        return Q8Blocks(order(self.blocks))


@dataclass(frozen=True)
class Q5Blocks:
    """A GGUF's Q5_0 blocks [rows, K / 32, 22] uint8 as stored (fp16 d, 32 fifth bits, 16 bytes: element j's low
    nibble, j + 16's high one: w = d · (q − 16))."""

    blocks: np.ndarray
    kind: ClassVar[str] = "q5_0"

    def dequantize(self) -> np.ndarray:
        block = self.blocks
        high = (block[..., 2:6].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
        codes = (_nibbles(block[..., 6:]) | (high.astype(np.uint8) << 4)).astype(np.float32) - 16
        return (_half(block, 0) * codes).reshape(block.shape[0], -1)

    def rows_reordered(self, order) -> "Q5Blocks":
        return Q5Blocks(order(self.blocks))


@dataclass(frozen=True)
class SuperBlocks:
    """A GGUF's Q4_K or Q6_K super-blocks [rows, K / 256, bytes] uint8 as stored (`kind`: the type's name in
    lower case, as the kernels and llama_forward name it)."""

    kind: str
    blocks: np.ndarray

    def dequantize(self) -> np.ndarray:
        return super_blocks.DEQUANTIZE[self.kind](torch.from_numpy(np.ascontiguousarray(self.blocks))).numpy()

    def rows_reordered(self, order) -> "SuperBlocks":
        return SuperBlocks(self.kind, order(self.blocks))


KernelBlocks = Int4Blocks | Int5Blocks | Q8Blocks | Q5Blocks | SuperBlocks


def _half(block: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte `start` of each block, as float32 [..., 1]."""
    return block[..., start:start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """Bytes [..., n] → codes [..., 2n]: the low nibbles, then the high ones (Q4_0/Q4_1/Q5_1.s order)."""
    codes = np.empty((*packed.shape[:-1], 2 * packed.shape[-1]), np.uint8)  # written in place: no temporaries
    np.bitwise_and(packed, 0xF, out=codes[..., :packed.shape[-1]])
    np.right_shift(packed, 4, out=codes[..., packed.shape[-1]:])
    return codes


def _int4_blocks(raw: np.ndarray, qtype: Type, rows: int) -> Int4Blocks:
    size = 18 if qtype == Type.Q4_0 else 20  # fp16 d (and Q4_1's fp16 m), 16 bytes: element j low, j + 16 high
    block = raw.reshape(rows, -1, size)
    d = _half(block, 0)[..., 0]
    m = -8 * d if qtype == Type.Q4_0 else _half(block, 2)[..., 0]
    return Int4Blocks(_nibbles(block[..., size - 16:]).reshape(rows, -1), d, m)


def _int5_blocks(raw: np.ndarray, rows: int) -> Int5Blocks:
    block = raw.reshape(rows, -1, 24)  # fp16 d, fp16 m, 32 fifth bits (element j's is bit j), 16 bytes of nibbles
    fifth = (block[..., 4:8].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
    codes = _nibbles(block[..., 8:]) | (fifth.astype(np.uint8) << 4)
    return Int5Blocks(codes.reshape(rows, -1), _half(block, 0)[..., 0], _half(block, 2)[..., 0])


def kernel_blocks(raw: np.ndarray, qtype: Type, rows: int,
                  order=lambda x: x) -> KernelBlocks | None:
    """A GGUF tensor's raw bytes (rows of blocks) as the kernels' blocks, with its rows put in `order` (a function
    of an array's first axis: llama's q/k rows are stored interleaved), or None for a type they do not cover or
    blocks that do not dequantize exactly to `gguf.quants.dequantize`'s numbers."""
    return checked_blocks(raw, qtype, rows, order)[0]


def checked_blocks(raw: np.ndarray, qtype: Type, rows: int, order=lambda x: x,
                   every_row: bool = False) -> tuple[KernelBlocks | None, np.ndarray | None]:
    """kernel_blocks's answer, and where it is None the tensor as `gguf.quants.dequantize` gives it ([rows, K]
    float32, in `order`; else None: the blocks' own dequantize() is those numbers). The check compares CHECKED_ROWS
    of the rows, or `every_row`."""
    raw = np.ascontiguousarray(raw)
    codes = raw.view(np.uint8).reshape(rows, -1)
    if qtype in INT4_TYPES:
        blocks = _int4_blocks(codes, qtype, rows)
    elif qtype in INT5_TYPES:
        blocks = _int5_blocks(codes, rows)
    elif qtype == Type.Q8_0:
        blocks = Q8Blocks(codes.reshape(rows, -1, 34).copy())
    elif qtype == Type.Q5_0:
        blocks = Q5Blocks(codes.reshape(rows, -1, 22).copy())
    elif qtype in SUPER_BLOCK_TYPES:
        blocks = SuperBlocks(qtype.name.lower(), codes.reshape(rows, -1, GGML_QUANT_SIZES[qtype][1]).copy())
    else:
        blocks = None
    if blocks is not None:
        blocks = blocks.rows_reordered(order)
        checked = np.arange(rows) if every_row else checked_rows(rows)
        source = order(np.arange(rows))[checked]  # the file's row of each of ours
        ours = _dequantized(blocks.rows_reordered(lambda a: a[checked]))
        if np.array_equal(ours, _reference(codes[source], qtype)):
            return blocks, None
    return None, order(_reference(raw, qtype).reshape(rows, -1))


def checked_rows(rows: int) -> np.ndarray:
    """The rows of `rows` the load compares: all of a tensor of up to CHECKED_ROWS, else CHECKED_ROWS spread evenly
    from the first to the last."""
    return np.unique(np.linspace(0, rows - 1, min(rows, CHECKED_ROWS)).round().astype(np.int64))


def _reference(raw: np.ndarray, qtype: Type) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return quants.dequantize(raw, qtype).astype(np.float32, copy=False)


def _dequantized(blocks: KernelBlocks) -> np.ndarray:
    """Our numbers of `blocks`: the CPU ops' own reading of a file's blocks kept as they are, where the ops are built
    (tens of times faster than the references, which stand in elsewhere and for the repacked int4, int5 blocks)."""
    if cpu_ops.available() and isinstance(blocks, (Q8Blocks, Q5Blocks, SuperBlocks)):
        return cpu_ops.dequantize_blocks(blocks.kind, torch.from_numpy(np.ascontiguousarray(blocks.blocks))).numpy()
    with np.errstate(invalid="ignore", over="ignore"):
        return blocks.dequantize()


def quantization_type(qtype: Type, width: int) -> Type:
    """The type a tensor of `width` inputs is quantized to for `qtype`: llama-quantize's fallback where a K-quant's
    super-blocks of 256 do not fit (Q4_K → Q5_0)."""
    return Type.Q5_0 if qtype == Type.Q4_K and width % SUPER_BLOCK else qtype


def quantized_blocks(weight: np.ndarray, qtype: Type) -> Int4Blocks | Q8Blocks | Q5Blocks | SuperBlocks:
    """[rows, K] float32 weights quantized to `qtype` (Q8_0, Q4_0, Q4_1, Q5_0 or Q4_K) by llama.cpp's reference
    quantizer (`gguf.quants.quantize` mirrors its quantize_row_*_ref; tritonllm/k_quants.py its Q4_K), as the
    kernels' blocks: those bytes read as a file's are, with the same check that they dequantize to exactly
    `gguf.quants.dequantize`'s numbers."""
    rows, width = weight.shape
    size = SUPER_BLOCK if qtype == Type.Q4_K else BLOCK
    if width % size:
        raise ValueError(f"{width} inputs are not whole blocks of {size}")
    weight = np.ascontiguousarray(weight, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):  # weights that are not finite fail the check below
        raw = quantize_q4_k(weight) if qtype == Type.Q4_K else quants.quantize(weight, qtype)
    blocks, _ = checked_blocks(raw, qtype, rows, every_row=True)  # the quantizer costs more than its check
    if blocks is None:
        raise ValueError(f"its {qtype.name} blocks do not dequantize exactly (weights that are not finite?)")
    return blocks
