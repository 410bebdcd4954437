#include "cpu_ops.h"
#include "blocks.h"

/* ---- projections over the checkpoint's quantized blocks: y[T][N] = x[T][K] . W[N][K]^T ----
 * int4 (a GGUF's Q4_0, Q4_1, repacked exactly at load): w = d * q + m per block of 32 inputs; int5 (Q5_1,
 * likewise): the same with 5-bit q; Q8_0: w = d * q, q signed; Q5_0 (as the GGUF stores it):
 * w = d * (q - 16), q of 5 bits; Q4_K, Q5_K and Q6_K as the GGUF stores them (super-blocks of 256 inputs: 8
 * blocks of 32 whose scales are decoded in the kernel, so a weight costs the file's bits, 4.5, 5.5 and 6.56).
 * Each weight row is dequantized to fp32 once per token chunk and multiplied in fp32. */

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
                                             const float *x, float *y, const uint8_t *end) {                   \
        vf acc[ROWS];                                                                                           \
        for (int r = 0; r < ROWS; r++) acc[r] = (vf){0};                                                        \
        for (int64_t s = 0; s < blocks / (SUB); s++) {                                                          \
            float table[ROWS][SCALE_TABLE];                                                                     \
            for (int r = 0; r < ROWS; r++) {                                                                    \
                const uint8_t *super = rows + r * row_bytes + s * (SUPER_BYTES);                                \
                /* ahead in this row, or past its end in the row this one's place takes in the next tile */     \
                const int64_t ahead = s * (SUPER_BYTES) + ONE_TOKEN_AHEAD;                                      \
                prefetch_lines(rows + r * row_bytes + ahead + (ahead < row_bytes ? 0 : ((ROWS) - 1) * row_bytes), \
                               SUPER_BYTES, end);                                                               \
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
    /* rows n0 .. n0 + rows - 1 of the N rows as fp32 w[rows][K]: the weights every product of NAME multiplies */ \
    static void NAME##_rows(const uint8_t *weights, int64_t K, int64_t N, int64_t n0, int64_t rows, float *w) {  \
        const int64_t blocks = K / QUANT_BLOCK, row_bytes = blocks / (SUB) * (SUPER_BYTES);                     \
        for (int64_t r = 0; r < rows; r++) {                                                                    \
            const uint8_t *row = weights + (n0 + r) * row_bytes;                                                \
            for (int64_t s = 0; s < blocks / (SUB); s++) {                                                      \
                const uint8_t *super = row + s * (SUPER_BYTES);                                                 \
                prefetch_lines(super + PREFETCH_AHEAD, SUPER_BYTES, weights + N * row_bytes);                  \
                float table[SCALE_TABLE];                                                                       \
                SCALES(super, table);                                                                           \
                for (int j = 0; j < (SUB); j += (UNIT)) {                                                       \
                    vf dequantized[(UNIT) * BLOCK_VECTORS];                                                     \
                    DEQUANTIZE(super, j, table, dequantized);                                                   \
                    float *out = w + r * K + (s * (SUB) + j) * QUANT_BLOCK;                                     \
                    for (int i = 0; i < (UNIT) * BLOCK_VECTORS; i++) store(out + i * VLEN, dequantized[i]);     \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
    }                                                                                                           \
    ONE_TOKEN_KERNEL(NAME, DEQUANTIZE, SCALES, SUPER_BYTES, SUB, UNIT, ROW_TILE)                                 \
    ONE_TOKEN_KERNEL(NAME, DEQUANTIZE, SCALES, SUPER_BYTES, SUB, UNIT, 1)                                        \
    void NAME(const float *x, int64_t T, int64_t K, const uint8_t *weights, int64_t N, float *y) {            \
        const int64_t blocks = K / QUANT_BLOCK, row_bytes = blocks / (SUB) * (SUPER_BYTES);                \
        const int64_t tiles = (N + ROW_TILE - 1) / ROW_TILE;                                                    \
        if (T == 1) {                                                                                           \
            _Pragma("omp parallel for schedule(static)") for (int64_t tile = 0; tile < tiles; tile++) {         \
                const int64_t n0 = tile * ROW_TILE;                                                             \
                const uint8_t *end = weights + N * row_bytes;                                                   \
                if (N - n0 >= ROW_TILE) {                                                                       \
                    ONE_TOKEN(NAME, ROW_TILE)(weights + n0 * row_bytes, row_bytes, blocks, x, y + n0, end);     \
                } else {                                                                                        \
                    for (int64_t n = n0; n < N; n++)                                                            \
                        ONE_TOKEN(NAME, 1)(weights + n * row_bytes, row_bytes, blocks, x, y + n, end);          \
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
                    NAME##_rows(weights, K, N, n0, rows, w);                                                    \
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

#define FP32_MATMUL(KIND, OP, NAME, ...) BLOCK_MATMUL(OP, __VA_ARGS__)
BLOCK_FORMATS(FP32_MATMUL)

/* Blocks of `kind` (blocks.h's enum) [N][K / 32 SUB] as the fp32 weights [N][K] their ops multiply (what a load
 * checks against gguf's numbers); 0, or -1 for no kind of blocks.h's. */
int64_t dequantize_blocks(int64_t kind, const uint8_t *weights, int64_t N, int64_t K, float *w) {
    switch (kind) {
#define DEQUANTIZE_CASE(KIND, OP, ...)                                                                           \
    case KIND:                                                                                                  \
        _Pragma("omp parallel for schedule(static)") for (int64_t n0 = 0; n0 < N; n0 += ROW_TILE)               \
            OP##_rows(weights, K, N, n0, N - n0 < ROW_TILE ? N - n0 : ROW_TILE, w + n0 * K);                    \
        return 0;
        BLOCK_FORMATS(DEQUANTIZE_CASE)
    default: return -1;
    }
}

/* ---- the same projections with int8 activations in two levels: each token's inputs are quantized per block of
 * 32 to codes q1 = round(x / dx), |q1| <= 127, with the block's own scale dx = absmax / 127 (llama.cpp's Q8_1), and
 * the rounding left over to second codes q2 = round(256 (x / dx - q1)), |q2| <= 127: x = dx (q1 + q2 / 256) to
 * within dx / 256 (absmax / 32,500; one level alone leaves absmax / 254). A block's products of weight and input
 * codes are summed exactly in integers, 256 Σ w q1 + Σ w q2, then y += (dw · dx / 256) · Σ + mw · sx per block, in
 * block order, in fp32, with sx = dx / 256 · (256 Σ q1 + Σ q2) (Q8_0 has no mw; Q6_K sums each 16 apart, its
 * unsigned codes' 32 Σ x taken back, and scales each by its own d').
 *
 * The weights are repacked at load into groups of 16 rows (pack_q4_rows, pack_q4_k_rows, pack_q5_rows,
 * pack_q8_rows, pack_q6_k_rows; blocks.h's row groups).
 * One vector then holds 4 inputs of every row of a group (16 rows with AVX-512, 8 with AVX2), so one broadcast of
 * 4 input codes meets them all: a block is 16 multiply-adds of 4 code pairs per lane (vpdpbusd with AVX512-VNNI;
 * pairs to int16, then to int32, without), no horizontal sums, and one scale vector for all the group's rows.
 * Every tile shape and every T computes each (row, token) pair the same way: batch-invariant to the bit. */

#define SECOND_LEVEL_BITS 8 /* q2's step: 1 / 256 of q1's */
#define SECOND_LEVEL (1 << SECOND_LEVEL_BITS)

typedef struct { /* a step's activations, quantized: [T][K] codes of each level, and per [T][K / 32] block
                  * dx / 256 and 256 Σ q1 + Σ q2, over its 32 inputs and over its first 16 (Q6_K's scales' span), and
                  * their product sx (with one level: dx, Σ q1 and their product, the same numbers) */
    int8_t *q1, *q2;
    float *d, *d_sum;
    int32_t *sum, *first_half;
} Q8Activations;

/* 8 int32 codes (each within int8) of a vector to bytes, 32 codes in order from four vectors: the saturating packs
 * interleave 128-bit halves, the permute restores the order. */
static inline void store_codes(int8_t *out, const __m256i codes[4]) {
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(codes[0], codes[1]),
                                              _mm256_packs_epi32(codes[2], codes[3]));
    _mm256_storeu_si256((__m256i *)out, _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

static inline int32_t sum_lanes(__m256i v) {
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1));
    return _mm_cvtsi128_si32(t4);
}

/* One token's K inputs (K a multiple of 32) as codes of both levels (one: the second's codes 0), scales and sums of
 * codes. */
static void quantize_q8(const float *x, int64_t K, int levels, int8_t *q1, int8_t *q2, float *d, float *d_sum,
                        int32_t *sum, int32_t *first_half) {
    const int first_shift = levels == 1 ? 0 : SECOND_LEVEL_BITS; /* one level: no second codes to make room for */
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    /* q2 within ±127 (256 · 0.5 rounds to 128): a sign flip of -128 (the AVX2 Q8_0 path's) would overflow */
    const __m256i top = _mm256_set1_epi32(127), bottom = _mm256_set1_epi32(-127);
    for (int64_t b = 0; b < K / QUANT_BLOCK; b++) {
        __m256 v[4], absmax8 = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + b * QUANT_BLOCK + i * 8);
            absmax8 = _mm256_max_ps(absmax8, _mm256_and_ps(v[i], magnitude));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(absmax8), _mm256_extractf128_ps(absmax8, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float absmax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
        const float inverse = absmax > 0.0f ? 127.0f / absmax : 0.0f;
        __m256i first[4], second[4], total = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) { /* rounded to nearest even (the default mode) */
            const __m256 scaled = _mm256_mul_ps(v[i], _mm256_set1_ps(inverse));
            first[i] = _mm256_cvtps_epi32(scaled);
            const __m256 left = _mm256_sub_ps(scaled, _mm256_cvtepi32_ps(first[i])); /* exact: |left| <= 0.5 */
            second[i] = levels == 1 ? _mm256_setzero_si256()
                                    : _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(
                                                           left, _mm256_set1_ps((float)SECOND_LEVEL))), top), bottom);
            total = _mm256_add_epi32(total, _mm256_add_epi32(_mm256_slli_epi32(first[i], first_shift), second[i]));
            if (i == 1) first_half[b] = sum_lanes(total);
        }
        store_codes(q1 + b * QUANT_BLOCK, first);
        store_codes(q2 + b * QUANT_BLOCK, second);
        d[b] = absmax / (127.0f * (1 << first_shift));
        sum[b] = sum_lanes(total);
        d_sum[b] = d[b] * (float)sum[b];
    }
}

static Q8Activations quantize_rows(const float *x, int64_t T, int64_t K, int levels) {
    const int64_t blocks = K / QUANT_BLOCK;
    const size_t code_bytes = (size_t)((T * K + 63) / 64 * 64);
    const size_t per_block = (size_t)(T * blocks * 4);
    const Q8Activations a = {aligned_alloc(64, code_bytes), aligned_alloc(64, code_bytes), malloc(per_block),
                             malloc(per_block), malloc(per_block), malloc(per_block)};
#pragma omp parallel for schedule(static) if (T > 1)
    for (int64_t t = 0; t < T; t++)
        quantize_q8(x + t * K, K, levels, a.q1 + t * K, a.q2 + t * K, a.d + t * blocks, a.d_sum + t * blocks,
                    a.sum + t * blocks, a.first_half + t * blocks);
    return a;
}

static void free_activations(Q8Activations a) {
    free(a.q1);
    free(a.q2);
    free(a.d);
    free(a.d_sum);
    free(a.sum);
    free(a.first_half);
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
#else
#define VECTOR_ROWS 8
#define RV(op) _mm256_##op
#define RV_SI(op) _mm256_##op##_si256
typedef __m256i rows_t;
typedef __m256 sums_t;
typedef __m128i half_scales_t;
#endif
/* vectors of rows a one-token tile takes: with AVX-512 32 rows, 18 tiles of a 576-row projection for 2 threads; with
 * AVX2 16 (four vectors, once the tiles' vectors were unrolled, spilled the token's broadcasts: at one token on Zen 3
 * two took 0.75-0.9x their time for Q4_K, Q6_K, int5, Q8_0) */
#define ONE_TOKEN_VECTORS 2
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

/* Each format's row groups, in units of one block of 32 inputs (Q4_K's: a super-block's 8, their codes one after
 * another, 4 chunks each, then its scales), for one vector of rows: a block's 8 chunks of codes (code_chunk from
 * `codes`, the block's advanced to that vector: chunk c, inputs 4c .. 4c + 3), its scales (FORMAT_scales: block j of
 * the unit) and what the tokens' blocks add to the rows' sums (FORMAT_tokens). */
typedef struct {
    sums_t first, second; /* int4, int5: d, m; Q4_K: d', m'; Q8_0: d; Q6_K: d' of inputs 0-15, of 16-31 */
} RowScales;

/* A format's weight codes: unsigned nibbles (int4, Q4_K), unsigned 5-bit codes (int5), unsigned 6-bit (Q6_K), Q8_0's
 * codes + 128 */
enum { INT4_CODES, INT5_CODES, Q6_CODES, Q8_0_CODES };

/* Chunk c of a block's codes for one vector of rows (inputs 4c .. 4c + 3, a lane a row), unpacked from the block's
 * bytes `codes` (advanced to that vector): int4's low nibbles of chunk c, high ones of chunk c - 4 (inputs 16 ..);
 * int5's with bit c of the fifths chunk as their bit 4; Q6_K's with bits 2k of high-pair chunk 4 + c / 4 (k = c % 4)
 * as their bits 4-5. One chunk at a time: only the chunk in use occupies a register. */
INLINED rows_t code_chunk(const uint8_t *codes, int c, int kind) {
    if (kind == Q8_0_CODES) return load_rows(codes + c * GROUP_CHUNK);
    const rows_t both = load_rows(codes + c % 4 * GROUP_CHUNK);
    const rows_t nibbles = c < 4 ? low_nibbles(both) : high_nibbles(both);
    if (kind == INT5_CODES) {
        const rows_t fifths = load_rows(codes + 4 * GROUP_CHUNK);
        const rows_t at_four = c < 4 ? RV(slli_epi16)(fifths, 4 - c) : RV(srli_epi16)(fifths, c - 4);
        return RV_SI(or)(nibbles, RV_SI(and)(at_four, RV(set1_epi8)(0x10)));
    }
    if (kind == Q6_CODES) {
        const rows_t pairs = load_rows(codes + (4 + c / 4) * GROUP_CHUNK);
        const int k = c % 4; /* a 16-bit shift of bits 2k to bits 4-5, then the mask */
        const rows_t at_top = k < 3 ? RV(slli_epi16)(pairs, 4 - 2 * k) : RV(srli_epi16)(pairs, 2);
        return RV_SI(or)(nibbles, RV_SI(and)(at_top, RV(set1_epi8)(0x30)));
    }
    return nibbles;
}

static inline RowScales d_and_m(const uint8_t *scales, int64_t half) { /* the group's 16 fp16 d, then 16 m */
    return (RowScales){row_scales(scales + half * VECTOR_ROWS * 2), row_scales(scales + 32 + half * VECTOR_ROWS * 2)};
}
static inline RowScales q4_groups_scales(const uint8_t *block, int j, int64_t half) {
    (void)j; /* one block a unit */
    return d_and_m(block + 4 * GROUP_CHUNK, half);
}
static inline RowScales q5_groups_scales(const uint8_t *block, int j, int64_t half) {
    (void)j;
    return d_and_m(block + 5 * GROUP_CHUNK, half);
}
static inline RowScales q8_groups_scales(const uint8_t *block, int j, int64_t half) {
    (void)j; /* one block a unit */
    const sums_t d = row_scales(block + 8 * GROUP_CHUNK + half * VECTOR_ROWS * 2);
    return (RowScales){d, d};
}
static inline sums_t int8_scales(const uint8_t *p) { /* VECTOR_ROWS int8 as floats (Q6_K's sc, Q4_K's sc and mn) */
#if VECTOR_ROWS == 16
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#endif
}
static inline RowScales q6_groups_scales(const uint8_t *block, int j, int64_t half) {
    (void)j; /* one block a unit */
    const uint8_t *sc = block + Q6_GROUP_SC + half * VECTOR_ROWS;
    const sums_t d = row_scales(block + Q6_GROUP_D + half * VECTOR_ROWS * 2);
    return (RowScales){RV(mul_ps)(d, int8_scales(sc)), RV(mul_ps)(d, int8_scales(sc + GROUP_ROWS))}; /* exact */
}

/* tokens a tile of one vector of rows takes (its codes unpacked once for them): 8 with AVX-512's 32 registers (Q6_K
 * 7% faster at 32 tokens than 4, int4 2%), 4 with AVX2's 16 */
#if VECTOR_ROWS == 16
#define ROWS_TOKEN_TILE 8
#else
#define ROWS_TOKEN_TILE 4
#endif

/* A running sum kept a chain, one add after another: with several tokens GCC otherwise rebalances the adds of each
 * token's products into a tree, all the products live at once, spilled to the stack (Q4_K at 32 tokens: 1.5x the
 * time). One token's tree fits the registers, and its depth is shorter than the chain. */
static inline void chained(rows_t *sum) { __asm__("" : "+v"(*sum)); }

/* Per row and token, the products of CHUNKS chunks of weight codes (from chunk FIRST of `codes`) and one level of
 * `tokens` tokens' input codes (x[t]: the token's codes of those chunks), summed exactly into sums[t]. Chunk by chunk:
 * each chunk of weights meets every token while in a register, and the tokens' sums are independent chains. */
INLINED void level_sums(const uint8_t *codes, int first, int chunks, const int8_t *const *x, int tokens, int kind,
                        rows_t *sums) {
#if defined(__AVX512VNNI__) && VECTOR_ROWS == 16
    rows_t even[ROWS_TOKEN_TILE], odd[ROWS_TOKEN_TILE]; /* two chains a token: dpbusd's latency */
    for (int t = 0; t < tokens; t++) even[t] = odd[t] = _mm512_setzero_si512();
    for (int j = 0; j < chunks; j += 2) {
        const rows_t pair[2] = {code_chunk(codes, first + j, kind), code_chunk(codes, first + j + 1, kind)};
        for (int t = 0; t < tokens; t++) {
            even[t] = _mm512_dpbusd_epi32(even[t], pair[0], four_codes(x[t] + 4 * j));
            odd[t] = _mm512_dpbusd_epi32(odd[t], pair[1], four_codes(x[t] + 4 * j + 4));
        }
    }
    /* Q8_0: Σ (w + 128) x */
    for (int t = 0; t < tokens; t++) sums[t] = _mm512_add_epi32(even[t], odd[t]);
#else
    const rows_t ones = RV(set1_epi16)(1);
    if (kind == INT4_CODES) { /* u4 x s8 pairs are at most 3840: 8 of them still fit int16 */
        rows_t pairs[ROWS_TOKEN_TILE];
        for (int j = 0; j < chunks; j++) {
            const rows_t chunk = code_chunk(codes, first + j, kind);
            for (int t = 0; t < tokens; t++) {
                const rows_t products = RV(maddubs_epi16)(chunk, four_codes(x[t] + 4 * j));
                pairs[t] = j ? RV(add_epi16)(pairs[t], products) : products;
                if (tokens > 1) chained(&pairs[t]);
            }
        }
        for (int t = 0; t < tokens; t++) sums[t] = RV(madd_epi16)(pairs[t], ones);
        return;
    }
    for (int t = 0; t < tokens; t++) sums[t] = RV_SI(setzero)();
    if (kind != Q8_0_CODES) { /* u5, u6 x s8 pairs are at most 16002: 2 of them fit int16 */
        for (int j = 0; j < chunks; j += 2) {
            const rows_t pair[2] = {code_chunk(codes, first + j, kind), code_chunk(codes, first + j + 1, kind)};
            for (int t = 0; t < tokens; t++) {
                const rows_t pairs = RV(add_epi16)(RV(maddubs_epi16)(pair[0], four_codes(x[t] + 4 * j)),
                                                   RV(maddubs_epi16)(pair[1], four_codes(x[t] + 4 * j + 4)));
                sums[t] = RV(add_epi32)(sums[t], RV(madd_epi16)(pairs, ones));
                if (tokens > 1) chained(&sums[t]);
            }
        }
        return;
    }
    /* Q8_0: signed weights again; their magnitudes against x with their signs (maddubs takes u8 x s8) */
    for (int j = 0; j < chunks; j++) {
        const rows_t signed_w = RV_SI(xor)(code_chunk(codes, first + j, kind), RV(set1_epi8)(-128));
        const rows_t magnitudes = RV(abs_epi8)(signed_w);
#if VECTOR_ROWS == 16
        const __mmask64 negative = _mm512_movepi8_mask(signed_w);
#endif
        for (int t = 0; t < tokens; t++) {
            const rows_t x4 = four_codes(x[t] + 4 * j);
#if VECTOR_ROWS == 16
            const rows_t signed_x = _mm512_mask_sub_epi8(x4, negative, _mm512_setzero_si512(), x4);
#else
            const rows_t signed_x = _mm256_sign_epi8(x4, signed_w);
#endif
            sums[t] = RV(add_epi32)(sums[t], RV(madd_epi16)(RV(maddubs_epi16)(magnitudes, signed_x), ones));
            if (tokens > 1) chained(&sums[t]);
        }
    }
#endif
}

/* 256 Σ w q1 + Σ w q2 per row and token over CHUNKS chunks from chunk FIRST of the tokens' blocks `at` (int4, int5,
 * Q8_0: at most 32 · 255 · 127 · 257; Q6_K: 16 · 63 · 127 · 257, 32 Σ x back: within int32); with one level Σ w q1,
 * as the activations' scales and sums then count. */
INLINED void two_level_sums(const uint8_t *codes, int first, int chunks, Q8Activations x, const int64_t *at, int tokens,
                            int kind, int levels, rows_t *sums) {
    const int8_t *x1[ROWS_TOKEN_TILE], *x2[ROWS_TOKEN_TILE];
    for (int t = 0; t < tokens; t++) {
        x1[t] = x.q1 + at[t] * QUANT_BLOCK + 4 * first;
        x2[t] = x.q2 + at[t] * QUANT_BLOCK + 4 * first;
    }
    level_sums(codes, first, chunks, x1, tokens, kind, sums);
    if (levels == 1) return;
    for (int t = 0; t < tokens; t++) sums[t] = RV(slli_epi32)(sums[t], SECOND_LEVEL_BITS);
    rows_t second[ROWS_TOKEN_TILE];
    level_sums(codes, first, chunks, x2, tokens, kind, second);
    for (int t = 0; t < tokens; t++) sums[t] = RV(add_epi32)(sums[t], second[t]);
}

/* FORMAT_tokens: what the tokens' blocks `at` add to the rows' sums acc[t], given the block's weight `codes` and
 * scales s. Every tile shape calls it with its own number of tokens, the arithmetic per (row, token) the same. */

/* acc + (d dx / 256) Σ + m sx (sx = dx / 256 · Σ x) */
INLINED void scale_min_tokens(const uint8_t *codes, RowScales s, Q8Activations x, const int64_t *at, sums_t *acc,
                              int tokens, int kind, int levels) {
    rows_t sums[ROWS_TOKEN_TILE];
    two_level_sums(codes, 0, 8, x, at, tokens, kind, levels, sums);
    for (int t = 0; t < tokens; t++) {
        acc[t] = RV(fmadd_ps)(RV(cvtepi32_ps)(sums[t]), RV(mul_ps)(s.first, RV(set1_ps)(x.d[at[t]])), acc[t]);
        acc[t] = RV(fmadd_ps)(s.second, RV(set1_ps)(x.d_sum[at[t]]), acc[t]);
    }
}
INLINED void q4_groups_tokens(const uint8_t *codes, RowScales s, Q8Activations x, const int64_t *at, sums_t *acc,
                              int tokens, int levels) {
    scale_min_tokens(codes, s, x, at, acc, tokens, INT4_CODES, levels);
}
INLINED void q5_groups_tokens(const uint8_t *codes, RowScales s, Q8Activations x, const int64_t *at, sums_t *acc,
                              int tokens, int levels) {
    scale_min_tokens(codes, s, x, at, acc, tokens, INT5_CODES, levels);
}

/* Q4_K's super-blocks: d' = d·sc and m' = −dmin·mn of block j, exact in fp32 (gguf's numbers); its codes are int4's */
static inline RowScales q4_k_groups_scales(const uint8_t *unit, int j, int64_t half) {
    const RowScales d = d_and_m(unit + Q4_K_GROUP_D, half); /* d, dmin */
    const uint8_t *row = unit + half * VECTOR_ROWS + GROUP_ROWS * j;
    return (RowScales){RV(mul_ps)(d.first, int8_scales(row + Q4_K_GROUP_SC)),
                       RV(sub_ps)(RV(setzero_ps)(), RV(mul_ps)(d.second, int8_scales(row + Q4_K_GROUP_MN)))};
}
#define q4_k_groups_tokens q4_groups_tokens
/* acc + (d dx / 256) Σ */
INLINED void q8_groups_tokens(const uint8_t *codes, RowScales s, Q8Activations x, const int64_t *at, sums_t *acc,
                              int tokens, int levels) {
    rows_t sums[ROWS_TOKEN_TILE];
    two_level_sums(codes, 0, 8, x, at, tokens, Q8_0_CODES, levels, sums);
    for (int t = 0; t < tokens; t++) {
#if defined(__AVX512VNNI__) && VECTOR_ROWS == 16
        sums[t] = _mm512_sub_epi32(sums[t], _mm512_set1_epi32(128 * x.sum[at[t]])); /* Σ (w + 128) x − 128 Σ x */
#endif
        acc[t] = RV(fmadd_ps)(RV(cvtepi32_ps)(sums[t]), RV(mul_ps)(s.first, RV(set1_ps)(x.d[at[t]])), acc[t]);
    }
}
/* acc + Σ over the block's two 16s of (d' dx / 256) (Σ q x − 32 Σ x), q the unsigned 6-bit code */
INLINED void q6_groups_tokens(const uint8_t *codes, RowScales s, Q8Activations x, const int64_t *at, sums_t *acc,
                              int tokens, int levels) {
    const sums_t scales[2] = {s.first, s.second};
    for (int h = 0; h < 2; h++) {
        rows_t sums[ROWS_TOKEN_TILE];
        two_level_sums(codes, 4 * h, 4, x, at, tokens, Q6_CODES, levels, sums);
        for (int t = 0; t < tokens; t++) {
            const int32_t x_sum = h ? x.sum[at[t]] - x.first_half[at[t]] : x.first_half[at[t]];
            const rows_t sum = RV(sub_epi32)(sums[t], RV(set1_epi32)(32 * x_sum));
            acc[t] = RV(fmadd_ps)(RV(cvtepi32_ps)(sum), RV(mul_ps)(scales[h], RV(set1_ps)(x.d[at[t]])), acc[t]);
        }
    }
}

/* VECTORS vectors of rows (from vector v0) x TOKENS tokens (from t0): y[t][row], block by block (FORMAT_tokens), with
 * LEVELS levels of activation codes. */
#define ROWS_TILE_(NAME, VECTORS, TOKENS, LEVELS) NAME##_rows_##VECTORS##x##TOKENS##_##LEVELS
#define ROWS_TILE(NAME, VECTORS, TOKENS, LEVELS) ROWS_TILE_(NAME, VECTORS, TOKENS, LEVELS)
#define ROWS_MICROKERNEL(NAME, FORMAT, UNIT_BYTES, UNIT_BLOCKS, VECTORS, TOKENS, LEVELS)                       \
    static inline void ROWS_TILE(NAME, VECTORS, TOKENS, LEVELS)(const uint8_t *weights, int64_t blocks,         \
                                                                Q8Activations x, int64_t K, int64_t v0,         \
                                                                int64_t t0, float *y, int64_t N) {              \
        const int64_t units = blocks / (UNIT_BLOCKS);                                                           \
        const uint8_t *weights_end = weights + (N + GROUP_ROWS - 1) / GROUP_ROWS * units * (UNIT_BYTES);        \
        sums_t acc[VECTORS][TOKENS];                                                                            \
        for (int v = 0; v < VECTORS; v++)                                                                       \
            for (int t = 0; t < TOKENS; t++) acc[v][t] = RV(setzero_ps)();                                      \
        for (int64_t u = 0; u < units; u++) {                                                                   \
            _Pragma("GCC unroll 8") for (int j = 0; j < (UNIT_BLOCKS); j++) { /* a unit's shared scales once */ \
                const int64_t b = u * (UNIT_BLOCKS) + j;                                                        \
                _Pragma("GCC unroll 8") for (int v = 0; v < VECTORS; v++) { /* acc[v] in registers */          \
                    const int64_t vector = v0 + v, half = vector % GROUP_VECTORS;                               \
                    const uint8_t *unit = weights + ((vector / GROUP_VECTORS) * units + u) * (UNIT_BYTES);      \
                    if (half == 0) /* the unit's bytes, a block's share at a time */                            \
                        prefetch_lines(unit + j * ((UNIT_BYTES) / (UNIT_BLOCKS)) + PREFETCH_AHEAD,              \
                                       (UNIT_BYTES) / (UNIT_BLOCKS), weights_end);                              \
                    const uint8_t *codes = unit + j * 4 * GROUP_CHUNK + half * VECTOR_ROWS * 4;                 \
                    const RowScales scales = FORMAT##_scales(unit, j, half);                                    \
                    int64_t at[TOKENS];                                                                         \
                    for (int t = 0; t < TOKENS; t++) at[t] = (t0 + t) * blocks + b;                             \
                    FORMAT##_tokens(codes, scales, x, at, acc[v], TOKENS, LEVELS);                                  \
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

/* NAME's work with LEVELS levels of activation codes, x quantized as `a` */
#define ROWS_MATMUL_LEVELS(NAME, FORMAT, UNIT_BYTES, UNIT_BLOCKS, LEVELS)                                     \
    ROWS_MICROKERNEL(NAME, FORMAT, UNIT_BYTES, UNIT_BLOCKS, ONE_TOKEN_VECTORS, 1, LEVELS)                       \
    ROWS_MICROKERNEL(NAME, FORMAT, UNIT_BYTES, UNIT_BLOCKS, 1, ROWS_TOKEN_TILE, LEVELS)                         \
    ROWS_MICROKERNEL(NAME, FORMAT, UNIT_BYTES, UNIT_BLOCKS, 1, 1, LEVELS)                                       \
    static void NAME##_##LEVELS(Q8Activations a, int64_t T, int64_t K, const uint8_t *weights, int64_t N,       \
                                float *y) {                                                                     \
        const int64_t blocks = K / QUANT_BLOCK;                                                                 \
        const int64_t vectors = (N + GROUP_ROWS - 1) / GROUP_ROWS * GROUP_VECTORS;                              \
        if (T == 1) {                                                                                           \
            const int64_t tiles = (vectors + ONE_TOKEN_VECTORS - 1) / ONE_TOKEN_VECTORS;                        \
            _Pragma("omp parallel for schedule(static)") for (int64_t tile = 0; tile < tiles; tile++) {         \
                const int64_t v0 = tile * ONE_TOKEN_VECTORS;                                                    \
                if (vectors - v0 >= ONE_TOKEN_VECTORS)                                                          \
                    ROWS_TILE(NAME, ONE_TOKEN_VECTORS, 1, LEVELS)(weights, blocks, a, K, v0, 0, y, N);          \
                else                                                                                            \
                    for (int64_t v = v0; v < vectors; v++)                                                      \
                        ROWS_TILE(NAME, 1, 1, LEVELS)(weights, blocks, a, K, v, 0, y, N);                       \
            }                                                                                                   \
            return;                                                                                             \
        }                                                                                                       \
        for (int64_t t0 = 0; t0 < T; t0 += TOKEN_CHUNK) {                                                       \
            const int64_t end = T - t0 < TOKEN_CHUNK ? T : t0 + TOKEN_CHUNK;                                    \
            _Pragma("omp parallel for schedule(static)") for (int64_t v = 0; v < vectors; v++) {                \
                int64_t t = t0;                                                                                 \
                for (; t + ROWS_TOKEN_TILE <= end; t += ROWS_TOKEN_TILE)                                        \
                    ROWS_TILE(NAME, 1, ROWS_TOKEN_TILE, LEVELS)(weights, blocks, a, K, v, t, y, N);             \
                for (; t < end; t++) ROWS_TILE(NAME, 1, 1, LEVELS)(weights, blocks, a, K, v, t, y, N);          \
            }                                                                                                   \
        }                                                                                                       \
    }

/* NAME(x, T, K, weights, N, y, levels) as the fp32-activation ops above, with x quantized per token first (levels
 * 2: two levels of codes; 1: the first alone, llama.cpp's Q8_1, half the integer work) and the weights in row groups
 * (pack_q4_rows, pack_q4_k_rows, pack_q5_rows, pack_q8_rows, pack_q6_k_rows). */
#define ROWS_MATMUL(NAME, FORMAT, UNIT_BYTES, UNIT_BLOCKS)                                                     \
    ROWS_MATMUL_LEVELS(NAME, FORMAT, UNIT_BYTES, UNIT_BLOCKS, 1)                                                \
    ROWS_MATMUL_LEVELS(NAME, FORMAT, UNIT_BYTES, UNIT_BLOCKS, 2)                                                \
    void NAME(const float *x, int64_t T, int64_t K, const uint8_t *weights, int64_t N, float *y, int64_t levels) { \
        const Q8Activations a = quantize_rows(x, T, K, levels == 1 ? 1 : 2);                                    \
        (levels == 1 ? NAME##_1 : NAME##_2)(a, T, K, weights, N, y);                                            \
        free_activations(a);                                                                                    \
    }

ROWS_MATMUL(q4_q8_matmul, q4_groups, Q4_GROUP_BYTES, 1)
ROWS_MATMUL(q8_q8_matmul, q8_groups, Q8_GROUP_BYTES, 1)
ROWS_MATMUL(q6_q8_matmul, q6_groups, Q6_GROUP_BYTES, 1)
ROWS_MATMUL(q5_q8_matmul, q5_groups, Q5_GROUP_BYTES, 1)
ROWS_MATMUL(q4_k_q8_matmul, q4_k_groups, Q4_K_GROUP_BYTES, SUPER_BLOCKS)
