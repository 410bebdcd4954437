"""llama.cpp's Q4_K quantizer (ggml-quants.c's quantize_row_q4_K_ref, with make_qkx2_quants' search), in numpy: the
`gguf` package quantizes only the legacy types. Every float32 operation is the C code's, in its order (sums run
element by element, as the C loops; ggml-base is built without FMA, so nothing is fused), so the bytes are
llama-quantize's own for a tensor without an importance matrix.

A super-block of 256 weights is 8 sub-blocks of 32, each w ≈ d·sc·q − dmin·m with 4-bit q and 6-bit sc, m: each
sub-block's scale and min are searched (21 candidate scales, least weighted squares), then rounded to 6 bits against
the super-block's largest, and the codes are recomputed with the rounded ones."""

from __future__ import annotations

import numpy as np

SUPER_BLOCK = 256
SUB_BLOCK = 32
BLOCK_BYTES = 144  # fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
F32 = np.float32


def quantize_q4_k(weight: np.ndarray) -> np.ndarray:
    """[rows, K] float32 (K a multiple of 256) → Q4_K blocks [rows, K / 256 · 144] uint8."""
    rows, width = weight.shape
    x = np.ascontiguousarray(weight, F32).reshape(-1, 8, SUB_BLOCK)  # [super-blocks, sub-block, weight]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        sum_x2 = _sequential_sum(x * x)
        av_x = np.sqrt(sum_x2 / F32(32))
        weights = av_x[..., None] + np.abs(x)
        scales, mins, codes = _make_qkx2_quants(x, weights)
        max_scale = np.maximum(scales.max(axis=1), F32(0))
        max_min = np.maximum(mins.max(axis=1), F32(0))
        inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0))
        inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0))
        sc = np.minimum(_nearest_int(inv_scale[:, None] * scales).astype(np.uint8), 63)  # C's uint8_t, then MIN
        mn = np.minimum(_nearest_int(inv_min[:, None] * mins).astype(np.uint8), 63)
        d = (max_scale / F32(63)).astype(np.float16)
        dmin = (max_min / F32(63)).astype(np.float16)
        # the codes again, against the rounded scales (a sub-block whose scale rounds to 0 keeps the search's)
        sub_d = d.astype(F32)[:, None] * sc.astype(F32)
        sub_m = dmin.astype(F32)[:, None] * mn.astype(F32)
        again = np.clip(_nearest_int((x + sub_m[..., None]) / sub_d[..., None]), 0, 15)
        codes = np.where((sub_d != 0)[..., None], again, codes).astype(np.uint8)
    nibbles = codes.reshape(-1, 4, 2, SUB_BLOCK)  # per 64 weights: the first 32 low, the next 32 high
    packed = nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)
    blocks = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), _pack_scales(sc, mn),
                             packed.reshape(-1, 128)], axis=1)
    return blocks.reshape(rows, width // SUPER_BLOCK * BLOCK_BYTES)


def _nearest_int(value: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: to nearest, ties to even (its 1.5 · 2^23 trick), for |value| < 2^22."""
    return np.rint(value).astype(np.int32)


def _sequential_sum(terms: np.ndarray) -> np.ndarray:
    """Σ over the last axis, one term after another in float32 (the C loop's order and roundings)."""
    total = terms[..., 0].copy()
    for i in range(1, terms.shape[-1]):
        total += terms[..., i]
    return total


def _make_qkx2_quants(x: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """make_qkx2_quants(32, nmax 15, rmin −1, rdelta 0.1, nstep 20, squared errors) for every sub-block at once:
    its scale, its min (as a positive offset: w ≈ scale · q − min) and its codes."""
    low = np.minimum(x.min(axis=-1), F32(0))
    high = x.max(axis=-1)
    sum_w = _sequential_sum(weights)
    sum_x = _sequential_sum(weights * x)
    flat = high == low  # all codes 0, scale 0
    iscale = F32(15) / (high - low)
    scale = F32(1) / iscale
    codes = np.clip(_nearest_int(iscale[..., None] * (x - low[..., None])), 0, 15)
    best = _weighted_squares(scale, codes, low, x, weights)
    for step in range(21):
        iscale = (F32(-1) + F32(0.1) * F32(step) + F32(15)) / (high - low)  # the best min so far (as the C)
        trial = np.clip(_nearest_int(iscale[..., None] * (x - low[..., None])), 0, 15)
        levels = trial.astype(F32)  # (an int32 array would promote the products to float64)
        wl = weights * levels
        sum_l, sum_l2, sum_xl = _sequential_sum(wl), _sequential_sum(wl * levels), _sequential_sum(wl * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        positive = this_min > 0
        this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
        this_min = np.where(positive, F32(0), this_min)
        error = _weighted_squares(this_scale, trial, this_min, x, weights)
        better = (det > 0) & (error < best)
        codes = np.where(better[..., None], trial, codes)
        best, scale, low = np.where(better, error, best), np.where(better, this_scale, scale), np.where(
            better, this_min, low)
    codes = np.where(flat[..., None], 0, codes)
    return np.where(flat, F32(0), scale), -low, codes


def _weighted_squares(scale, codes, low, x, weights) -> np.ndarray:
    """Σ w · (scale · q + min − x)² in the C loop's order."""
    diff = scale[..., None] * codes.astype(F32) + low[..., None] - x
    return _sequential_sum(weights * (diff * diff))


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins [blocks, 8] → Q4_K's 12 bytes (get_scale_min_k4's inverse)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    packed = np.zeros((len(sc), 12), np.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    return packed
