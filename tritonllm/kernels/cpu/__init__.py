"""The CPU's fused ops (the C files of this folder, declared in cpu_ops.h), built for this machine on first use and called through ctypes.

One step of a small model on a CPU is hundreds of small torch ops (each a dispatch and an OpenMP fork), and the
int4 weights have no fast fp32-activation kernel in torch. These ops do the same work in a few calls per layer
(`llama_forward`: one call for a whole step's layers), and `q4_matmul` reads the checkpoint's own 4-bit weights (5
bits per weight with their scales, against 16 for fp16). `load(directory)` compiles the library with
`-march=native` (so it suits exactly the CPU it runs on; `TRITONLLM_CPU_MARCH` names another target, e.g.
x86-64-v3 for AVX2 code on an AVX-512 CPU) into that directory, keyed by the source, the flags and the CPU's
feature flags, and loads it; until then, without a C compiler, or with TRITONLLM_CPU_OPS=0, the engine's
ops run the torch references. ctypes releases the GIL during each call; the OpenMP runtime is torch's own (the
library links libgomp.so.1, which torch has already loaded), so the process keeps one thread team."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from tritonllm.kernels.cpu.super_blocks import (Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, SUPER_BLOCK, q4_k_scale_min,
                                                q6_k_codes, q6_k_scales, six_bit_scales)
from tritonllm.kernels.decode_attention import paged_decode_attention_reference
from tritonllm.kernels.kv_cache import store_kv_cache_reference
from tritonllm.kernels.prefill_attention import prefill_attention_reference
from tritonllm.kernels.rotary import rotary_embedding_reference

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent  # *.c (one concept each) and their headers, built into one library
MARCH = os.environ.get("TRITONLLM_CPU_MARCH", "native")
# avoid-fma-max-bits=0: GCC's Zen tunings (-march=native on AMD Zen 3) split some multiply-add chains into a multiply
# and an add, and not every tile alike: a token's sums then rounded differently in a batch than alone
FLAGS = ["-O3", f"-march={MARCH}", "--param=avoid-fma-max-bits=0", "-mprefer-vector-width=512", "-fopenmp",
         "-shared", "-fPIC", "-std=gnu11"]
QUANT_BLOCK = 32  # as in quant_matmul.c
# blocks.h's bytes a block of 32 inputs (per row; its row groups' per group of GROUP_ROWS rows), and
# a K-quant super-block's of SUPER_BLOCK (super_blocks.py)
Q4_BYTES, Q5_1_BYTES, Q8_BYTES, Q5_BYTES = 24, 28, 34, 22
Q4_GROUP_BYTES, Q5_GROUP_BYTES, Q8_GROUP_BYTES, Q6_GROUP_BYTES = 4 * 64 + 64, 5 * 64 + 64, 8 * 64 + 32, 6 * 64 + 64
Q4_K_GROUP_BYTES = 8 * 4 * 64 + 2 * 8 * 16 + 64  # per super-block of 256 inputs
X86_MACHINES = ("x86_64", "AMD64")  # the C ops are written with x86 intrinsics

_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES = {
    "q4_matmul": [_p, _i64, _i64, _p, _i64, _p],
    "q5_1_matmul": [_p, _i64, _i64, _p, _i64, _p],
    "q8_matmul": [_p, _i64, _i64, _p, _i64, _p],
    "q5_matmul": [_p, _i64, _i64, _p, _i64, _p],
    "q4_k_matmul": [_p, _i64, _i64, _p, _i64, _p],
    "q5_k_matmul": [_p, _i64, _i64, _p, _i64, _p],
    "q6_k_matmul": [_p, _i64, _i64, _p, _i64, _p],
    "dequantize_blocks": [_i64, _p, _i64, _i64, _p],
    "q4_q8_matmul": [_p, _i64, _i64, _p, _i64, _p, _i64],
    "q8_q8_matmul": [_p, _i64, _i64, _p, _i64, _p, _i64],
    "q6_q8_matmul": [_p, _i64, _i64, _p, _i64, _p, _i64],
    "q5_q8_matmul": [_p, _i64, _i64, _p, _i64, _p, _i64],
    "q4_k_q8_matmul": [_p, _i64, _i64, _p, _i64, _p, _i64],
    "paged_decode_attention": [_p, _i64, _i64, _i64, _i64, _p, _p, _i64, _i64, _p, _i64, _p, _i64, _f32, _p, _i64],
    "paged_prefill_attention": [_p, _i64, _i64, _p, _p, _p, _i64, _i64, _p, _p, _i64, _i64, _p, _i64, _f32, _p,
                                _i64],
    "paged_prefill_attention_bf16": [_p, _i64, _i64, _p, _p, _p, _i64, _i64, _p, _p, _i64, _i64, _p, _i64, _f32,
                                     _p, _i64, _i64],
    "block_matmul_bf16": [_p, _i64, _i64, _i64, _p, _i64, _p, _i64, _i64],
    "amx_tiles_available": [],
    "rms_norm": [_p, _p, _p, _i64, _i64, _f32, _p, _p],
    "rotary_embedding": [_p, _i64, _i64, _p, _i64, _i64, _i64, _i64, _p, _p],
    "store_kv_cache": [_p, _i64, _p, _i64, _i64, _i64, _p, _p, _p, _i64],
    "silu_and_mul": [_p, _i64, _i64, _p],
    "sample_rows": [_p, _p, _i64, _i64, _p, _p, _p, _p],
    "llama_forward": [_p, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _f32, _f32, _p, _p, _p, _i64, _p, _p, _p, _i64,
                      _i64],
}

RESULTS = {"paged_prefill_attention_bf16": _i64, "block_matmul_bf16": _i64, "amx_tiles_available": _i64,
           "dequantize_blocks": _i64}  # the rest return nothing


def _cpu_flags() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return ""


def build(directory: Path, source_dir: Path = SOURCE_DIR) -> Path | None:
    """The library compiled from `source_dir`'s C files for this CPU in `directory` (unless already there; other
    builds for the same target there are removed), or None without a working C compiler."""
    if platform.machine() not in X86_MACHINES:
        log.warning("the CPU ops are x86 code (AVX2 and AVX-512 intrinsics): on this %s CPU the torch reference "
                    "ops run (slower)", platform.machine())
        return None
    if MARCH == "native" and not {"avx2", "fma"} <= set(_cpu_flags().split()):
        log.warning("the CPU ops need AVX2 and FMA (x86-64-v3), which this CPU lacks: the torch reference ops run "
                    "(slower)")
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.warning("no C compiler: the CPU runs the torch reference ops (slower)")
        return None
    sources = sorted(source_dir.glob("*.c"))
    content = b"".join(path.name.encode() + path.read_bytes() for path in sorted(source_dir.glob("*.[ch]")))
    key = hashlib.sha256(content + "\n".join([" ".join(FLAGS), _cpu_flags(), torch.__version__])
                         .encode()).hexdigest()[:16]  # bytes: the stub's locale may be ASCII
    target = directory / f"cpu_ops-{MARCH}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:  # concurrent builders each rename their own
        built = Path(scratch) / target.name
        result = subprocess.run([compiler, *FLAGS, *map(str, sources), "-o", str(built), "-lm"],
                                capture_output=True, text=True)
        if result.returncode != 0:
            log.warning("building the CPU ops failed, using the torch references: %s", result.stderr[-2000:])
            return None
        os.replace(built, target)
    for stale in target.parent.glob(f"cpu_ops-{MARCH}-*.so"):  # older sources or flags (a loaded copy stays mapped)
        if stale != target:
            stale.unlink(missing_ok=True)
    return target


_library: ctypes.CDLL | None = None


def load(directory: Path) -> bool:
    """Build (unless cached in `directory`) and load the ops once per process; whether they are in use."""
    global _library
    if _library is None and os.environ.get("TRITONLLM_CPU_OPS", "1") != "0":
        path = build(directory)
        if path is not None:
            _library = open_library(path)
    return _library is not None


def open_library(path: Path, older: bool = False) -> ctypes.CDLL:
    """A built library with its functions' signatures set; `older`: an earlier revision's build (bench/cpu_ops_ab.py),
    which may lack the ops added since."""
    library = ctypes.CDLL(str(path))
    for name, argtypes in SIGNATURES.items():
        if older and not hasattr(library, name):
            continue
        getattr(library, name).argtypes = argtypes
        getattr(library, name).restype = RESULTS.get(name)
    return library


def available() -> bool:
    return _library is not None


def _table(block_tables: torch.Tensor) -> torch.Tensor:
    """Block tables as the kernels read them: rows of contiguous entries (the rows may be strided: the runner's
    tables are views of a wider buffer)."""
    return block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


# ---- quantized weights: a GGUF's blocks (int4: w = d · q + m, Q8_0: w = d · q) ----

def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """int4 codes q [out, in] (0..15) and scales d, zeros m [out, in / 32] (fp32 values) → the kernel's blocks
    [out, in / 32, 24] uint8: d, m as fp32, then 16 bytes holding element j (low nibble) and j + 16 (high)."""
    rows, width = q.shape
    codes = q.to(torch.uint8).view(rows, width // QUANT_BLOCK, QUANT_BLOCK)
    nibbles = codes[..., :16] | (codes[..., 16:] << 4)
    scales = [t.float().contiguous().view(torch.uint8).view(rows, width // QUANT_BLOCK, 4) for t in (d, m)]
    return torch.cat([*scales, nibbles], dim=-1).contiguous()


def pack_q5_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """int5 codes q [out, in] (0..31) and scales d, zeros m [out, in / 32] (fp32 values) → q5_1_matmul's blocks
    [out, in / 32, 28] uint8: d, m as fp32, the 32 fifth bits (element j's is bit j), then pack_q4's nibbles."""
    rows, width = q.shape
    codes = q.to(torch.uint8).view(rows, width // QUANT_BLOCK, QUANT_BLOCK)
    nibbles = (codes[..., :16] & 15) | ((codes[..., 16:] & 15) << 4)
    fifth = ((codes.to(torch.int64) >> 4) << torch.arange(QUANT_BLOCK)).sum(-1).to(torch.int32)  # distinct bits
    scales = [t.float().contiguous().view(torch.uint8).view(rows, width // QUANT_BLOCK, 4) for t in (d, m)]
    return torch.cat([*scales, fifth[..., None].view(torch.uint8), nibbles], dim=-1).contiguous()


def pack_q5_as_q8(blocks: torch.Tensor) -> torch.Tensor:
    """A GGUF's Q5_0 blocks [out, in / 32, 22] uint8 (fp16 d, 32 fifth bits: element j's is bit j, 16 bytes: element
    j's low nibble, j + 16's high one; w = d · (q − 16)) → Q8_0 blocks [out, in / 32, 34] of the same numbers."""
    fifth = (blocks[..., 2:6].contiguous().view(torch.int32) >> torch.arange(32, dtype=torch.int32)) & 1
    low = blocks[..., 6:]
    codes = (torch.cat([low & 15, low >> 4], dim=-1).to(torch.int16) | (fifth.to(torch.int16) << 4)) - 16
    return torch.cat([blocks[..., :2], codes.to(torch.int8).view(torch.uint8)], dim=-1).contiguous()


def pack_q8_exact(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [out, in] as Q8_0 blocks [out, in / 32, 34] uint8 (fp16 d, then 32 int8 codes: w = d · q), or None
    unless those blocks hold it exactly: a GGUF's Q8_0 tensor dequantized comes back to its own blocks (llama.cpp
    scales each block by its absmax / 127), any other weight does not."""
    rows, width = weight.shape
    if width % QUANT_BLOCK:
        return None
    blocks = weight.float().reshape(rows, width // QUANT_BLOCK, QUANT_BLOCK)
    d = (blocks.abs().amax(dim=-1, keepdim=True) / 127).to(torch.float16)
    q = torch.where(d == 0, 0.0, blocks / d.float()).round().clamp(-127, 127)
    if not torch.equal(q * d.float(), blocks):
        return None
    return torch.cat([d.view(torch.uint8), q.to(torch.int8).view(torch.uint8)], dim=-1).contiguous()


GROUP_ROWS = 16  # as in blocks.h: the int8-activation ops' weights in groups of 16 rows


def _row_groups(codes: torch.Tensor, scales: list[torch.Tensor]) -> torch.Tensor:
    """Each row's code bytes [out, blocks · chunks · 4] (per block, chunk c holds the row's 4 bytes for inputs 4c ..
    4c + 3) and per-block scales [out, blocks] (fp16, or int8 as they are) → [groups of 16 rows, blocks, chunks · 64
    + 16 bytes per scale] uint8: per group and block, each chunk as the group's 16 rows' 4 bytes side by side, then
    each scale's 16 values (blocks.h's row groups)."""
    rows, blocks = scales[0].shape
    padding = -rows % GROUP_ROWS  # zero rows: their outputs are computed, never stored
    groups = (rows + padding) // GROUP_ROWS
    codes = F.pad(codes, (0, 0, 0, padding)).view(groups, GROUP_ROWS, blocks, -1, 4).permute(0, 2, 3, 1, 4)
    scales = [F.pad(t if t.dtype == torch.int8 else t.to(torch.float16), (0, 0, 0, padding))
              .view(groups, GROUP_ROWS, blocks).transpose(1, 2).contiguous().view(torch.uint8) for t in scales]
    return torch.cat([codes.reshape(groups, blocks, -1), *scales], dim=-1).contiguous()


def _nibble_chunks(q: torch.Tensor) -> torch.Tensor:
    """Codes q [out, in] → per block of 32, 4 chunks of 4 bytes [out, in / 32, 16] uint8: chunk c's low nibbles the
    low 4 bits of inputs 4c .. 4c + 3, its high nibbles those of 16 + 4c .. 16 + 4c + 3 (the row groups' codes, or
    their low bits)."""
    rows, width = q.shape
    codes = q.to(torch.uint8).view(rows, width // QUANT_BLOCK, 2, 16) & 15
    return codes[:, :, 0] | (codes[:, :, 1] << 4)


def pack_q4_rows(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """int4 codes q [out, in] (0..15) and scales d, zeros m [out, in / 32] → q4_q8_matmul's row groups: per block,
    4 chunks whose low nibbles hold inputs 4c .. 4c + 3 and high nibbles 16 + 4c .. 16 + 4c + 3, then d, m rounded
    to fp16 (exact for Q4_0 and Q4_1)."""
    def pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return _row_groups(_nibble_chunks(q).reshape(q.shape[0], -1), [d, m])

    return _in_row_chunks(pack, q, d, m)


def pack_q4_k_rows(blocks: torch.Tensor) -> torch.Tensor:
    """A GGUF's Q4_K super-blocks [out, in / 256, 144] → q4_k_q8_matmul's row groups, a super-block a unit: each of
    its 8 blocks' codes as pack_q4_rows's chunks, then the 6-bit sc of each block (a byte a row), the mn likewise,
    and the fp16 d, dmin (4.625 bits a weight; d' = d·sc and m' = −dmin·mn exact, as Q4_K's)."""
    def pack(blocks: torch.Tensor) -> torch.Tensor:
        sc, mn, d, dmin = six_bit_scales(blocks)
        tails = [t[..., j].to(torch.int8) for t in (sc, mn) for j in range(8)] + [d[..., 0], dmin[..., 0]]
        return _row_groups(_nibble_chunks(q4_k_scale_min(blocks)[0]).reshape(len(blocks), -1), tails)

    return _in_row_chunks(pack, blocks)


def pack_q5_rows(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """int5 codes q [out, in] (0..31) and scales d, zeros m [out, in / 32] → q5_q8_matmul's row groups: per block,
    pack_q4_rows's chunks of the low 4 bits, a chunk whose bit c holds code chunk c's fifth bits, then d, m rounded
    to fp16 (exact for Q5_0 and Q5_1, not for every Q5_K scale d·sc: relative 2^-12, as float16 weights)."""
    def pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        rows, width = q.shape
        tops = (q.to(torch.uint8) >> 4).view(rows, width // QUANT_BLOCK, 8, 4)  # [.., code chunk c, input]
        fifths = sum(tops[:, :, c] << c for c in range(8)).to(torch.uint8)
        return _row_groups(torch.cat([_nibble_chunks(q), fifths], dim=-1).reshape(rows, -1), [d, m])

    return _in_row_chunks(pack, q, d, m)


def pack_q8_rows(blocks: torch.Tensor) -> torch.Tensor:
    """pack_q8_exact's Q8_0 blocks → q8_q8_matmul's row groups: per block, 8 chunks of codes + 128 (unsigned
    bytes, for vpdpbusd), then d."""
    def pack(blocks: torch.Tensor) -> torch.Tensor:
        rows, count = blocks.shape[:2]
        d = blocks[..., :2].contiguous().view(torch.float16).view(rows, count)
        codes = blocks[..., 2:].contiguous().view(torch.int8).view(torch.uint8) ^ 0x80  # + 128, as unsigned bytes
        return _row_groups(codes.reshape(rows, -1), [d])

    return _in_row_chunks(pack, blocks)


def pack_q6_k_rows(blocks: torch.Tensor) -> torch.Tensor:
    """A GGUF's Q6_K super-blocks [out, in / 256, 210] → q6_q8_matmul's row groups: per block of 32, its unsigned
    6-bit codes q (w = d·sc·(q − 32)) as 4 chunks of low 4 bits (as pack_q4_rows's nibbles) and 2 chunks of high bit
    pairs (chunk 4 + p, bits 2k: code chunk 4p + k's), then the int8 sc of inputs 0-15, of 16-31, and the fp16 d of
    the block's super-block (its d' = d·sc exact, as Q6_K's)."""
    def pack(blocks: torch.Tensor) -> torch.Tensor:
        rows, count = blocks.shape[:2]
        q = (q6_k_codes(blocks)[0] + 32).to(torch.uint8)
        tops = (q >> 4).view(rows, count * 8, 2, 4, 4)  # [.., p, k, input]: code chunk 4p + k's
        pairs = tops[:, :, :, 0] | (tops[:, :, :, 1] << 2) | (tops[:, :, :, 2] << 4) | (tops[:, :, :, 3] << 6)
        sc, d = q6_k_scales(blocks)
        sc, d = sc.reshape(rows, count * 8, 2), d.expand(rows, count, 8).reshape(rows, count * 8)
        return _row_groups(torch.cat([_nibble_chunks(q), pairs.reshape(rows, -1, 8)], dim=-1).reshape(rows, -1),
                           [sc[..., 0], sc[..., 1], d])

    return _in_row_chunks(pack, blocks)


PACKED_ROWS = 64 * GROUP_ROWS  # rows a packing step takes: its temporaries stay small (a vocabulary-sized head's
# would be several times the packed weights)


def _in_row_chunks(pack, *tensors: torch.Tensor) -> torch.Tensor:
    """pack(*tensors) (row groups of the tensors' rows), PACKED_ROWS rows at a time, into one tensor."""
    rows = tensors[0].shape[0]
    first = pack(*(t[:PACKED_ROWS] for t in tensors))
    out = torch.empty((-(-rows // GROUP_ROWS), *first.shape[1:]), dtype=torch.uint8)
    out[:len(first)] = first
    for start in range(PACKED_ROWS, rows, PACKED_ROWS):
        group = start // GROUP_ROWS
        part = pack(*(t[start:start + PACKED_ROWS] for t in tensors))
        out[group:group + len(part)] = part
    return out


def _checked(tensor: torch.Tensor, name: str, dtype: torch.dtype | None, shape: tuple[int | None, ...]) -> None:
    """Raise ValueError unless `tensor` is a CPU tensor of `dtype` (None: any) and `shape` (None: any size there):
    the C ops read raw memory, so a wrong one would be read as something else, or past its end."""
    if (tensor.device.type != "cpu" or dtype not in (None, tensor.dtype) or tensor.dim() != len(shape)
            or any(want is not None and got != want for got, want in zip(tensor.shape, shape))):
        expected = "[" + ", ".join("*" if n is None else str(n) for n in shape) + "]"
        raise ValueError(f"{name}: expected a CPU {dtype or 'any'} tensor {expected}, got {tensor.device.type} "
                         f"{tensor.dtype} {list(tensor.shape)}")


def _checked_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_heads: int | None, head_dim: int) -> None:
    """Paged caches [blocks, block_size, kv_heads, head_dim] alike."""
    _checked(k_cache, "k_cache", None, (None, None, kv_heads, head_dim))
    _checked(v_cache, "v_cache", None, tuple(k_cache.shape))


def _block_matmul(op, x: torch.Tensor, packed: torch.Tensor, rows: int, block_bytes: int,
                  group_rows: int = 1, block_inputs: int = QUANT_BLOCK, levels: int | None = None) -> torch.Tensor:
    """x [tokens, in] float32 @ weights [rows, in].T in blocks of `block_bytes` per `block_inputs` inputs, per row or
    (for the int8-activation ops, with their `levels` of codes) per group of `group_rows` rows."""
    if levels not in (None, 1, 2):
        raise ValueError(f"levels: 1 or 2, not {levels}")
    _checked(x, "x", torch.float32, (None, None))
    if x.shape[1] % block_inputs:
        raise ValueError(f"x: {x.shape[1]} inputs, not a multiple of {block_inputs}")
    _checked(packed, "weights", torch.uint8, (-(-rows // group_rows), x.shape[1] // block_inputs, block_bytes))
    if not packed.is_contiguous():
        raise ValueError("weights: not contiguous (pack them once, at load)")
    x = x.contiguous()
    out = torch.empty(x.shape[0], rows, dtype=torch.float32)
    levels_argument = [] if levels is None else [levels]
    op(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), rows, out.data_ptr(), *levels_argument)
    return out


def q4_matmul(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [tokens, in] float32 @ pack_q4's weights [out, in].T → [tokens, out]."""
    return _block_matmul(_library.q4_matmul, x, packed, packed.shape[0], Q4_BYTES)


def q5_1_matmul(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [tokens, in] float32 @ pack_q5_1's weights [out, in].T → [tokens, out]."""
    return _block_matmul(_library.q5_1_matmul, x, packed, packed.shape[0], Q5_1_BYTES)


def q8_matmul(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [tokens, in] float32 @ pack_q8_exact's weights [out, in].T → [tokens, out]."""
    return _block_matmul(_library.q8_matmul, x, packed, packed.shape[0], Q8_BYTES)


def q5_matmul(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """x [tokens, in] float32 @ a GGUF's Q5_0 blocks [out, in / 32, 22] uint8 (fp16 d, 32 high bits, 16 bytes of
    nibbles: w = d · (q − 16)), as the file stores them, .T → [tokens, out]."""
    return _block_matmul(_library.q5_matmul, x, blocks, blocks.shape[0], Q5_BYTES)


def q4_k_matmul(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """x [tokens, in] float32 @ a GGUF's Q4_K super-blocks [out, in / 256, 144] uint8, as the file stores them, .T
    → [tokens, out] (super_blocks.dequantize_q4_k's weights)."""
    return _block_matmul(_library.q4_k_matmul, x, blocks, blocks.shape[0], Q4_K_BYTES, block_inputs=SUPER_BLOCK)


def q5_k_matmul(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """x [tokens, in] float32 @ a GGUF's Q5_K super-blocks [out, in / 256, 176] uint8, as the file stores them, .T
    → [tokens, out] (super_blocks.dequantize_q5_k's weights)."""
    return _block_matmul(_library.q5_k_matmul, x, blocks, blocks.shape[0], Q5_K_BYTES, block_inputs=SUPER_BLOCK)


def q6_k_matmul(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """x [tokens, in] float32 @ a GGUF's Q6_K super-blocks [out, in / 256, 210] uint8, as the file stores them, .T
    → [tokens, out] (super_blocks.dequantize_q6_k's weights)."""
    return _block_matmul(_library.q6_k_matmul, x, blocks, blocks.shape[0], Q6_K_BYTES, block_inputs=SUPER_BLOCK)


# blocks.h's enum: what a projection's blocks are
BLOCK_KINDS = {"int4": 0, "q8_0": 1, "q6_k": 2, "q5_0": 3, "int5": 4, "q4_k": 5, "q5_k": 6, "int4_groups": 7,
               "q8_0_groups": 8, "q6_k_groups": 9, "int5_groups": 10, "q4_k_groups": 11}
BF16_TOKENS = 32  # block_matmul_bf16.c's tokens a step (AMX_TOKENS)
BLOCK_BYTES = {"int4": (Q4_BYTES, QUANT_BLOCK), "int5": (Q5_1_BYTES, QUANT_BLOCK), "q8_0": (Q8_BYTES, QUANT_BLOCK),
               "q5_0": (Q5_BYTES, QUANT_BLOCK), "q4_k": (Q4_K_BYTES, SUPER_BLOCK), "q5_k": (Q5_K_BYTES, SUPER_BLOCK),
               "q6_k": (Q6_K_BYTES, SUPER_BLOCK)}
"""A kind of blocks as the fp32-activation ops read them: (bytes, inputs) a (super-)block."""
ROW_GROUP_BYTES = {"int4_groups": (Q4_GROUP_BYTES, QUANT_BLOCK), "int5_groups": (Q5_GROUP_BYTES, QUANT_BLOCK),
                   "q8_0_groups": (Q8_GROUP_BYTES, QUANT_BLOCK), "q6_k_groups": (Q6_GROUP_BYTES, QUANT_BLOCK),
                   "q4_k_groups": (Q4_K_GROUP_BYTES, SUPER_BLOCK)}
"""The int8-activation ops' row groups (pack_q4_rows, pack_q4_k_rows, pack_q5_rows, pack_q8_rows, pack_q6_k_rows) as
block_matmul_bf16 reads them: (bytes, inputs) a unit of GROUP_ROWS rows."""


def dequantize_blocks(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """A kind's blocks [rows, in / block inputs, block bytes] uint8 (as its fp32-activation op takes them) → the
    weights that op multiplies, [rows, in] float32."""
    block_bytes, block_inputs = BLOCK_BYTES[kind]
    _checked(blocks, "blocks", torch.uint8, (None, None, block_bytes))
    if not blocks.is_contiguous():
        raise ValueError("blocks: not contiguous")
    out = torch.empty(blocks.shape[0], blocks.shape[1] * block_inputs, dtype=torch.float32)
    _library.dequantize_blocks(BLOCK_KINDS[kind], blocks.data_ptr(), out.shape[0], out.shape[1], out.data_ptr())
    return out


def has_amx_tiles() -> bool:
    """Whether this library, CPU and OS run the bf16 ops on AMX tiles."""
    return _library is not None and bool(_library.amx_tiles_available())


def has_bf16_ops() -> bool:
    """Whether this library has the bf16 ops (block_matmul_bf16, prefill_attention_bf16): built for a CPU with
    AVX512-BF16, which every CPU with AMX has."""
    return _library is not None and _library.block_matmul_bf16(None, 0, 0, 0, None, 0, None, 0, 0) == 0


def block_matmul_bf16(x: torch.Tensor, parts: list[tuple[str, torch.Tensor, int]], tiles: bool = True
                      ) -> torch.Tensor:
    """x [tokens, in] float32 (rounded to bf16 in the op) @ a projection's weights [out, in].T → [tokens, out]
    float32, the weights read from their blocks (block_matmul_bf16.c): on AMX tiles where has_amx_tiles() and
    `tiles`, else as AVX512-BF16 dot products. parts are (BLOCK_KINDS name, blocks as the fp32-activation ops take
    them, or the int8-activation ops' row groups: ROW_GROUP_BYTES, output rows, a multiple of 16) in output order.
    Only where has_bf16_ops()."""
    _checked(x, "x", torch.float32, (None, None))
    tokens, inputs = x.shape
    for kind, blocks, rows in parts:
        block_bytes, block_inputs = ROW_GROUP_BYTES[kind] if kind in ROW_GROUP_BYTES else BLOCK_BYTES[kind]
        if inputs % block_inputs or rows % 16:
            raise ValueError(f"{kind}: {inputs} inputs, {rows} rows: not multiples of {block_inputs} and 16")
        groups = rows // GROUP_ROWS if kind in ROW_GROUP_BYTES else rows
        _checked(blocks, "weights", torch.uint8, (groups, inputs // block_inputs, block_bytes))
        if not blocks.is_contiguous():
            raise ValueError("weights: not contiguous (pack them once, at load)")
    x = x.contiguous()
    width = sum(rows for _, _, rows in parts)
    out = torch.empty(tokens + -tokens % BF16_TOKENS, width, dtype=torch.float32)  # rows past `tokens` left out
    column = 0
    for kind, blocks, rows in parts:
        if _library.block_matmul_bf16(x.data_ptr(), tokens, inputs, BLOCK_KINDS[kind], blocks.data_ptr(), rows,
                                      out.data_ptr() + 4 * column, width, int(tiles)):
            raise RuntimeError("block_matmul_bf16: no AVX512-BF16 in this build (ask has_bf16_ops() first)")
        column += rows
    return out[:tokens]


def q4_q8_matmul(x: torch.Tensor, packed: torch.Tensor, rows: int, levels: int = 2) -> torch.Tensor:
    """x [tokens, in] float32 @ the weights [rows, in].T that pack_q4_rows packed, with each token's x quantized per
    block of 32 to two levels of int8 codes first (q1 = round(x / dx) with dx the block's absmax / 127, llama.cpp's
    Q8_1; q2 = round(256 (x / dx − q1)) within ±127; sx = dx / 256 · Σ (256 q1 + q2)):
    Σ_b dw·(dx / 256)·(the block's products of 256 q1 + q2, summed exactly) + mw·sx. levels 1: q2 = 0 (llama.cpp's
    numerics; half the integer work)."""
    return _block_matmul(_library.q4_q8_matmul, x, packed, rows, Q4_GROUP_BYTES, GROUP_ROWS, levels=levels)


def q5_q8_matmul(x: torch.Tensor, packed: torch.Tensor, rows: int, levels: int = 2) -> torch.Tensor:
    """As q4_q8_matmul over pack_q5_rows's weights (5-bit codes)."""
    return _block_matmul(_library.q5_q8_matmul, x, packed, rows, Q5_GROUP_BYTES, GROUP_ROWS, levels=levels)


def q4_k_q8_matmul(x: torch.Tensor, packed: torch.Tensor, rows: int, levels: int = 2
                   ) -> torch.Tensor:
    """As q4_q8_matmul over pack_q4_k_rows's weights (Q4_K's exact d', m')."""
    return _block_matmul(_library.q4_k_q8_matmul, x, packed, rows, Q4_K_GROUP_BYTES, GROUP_ROWS, SUPER_BLOCK,
                         levels=levels)


def q8_q8_matmul(x: torch.Tensor, packed: torch.Tensor, rows: int, levels: int = 2) -> torch.Tensor:
    """As q4_q8_matmul over pack_q8_rows's weights (Σ_b dw·dx·Σ code products)."""
    return _block_matmul(_library.q8_q8_matmul, x, packed, rows, Q8_GROUP_BYTES, GROUP_ROWS, levels=levels)


def q6_q8_matmul(x: torch.Tensor, packed: torch.Tensor, rows: int, levels: int = 2) -> torch.Tensor:
    """As q4_q8_matmul over pack_q6_k_rows's weights: Σ per 16 inputs d'·(dx / 256)·(Σ q·code − 32 Σ code), q the
    unsigned 6-bit weight codes, code = 256 q1 + q2."""
    return _block_matmul(_library.q6_q8_matmul, x, packed, rows, Q6_GROUP_BYTES, GROUP_ROWS, levels=levels)


def sample_tokens(logits: torch.Tensor, raw: torch.Tensor, inverse_temperatures: torch.Tensor,
                  uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As kernels.sampling.sample_tokens_reference, each row in a few passes while it is in cache."""
    _checked(logits, "logits", torch.float32, (None, None))
    _checked(raw, "raw", torch.float32, tuple(logits.shape))
    rows, vocab = logits.shape
    for name, tensor in (("inverse_temperatures", inverse_temperatures), ("uniforms", uniforms)):
        if tuple(tensor.shape) != (rows,):
            raise ValueError(f"{name}: expected [{rows}], got {list(tensor.shape)}")
    logits, raw = logits.contiguous(), raw.contiguous()
    inverse_temperatures, uniforms = (t.to(torch.float32).contiguous() for t in (inverse_temperatures, uniforms))
    tokens = torch.empty(rows, dtype=torch.int64)
    log_normalizers = torch.empty(rows, dtype=torch.float32)
    _library.sample_rows(logits.data_ptr(), raw.data_ptr(), rows, vocab, inverse_temperatures.data_ptr(),
                         uniforms.data_ptr(), tokens.data_ptr(), log_normalizers.data_ptr())
    return tokens, log_normalizers


def _rows(x: torch.Tensor) -> bool:
    """Whether x [tokens, heads, dim] has each token's heads back to back (its rows may be strided)."""
    return x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    width = x.shape[-1]
    _checked(x, "x", torch.float32, (None,) * x.dim())
    _checked(weight.contiguous(), "weight", torch.float32, (width,))
    if residual is not None:
        _checked(residual, "residual", torch.float32, tuple(x.shape))
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    summed = None if residual is None else torch.empty_like(x)
    _library.rms_norm(x.data_ptr(), _ptr(None if residual is None else residual.contiguous()), weight.data_ptr(),
                       x.numel() // width, width, eps, out.data_ptr(), _ptr(summed))
    return out if residual is None else (out, summed)


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    tokens, _, head_dim = q.shape
    for name, tensor in (("q", q), ("k", k)):
        _checked(tensor, name, torch.float32, (tokens, None, head_dim))
    for name, tensor in (("cos", cos), ("sin", sin)):
        _checked(tensor, name, torch.float32, (tokens, head_dim // 2))
    if not (_rows(q) and _rows(k)):
        return rotary_embedding_reference(q, k, cos, sin)
    cos, sin = cos.contiguous(), sin.contiguous()
    _library.rotary_embedding(q.data_ptr(), q.stride(0), q.shape[1], k.data_ptr(), k.stride(0), k.shape[1],
                               q.shape[0], q.shape[2], cos.data_ptr(), sin.data_ptr())


def _half(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int | None:
    """The ops' `half` flag for a KV cache: 1 for float16, 0 for float32, None for what they do not read."""
    if k_cache.dtype != v_cache.dtype or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    return {torch.float32: 0, torch.float16: 1}.get(k_cache.dtype)


def store_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    tokens, kv_heads, head_dim = k.shape
    _checked(k, "k", torch.float32, (tokens, kv_heads, head_dim))
    _checked(v, "v", torch.float32, (tokens, kv_heads, head_dim))
    _checked(slot_mapping, "slot_mapping", None, (tokens,))
    _checked_cache(k_cache, v_cache, kv_heads, head_dim)
    half = _half(k_cache, v_cache)
    if not (_rows(k) and _rows(v) and slot_mapping.dtype == torch.int64 and half is not None):
        return store_kv_cache_reference(k, v, k_cache, v_cache, slot_mapping)
    slots = slot_mapping.contiguous()
    _library.store_kv_cache(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k.shape[0],
                             k.shape[1] * k.shape[2], k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), half)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, workspace=None) -> torch.Tensor:
    seqs, _, head_dim = q.shape
    _checked(q, "q", torch.float32, (seqs, None, head_dim))
    _checked_cache(k_cache, v_cache, None, head_dim)
    _checked(block_tables, "block_tables", None, (seqs, None))
    _checked(context_lens, "context_lens", None, (seqs,))
    half = _half(k_cache, v_cache)
    if not (_rows(q) and block_tables.dtype == torch.int64 and context_lens.dtype == torch.int32 and half is not None):
        return paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale, workspace)
    seqs, heads, head_dim = q.shape
    out = torch.empty(seqs, heads, head_dim, dtype=torch.float32)
    tables = _table(block_tables)
    lens = context_lens.contiguous()
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    _library.paged_decode_attention(q.data_ptr(), q.stride(0), seqs, heads, head_dim, k_cache.data_ptr(),
                                     v_cache.data_ptr(), block_size, kv_heads, tables.data_ptr(), tables.stride(0),
                                     lens.data_ptr(), tables.shape[1] * block_size, scale, out.data_ptr(), half)
    return out


def _prefill_arguments(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_starts: torch.Tensor,
                       query_lens: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                       scale: float) -> tuple | None:
    """The prefill attention ops' arguments but their output (pointers, the tensors they point into, to keep alive
    through the call, and whether the cache is float16), or None where the C ops do not take these tensors."""
    _checked(q, "q", torch.float32, (None, None, None))
    _checked_cache(k_cache, v_cache, None, q.shape[2])
    chunks = len(query_starts)
    for name, tensor in (("query_lens", query_lens), ("context_lens", context_lens)):
        _checked(tensor, name, None, (chunks,))
    _checked(block_tables, "block_tables", None, (chunks, None))
    half = _half(k_cache, v_cache)
    if not (_rows(q) and half is not None):
        return None
    heads, head_dim = q.shape[1:]
    tables = _table(block_tables.to(torch.int64))
    starts, lens, contexts = (t.to(torch.int32).contiguous() for t in (query_starts, query_lens, context_lens))
    return (q.data_ptr(), q.stride(0), len(starts), starts.data_ptr(), lens.data_ptr(), contexts.data_ptr(), heads,
            head_dim, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1], k_cache.shape[2], tables.data_ptr(),
            tables.stride(0), scale), (starts, lens, contexts, tables), half


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_starts: torch.Tensor,
                      query_lens: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                      scale: float) -> torch.Tensor:
    arguments = _prefill_arguments(q, k_cache, v_cache, query_starts, query_lens, context_lens, block_tables, scale)
    if arguments is None:
        return prefill_attention_reference(q, k_cache, v_cache, query_starts, query_lens, context_lens, block_tables,
                                           scale)
    pointers, _kept, half = arguments
    out = torch.empty(q.shape, dtype=torch.float32)
    _library.paged_prefill_attention(*pointers, out.data_ptr(), half)
    return out


def prefill_attention_bf16(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_starts: torch.Tensor,
                           query_lens: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                           scale: float, tiles: bool = True) -> torch.Tensor | None:
    """prefill_attention for prompts computed in bfloat16 (attention_bf16.c): Q, K, V and the probabilities rounded
    to bf16, sums in float32, on AMX tiles where has_amx_tiles() and `tiles`, else as AVX512-BF16 dot products. None
    where this library has no bf16 ops, the head size is not 64 or the tensors are not the C ops' kind."""
    arguments = _prefill_arguments(q, k_cache, v_cache, query_starts, query_lens, context_lens, block_tables, scale)
    if arguments is None or _library is None:
        return None
    pointers, _kept, half = arguments
    out = torch.empty(q.shape, dtype=torch.float32)
    return None if _library.paged_prefill_attention_bf16(*pointers, out.data_ptr(), half, int(tiles)) else out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    _checked(x, "x", torch.float32, (None,) * x.dim())
    if x.shape[-1] % 2:
        raise ValueError(f"x: an odd width {x.shape[-1]} (gate and up side by side)")
    x = x.contiguous()
    width = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], width, dtype=torch.float32)
    _library.silu_and_mul(x.data_ptr(), x.numel() // x.shape[-1], width, out.data_ptr())
    return out


# ---- a whole decode forward ----

PROJECTION_PARTS = 3  # most parts of one fused projection (qkv)


class ProjectionPart(ctypes.Structure):
    _fields_ = [("blocks", ctypes.c_void_p), ("rows", ctypes.c_int64), ("kind", ctypes.c_int64)]


class DecoderLayer(ctypes.Structure):
    """One layer's tensors as llama_forward.c reads them."""

    _fields_ = ([(name, ctypes.c_void_p) for name in ("input_norm", "post_attention_norm")]
                + [(name, ProjectionPart * PROJECTION_PARTS) for name in ("qkv", "o", "gate_up", "down")]
                + [(name, ctypes.c_void_p) for name in ("k_cache", "v_cache")])


def decoder_layers(layers: list[dict[str, torch.Tensor | list[tuple[str, torch.Tensor, int]]]]) -> ctypes.Array:
    """Each layer's tensors (DecoderLayer's field names; a projection as its parts: (BLOCK_KINDS name, packed
    blocks, output rows) each, in output order) as one array; the tensors must outlive it."""
    array = (DecoderLayer * len(layers))()
    for entry, tensors in zip(array, layers):
        for name, value in tensors.items():
            if isinstance(value, torch.Tensor):
                assert value.is_contiguous(), name
                setattr(entry, name, value.data_ptr())
                continue
            assert 0 < len(value) <= PROJECTION_PARTS, name
            for part, (kind, packed, rows) in zip(getattr(entry, name), value):
                assert packed.is_contiguous(), name
                part.blocks, part.rows, part.kind = packed.data_ptr(), rows, BLOCK_KINDS[kind]
    return array


class AttentionRows(ctypes.Structure):
    """A step's rows as llama_forward.c's attention reads them: decode rows, then prompt chunks."""

    _fields_ = [("decodes", ctypes.c_int64), ("decode_tables", ctypes.c_void_p),
                ("decode_table_stride", ctypes.c_int64), ("decode_context_lens", ctypes.c_void_p),
                ("max_decode_context", ctypes.c_int64), ("chunks", ctypes.c_int64),
                ("query_starts", ctypes.c_void_p), ("query_lens", ctypes.c_void_p),
                ("chunk_context_lens", ctypes.c_void_p), ("chunk_tables", ctypes.c_void_p),
                ("chunk_table_stride", ctypes.c_int64)]


def llama_forward(layers: ctypes.Array, hidden: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                  intermediate: int, eps: float, scale: float, cos: torch.Tensor, sin: torch.Tensor,
                  slot_mapping: torch.Tensor, block_size: int, decode_tables: torch.Tensor | None,
                  decode_context_lens: torch.Tensor | None, chunks: tuple[torch.Tensor, ...] | None, half_cache: bool,
                  int8_levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer of a dense decoder over a step's rows: the embeddings [tokens, hidden] → (the last MLP's output,
    the residual stream before it), as the layers op by op would give them. The first len(decode_context_lens) rows
    are one-token queries (decode_tables, decode_context_lens: as paged_decode_attention's), the rest prompt chunks
    (chunks: prefill_attention's query_starts, query_lens, context_lens, block_tables, rows from the first prompt
    row). half_cache: the layers' KV caches are float16 (else float32); int8_levels: 0, the fp32-activation ops of
    the parts' kinds; 1 or 2, the int4, int5, Q8_0, Q4_K and Q6_K parts are q4_q8_matmul's, q5_q8_matmul's,
    q8_q8_matmul's, q4_k_q8_matmul's and q6_q8_matmul's with that many levels of codes."""
    tokens = hidden.shape[0]
    _checked(hidden, "hidden", torch.float32, (tokens, None))
    for name, tensor in (("cos", cos), ("sin", sin)):
        _checked(tensor, name, torch.float32, (tokens, head_dim // 2))
    _checked(slot_mapping, "slot_mapping", torch.int64, (tokens,))
    if int8_levels not in (0, 1, 2):
        raise ValueError(f"int8_levels: 0, 1 or 2, not {int8_levels}")
    rows, kept = AttentionRows(), []
    if decode_context_lens is not None:
        decodes = len(decode_context_lens)
        _checked(decode_tables, "decode_tables", torch.int64, (decodes, None))
        _checked(decode_context_lens, "decode_context_lens", torch.int32, (decodes,))
        tables, lens = _table(decode_tables), decode_context_lens.contiguous()
        kept += [tables, lens]
        rows.decodes, rows.decode_tables, rows.decode_table_stride = decodes, tables.data_ptr(), tables.stride(0)
        rows.decode_context_lens, rows.max_decode_context = lens.data_ptr(), tables.shape[1] * block_size
    if chunks is not None:
        starts, lens, contexts, tables = chunks
        count = len(starts)
        for name, tensor in (("query_starts", starts), ("query_lens", lens), ("chunk_context_lens", contexts)):
            _checked(tensor, name, torch.int32, (count,))
        _checked(tables, "chunk_tables", torch.int64, (count, None))
        starts, lens, contexts, tables = (t.contiguous() for t in (starts, lens, contexts, _table(tables)))
        if int((starts + lens).max()) != tokens - rows.decodes or int(lens.min()) < 1:
            raise ValueError("chunks: their rows are not the rows after the decodes")
        kept += [starts, lens, contexts, tables]
        rows.chunks, rows.query_starts, rows.query_lens = count, starts.data_ptr(), lens.data_ptr()
        rows.chunk_context_lens, rows.chunk_tables, rows.chunk_table_stride = (contexts.data_ptr(), tables.data_ptr(),
                                                                               tables.stride(0))
    elif rows.decodes != tokens:
        raise ValueError(f"{tokens} rows, {rows.decodes} of them decodes and no chunks")
    hidden = hidden.contiguous().clone()  # written in place
    residual = torch.empty_like(hidden)
    cos, sin, slots = cos.contiguous(), sin.contiguous(), slot_mapping.contiguous()
    _library.llama_forward(ctypes.addressof(layers), len(layers), hidden.shape[0], hidden.shape[1], heads, kv_heads,
                           head_dim, intermediate, eps, scale, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                           block_size, ctypes.addressof(rows), hidden.data_ptr(), residual.data_ptr(), int(half_cache),
                           int8_levels)
    return hidden, residual
