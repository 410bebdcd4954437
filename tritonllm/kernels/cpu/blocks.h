/* A GGUF's blocks as the CPU ops read them: their layouts (per block of 32 inputs, or per K-quant super-block of 256)
 * and their dequantization to fp32 vectors in registers, exactly the file's numbers (gguf.quants.dequantize's).
 * DEQUANTIZE(block, j, table, out) gives UNIT blocks from block j of a super-block (SUB blocks; 1 for the formats
 * whose scale is in each block), after SCALES(super, table) decoded the super-block's scales once. Included by the
 * matmuls over blocks: fp32 activations (quant_matmul.c) and bf16 prompt rows on AMX (block_matmul_amx.c). */

#pragma once

#include "vector.h"

/* kernels/cpu/__init__.py's BLOCK_KINDS: what a projection's blocks are */
enum { INT4_BLOCKS, Q8_0_BLOCKS, Q6_K_BLOCKS, Q5_0_BLOCKS, INT5_BLOCKS, Q4_K_BLOCKS, Q5_K_BLOCKS, INT4_ROW_GROUPS,
       Q8_ROW_GROUPS, Q6_ROW_GROUPS, INT5_ROW_GROUPS, Q4_K_ROW_GROUPS };

/* The int8-activation ops' layout (quant_matmul.c; the bf16 prompt rows read it too): rows in groups of 16, per
 * group and block of 32 inputs its codes as chunks of 64 bytes (chunk c, byte 4r + i: row r's code for input 4c + i;
 * int4's chunks hold inputs 16 + 4c + i in their high nibbles), then the 16 rows' fp16 d (and m). */
#define GROUP_ROWS 16
#define GROUP_CHUNK 64                          /* bytes: 4 codes of each of a group's rows */
#define Q4_GROUP_BYTES (4 * GROUP_CHUNK + 64)   /* per block: 32 nibbles a row in 4 chunks, 16 d, 16 m */
#define Q8_GROUP_BYTES (8 * GROUP_CHUNK + 32)   /* per block: 32 codes + 128 a row (as u8) in 8 chunks, 16 d */
/* Q6_K's: its 6-bit codes q (w = d·sc·(q − 32)) as int4's chunks of low 4 bits, then 2 chunks of high bit pairs
 * (chunk 4 + p, bits 2k: those of code chunk 4p + k), then the 16 rows' int8 sc of inputs 0-15, of 16-31, and their
 * super-block's fp16 d: 7 bits a weight, d' = d·sc exact as Q6_K's */
#define Q6_GROUP_SC (6 * GROUP_CHUNK)           /* 16 sc of inputs 0-15, 16 of 16-31 */
#define Q6_GROUP_D (Q6_GROUP_SC + 2 * GROUP_ROWS) /* 16 fp16 d */
#define Q6_GROUP_BYTES (Q6_GROUP_D + 2 * GROUP_ROWS)
/* int5's (a GGUF's Q5_1, Q5_K, and Q5_0 as d·q − 16d): int4's chunks of low 4 bits, a chunk of fifth bits (bit c:
 * code chunk c's), 16 d, 16 m: 6 bits a weight */
#define Q5_GROUP_BYTES (5 * GROUP_CHUNK + 64)
/* Q4_K's, per super-block (its 8 blocks a unit): int4's chunks of each block in turn, then the 16 rows' 6-bit sc of
 * each block (bytes), their mn likewise, their fp16 d, dmin: 4.625 bits a weight, d' = d·sc and m' = −dmin·mn
 * exact as Q4_K's */
#define Q4_K_GROUP_SC (SUPER_BLOCKS * 4 * GROUP_CHUNK)           /* block j's 16 sc at + 16 j (bytes, 0-63) */
#define Q4_K_GROUP_MN (Q4_K_GROUP_SC + SUPER_BLOCKS * GROUP_ROWS)  /* likewise its mn */
#define Q4_K_GROUP_D (Q4_K_GROUP_MN + SUPER_BLOCKS * GROUP_ROWS)   /* 16 fp16 d, then 16 fp16 dmin */
#define Q4_K_GROUP_BYTES (Q4_K_GROUP_D + 4 * GROUP_ROWS)

#define QUANT_BLOCK 32
#define Q4_1_BYTES 24 /* fp32 d, fp32 m (the GGUF's fp16, widened at load: each a broadcast from memory, where
                       * fp16 took a conversion and two shuffles per row and block), 16 bytes of nibbles: element
                       * j low, element j + 16 high */
#define Q5_1_BYTES 28 /* int5: fp32 d, fp32 m, 4 bytes of fifth bits (element j: bit j), 16 of nibbles as Q4_1's */
#define Q8_0_BYTES 34 /* fp16 d, 32 signed bytes */
#define Q5_0_BYTES 22 /* fp16 d, 4 bytes of high bits (element j: bit j), 16 bytes: element j low, j + 16 high */
#define Q4_K_BYTES 144 /* a super-block: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles */
#define Q5_K_BYTES 176 /* a super-block: Q4_K's, with 32 bytes of fifth bits before the nibbles */
#define Q6_K_BYTES 210 /* a super-block: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, fp16 d */
#define SUPER_BLOCKS 8 /* a K-quant super-block's blocks of 32 */
#define Q4_K_UNIT 2    /* blocks dequantized at once: those sharing their bytes */
#define Q5_K_UNIT 2
#define Q6_K_UNIT 4

/* A Q8_0 block's fp16 scale as a float. A vector conversion (of it and the first two codes): a scalar one merges
 * into its destination register, which chains every block to the one before. */
static inline float block_scale(const uint8_t *block) {
#if defined(__F16C__)
    int32_t bytes;
    memcpy(&bytes, block, 4);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(bytes))[0];
#else
    _Float16 scale;
    memcpy(&scale, block, 2);
    return (float)scale;
#endif
}

#define BLOCK_VECTORS (QUANT_BLOCK / VLEN)
#define SCALE_TABLE 32 /* floats: a super-block's scales decoded once per row and super-block (K-quants) */

/* The formats of one block per "super-block" keep their scales in each block. */
static inline void no_scales(const uint8_t *block, float *table) { (void)block, (void)table; }

/* A block's 32 weights as BLOCK_VECTORS vectors (in registers, once inlined). */
static inline void dequantize_q4_1(const uint8_t *block, int j, const float *table, vf *out) {
    (void)j, (void)table; /* one block, its scale in it */
    float d, m;
    memcpy(&d, block, 4);
    memcpy(&m, block + 4, 4);
    const vf dv = splat(d), mv = splat(m);
    /* each byte widened to an int32 lane once, then split into its two nibbles there: one shuffle per VLEN bytes
     * (intrinsics: GCC scalarizes these conversions written as vector casts) */
#if VLEN == 16
    const vi codes = (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(block + 8)));
    out[0] = __builtin_convertvector(codes & 15, vf) * dv + mv;
    out[1] = __builtin_convertvector(codes >> 4, vf) * dv + mv;
#else
    /* 8 bytes each, widened straight from memory (vpmovzxbd's load form: no byte shift in a register) */
    const vi codes[2] = {(vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(block + 8))),
                         (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(block + 16)))};
    for (int half = 0; half < 2; half++) {
        out[half] = __builtin_convertvector(codes[half] & 15, vf) * dv + mv;
        out[2 + half] = __builtin_convertvector(codes[half] >> 4, vf) * dv + mv;
    }
#endif
}

static inline void dequantize_q8_0(const uint8_t *block, int j, const float *table, vf *out) {
    (void)j, (void)table; /* one block, its scale in it */
    const vf dv = splat(block_scale(block));
    for (int i = 0; i < QUANT_BLOCK; i += VLEN) {
#if VLEN == 16 /* intrinsics: GCC scalarizes the conversion of signed bytes */
        const __m128i codes = _mm_loadu_si128((const __m128i *)(block + 2 + i));
        out[i / VLEN] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)) * dv;
#else
        const __m128i codes = _mm_loadl_epi64((const __m128i *)(block + 2 + i));
        out[i / VLEN] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)) * dv;
#endif
    }
}

/* A block's 32 five-bit codes, element j's low 4 bits from the 16 bytes at `nibbles` (j low, j + 16 high) and its
 * fifth bit j of `fifths`, as floats less `offset` (Q5_0's 16; 0 for Q5_1): small integers, exact. */
static inline void five_bit_codes(const uint8_t *nibbles, uint32_t fifths, int offset, vf *out) {
#if VLEN == 16 && defined(__AVX512BW__) && defined(__AVX512VL__)
    /* in signed bytes: each nibble, less 16 where its fifth bit is clear (offset 16) or plus 16 where it is set */
    const __m128i packed = _mm_loadu_si128((const __m128i *)nibbles), sixteen = _mm_set1_epi8(16);
    const __m128i low = _mm_and_si128(packed, _mm_set1_epi8(15));
    const __m128i top = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(15));
    const __m128i codes[2] = {
        offset ? _mm_mask_sub_epi8(low, (__mmask16)~fifths, low, sixteen)
               : _mm_mask_add_epi8(low, (__mmask16)fifths, low, sixteen),
        offset ? _mm_mask_sub_epi8(top, (__mmask16)~(fifths >> 16), top, sixteen)
               : _mm_mask_add_epi8(top, (__mmask16)(fifths >> 16), top, sixteen)};
    for (int v = 0; v < 2; v++) out[v] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes[v]));
#else
    vi lane;
    for (int i = 0; i < VLEN; i++) lane[i] = i;
    /* out[v] holds elements v * VLEN ..: their low 4 bits from the nibbles, the 5th from `fifths` */
#if VLEN == 16
    const vi codes = (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)nibbles));
    const vi low[2] = {codes & 15, codes >> 4};
#else
    const vi codes[2] = {(vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)nibbles)),
                         (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(nibbles + 8)))};
    const vi low[4] = {codes[0] & 15, codes[1] & 15, codes[0] >> 4, codes[1] >> 4};
#endif
    for (int v = 0; v < BLOCK_VECTORS; v++) {
        const vi fifth = (((vi){0} + (int32_t)(fifths >> (v * VLEN))) >> lane & 1) << 4;
        out[v] = __builtin_convertvector((low[v] | fifth) - offset, vf);
    }
#endif
}

/* Q5_0 (as the GGUF stores it): fp16 d, 32 fifth bits, 16 bytes of nibbles; w = d * (q - 16) */
static inline void dequantize_q5_0(const uint8_t *block, int j, const float *table, vf *out) {
    (void)j, (void)table; /* one block, its scale in it */
    const vf dv = splat(block_scale(block));
    uint32_t fifths;
    memcpy(&fifths, block + 2, 4);
    five_bit_codes(block + 6, fifths, 16, out);
    for (int v = 0; v < BLOCK_VECTORS; v++) out[v] *= dv;
}

/* int5 (a GGUF's Q5_1, repacked): fp32 d, fp32 m, 32 fifth bits, 16 bytes of nibbles; w = d * q + m */
static inline void dequantize_q5_1(const uint8_t *block, int j, const float *table, vf *out) {
    (void)j, (void)table; /* one block, its scale in it */
    float d, m;
    memcpy(&d, block, 4);
    memcpy(&m, block + 4, 4);
    uint32_t fifths;
    memcpy(&fifths, block + 8, 4);
    five_bit_codes(block + 12, fifths, 0, out);
    for (int v = 0; v < BLOCK_VECTORS; v++) out[v] = out[v] * splat(d) + splat(m);
}

#if VLEN == 16
/* Byte `at` of each of `into`'s 16 lanes replaced by bytes 16g .. 16g + 15 of `bytes` (codes made 64 at a time in
 * bytes, then spread to lanes: one shuffle per 16 where VBMI has vpermb) */
static inline __m512i lane_bytes(__m512i bytes, int g, __m512i into, int at) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __mmask64 byte_at = 0x1111111111111111ull << at;
#if defined(__AVX512VBMI__)
    const __m512i from = _mm512_slli_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32(16 * g)), 8 * at);
    return _mm512_mask_permutexvar_epi8(into, byte_at, from, bytes);
#else /* the 16 bytes to every 128-bit lane, then a shuffle within lanes */
    const __m512i part = _mm512_broadcast_i32x4(_mm512_extracti32x4_epi32(bytes, g));
    return _mm512_mask_shuffle_epi8(into, byte_at, part, _mm512_slli_epi32(lane, 8 * at));
#endif
}

/* A vector of 16-bit lanes: `low` in its first 256 bits, `high` in the others (per-half shifts: vpsrlvw) */
static inline __m512i halves(int16_t low, int16_t high) {
    return _mm512_inserti64x4(_mm512_set1_epi16(low), _mm256_set1_epi16(high), 1);
}
#endif

/* Q4_K: w = (d * sc) * q - dmin * mn per block of 32, with 6-bit sc, mn packed in 12 bytes (gguf's
 * get_scale_min); d * sc and dmin * mn are rounded once to fp32 as gguf rounds them (the table: 8 d', then 8 m' =
 * -dmin * mn), then d' * q (exact: 17 + 4 bits) + m' as int4's dequantize_q4_1. */
static inline void q4_k_scales(const uint8_t *super, float *table) {
    uint32_t packed[3];
    memcpy(packed, super + 4, 12);
    const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
    const uint32_t sc[2] = {packed[0] & low6, (packed[2] & low4) | ((packed[0] >> 6) & top2) << 4};
    const uint32_t mn[2] = {packed[1] & low6, ((packed[2] >> 4) & low4) | ((packed[1] >> 6) & top2) << 4};
    const __m256 d = _mm256_set1_ps(block_scale(super)), dmin = _mm256_set1_ps(block_scale(super + 2));
    const __m256 scales = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc)));
    const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mn)));
    _mm256_storeu_ps(table, _mm256_mul_ps(d, scales));
    _mm256_storeu_ps(table + 8, _mm256_xor_ps(_mm256_mul_ps(dmin, mins), _mm256_set1_ps(-0.0f)));
}

/* Blocks j and j + 1 (j even): the low and high nibbles of bytes 16 + 16j .. + 31. */
static inline void dequantize_q4_k(const uint8_t *super, int j, const float *table, vf *out) {
    const uint8_t *bytes = super + 16 + 16 * j;
#if VLEN == 16
    /* each weight looked up in its block's 16 values d' * k + m' (one rounding, as the product is exact) */
    const vf iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const __m512 low = (__m512)(iota * splat(table[j]) + splat(table[8 + j]));
    const __m512 high = (__m512)(iota * splat(table[j + 1]) + splat(table[9 + j]));
    for (int h = 0; h < 2; h++) {
        const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(bytes + 16 * h)));
        out[h] = (vf)_mm512_permutexvar_ps(codes, low); /* the index's low 4 bits: the low nibble */
        out[2 + h] = (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), high);
    }
#else
    const vf dv[2] = {splat(table[j]), splat(table[j + 1])}, mv[2] = {splat(table[8 + j]), splat(table[9 + j])};
    for (int v = 0; v < BLOCK_VECTORS; v++) {
        const vi codes = (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(bytes + v * VLEN)));
        out[v] = __builtin_convertvector(codes & 15, vf) * dv[0] + mv[0];
        out[BLOCK_VECTORS + v] = __builtin_convertvector(codes >> 4, vf) * dv[1] + mv[1];
    }
#endif
}

/* Q5_K: Q4_K's blocks with a fifth bit (block j's: bit j of bytes 16 .. 47), the same scales; d' * q still exact
 * (17 + 5 bits). Blocks j and j + 1 (j even). */
static inline void dequantize_q5_k(const uint8_t *super, int j, const float *table, vf *out) {
    const uint8_t *fifths = super + 16, *bytes = super + 48 + 16 * j;
#if VLEN == 16
    /* each weight looked up in its block's 32 values d' * k + m' (two tables of 16: vpermt2ps) */
    const vf iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    __m512 values[2][2];
    for (int b = 0; b < 2; b++)
        for (int t = 0; t < 2; t++)
            values[b][t] = (__m512)((iota + splat(16.0f * t)) * splat(table[j + b]) + splat(table[8 + j + b]));
    /* block j's codes in the first 256 bits, j + 1's in the others, a byte each: the nibble (low, high) in bits 0-3,
     * the fifth bit (bit j, j + 1) in bit 4, bits 5-7 whatever (vpermt2ps reads 5 bits of an index) */
    const __m512i nibbles = _mm512_srlv_epi16(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)bytes)),
                                              halves(0, 4));
    const __m512i tops = _mm512_slli_epi16(_mm512_srlv_epi16(_mm512_broadcast_i64x4(_mm256_loadu_si256(
        (const __m256i *)fifths)), halves(j, j + 1)), 4);
    const __m512i codes = _mm512_ternarylogic_epi32(nibbles, tops, _mm512_set1_epi8(15), 0xe4); /* bits of A or B */
    for (int q = 0; q < 4; q++)
        out[q] = (vf)_mm512_permutex2var_ps(values[q / 2][0], lane_bytes(codes, q, _mm512_setzero_si512(), 0),
                                            values[q / 2][1]);
#else
    for (int b = 0; b < 2; b++) {
        const vf dv = splat(table[j + b]), mv = splat(table[8 + j + b]);
        for (int v = 0; v < BLOCK_VECTORS; v++) {
            const vi codes = (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(bytes + v * VLEN)));
            const vi tops = (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(fifths + v * VLEN)));
            const vi q = (b ? codes >> 4 : codes & 15) | ((tops >> (j + b) & 1) << 4);
            out[b * BLOCK_VECTORS + v] = __builtin_convertvector(q, vf) * dv + mv;
        }
    }
#endif
}

/* Q6_K (16 blocks of 16 in gguf's terms): w = (d * sc) * (q - 32), 6-bit q as a low nibble and a high bit pair,
 * int8 sc per 16 inputs; d * sc rounded once to fp32 as gguf rounds it, d' (exact: 11 + 7 bits), and d' * (q - 32)
 * exact too (+ 5 bits). Our block j = 4n + k of half n: the low nibbles (k < 2) or high ones of bytes
 * 64n + 32(k % 2) .., bits 2k of bytes 128 + 32n ..
 * With AVX-512 a weight is fma(1 + q / 64, 64 d', -96 d'), every step exact (so the same bits as d' * (q - 32)), with
 * 1 + q / 64 a float whose mantissa's top bits are q: one byte shuffle per 16 weights, no widening or conversion
 * (the table: 16 64 d', then 16 -96 d'). With AVX2 the table is the 16 d'. */
static inline void q6_k_scales(const uint8_t *super, float *table) {
    const __m128i scales = _mm_loadu_si128((const __m128i *)(super + 192));
    const __m256 d = _mm256_set1_ps(block_scale(super + 208));
    const __m256 first = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(scales)));
    const __m256 second = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(scales, 8))));
#if VLEN == 16
    const __m256 step = _mm256_set1_ps(64.0f), offset = _mm256_set1_ps(-96.0f);
    _mm256_storeu_ps(table, _mm256_mul_ps(first, step));
    _mm256_storeu_ps(table + 8, _mm256_mul_ps(second, step));
    _mm256_storeu_ps(table + 16, _mm256_mul_ps(first, offset));
    _mm256_storeu_ps(table + 24, _mm256_mul_ps(second, offset));
    /* read back as broadcasts from memory: GCC otherwise keeps the table in registers and extracts each scale with
     * two more shuffles, on the pipes the byte shuffles need */
    __asm__ volatile("" : : "r"(table) : "memory");
#else
    _mm256_storeu_ps(table, first);
    _mm256_storeu_ps(table + 8, second);
#endif
}

/* Blocks j .. j + 3 (j = 4n: half n): the codes in bytes, then VLEN at a time into lanes, scaled by their 16's d'. */
static inline void dequantize_q6_k(const uint8_t *super, int j, const float *table, vf *out) {
    const int n = j / 4;
    const uint8_t *low = super + 64 * n, *high = super + 128 + 32 * n;
#if VLEN == 16
    /* blocks 4n, 4n + 1 from the low nibbles of 64 bytes, 4n + 2, 4n + 3 from their high ones; block k's high bit
     * pairs are bits 2k of the same 32 bytes (shifted per 256-bit half: vpsrlvw); each code as 0x80 | 2q */
    const __m512i bits = _mm512_loadu_si512(low), doubled = _mm512_set1_epi8(0x1e), pair = _mm512_set1_epi8(3);
    const __m512i tops = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)high));
    const __m512i shifts[2] = {halves(0, 2), halves(4, 6)}, one = _mm512_set1_epi32(0x3f800000);
    const __m512i nibbles[2] = {_mm512_and_si512(_mm512_slli_epi16(bits, 1), doubled),
                                _mm512_and_si512(_mm512_srli_epi16(bits, 3), doubled)};
    for (int p = 0; p < 2; p++) { /* blocks 4n + 2p, 4n + 2p + 1 */
        const __m512i pairs = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(tops, shifts[p]), pair), 5);
        const __m512i codes = _mm512_ternarylogic_epi32(nibbles[p], pairs, _mm512_set1_epi8((char)0x80), 0xfe);
        for (int q = 0; q < 4; q++) { /* 16 codes, one scale */
            const int g = 8 * n + 4 * p + q;
            const __m512 one_and_code = _mm512_castsi512_ps(lane_bytes(codes, q, one, 2)); /* 1 + q / 64 */
            out[4 * p + q] = (vf)_mm512_fmadd_ps(one_and_code, _mm512_set1_ps(table[g]), _mm512_set1_ps(table[16 + g]));
        }
    }
#else
    const __m256i nibble = _mm256_set1_epi8(15), pair = _mm256_set1_epi8(3), offset = _mm256_set1_epi8(32);
    const __m256i tops = _mm256_loadu_si256((const __m256i *)high);
    for (int k = 0; k < 4; k++) { /* block 4n + k: 32 codes at once, the low 4 bits, the high 2, less 32 */
        const __m256i bits = _mm256_loadu_si256((const __m256i *)(low + 32 * (k % 2)));
        const __m256i nibbles = _mm256_and_si256(k >= 2 ? _mm256_srli_epi16(bits, 4) : bits, nibble);
        const __m256i pairs = _mm256_and_si256(_mm256_srli_epi16(tops, 2 * k), pair);
        const __m256i codes = _mm256_sub_epi8(_mm256_or_si256(nibbles, _mm256_slli_epi16(pairs, 4)), offset);
        for (int v = 0; v < BLOCK_VECTORS; v++) {
            const __m128i half = v < 2 ? _mm256_castsi256_si128(codes) : _mm256_extracti128_si256(codes, 1);
            const __m128i part = v % 2 ? _mm_srli_si128(half, 8) : half;
            out[k * BLOCK_VECTORS + v] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part))
                                       * splat(table[8 * n + 2 * k + v / 2]);
        }
    }
#endif
}

/* Every kind of blocks the kernels read, declared once: X(kind, its fp32-activation op, its name, DEQUANTIZE, SCALES,
 * SUPER_BYTES, SUB, UNIT) */
#define BLOCK_FORMATS(X)                                                                                      \
    X(INT4_BLOCKS, q4_matmul, int4, dequantize_q4_1, no_scales, Q4_1_BYTES, 1, 1)                            \
    X(INT5_BLOCKS, q5_1_matmul, int5, dequantize_q5_1, no_scales, Q5_1_BYTES, 1, 1)                          \
    X(Q8_0_BLOCKS, q8_matmul, q8_0, dequantize_q8_0, no_scales, Q8_0_BYTES, 1, 1)                            \
    X(Q5_0_BLOCKS, q5_matmul, q5_0, dequantize_q5_0, no_scales, Q5_0_BYTES, 1, 1)                            \
    X(Q4_K_BLOCKS, q4_k_matmul, q4_k, dequantize_q4_k, q4_k_scales, Q4_K_BYTES, SUPER_BLOCKS, Q4_K_UNIT)     \
    X(Q5_K_BLOCKS, q5_k_matmul, q5_k, dequantize_q5_k, q4_k_scales, Q5_K_BYTES, SUPER_BLOCKS, Q5_K_UNIT)     \
    X(Q6_K_BLOCKS, q6_k_matmul, q6_k, dequantize_q6_k, q6_k_scales, Q6_K_BYTES, SUPER_BLOCKS, Q6_K_UNIT)
