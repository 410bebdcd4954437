"""The model's projections and LM head in a weight format, and choosing the format by measurement.

On a CPU the matmuls are most of a step, and which format is fastest depends on the machine: fp32 through
oneDNN (prepacked) beats MKL's small-batch sgemm on some CPUs; fbgemm's fp16-weight kernels halve the bytes
read on any AVX2 CPU; the CPU ops' int4 kernel (tritonllm/kernels/cpu) reads the GGUF's own 4-bit blocks, a third of
fp16's bytes, and dequantizes them in registers (memory-bound one token at a time with AVX-512, compute-bound
with AVX2 only); bf16 weights and activations, and torch's int4 weight-only kernel, are fast only on CPUs with
bf16 hardware (AVX512-BF16, AMX) and much slower without it. `choose_format` times the candidates on the
model itself at load (decode steps in each format) and keeps the fastest one that is exact or near-exact for the
checkpoint:

| format | weights | activations | numerics | auto may pick it |
|---|---|---|---|---|
| float32 | fp32 (MKL, or prepacked for oneDNN) | fp32 | exact | yes |
| float16 | fp16, prepacked for fbgemm | fp32 | weights rounded to fp16 (11-bit mantissa), fp32 accumulation | yes |
| int4 | the GGUF's own blocks: Q4_0, Q4_1 as int4 blocks (scale d, zero m per 32 weights, fp32), Q5_1 as int5 blocks (likewise), Q8_0, Q5_0, Q4_K, Q5_K and Q6_K as they are (the LM head's too); the CPU ops' kernels with fp32 activations, torch's (int4 blocks) with bf16; a projection of another type (or of mixed types) as float16 with fp32 activations, bf16 with bf16 | fp32 (auto), or bf16 | fp32: exactly the file's weights where they keep their blocks, else rounded to fp16; bf16: activations and d, m rounded to bf16 | with fp32 activations |
| int4-q8 | the same blocks, repacked in groups of 16 rows for the CPU ops' integer kernels (Q5_0 as d·q − 16d, Q5_1 and Q5_K as int5 blocks, their d, m rounded to fp16: Q5_K's d·sc may not be one; Q4_K's and Q6_K's codes and d·sc exactly, 4.625 and 7 bits a weight) | each token's inputs per block of 32 to two levels of int8 codes, x ≈ dx·(q1 + q2/256) (q1 llama.cpp's Q8_1), exact integer sums per block (Q6_K: per 16) | near-exact: inputs within absmax/32,500, the fp16 rounding of Q5_K's d·sc; logits closer to float32's than float16's | yes: a GGUF read as its blocks alone (untimed: it beats int4 at 1 and 32 streams on AVX2, AVX-512 and VNNI), else timed |
| bfloat16 | bf16 | bf16 | weights and activations rounded to bf16 (8-bit mantissa) | only with dtype=bfloat16 |
| int8 | per-output-channel int8 (a quantization of the checkpoint) | int8 per token (one absmax scale per token), exact int32 accumulation | lossy | no: only when asked for |

auto considers only what keeps float32's greedy output on the accuracy test set (tests/test_weight_formats.py).
With int4 the LM head (or the tied embedding) runs on the GGUF's blocks of it through the CPU ops where the
kernels cover its type (a Q4_K_M file's Q6_K head, a Q8_0 one; an older conversion's Q8_0 head is found by
re-blocking the weight and checking it comes back to the bit), else as float16 (fp32 activations) or bf16 (bf16
activations); int4-q8 runs a Q8_0 or Q6_K head with int8 activations too; with float16 and int8 it is in the same format
as the projections. A fused projection whose parts differ in kind (a Q4_K_M qkv: q, k Q4_K, v Q6_K) runs part by
part. Every format computes each token's row on its own (per-token
quantization, no batch-wide scales), so a request's output does not depend on what it is batched with."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tritonllm.engine.config import WEIGHT_FORMATS
from tritonllm.engine.layers.row_dtype import activation_levels, matmul_dtype
from tritonllm.kernels import cpu as cpu_ops
from tritonllm.kernels.cpu import super_blocks

log = logging.getLogger(__name__)

INT4_GROUP = 32  # Q4_1's block size, and the int4 kernel's group
BLOCK_FORMATS = ("int4", "int4-q8")  # the formats that serve a GGUF's own blocks
FBGEMM_ROW_GROUP = 4  # float16: every row through the same fbgemm kernel (with 1-2 rows AVX2 sums differently)


def _cpu_flags() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


# oneDNN's ISA caps (ONEDNN_MAX_CPU_ISA) under which its bf16 matmuls run on bf16 hardware
_ONEDNN_BF16_ISAS = ("ALL", "DEFAULT", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX",
                     "AVX512_CORE_AMX_FP16", "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512",
                     "AVX10_2_512_AMX_2")


def cpu_has_bf16() -> bool:
    """Whether this process computes in bf16 natively: the CPU has it and oneDNN is not capped below it (as
    bench/peers.py --isa avx2 caps it); otherwise bf16 matmuls are emulated, several times slower."""
    flags = _cpu_flags()
    uncapped = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper() in _ONEDNN_BF16_ISAS
    return uncapped and ("avx512_bf16" in flags or "amx_bf16" in flags)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


# the overload, resolved once (not per call)
_onednn_linear = torch.ops.mkldnn._linear_pointwise.default if onednn_available() else None


def _fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


@dataclass(frozen=True)
class ScaleMinWeight:
    """A projection's weights as blocks along the input dimension: w = d · q + m per 32 inputs
    (tritonllm/gguf_blocks.py makes them from a GGUF's blocks, exactly)."""

    q: torch.Tensor  # [out, in] uint8 codes
    d: torch.Tensor  # [out, in / 32] float32
    m: torch.Tensor  # [out, in / 32] float32

    @classmethod
    def concat(cls, parts: list["ScaleMinWeight"]) -> "ScaleMinWeight":
        """Fused projections (qkv, gate_up) concatenate their parts' output rows."""
        return cls(*(torch.cat([getattr(p, name) for p in parts]) for name in ("q", "d", "m")))

    def dequantize(self) -> torch.Tensor:
        """[out, in] float32: d · q, then + m, each rounded (gguf_blocks's numbers, checked against the file's)."""
        return self.d.repeat_interleave(INT4_GROUP, 1) * self.q.float() + self.m.repeat_interleave(INT4_GROUP, 1)

    def rows(self, index: torch.Tensor) -> "ScaleMinWeight":
        return type(self)(self.q[index], self.d[index], self.m[index])

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)


class Q4Weight(ScaleMinWeight):
    """int4: codes in 0..15 (a GGUF's Q4_0, Q4_1 and Q4_K blocks)."""


class Int5Weight(ScaleMinWeight):
    """int5: codes in 0..31 (a GGUF's Q5_1 blocks; its Q5_0 and Q5_K ones for the integer kernels)."""


@dataclass(frozen=True)
class Q8Weight:
    """A projection's weights as a GGUF's Q8_0 blocks: [out, in / 32, 34] uint8 (fp16 d, 32 int8 codes)."""

    blocks: torch.Tensor

    @staticmethod
    def concat(parts: list["Q8Weight"]) -> "Q8Weight":
        return Q8Weight(torch.cat([p.blocks for p in parts]))

    def dequantize(self) -> torch.Tensor:
        d = self.blocks[..., :2].contiguous().view(torch.float16).float()
        return (self.blocks[..., 2:].contiguous().view(torch.int8).float() * d).flatten(1)

    def rows(self, index: torch.Tensor) -> "Q8Weight":
        return Q8Weight(self.blocks[index])

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.blocks.shape[1] * INT4_GROUP


@dataclass(frozen=True)
class Q5Weight:
    """A projection's weights as a GGUF's Q5_0 blocks: [out, in / 32, 22] uint8 (fp16 d, 32 fifth bits, 16 bytes of
    nibbles: w = d · (q − 16)), as the file stores them."""

    blocks: torch.Tensor

    @staticmethod
    def concat(parts: list["Q5Weight"]) -> "Q5Weight":
        return Q5Weight(torch.cat([p.blocks for p in parts]))

    def as_q8(self) -> Q8Weight:
        """The same numbers as Q8_0 blocks."""
        return Q8Weight(cpu_ops.pack_q5_as_q8(self.blocks))

    def as_int5(self) -> Int5Weight:
        """The same numbers as int5 blocks, d · q + m with m = −16 d (exact), for the integer kernels."""
        d = self.blocks[..., :2].contiguous().view(torch.float16).float()[..., 0]
        codes = self.as_q8().blocks[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 16
        return Int5Weight(codes.to(torch.uint8).flatten(1), d, -16 * d)

    def dequantize(self) -> torch.Tensor:
        return self.as_q8().dequantize()

    def rows(self, index: torch.Tensor) -> "Q5Weight":
        return Q5Weight(self.blocks[index])

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.blocks.shape[1] * INT4_GROUP


@dataclass(frozen=True)
class SuperBlockWeight:
    """A projection's weights as a GGUF's Q4_K, Q5_K or Q6_K super-blocks [out, in / 256, bytes] uint8, as the file
    stores them (kernels/cpu/super_blocks.py: their layouts)."""

    kind: str  # q4_k, q5_k, q6_k
    blocks: torch.Tensor

    @staticmethod
    def concat(parts: list["SuperBlockWeight"]) -> "SuperBlockWeight":
        assert len({p.kind for p in parts}) == 1
        return SuperBlockWeight(parts[0].kind, torch.cat([p.blocks for p in parts]))

    def as_q4(self) -> Q4Weight:
        """Q4_K's blocks of 32 as int4 blocks, the same numbers (for the kernels that take only those)."""
        assert self.kind == "q4_k"
        return Q4Weight(*super_blocks.q4_k_scale_min(self.blocks))

    def as_int5(self) -> Int5Weight:
        """Q5_K's blocks of 32 as int5 blocks, the same numbers (for the integer kernels)."""
        assert self.kind == "q5_k"
        return Int5Weight(*super_blocks.q5_k_scale_min(self.blocks))

    def dequantize(self) -> torch.Tensor:
        return super_blocks.DEQUANTIZE[self.kind](self.blocks)

    def rows(self, index: torch.Tensor) -> "SuperBlockWeight":
        return SuperBlockWeight(self.kind, self.blocks[index])

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.blocks.shape[1] * super_blocks.SUPER_BLOCK


SUPER_BLOCK_MATMUL = {"q4_k": cpu_ops.q4_k_matmul, "q5_k": cpu_ops.q5_k_matmul, "q6_k": cpu_ops.q6_k_matmul}


BlockWeight = Q4Weight | Int5Weight | Q8Weight | Q5Weight | SuperBlockWeight


@dataclass(frozen=True)
class MixedWeight:
    """A fused projection whose parts (runs of output rows) have blocks of different kinds, or some none."""

    parts: tuple[BlockWeight | None, ...]
    rows: tuple[int, ...]  # each part's output rows

    def dequantize(self) -> torch.Tensor:
        """Only for parts that all have blocks."""
        return torch.cat([part.dequantize() for part in self.parts])


class Projection(nn.Module):
    """y = x @ W.T (+ bias) for one weight format and kernel; replaces an nn.Linear after loading. With
    prefill_dtype=bfloat16 prompt rows (engine/layers/row_dtype.py) run on the CPU's bf16 matrix units: straight
    from the GGUF's blocks where the projection is such blocks (the CPU ops' block_matmul_bf16: AMX tiles or
    AVX512-BF16 dot products), else on bf16 weights prepacked for oneDNN, a copy. Either computes each row alike whatever the batch's size."""

    def __init__(self, bias: torch.Tensor | None):
        super().__init__()
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.prompt_weight: torch.Tensor | None = None
        self.prompt_parts: list[tuple[str, torch.Tensor, int]] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [tokens, in]
        if matmul_dtype() != torch.bfloat16:
            out = self.matmul(x)
        elif self.prompt_parts is not None:
            out = cpu_ops.block_matmul_bf16(x, self.prompt_parts)
        elif self.prompt_weight is not None:
            out = _onednn_linear(x.to(torch.bfloat16), self.prompt_weight, None, "none", [], "").to(x.dtype)
        else:
            out = self.matmul(x)
        return out if self.bias is None else out + self.bias

    def run_prompts_in_bf16(self, weight: Callable[[], torch.Tensor]) -> None:
        """Prompt rows on the blocks (block_matmul_bf16), else on the [out, in] weights `weight()` gives, rounded to bf16."""
        parts = self.plain_block_parts()
        if parts is not None and cpu_ops.has_bf16_ops() and all(rows % 16 == 0 for _, _, rows in parts):
            self.prompt_parts = parts
        else:
            self.prompt_weight = torch.ops.mkldnn._reorder_linear_weight(weight().to(torch.bfloat16), 1)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def plain_block_parts(self) -> list[tuple[str, torch.Tensor, int]] | None:
        """The projection's weights as blocks block_matmul_bf16 reads (those of the fp32-activation kernels, or the
        int8-activation ones' row groups): (kind of blocks, blocks, output rows) per run of rows; None for one
        without such blocks."""
        return None

    def block_parts(self) -> list[tuple[str, torch.Tensor, int]] | None:
        """The projection as the CPU ops' llama_forward reads it (it adds no bias)."""
        return None if self.bias is not None else self.plain_block_parts()


class DenseProjection(Projection):
    """fp32 or bf16 weights through aten (MKL on the CPU, cuBLAS on CUDA)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(bias)
        self.weight = nn.Parameter(weight, requires_grad=False)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class OneDNNProjection(Projection):
    """fp32 or bf16 weights prepacked into oneDNN's blocked layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(bias)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return _onednn_linear(x, self.packed, None, "none", [], "")


class Float16Projection(Projection):
    """fp16 weights prepacked for fbgemm, fp32 activations and accumulation. The rows go in whole groups of
    FBGEMM_ROW_GROUP (zeros after the last): fbgemm's AVX2 kernels for a block of one or two rows sum in another order
    than the others, so a token's row would change with the batch's size."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(bias)
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.float(), None)
        self.linear = torch.ops.quantized.linear_dynamic_fp16.default

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if padding := -rows % FBGEMM_ROW_GROUP:
            x = torch.cat([x, x.new_zeros(padding, x.shape[1])])
        return self.linear(x, self.packed)[:rows]


class Int8Projection(Projection):
    """int8 weights with one scale per output channel; each token's activations quantized to int8 with its own
    absmax scale; int8 x int8 products summed exactly in int32, then scaled back to fp32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(bias)
        scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
        self.weight_t = (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8).t().contiguous()
        self.scales = scales.float()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        token_scales = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        quantized = (x / token_scales).round_().to(torch.int8)
        return torch._int_mm(quantized, self.weight_t).float().mul_(token_scales).mul_(self.scales)


class Int4Projection(Projection):
    """int4 blocks in torch's int4 CPU layout: w = (q − 8) · d + (m + 8d) per group of 32 inputs (fast with bf16
    activations on bf16 hardware)."""

    def __init__(self, weight: Q4Weight, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__(bias)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.q.to(torch.int32), 2)
        d, m = weight.d.float(), weight.m.float()
        self.scales_and_zeros = torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1).contiguous().to(dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scales_and_zeros)


class Q4Projection(Projection):
    """int4 blocks as they are: the CPU ops' kernel dequantizes w = d · q + m per block in
    registers and multiplies in fp32 (6 bits a weight with the scales widened to fp32), or, with int8 activations,
    sums each block's products of codes in integers over the blocks repacked in groups of rows (q4_q8_matmul; 5
    bits a weight)."""

    def __init__(self, weight: Q4Weight, bias: torch.Tensor | None, int8_activations: bool):
        super().__init__(bias)
        self.rows = weight.q.shape[0]
        self.int8_activations = int8_activations
        self.packed = (cpu_ops.pack_q4_rows if int8_activations else cpu_ops.pack_q4)(weight.q, weight.d, weight.m)

    def plain_block_parts(self) -> list[tuple[str, torch.Tensor, int]] | None:
        return [("int4_groups" if self.int8_activations else "int4", self.packed, self.rows)]

    def block_parts(self) -> list[tuple[str, torch.Tensor, int]] | None:  # (int8 activations: the groups of rows)
        return None if self.bias is not None else [("int4", self.packed, self.rows)]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_activations:
            return cpu_ops.q4_q8_matmul(x, self.packed, self.rows, activation_levels())
        return cpu_ops.q4_matmul(x, self.packed)


class Int5Projection(Projection):
    """int5 blocks (a GGUF's Q5_1; with int8 activations its Q5_0 and Q5_K too): the CPU ops' kernel dequantizes
    w = d · q + m per block in registers and multiplies in fp32 (7 bits a weight with the scales widened to fp32),
    or sums each block's products of codes in integers over the blocks repacked in groups of rows (q5_q8_matmul; 6
    bits a weight)."""

    def __init__(self, weight: Int5Weight, bias: torch.Tensor | None, int8_activations: bool):
        super().__init__(bias)
        self.rows = weight.q.shape[0]
        self.int8_activations = int8_activations
        self.packed = (cpu_ops.pack_q5_rows if int8_activations else cpu_ops.pack_q5_1)(weight.q, weight.d, weight.m)

    def plain_block_parts(self) -> list[tuple[str, torch.Tensor, int]] | None:
        return [("int5_groups" if self.int8_activations else "int5", self.packed, self.rows)]

    def block_parts(self) -> list[tuple[str, torch.Tensor, int]] | None:  # (int8 activations: the groups of rows)
        return None if self.bias is not None else [("int5", self.packed, self.rows)]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_activations:
            return cpu_ops.q5_q8_matmul(x, self.packed, self.rows, activation_levels())
        return cpu_ops.q5_1_matmul(x, self.packed)


class Q8Projection(Projection):
    """Q8_0 weights as blocks (8.5 bits a weight with their scales): the CPU ops' kernel dequantizes w = d · q per
    block in registers and multiplies in fp32, or sums codes in integers with int8 activations (over the blocks
    repacked in groups of rows)."""

    def __init__(self, blocks: torch.Tensor, bias: torch.Tensor | None, int8_activations: bool):
        super().__init__(bias)
        self.rows = blocks.shape[0]
        self.int8_activations = int8_activations
        self.packed = cpu_ops.pack_q8_rows(blocks) if int8_activations else blocks

    def plain_block_parts(self) -> list[tuple[str, torch.Tensor, int]] | None:
        return [("q8_0_groups" if self.int8_activations else "q8_0", self.packed, self.rows)]

    def block_parts(self) -> list[tuple[str, torch.Tensor, int]] | None:  # (int8 activations: the groups of rows)
        return None if self.bias is not None else [("q8_0", self.packed, self.rows)]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_activations:
            return cpu_ops.q8_q8_matmul(x, self.packed, self.rows, activation_levels())
        return cpu_ops.q8_matmul(x, self.packed)


class Q5Projection(Projection):
    """Q5_0 weights as the GGUF stores them (5.5 bits a weight): the CPU ops' kernel dequantizes w = d · (q − 16) per
    block in registers and multiplies in fp32 (the same products, in the same order, as the Q8_0 kernel over the
    same numbers as Q8_0 blocks: the same bits, a third fewer bytes read)."""

    def __init__(self, blocks: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(bias)
        self.blocks = blocks.contiguous()

    def plain_block_parts(self) -> list[tuple[str, torch.Tensor, int]] | None:
        return [("q5_0", self.blocks, self.blocks.shape[0])]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_ops.q5_matmul(x, self.blocks)


# K-quants with int8 activations: their super-blocks repacked in groups of rows, and the op over them
SUPER_BLOCK_ROWS = {"q4_k": (cpu_ops.pack_q4_k_rows, cpu_ops.q4_k_q8_matmul),
                    "q6_k": (cpu_ops.pack_q6_k_rows, cpu_ops.q6_q8_matmul)}


class SuperBlockRowsProjection(Projection):
    """Q4_K or Q6_K weights with int8 activations: the super-blocks repacked in groups of rows (pack_q4_k_rows: 4.625
    bits a weight; pack_q6_k_rows: 7), their scales d' exact, each block's (Q6_K: each 16's) products of codes summed
    in integers (q4_k_q8_matmul, q6_q8_matmul)."""

    def __init__(self, weight: SuperBlockWeight, bias: torch.Tensor | None):
        super().__init__(bias)
        self.kind, self.rows = weight.kind, weight.blocks.shape[0]
        pack, self.op = SUPER_BLOCK_ROWS[weight.kind]
        self.packed = pack(weight.blocks)

    def plain_block_parts(self) -> list[tuple[str, torch.Tensor, int]] | None:
        return [(f"{self.kind}_groups", self.packed, self.rows)]

    def block_parts(self) -> list[tuple[str, torch.Tensor, int]] | None:  # (int8 activations: the groups of rows)
        return None if self.bias is not None else [(self.kind, self.packed, self.rows)]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.packed, self.rows, activation_levels())


class SuperBlockProjection(Projection):
    """Q4_K, Q5_K or Q6_K weights as the GGUF stores them (4.5, 5.5 and 6.56 bits a weight): the CPU ops' kernel
    decodes a super-block's scales once per row, dequantizes its blocks in registers and multiplies in fp32."""

    def __init__(self, weight: SuperBlockWeight, bias: torch.Tensor | None):
        super().__init__(bias)
        self.kind, self.blocks = weight.kind, weight.blocks.contiguous()

    def plain_block_parts(self) -> list[tuple[str, torch.Tensor, int]] | None:
        return [(self.kind, self.blocks, self.blocks.shape[0])]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return SUPER_BLOCK_MATMUL[self.kind](x, self.blocks)


class PartsProjection(Projection):
    """A fused projection run part by part, each in its own kernel, their outputs side by side."""

    def __init__(self, parts: list[Projection]):
        super().__init__(None)
        self.parts = nn.ModuleList(parts)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def plain_block_parts(self) -> list[tuple[str, torch.Tensor, int]] | None:
        return _joined([part.plain_block_parts() for part in self.parts])

    def block_parts(self) -> list[tuple[str, torch.Tensor, int]] | None:
        return _joined([part.block_parts() for part in self.parts])


def _joined(parts: list[list | None]) -> list | None:
    """Parts' lists one after another; None where one has none."""
    return None if any(p is None for p in parts) else [entry for p in parts for entry in p]


@dataclass(frozen=True)
class Choice:
    """A weight format, the activation dtype it runs with, and its kernel."""

    weight_format: str
    dtype: torch.dtype
    kernel: str  # aten, onednn, fbgemm (float16), int8, int4 (torch's), cpu_ops (int4 and int4-q8, tritonllm/kernels/cpu)

    @property
    def blocks(self) -> bool:
        """Whether the projections are the GGUF's own blocks (where it has blocks the kernels run)."""
        return self.weight_format in BLOCK_FORMATS

    @property
    def int8_activations(self) -> bool:
        return self.weight_format == "int4-q8"

    @property
    def runs_blocks_alone(self) -> bool:
        """Whether a weight with blocks needs no dense copy (the CPU ops run every kind of block)."""
        return self.blocks and self.kernel == "cpu_ops"

    def make(self, weight: torch.Tensor, bias: torch.Tensor | None,
             blocks: BlockWeight | MixedWeight | None = None) -> Projection:
        """A projection of fp32 `weight` (or of its GGUF blocks, for int4 and int4-q8: without blocks a kernel
        runs, as float16 or bf16, the head's way)."""
        if isinstance(blocks, MixedWeight) and self.blocks:
            biases = [None] * len(blocks.rows) if bias is None else bias.split(blocks.rows)
            return PartsProjection([self.make(part_weight, part_bias, part) for part_weight, part_bias, part
                                    in zip(weight.split(blocks.rows), biases, blocks.parts)])
        if isinstance(blocks, SuperBlockWeight) and blocks.kind == "q4_k" and self.kernel == "int4":
            blocks = blocks.as_q4()
        if self.int8_activations and (isinstance(blocks, Q5Weight)
                                      or isinstance(blocks, SuperBlockWeight) and blocks.kind == "q5_k"):
            blocks = blocks.as_int5()
        if self.blocks and not (isinstance(blocks, Q4Weight) or self.kernel == "cpu_ops" and blocks is not None):
            return self._dense_beside_blocks(weight, bias)
        bias = None if bias is None else bias.to(self.dtype)
        if self.kernel == "int4":
            return Int4Projection(blocks, bias, self.dtype)
        if isinstance(blocks, Q8Weight):
            return Q8Projection(blocks.blocks, bias, self.int8_activations)
        if isinstance(blocks, Q5Weight):
            return Q5Projection(blocks.blocks, bias)
        if isinstance(blocks, SuperBlockWeight) and blocks.kind in SUPER_BLOCK_ROWS and self.int8_activations:
            return SuperBlockRowsProjection(blocks, bias)
        if isinstance(blocks, SuperBlockWeight):
            return SuperBlockProjection(blocks, bias)
        if isinstance(blocks, Int5Weight):
            return Int5Projection(blocks, bias, self.int8_activations)
        if self.kernel == "cpu_ops":
            return Q4Projection(blocks, bias, self.int8_activations)
        if self.kernel == "int8":
            return Int8Projection(weight, bias)
        if self.kernel == "fbgemm":
            return Float16Projection(weight, bias)
        weight = weight.to(self.dtype)
        return OneDNNProjection(weight, bias) if self.kernel == "onednn" else DenseProjection(weight, bias)

    def make_head(self, weight: torch.Tensor, blocks: BlockWeight | None = None) -> Projection:
        """The LM head: with the CPU ops, the GGUF's own blocks of it (or of the tied embedding) where it has some,
        else its Q8_0 blocks where the weight is exactly those (half fp16's bytes, and exact); otherwise near-exact:
        fp16 weights with fp32 activations, bf16 with bf16 activations."""
        if self.kernel == "cpu_ops" and blocks is not None:
            return self.make(weight, None, blocks)
        if self.kernel == "cpu_ops" and (packed := cpu_ops.pack_q8_exact(weight)) is not None:
            return Q8Projection(packed, None, self.int8_activations)
        if self.blocks:
            return self._dense_beside_blocks(weight, None)
        return self.make(weight, None)

    def _dense_beside_blocks(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Projection:
        """A weight the block formats have no blocks for: fp16 weights with fp32 activations (near-exact), bf16
        with bf16 activations."""
        if self.dtype == torch.float32 and _fbgemm_available():
            return Choice("float16", self.dtype, "fbgemm").make(weight, bias)
        if onednn_available():
            try:
                return Choice("bfloat16", self.dtype, "onednn").make(weight, bias)
            except RuntimeError:  # oneDNN's bf16 path needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT
                log.info("oneDNN has no bf16 kernel for this CPU: a weight without blocks runs through aten")
        return Choice("bfloat16", self.dtype, "aten").make(weight, bias)

    def describe(self) -> str:
        activations = {"int8": "int8 per token", "int4-q8": "two-level int8 per block of 32"}.get(
            self.weight_format, str(self.dtype).removeprefix("torch."))
        return f"{self.weight_format} ({self.kernel} kernel, {activations} activations)"


def candidates(requested: str, dtype: torch.dtype | None, has_blocks: bool, blocks_alone: bool = False
               ) -> list[Choice]:
    """What `requested` may run as on the CPU; `dtype` None lets the format choose the activations.

    auto considers only what keeps float32's greedy output (the table above): fp32 activations with fp32 or fp16
    weights, or with the GGUF's own blocks (has_blocks: the checkpoint has some the kernels run). bf16 activations
    (bfloat16; int4 on bf16 hardware without the CPU ops) change some greedy continuations: they run when asked for,
    by weight_format or by dtype=bfloat16 (then auto times those). A GGUF read as its blocks alone (blocks_alone:
    no dense copy of them was made) runs on them through the CPU ops where they are built, untimed: the file's own
    numbers, exactly, and no dense copy to time the others on (an HF checkpoint quantized at load likewise)."""
    if requested not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight_format {requested!r} (choose from {', '.join(WEIGHT_FORMATS)})")
    if requested == "auto" and blocks_alone and (dtype or torch.float32) == torch.float32 and cpu_ops.available():
        return [Choice("int4-q8", torch.float32, "cpu_ops")]
    if requested == "auto":
        act = dtype or torch.float32
        integer = ["int4-q8"] if act == torch.float32 and cpu_ops.available() else []
        formats = (["float32"] + (["float16"] if _fbgemm_available() else []) if act == torch.float32
                   else ["bfloat16"]) + (["int4", *integer] if has_blocks else [])
    else:
        formats = [requested]
        if requested in BLOCK_FORMATS and not has_blocks:
            raise ValueError(f"weight_format {requested} serves a GGUF's own blocks; this model has none the kernels "
                             "run (it was not read from a llama or qwen3 GGUF with projections of a type they "
                             "run, README's GGUF types, nor quantized at load from an HF checkpoint: set "
                             "quantization)")
        if requested == "int4-q8" and not cpu_ops.available():
            raise ValueError("weight_format int4-q8 runs on the CPU ops, which could not be built here (no C "
                             "compiler, or TRITONLLM_CPU_OPS=0)")
        # int4: fp32 through the CPU ops (exact, and faster than torch's bf16 kernel where both run), else bf16
        # activations where the CPU computes them natively
        int4_native = torch.float32 if cpu_ops.available() or not cpu_has_bf16() else torch.bfloat16
        native = {"bfloat16": torch.bfloat16, "int4": int4_native}.get(requested, torch.float32)
        act = dtype or native
        if act != native and requested != "int4":  # int4 runs with either
            raise ValueError(f"weight_format {requested} needs {native} activations, not dtype {dtype}")
    choices = []
    for weight_format in formats:
        if weight_format == "int4-q8" or weight_format == "int4" and act == torch.float32 and cpu_ops.available():
            kernels = ["cpu_ops"]  # torch's fp32-activation int4 kernel is many times slower
        elif weight_format in ("int8", "int4"):
            kernels = [weight_format]
        elif weight_format == "float16":
            kernels = ["fbgemm"]
        else:
            kernels = ["aten"] + (["onednn"] if onednn_available() else [])
        choices += [Choice(weight_format, act, kernel) for kernel in kernels]
    return choices


def choose_format(options: list[Choice], step_seconds: Callable[[Choice], float]) -> Choice:
    """The option whose model steps fastest (`step_seconds`: decode steps of the whole model in that format, so
    what a format saves outside the matmuls counts too), logged with the figures. One option is not timed."""
    if len(options) == 1:
        return options[0]
    timings = {}
    for option in options:
        try:
            timings[option] = step_seconds(option)
        except RuntimeError as error:  # e.g. a oneDNN kernel this CPU lacks
            log.info("weight format %s unavailable here: %s", option.describe(), error)
    best = min(timings, key=timings.get)
    log.info("weight formats timed (decode steps of 1 and 16 tokens): %s → %s",
             ", ".join(f"{o.describe()} {t * 1e3:.1f} ms" for o, t in timings.items()), best.describe())
    return best


def fastest_run(run: Callable[[], object]) -> float:
    """Seconds of the fastest of five runs after a warm-up (oneDNN and the int kernels set themselves up on first
    use): what another process on the cores adds is noise, not cost."""
    run()
    timings = []
    for _ in range(5):
        started = time.perf_counter()
        run()
        timings.append(time.perf_counter() - started)
    return min(timings)
