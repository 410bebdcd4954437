#include "cpu_ops.h"

/* ---- projections over the checkpoint's quantized blocks: y[T][N] = x[T][K] . W[N][K]^T ----
 * int4 (a GGUF's Q4_0, Q4_1, repacked exactly at load): w = d * q + m per block of 32 inputs; int5 (Q5_1,
 * likewise): the same with 5-bit q; Q8_0: w = d * q, q signed; Q5_0 (as the GGUF stores it):
 * w = d * (q - 16), q of 5 bits; Q4_K, Q5_K and Q6_K as the GGUF stores them (super-blocks of 256 inputs: 8
 * blocks of 32 whose scales are decoded in the kernel, so a weight costs the file's bits, 4.5, 5.5 and 6.56).
 * Each weight row is dequantized to fp32 once per token chunk and multiplied in fp32. */

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
#define SCALE_TABLE 16 /* floats: a super-block's scales decoded once per row and super-block (K-quants) */

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

static inline void dequantize_q5_0(const uint8_t *block, int j, const float *table, vf *out) {
    (void)j, (void)table; /* one block, its scale in it */
    const vf dv = splat(block_scale(block));
    uint32_t high;
    memcpy(&high, block + 2, 4);
#if VLEN == 16 && defined(__AVX512BW__) && defined(__AVX512VL__)
    /* in bytes, as the Q8_0 codes: each nibble, less 16 where its fifth bit is clear (a masked subtract) */
    const __m128i packed = _mm_loadu_si128((const __m128i *)(block + 6)), sixteen = _mm_set1_epi8(16);
    const __m128i low = _mm_and_si128(packed, _mm_set1_epi8(15));
    const __m128i top = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(15));
    const __m128i codes[2] = {_mm_mask_sub_epi8(low, (__mmask16)~high, low, sixteen),
                              _mm_mask_sub_epi8(top, (__mmask16)~(high >> 16), top, sixteen)};
    for (int v = 0; v < 2; v++) out[v] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes[v])) * dv;
#else
    vi lane;
    for (int i = 0; i < VLEN; i++) lane[i] = i;
    /* out[v] holds elements v * VLEN ..: their low 4 bits from the nibbles, the 5th from `high`, then - 16 */
#if VLEN == 16
    const vi codes = (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(block + 6)));
    const vi nibbles[2] = {codes & 15, codes >> 4};
#else
    const vi codes[2] = {(vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(block + 6))),
                         (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(block + 14)))};
    const vi nibbles[4] = {codes[0] & 15, codes[1] & 15, codes[0] >> 4, codes[1] >> 4};
#endif
    for (int v = 0; v < BLOCK_VECTORS; v++) {
        const vi fifth = (((vi){0} + (int32_t)(high >> (v * VLEN))) >> lane & 1) << 4;
        out[v] = __builtin_convertvector((nibbles[v] | fifth) - 16, vf) * dv;
    }
#endif
}

static inline void dequantize_q5_1(const uint8_t *block, int j, const float *table, vf *out) {
    (void)j, (void)table; /* one block, its scale in it */
    float d, m;
    memcpy(&d, block, 4);
    memcpy(&m, block + 4, 4);
    const vf dv = splat(d), mv = splat(m);
    uint32_t high;
    memcpy(&high, block + 8, 4);
#if VLEN == 16 && defined(__AVX512BW__) && defined(__AVX512VL__)
    /* in bytes: each nibble, plus 16 where its fifth bit is set (a masked add) */
    const __m128i packed = _mm_loadu_si128((const __m128i *)(block + 12)), sixteen = _mm_set1_epi8(16);
    const __m128i low = _mm_and_si128(packed, _mm_set1_epi8(15));
    const __m128i top = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(15));
    const __m128i codes[2] = {_mm_mask_add_epi8(low, (__mmask16)high, low, sixteen),
                              _mm_mask_add_epi8(top, (__mmask16)(high >> 16), top, sixteen)};
    for (int v = 0; v < 2; v++) out[v] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes[v])) * dv + mv;
#else
    vi lane;
    for (int i = 0; i < VLEN; i++) lane[i] = i;
#if VLEN == 16
    const vi codes = (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(block + 12)));
    const vi nibbles[2] = {codes & 15, codes >> 4};
#else
    const vi codes[2] = {(vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(block + 12))),
                         (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(block + 20)))};
    const vi nibbles[4] = {codes[0] & 15, codes[1] & 15, codes[0] >> 4, codes[1] >> 4};
#endif
    for (int v = 0; v < BLOCK_VECTORS; v++) {
        const vi fifth = (((vi){0} + (int32_t)(high >> (v * VLEN))) >> lane & 1) << 4;
        out[v] = __builtin_convertvector(nibbles[v] | fifth, vf) * dv + mv;
    }
#endif
}

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
    const __m512i nibble = _mm512_set1_epi32(15), one = _mm512_set1_epi32(1);
    for (int h = 0; h < 2; h++) {
        const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(bytes + 16 * h)));
        const __m512i tops = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(fifths + 16 * h)));
        for (int b = 0; b < 2; b++) {
            const __m512i low = b ? _mm512_srli_epi32(codes, 4) : _mm512_and_si512(codes, nibble);
            const __m512i fifth = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(tops, j + b), one), 4);
            out[2 * b + h] = (vf)_mm512_permutex2var_ps(values[b][0], _mm512_or_si512(low, fifth), values[b][1]);
        }
    }
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
 * int8 sc per 16 inputs; d * sc rounded once to fp32 as gguf rounds it (the table: 16 d'). Our block j = 4n + k of
 * half n: the low nibbles (k < 2) or high ones of bytes 64n + 32(k % 2) .., bits 2k of bytes 128 + 32n .. */
static inline void q6_k_scales(const uint8_t *super, float *table) {
    const __m128i scales = _mm_loadu_si128((const __m128i *)(super + 192));
    const __m256 d = _mm256_set1_ps(block_scale(super + 208));
    _mm256_storeu_ps(table, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(scales))));
    _mm256_storeu_ps(table + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(scales, 8)))));
}

/* Blocks j .. j + 3 (j = 4n: half n): the codes in bytes, then VLEN at a time widened, times their 16's d'. */
static inline void dequantize_q6_k(const uint8_t *super, int j, const float *table, vf *out) {
    const int n = j / 4;
    const uint8_t *low = super + 64 * n, *high = super + 128 + 32 * n;
#if VLEN == 16
    /* blocks 4n, 4n + 1 from the low nibbles of 64 bytes, 4n + 2, 4n + 3 from their high ones; block k's high bit
     * pairs are bits 2k of the same 32 bytes (shifted per 256-bit half: vpsrlvw) */
    const __m512i bits = _mm512_loadu_si512(low), nibble = _mm512_set1_epi8(15), pair = _mm512_set1_epi8(3);
    const __m512i tops = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)high));
    const __m512i offset = _mm512_set1_epi8(32);
    const __m512i shifts[2] = {_mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1),
                               _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1)};
    const __m512i nibbles[2] = {_mm512_and_si512(bits, nibble), _mm512_and_si512(_mm512_srli_epi16(bits, 4), nibble)};
    for (int p = 0; p < 2; p++) { /* blocks 4n + 2p, 4n + 2p + 1 */
        const __m512i pairs = _mm512_and_si512(_mm512_srlv_epi16(tops, shifts[p]), pair);
        const __m512i codes = _mm512_sub_epi8(_mm512_or_si512(nibbles[p], _mm512_slli_epi16(pairs, 4)), offset);
        for (int q = 0; q < 4; q++) { /* 16 codes, one scale */
            const __m128i part = _mm512_extracti32x4_epi32(codes, q);
            out[4 * p + q] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(part)) * splat(table[8 * n + 4 * p + q]);
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

/* rows x tokens dot products over K from the dequantized rows w[rows][K]: every (row, token) pair accumulates
 * the same way whatever the tile's size, so tiling never changes a result. */
#define TILE_(ROWS, TOKENS) tile_##ROWS##x##TOKENS
#define TILE(ROWS, TOKENS) TILE_(ROWS, TOKENS) /* expands ROW_TILE, TOKEN_TILE before pasting */
#define MICROKERNEL(ROWS, TOKENS)                                                                               \
    static inline void TILE(ROWS, TOKENS)(const float *w, int64_t K, const float *x, float *y, int64_t N) { \
        vf acc[ROWS][TOKENS];                                                                                   \
        for (int r = 0; r < ROWS; r++)                                                                          \
            for (int t = 0; t < TOKENS; t++) acc[r][t] = (vf){0};                                               \
        for (int64_t k = 0; k < K; k += VLEN) {                                                                 \
            vf wv[ROWS];                                                                                        \
            for (int r = 0; r < ROWS; r++) {                                                                    \
                wv[r] = load(w + r * K + k);                                                                    \
                __asm__("" : "+v"(wv[r])); /* kept in a register: GCC re-reads it from memory per token */     \
            }                                                                                                   \
            for (int t = 0; t < TOKENS; t++) {                                                                  \
                vf xv = load(x + t * K + k);                                                                    \
                for (int r = 0; r < ROWS; r++) acc[r][t] += wv[r] * xv;                                         \
            }                                                                                                   \
        }                                                                                                       \
        if (ROWS * TOKENS < VLEN / 2) { /* too few to share lane_sums' shuffles */                              \
            for (int t = 0; t < TOKENS; t++)                                                                    \
                for (int r = 0; r < ROWS; r++) y[t * N + r] = lane_sum(acc[r][t]);                              \
            return;                                                                                             \
        }                                                                                                       \
        enum { GROUPS = (ROWS * TOKENS + VLEN - 1) / VLEN };                                                    \
        float sums[GROUPS * VLEN] __attribute__((aligned(64)));                                                 \
        for (int g = 0; g < GROUPS; g++) {                                                                      \
            vf group[VLEN];                                                                                     \
            for (int i = 0; i < VLEN; i++) {                                                                    \
                const int pair = g * VLEN + i; /* token-major: a token's row sums end up side by side */       \
                group[i] = pair < ROWS * TOKENS ? acc[pair % ROWS][pair / ROWS] : (vf){0};                      \
            }                                                                                                   \
            store(sums + g * VLEN, lane_sums(group));                                                           \
        }                                                                                                       \
        for (int t = 0; t < TOKENS; t++)                                                                        \
            for (int r = 0; r < ROWS; r++) y[t * N + r] = sums[t * ROWS + r];                                   \
    }

MICROKERNEL(ROW_TILE, TOKEN_TILE)
MICROKERNEL(ROW_TILE, 1)
MICROKERNEL(1, TOKEN_TILE)
MICROKERNEL(1, 1)

/* One token against ROWS rows of blocks, dequantized in registers (no row buffer: with one token nothing reuses
 * it). The same products summed in the same order as TILE(ROWS, 1) over the dequantized rows: the same bits. */
#define ONE_TOKEN_(NAME, ROWS) NAME##_one_token_##ROWS
#define ONE_TOKEN(NAME, ROWS) ONE_TOKEN_(NAME, ROWS)
#define ONE_TOKEN_KERNEL(NAME, DEQUANTIZE, SCALES, SUPER_BYTES, SUB, UNIT, ROWS)                              \
    static inline void ONE_TOKEN(NAME, ROWS)(const uint8_t *rows, int64_t row_bytes, int64_t blocks,          \
                                             const float *x, float *y) {                                       \
        vf acc[ROWS];                                                                                           \
        for (int r = 0; r < ROWS; r++) acc[r] = (vf){0};                                                        \
        for (int64_t s = 0; s < blocks / (SUB); s++) {                                                          \
            float table[ROWS][SCALE_TABLE];                                                                     \
            for (int r = 0; r < ROWS; r++) {                                                                    \
                const uint8_t *super = rows + r * row_bytes + s * (SUPER_BYTES);                                \
                __builtin_prefetch(super + PREFETCH_AHEAD, 0, 3);                                               \
                SCALES(super, table[r]);                                                                        \
            }                                                                                                   \
            _Pragma("GCC unroll 8") for (int j = 0; j < (SUB); j += (UNIT)) {                                   \
                const int64_t b = s * (SUB) + j;                                                                \
                vf xv[(UNIT) * BLOCK_VECTORS];                                                                  \
                for (int i = 0; i < (UNIT) * BLOCK_VECTORS; i++) xv[i] = load(x + b * QUANT_BLOCK + i * VLEN); \
                _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) { /* acc[r] in registers */             \
                    vf w[(UNIT) * BLOCK_VECTORS];                                                               \
                    DEQUANTIZE(rows + r * row_bytes + s * (SUPER_BYTES), j, table[r], w);                       \
                    for (int i = 0; i < (UNIT) * BLOCK_VECTORS; i++) acc[r] += w[i] * xv[i];                    \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
        for (int r = 0; r < ROWS; r++) y[r] = lane_sum(acc[r]);                                                 \
    }

/* NAME(x, T, K, weights, N, y): weights [N][K / (32 SUB)] (super-)blocks of SUPER_BYTES, each SUB blocks of 32
 * inputs; K a multiple of 32 SUB (and so of VLEN). */
#define BLOCK_MATMUL(NAME, DEQUANTIZE, SCALES, SUPER_BYTES, SUB, UNIT)                                           \
    ONE_TOKEN_KERNEL(NAME, DEQUANTIZE, SCALES, SUPER_BYTES, SUB, UNIT, ROW_TILE)                                 \
    ONE_TOKEN_KERNEL(NAME, DEQUANTIZE, SCALES, SUPER_BYTES, SUB, UNIT, 1)                                        \
    void NAME(const float *x, int64_t T, int64_t K, const uint8_t *weights, int64_t N, float *y) {            \
        const int64_t blocks = K / QUANT_BLOCK, row_bytes = blocks / (SUB) * (SUPER_BYTES);                \
        const int64_t tiles = (N + ROW_TILE - 1) / ROW_TILE;                                                    \
        if (T == 1) {                                                                                           \
            _Pragma("omp parallel for schedule(static)") for (int64_t tile = 0; tile < tiles; tile++) {         \
                const int64_t n0 = tile * ROW_TILE;                                                             \
                if (N - n0 >= ROW_TILE) {                                                                       \
                    ONE_TOKEN(NAME, ROW_TILE)(weights + n0 * row_bytes, row_bytes, blocks, x, y + n0);          \
                } else {                                                                                        \
                    for (int64_t n = n0; n < N; n++)                                                            \
                        ONE_TOKEN(NAME, 1)(weights + n * row_bytes, row_bytes, blocks, x, y + n);               \
                }                                                                                               \
            }                                                                                                   \
            return;                                                                                             \
        }                                                                                                       \
        for (int64_t t0 = 0; t0 < T; t0 += TOKEN_CHUNK) {                                                       \
            const int64_t tokens = T - t0 < TOKEN_CHUNK ? T - t0 : TOKEN_CHUNK;                                 \
            const float *xc = x + t0 * K;                                                                       \
            float *yc = y + t0 * N;                                                                             \
            _Pragma("omp parallel") {                                                                           \
                float *w = aligned_alloc(64, (size_t)(ROW_TILE * K * 4));                                       \
                _Pragma("omp for schedule(static)") for (int64_t tile = 0; tile < tiles; tile++) {              \
                    const int64_t n0 = tile * ROW_TILE;                                                         \
                    const int64_t rows = N - n0 < ROW_TILE ? N - n0 : ROW_TILE;                                 \
                    for (int64_t r = 0; r < rows; r++) {                                                        \
                        const uint8_t *row = weights + (n0 + r) * row_bytes;                                    \
                        for (int64_t s = 0; s < blocks / (SUB); s++) {                                          \
                            const uint8_t *super = row + s * (SUPER_BYTES);                                     \
                            __builtin_prefetch(super + PREFETCH_AHEAD, 0, 3);                                   \
                            float table[SCALE_TABLE];                                                           \
                            SCALES(super, table);                                                               \
                            for (int j = 0; j < (SUB); j += (UNIT)) {                                           \
                                vf dequantized[(UNIT) * BLOCK_VECTORS];                                         \
                                DEQUANTIZE(super, j, table, dequantized);                                       \
                                float *out = w + r * K + (s * (SUB) + j) * QUANT_BLOCK;                         \
                                for (int i = 0; i < (UNIT) * BLOCK_VECTORS; i++)                                \
                                    store(out + i * VLEN, dequantized[i]);                                      \
                            }                                                                                   \
                        }                                                                                       \
                    }                                                                                           \
                    if (rows == ROW_TILE) {                                                                     \
                        int64_t t = 0;                                                                          \
                        for (; t + TOKEN_TILE <= tokens; t += TOKEN_TILE)                                       \
                            TILE(ROW_TILE, TOKEN_TILE)(w, K, xc + t * K, yc + t * N + n0, N);                   \
                        for (; t < tokens; t++) TILE(ROW_TILE, 1)(w, K, xc + t * K, yc + t * N + n0, N);        \
                    } else {                                                                                    \
                        for (int64_t r = 0; r < rows; r++) {                                                    \
                            int64_t t = 0;                                                                      \
                            for (; t + TOKEN_TILE <= tokens; t += TOKEN_TILE)                                   \
                                TILE(1, TOKEN_TILE)(w + r * K, K, xc + t * K, yc + t * N + n0 + r, N);          \
                            for (; t < tokens; t++) TILE(1, 1)(w + r * K, K, xc + t * K, yc + t * N + n0 + r, N); \
                        }                                                                                       \
                    }                                                                                           \
                }                                                                                               \
                free(w);                                                                                        \
            }                                                                                                   \
        }                                                                                                       \
    }

BLOCK_MATMUL(q4_matmul, dequantize_q4_1, no_scales, Q4_1_BYTES, 1, 1)
BLOCK_MATMUL(q5_1_matmul, dequantize_q5_1, no_scales, Q5_1_BYTES, 1, 1)
BLOCK_MATMUL(q8_matmul, dequantize_q8_0, no_scales, Q8_0_BYTES, 1, 1)
BLOCK_MATMUL(q5_matmul, dequantize_q5_0, no_scales, Q5_0_BYTES, 1, 1)
BLOCK_MATMUL(q4_k_matmul, dequantize_q4_k, q4_k_scales, Q4_K_BYTES, SUPER_BLOCKS, Q4_K_UNIT)
BLOCK_MATMUL(q5_k_matmul, dequantize_q5_k, q4_k_scales, Q5_K_BYTES, SUPER_BLOCKS, Q5_K_UNIT)
BLOCK_MATMUL(q6_k_matmul, dequantize_q6_k, q6_k_scales, Q6_K_BYTES, SUPER_BLOCKS, Q6_K_UNIT)

/* ---- the same projections with int8 activations, llama.cpp's way (its Q8_1 activations): each token's inputs
 * are quantized per block of 32 to codes qx = round(x / dx), |qx| <= 127, with the block's own scale dx = absmax /
 * 127 and sx = dx · Σ qx. A block's products of weight and input codes are summed exactly in integers, then
 * y += (dw · dx) · Σ + mw · sx per block, in block order, in fp32 (Q8_0 has no mw).
 *
 * The weights are repacked at load into groups of 16 rows (pack_q4_rows / pack_q8_rows): per group and block, its
 * codes as chunks of 64 bytes (chunk c, byte 4r + i: row r's code for input 4c + i; Q4_1's chunks hold inputs
 * 16 + 4c + i in their high nibbles), then the 16 rows' fp16 dw (and mw). One vector then holds 4 inputs of every
 * row of a group (16 rows with AVX-512, 8 with AVX2), so one broadcast of 4 input codes meets them all: a block is
 * 8 multiply-adds of 4 code pairs per lane (vpdpbusd with AVX512-VNNI; pairs to int16, then to int32, without),
 * no horizontal sums, and one scale vector for all the group's rows. Every tile shape and every T computes each
 * (row, token) pair the same way: batch-invariant to the bit. */

#define GROUP_ROWS 16
#define GROUP_CHUNK 64                          /* bytes: 4 codes of each of a group's rows */
#define Q4_GROUP_BYTES (4 * GROUP_CHUNK + 64)   /* per block: 32 nibbles a row in 4 chunks, 16 dw, 16 mw */
#define Q8_GROUP_BYTES (8 * GROUP_CHUNK + 32)   /* per block: 32 codes + 128 a row (as u8) in 8 chunks, 16 dw */

typedef struct { /* a step's activations, quantized: [T][K] codes, and per [T][K / 32] block dx and Σ qx */
    int8_t *q;
    float *d;
    int32_t *sum;
} Q8Activations;

/* One token's K inputs (K a multiple of 32) as codes, scales and sums of codes. */
static void quantize_q8(const float *x, int64_t K, int8_t *q, float *d, int32_t *sum) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < K / QUANT_BLOCK; b++) {
        __m256 v[4], top = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + b * QUANT_BLOCK + i * 8);
            top = _mm256_max_ps(top, _mm256_and_ps(v[i], magnitude));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float absmax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
        const float scale = absmax / 127.0f, inverse = absmax > 0.0f ? 127.0f / absmax : 0.0f;
        __m256i codes[4], total = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) { /* rounded to nearest even (the default mode) */
            codes[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inverse)));
            total = _mm256_add_epi32(total, codes[i]);
        }
        /* int32 → int8 with saturating packs, which interleave 128-bit halves; the permute restores the order */
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(codes[0], codes[1]),
                                                  _mm256_packs_epi32(codes[2], codes[3]));
        _mm256_storeu_si256((__m256i *)(q + b * QUANT_BLOCK),
                            _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1));
        d[b] = scale;
        sum[b] = _mm_cvtsi128_si32(t4);
    }
}

static Q8Activations quantize_rows(const float *x, int64_t T, int64_t K) {
    const int64_t blocks = K / QUANT_BLOCK;
    const Q8Activations a = {aligned_alloc(64, (size_t)((T * K + 63) / 64 * 64)), malloc((size_t)(T * blocks * 4)),
                             malloc((size_t)(T * blocks * 4))};
#pragma omp parallel for schedule(static) if (T > 1)
    for (int64_t t = 0; t < T; t++) quantize_q8(x + t * K, K, a.q + t * K, a.d + t * blocks, a.sum + t * blocks);
    return a;
}

static void free_activations(Q8Activations a) {
    free(a.q);
    free(a.d);
    free(a.sum);
}

/* A vector of a group's rows: lanes of 4 codes (rows_t), of int32 sums or of floats (sums_t), one lane a row;
 * RV(op) and RV_SI(op) name an intrinsic of that width. */
#if defined(__AVX512BW__)
#define VECTOR_ROWS 16
#define RV(op) _mm512_##op
#define RV_SI(op) _mm512_##op##_si512
typedef __m512i rows_t;
typedef __m512 sums_t;
typedef __m256i half_scales_t; /* VECTOR_ROWS fp16 */
#define ONE_TOKEN_VECTORS 2 /* 32 rows a one-token tile: 18 tiles of a 576-row projection for 2 threads */
#else
#define VECTOR_ROWS 8
#define RV(op) _mm256_##op
#define RV_SI(op) _mm256_##op##_si256
typedef __m256i rows_t;
typedef __m256 sums_t;
typedef __m128i half_scales_t;
#define ONE_TOKEN_VECTORS 4
#endif
static inline rows_t load_rows(const uint8_t *p) { return RV_SI(loadu)((const rows_t *)p); }
static inline rows_t four_codes(const int8_t *x) { int32_t v; memcpy(&v, x, 4); return RV(set1_epi32)(v); }
static inline rows_t low_nibbles(rows_t v) { return RV_SI(and)(v, RV(set1_epi8)(15)); }
static inline rows_t high_nibbles(rows_t v) { return low_nibbles(RV(srli_epi16)(v, 4)); }
static inline sums_t row_scales(const uint8_t *p) {
    half_scales_t half;
    memcpy(&half, p, sizeof half);
    return RV(cvtph_ps)(half);
}
#define GROUP_VECTORS (GROUP_ROWS / VECTOR_ROWS)

/* A block's 8 vectors of codes for one vector of rows (`codes`: the group's block, advanced to that vector). */
static inline void q4_1_rows(const uint8_t *codes, rows_t w[8]) {
    for (int c = 0; c < 4; c++) {
        const rows_t both = load_rows(codes + c * GROUP_CHUNK);
        w[c] = low_nibbles(both);
        w[4 + c] = high_nibbles(both); /* inputs 16 + 4c .. 16 + 4c + 3 */
    }
}
static inline void q8_0_rows(const uint8_t *codes, rows_t w[8]) {
    for (int c = 0; c < 8; c++) w[c] = load_rows(codes + c * GROUP_CHUNK);
}

/* Per row, the block's 32 products of its weight codes w (0..15, or a Q8_0 code + 128) and one token's input
 * codes x, summed exactly. */
static inline rows_t block_sum(const rows_t w[8], const int8_t *x, int32_t x_sum, int q8_0) {
#if defined(__AVX512VNNI__) && VECTOR_ROWS == 16
    rows_t even = _mm512_setzero_si512(), odd = _mm512_setzero_si512(); /* two chains: dpbusd's latency */
    for (int j = 0; j < 8; j += 2) {
        even = _mm512_dpbusd_epi32(even, w[j], four_codes(x + 4 * j));
        odd = _mm512_dpbusd_epi32(odd, w[j + 1], four_codes(x + 4 * j + 4));
    }
    const rows_t sum = _mm512_add_epi32(even, odd);
    return q8_0 ? _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * x_sum)) : sum; /* Σ (w + 128) x − 128 Σ x */
#else
    (void)x_sum;
    const rows_t ones = RV(set1_epi16)(1);
    if (!q8_0) { /* u4 x s8 pairs are at most 3810: 8 of them still fit int16 */
        rows_t pairs = RV(maddubs_epi16)(w[0], four_codes(x));
        for (int j = 1; j < 8; j++) pairs = RV(add_epi16)(pairs, RV(maddubs_epi16)(w[j], four_codes(x + 4 * j)));
        return RV(madd_epi16)(pairs, ones);
    }
    /* Q8_0: signed weights again; their magnitudes against x with their signs (maddubs takes u8 x s8) */
    rows_t sum = RV_SI(setzero)();
    for (int j = 0; j < 8; j++) {
        const rows_t signed_w = RV_SI(xor)(w[j], RV(set1_epi8)(-128)), x4 = four_codes(x + 4 * j);
#if VECTOR_ROWS == 16
        const rows_t signed_x = _mm512_mask_sub_epi8(x4, _mm512_movepi8_mask(signed_w), _mm512_setzero_si512(), x4);
#else
        const rows_t signed_x = _mm256_sign_epi8(x4, signed_w);
#endif
        sum = RV(add_epi32)(sum, RV(madd_epi16)(RV(maddubs_epi16)(RV(abs_epi8)(signed_w), signed_x), ones));
    }
    return sum;
#endif
}

/* VECTORS vectors of rows (from vector v0) x TOKENS tokens (from t0): y[t][row] = Σ_b dw dx Σ + mw sx. */
#define ROWS_TILE_(NAME, VECTORS, TOKENS) NAME##_rows_##VECTORS##x##TOKENS
#define ROWS_TILE(NAME, VECTORS, TOKENS) ROWS_TILE_(NAME, VECTORS, TOKENS)
#define ROWS_MICROKERNEL(NAME, FORMAT, GROUP_BYTES, HAS_MIN, VECTORS, TOKENS)                                   \
    static inline void ROWS_TILE(NAME, VECTORS, TOKENS)(const uint8_t *weights, int64_t blocks, Q8Activations x, \
                                                        int64_t K, int64_t v0, int64_t t0, float *y, int64_t N) { \
        sums_t acc[VECTORS][TOKENS];                                                                            \
        for (int v = 0; v < VECTORS; v++)                                                                       \
            for (int t = 0; t < TOKENS; t++) acc[v][t] = RV(setzero_ps)();                                      \
        for (int64_t b = 0; b < blocks; b++) {                                                                  \
            for (int v = 0; v < VECTORS; v++) {                                                                 \
                const int64_t vector = v0 + v, half = vector % GROUP_VECTORS;                                   \
                const uint8_t *block = weights + ((vector / GROUP_VECTORS) * blocks + b) * (GROUP_BYTES);       \
                __builtin_prefetch(block + PREFETCH_AHEAD, 0, 3);                                               \
                rows_t w[8];                                                                                    \
                FORMAT##_rows(block + half * VECTOR_ROWS * 4, w);                                               \
                const uint8_t *scales = block + (GROUP_BYTES) - (HAS_MIN ? 64 : 32) + half * VECTOR_ROWS * 2;   \
                const sums_t dw = row_scales(scales), mw = HAS_MIN ? row_scales(scales + 32) : dw;              \
                for (int t = 0; t < TOKENS; t++) {                                                              \
                    const int64_t at = (t0 + t) * blocks + b;                                                   \
                    const rows_t sum = block_sum(w, x.q + at * QUANT_BLOCK, x.sum[at], !(HAS_MIN));             \
                    const sums_t scale = RV(mul_ps)(dw, RV(set1_ps)(x.d[at]));                                  \
                    acc[v][t] = RV(fmadd_ps)(RV(cvtepi32_ps)(sum), scale, acc[v][t]);                           \
                    if (HAS_MIN) /* sx = dx Σ qx */                                                              \
                        acc[v][t] = RV(fmadd_ps)(mw, RV(set1_ps)(x.d[at] * (float)x.sum[at]), acc[v][t]);       \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
        for (int v = 0; v < VECTORS; v++) {                                                                     \
            const int64_t row = (v0 + v) * VECTOR_ROWS, rows = N - row < VECTOR_ROWS ? N - row : VECTOR_ROWS;   \
            for (int t = 0; t < TOKENS; t++) {                                                                  \
                float *out = y + (t0 + t) * N + row;                                                            \
                if (rows == VECTOR_ROWS) {                                                                      \
                    RV(storeu_ps)(out, acc[v][t]);                                                              \
                } else if (rows > 0) { /* a last group's padding rows: computed, not stored */                  \
                    float lanes[VECTOR_ROWS];                                                                   \
                    RV(storeu_ps)(lanes, acc[v][t]);                                                            \
                    memcpy(out, lanes, (size_t)rows * 4);                                                       \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
    }

#define ROWS_TOKEN_TILE 4

/* NAME(x, T, K, weights, N, y) as the fp32-activation ops above, with x quantized per token first and the weights
 * in row groups (pack_q4_rows, pack_q8_rows). */
#define ROWS_MATMUL(NAME, FORMAT, GROUP_BYTES, HAS_MIN)                                                         \
    ROWS_MICROKERNEL(NAME, FORMAT, GROUP_BYTES, HAS_MIN, ONE_TOKEN_VECTORS, 1)                                  \
    ROWS_MICROKERNEL(NAME, FORMAT, GROUP_BYTES, HAS_MIN, 1, ROWS_TOKEN_TILE)                                    \
    ROWS_MICROKERNEL(NAME, FORMAT, GROUP_BYTES, HAS_MIN, 1, 1)                                                  \
    void NAME(const float *x, int64_t T, int64_t K, const uint8_t *weights, int64_t N, float *y) {              \
        const int64_t blocks = K / QUANT_BLOCK;                                                                 \
        const int64_t vectors = (N + GROUP_ROWS - 1) / GROUP_ROWS * GROUP_VECTORS;                              \
        const Q8Activations a = quantize_rows(x, T, K);                                                         \
        if (T == 1) {                                                                                           \
            const int64_t tiles = (vectors + ONE_TOKEN_VECTORS - 1) / ONE_TOKEN_VECTORS;                        \
            _Pragma("omp parallel for schedule(static)") for (int64_t tile = 0; tile < tiles; tile++) {         \
                const int64_t v0 = tile * ONE_TOKEN_VECTORS;                                                    \
                if (vectors - v0 >= ONE_TOKEN_VECTORS)                                                          \
                    ROWS_TILE(NAME, ONE_TOKEN_VECTORS, 1)(weights, blocks, a, K, v0, 0, y, N);                  \
                else                                                                                            \
                    for (int64_t v = v0; v < vectors; v++) ROWS_TILE(NAME, 1, 1)(weights, blocks, a, K, v, 0, y, N); \
            }                                                                                                   \
            free_activations(a);                                                                                \
            return;                                                                                             \
        }                                                                                                       \
        for (int64_t t0 = 0; t0 < T; t0 += TOKEN_CHUNK) {                                                       \
            const int64_t end = T - t0 < TOKEN_CHUNK ? T : t0 + TOKEN_CHUNK;                                    \
            _Pragma("omp parallel for schedule(static)") for (int64_t v = 0; v < vectors; v++) {                \
                int64_t t = t0;                                                                                 \
                for (; t + ROWS_TOKEN_TILE <= end; t += ROWS_TOKEN_TILE)                                        \
                    ROWS_TILE(NAME, 1, ROWS_TOKEN_TILE)(weights, blocks, a, K, v, t, y, N);                     \
                for (; t < end; t++) ROWS_TILE(NAME, 1, 1)(weights, blocks, a, K, v, t, y, N);                  \
            }                                                                                                   \
        }                                                                                                       \
        free_activations(a);                                                                                    \
    }

ROWS_MATMUL(q4_q8_matmul, q4_1, Q4_GROUP_BYTES, 1)
ROWS_MATMUL(q8_q8_matmul, q8_0, Q8_GROUP_BYTES, 0)
