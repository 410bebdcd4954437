/* The CPU's fused ops, compiled for the machine they run on (tritonllm/kernels/cpu/__init__.py builds this file with
 * -O3 -march=native -fopenmp; the OpenMP runtime is the one torch already loaded, so they share its team).
 *
 * Every op computes each output row on its own, in a fixed order: a token's result does not depend on what it
 * is batched with, to the bit. Reductions are written with explicit vectors (the compiler may not reorder a
 * float sum by itself), elementwise loops are left to its vectorizer. All tensors are float32 unless named; the KV
 * cache is float32 or float16 (`half`). */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define VLEN 16
#define ROW_TILE 6   /* 6 rows x 4 tokens of accumulators + 6 weight vectors: 31 of AVX-512's 32 registers */
#define TOKEN_TILE 4 /* (6 x 4 measured 15% faster than 4 x 4, 4 x 6 and 8 x 2 at 32 tokens) */
#else
#define VLEN 8
#define ROW_TILE 3
#define TOKEN_TILE 4 /* AVX2's 16 registers: 3 x 4 accumulators + 3 weight vectors + 1 of activations (at 32 tokens
                      * 0.70-0.74x the time of 4 x 2; 3 x 3, 4 x 3 0.79-0.85x; 5 x 2, 6 x 2 0.92-0.98x) */
#endif
#if VLEN == 16
#define VALUE_CHUNK 4 /* attention: 3 heads x 4 vectors of accumulators + 4 of values */
#else
#define VALUE_CHUNK 2
#endif
#define HEAD_TILE 3 /* query heads sharing a kv head, per pass over its values */
#define TOKEN_CHUNK 64 /* tokens whose activations stay in L2 while every weight row streams past them */
#define PREFETCH_AHEAD 4096 /* bytes of a thread's weight stream requested ahead, into L1 (prefetcht0): the hardware
                             * alone kept too few in flight. Measured on a one-token step: 1-8 KiB ahead as
                             * non-temporal 11.3-13.3 ms, into L1 8.6-11.7 (4 KiB: 8.8), none 13.4-14.1 */

typedef float vf __attribute__((vector_size(VLEN * 4)));
typedef float vf_unaligned __attribute__((vector_size(VLEN * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VLEN * 4)));

static inline vf load(const float *p) { return *(const vf_unaligned *)p; }
static inline void store(float *p, vf v) { *(vf_unaligned *)p = v; }
static inline vf splat(float x) { /* a broadcast ((vf){0} + x costs an add: 0 + -0 is +0) */
#if VLEN == 16
    return (vf)_mm512_set1_ps(x);
#else
    return (vf)_mm256_set1_ps(x);
#endif
}

/* A vector's lanes summed as a tree (halves added, then their halves...): a fixed order, in a few shuffles. */
static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

static inline float lane_sum(vf v) {
#if VLEN == 16
    return _mm512_reduce_add_ps((__m512)v);
#else
    return sum8((__m256)v);
#endif
}

/* VLEN vectors' lane sums as one vector (lane j: the sum of v[j]): halves of pairs added, then their halves...
 * (15 shuffled adds for 16 sums, where lane_sum takes 4 steps each). */
#define HALVES(a, b, ...) (__builtin_shufflevector(a, b, __VA_ARGS__))
static inline vf lane_sums(const vf *v) {
#if VLEN == 16
    vf z[8], w[4], u[2];
    for (int i = 0; i < 8; i++)
        z[i] = HALVES(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + HALVES(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        w[i] = HALVES(z[2 * i], z[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + HALVES(z[2 * i], z[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        u[i] = HALVES(w[2 * i], w[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + HALVES(w[2 * i], w[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return HALVES(u[0], u[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + HALVES(u[0], u[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
    vf z[4], w[2];
    for (int i = 0; i < 4; i++)
        z[i] = HALVES(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11)
             + HALVES(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        w[i] = HALVES(z[2 * i], z[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13)
             + HALVES(z[2 * i], z[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return HALVES(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14) + HALVES(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

static inline vf vmax(vf a, vf b) {
    vi a_bigger = a > b;
    return (vf)((a_bigger & (vi)a) | (~a_bigger & (vi)b));
}

static inline float dot(const float *a, const float *b, int64_t n) {
    vf acc = {0};
    int64_t i = 0;
    for (; i + VLEN <= n; i += VLEN) acc += load(a + i) * load(b + i);
    float sum = lane_sum(acc);
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* exp's range reduction, for x (a float or a vector of floats) in [-87, 88]: x = n ln2 + r, |r| <= ln2 / 2;
 * sets n and p = exp(r) by its Taylor series to r^7 / 7! (the caller scales p by 2^n). Plain arithmetic, so loops
 * using it vectorize. */
#define EXP_REDUCE(x, n, p)                                                                                     \
    do {                                                                                                        \
        n = ((x) * 1.44269504089f + 12582912.0f) - 12582912.0f; /* 1.5 * 2^23: rounds x / ln2 to an integer */ \
        const __typeof__(n) r_ = (x) - n * 0.693145751953125f - n * 1.428606765330187e-06f; /* ln2, 2 parts */ \
        p = 1.0f + r_ * (1.0f + r_ * (0.5f + r_ * (1.66666667e-1f + r_ * (4.16666667e-2f + r_ * (8.33333333e-3f  \
                + r_ * (1.38888889e-3f + r_ * 1.98412698e-4f))))));                                               \
    } while (0)

/* exp(x) for x <= 88 to ~2 ulp */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n, p;
    EXP_REDUCE(x, n, p);
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

/* exp_approx of each lane (written out: GCC leaves exp_approx's loops scalar for AVX2) */
static inline vf exp_lanes(vf x) {
    x = vmax(x, splat(-87.0f));
    x = -vmax(-x, splat(-88.0f));
    vf n, p;
    EXP_REDUCE(x, n, p);
    return p * (vf)((__builtin_convertvector(n, vi) + 127) << 23);
}

/* ---- projections over the checkpoint's quantized blocks: y[T][N] = x[T][K] . W[N][K]^T ----
 * Q4_1 (the decoder's projections): w = d * q + m per block of 32 inputs; Q8_0 (a GGUF's embedding and LM head):
 * w = d * q, q signed. Each weight row is dequantized to fp32 once per token chunk and multiplied in fp32. */

#define QUANT_BLOCK 32
#define Q4_1_BYTES 24 /* fp32 d, fp32 m (the GGUF's fp16, widened at load: each a broadcast from memory, where
                       * fp16 took a conversion and two shuffles per row and block), 16 bytes of nibbles: element
                       * j low, element j + 16 high */
#define Q8_0_BYTES 34 /* fp16 d, 32 signed bytes */

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

/* A block's 32 weights as BLOCK_VECTORS vectors (in registers, once inlined). */
static inline void dequantize_q4_1(const uint8_t *block, vf *out) {
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

static inline void dequantize_q8_0(const uint8_t *block, vf *out) {
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
#define ONE_TOKEN_KERNEL(NAME, DEQUANTIZE, BLOCK_BYTES, ROWS)                                                  \
    static inline void ONE_TOKEN(NAME, ROWS)(const uint8_t *rows, int64_t row_bytes, int64_t blocks,          \
                                             const float *x, float *y) {                                       \
        vf acc[ROWS];                                                                                           \
        for (int r = 0; r < ROWS; r++) acc[r] = (vf){0};                                                        \
        for (int64_t b = 0; b < blocks; b++) {                                                                  \
            vf xv[BLOCK_VECTORS];                                                                               \
            for (int i = 0; i < BLOCK_VECTORS; i++) xv[i] = load(x + b * QUANT_BLOCK + i * VLEN);              \
            for (int r = 0; r < ROWS; r++) {                                                                    \
                const uint8_t *block = rows + r * row_bytes + b * (BLOCK_BYTES);                                \
                __builtin_prefetch(block + PREFETCH_AHEAD, 0, 3);                                               \
                vf w[BLOCK_VECTORS];                                                                            \
                DEQUANTIZE(block, w);                                                                           \
                for (int i = 0; i < BLOCK_VECTORS; i++) acc[r] += w[i] * xv[i];                                 \
            }                                                                                                   \
        }                                                                                                       \
        for (int r = 0; r < ROWS; r++) y[r] = lane_sum(acc[r]);                                                 \
    }

/* NAME(x, T, K, weights, N, y): weights [N][K / 32] blocks of BLOCK_BYTES; K a multiple of 32 (and so of VLEN). */
#define BLOCK_MATMUL(NAME, DEQUANTIZE, BLOCK_BYTES)                                                              \
    ONE_TOKEN_KERNEL(NAME, DEQUANTIZE, BLOCK_BYTES, ROW_TILE)                                                    \
    ONE_TOKEN_KERNEL(NAME, DEQUANTIZE, BLOCK_BYTES, 1)                                                           \
    void NAME(const float *x, int64_t T, int64_t K, const uint8_t *weights, int64_t N, float *y) {            \
        const int64_t blocks = K / QUANT_BLOCK, row_bytes = blocks * (BLOCK_BYTES);                             \
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
                        for (int64_t b = 0; b < blocks; b++) {                                                  \
                            __builtin_prefetch(row + b * (BLOCK_BYTES) + PREFETCH_AHEAD, 0, 3);                 \
                            vf dequantized[BLOCK_VECTORS];                                                      \
                            DEQUANTIZE(row + b * (BLOCK_BYTES), dequantized);                                   \
                            for (int i = 0; i < BLOCK_VECTORS; i++)                                             \
                                store(w + r * K + b * QUANT_BLOCK + i * VLEN, dequantized[i]);                  \
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

BLOCK_MATMUL(q4_matmul, dequantize_q4_1, Q4_1_BYTES)
BLOCK_MATMUL(q8_matmul, dequantize_q8_0, Q8_0_BYTES)

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

/* ---- attention over the paged cache ----
 * Caches: [blocks][block_size][kv_heads][D]; a sequence's block table lists its blocks. Query heads g * G ..
 * g * G + G - 1 read kv head g. */

/* A KV cache's elements are float32, or float16 when `half` (half the bytes that attention, bound by memory
 * reads, streams; F16C converts VLEN of them in one instruction, rounding to nearest even like torch). */
static inline const void *cache_row(const void *cache, int64_t element, int half) {
    return (const char *)cache + element * (half ? 2 : 4);
}

static inline vf load_cached(const void *row, int64_t i, int half) {
    if (!half) return load((const float *)row + i);
#if VLEN == 16
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i)));
#else
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
#endif
}

static inline float cached(const void *row, int64_t i, int half) {
    return half ? _cvtsh_ss(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

typedef struct { /* one thread's scratch: scores of G heads over the longest context, and their outputs */
    float *scores, *acc;
    int64_t row_len;
} AttentionScratch;

static AttentionScratch scratch_for(int64_t group, int64_t D, int64_t max_context) {
    const int64_t padded_group = (group + HEAD_TILE - 1) / HEAD_TILE * HEAD_TILE;
    const int64_t row_len = max_context + VLEN; /* a score row: whole vectors of positions */
    /* calloc: the padding heads' weights stay 0 */
    return (AttentionScratch){calloc((size_t)(padded_group * row_len), 4), malloc((size_t)(padded_group * D * 4)),
                              row_len};
}

static void free_scratch(AttentionScratch scratch) {
    free(scratch.acc);
    free(scratch.scores);
}

/* One query position's G heads (qs: G heads of D back to back) attending to the first n positions of a sequence
 * (table: its blocks) through kv head g; out: G heads of D. Decode and prefill rows both come here, so a
 * position's result does not depend on how it was batched. Inlined with `half` a constant: a copy per cache type. */
static inline __attribute__((always_inline)) void attend(
    const float *qs, int64_t group, int64_t D, int64_t n, const int64_t *table, const void *k_cache,
    const void *v_cache, int64_t block_size, int64_t kv_heads, int64_t g, float scale, AttentionScratch scratch,
    float *out, const int half) {
    float *const scores = scratch.scores, *const acc = scratch.acc;
    const int64_t row_len = scratch.row_len, row_bytes = D * (half ? 2 : 4);
/* this kv head's row of position p in a cache */
#define head_row(cache, p) \
    cache_row(cache, ((table[(p) / block_size] * block_size + (p) % block_size) * kv_heads + g) * D, half)
    for (int64_t p0 = 0; p0 < n; p0 += VLEN) { /* VLEN positions' dot products, summed together */
        for (int64_t p = p0 + VLEN; p < p0 + 2 * VLEN && p < n; p++) /* the next ones' keys */
            for (int64_t byte = 0; byte < row_bytes; byte += 64)
                __builtin_prefetch((const char *)head_row(k_cache, p) + byte, 0, 3);
        for (int64_t h = 0; h < group; h++) {
            const float *qh = qs + h * D;
            vf partial[VLEN];
            for (int64_t j = 0; j < VLEN; j++) {
                partial[j] = (vf){0};
                if (p0 + j >= n) continue;
                const void *k = head_row(k_cache, p0 + j);
                int64_t c = 0;
                for (; c + VLEN <= D; c += VLEN) partial[j] += load(qh + c) * load_cached(k, c, half);
                for (; c < D; c++) partial[j][0] += qh[c] * cached(k, c, half);
            }
            store(scores + h * row_len + p0, lane_sums(partial) * scale);
        }
    }
    for (int64_t h = 0; h < group; h++) {
        float *row = scores + h * row_len;
        vf top = splat(-INFINITY);
        int64_t p = 0;
        for (; p + VLEN <= n; p += VLEN) top = vmax(top, load(row + p));
        float highest = -INFINITY;
        for (int i = 0; i < VLEN; i++) highest = top[i] > highest ? top[i] : highest;
        for (; p < n; p++) highest = row[p] > highest ? row[p] : highest;
        for (p = 0; p + VLEN <= n; p += VLEN) store(row + p, exp_lanes(load(row + p) - highest));
        for (; p < n; p++) row[p] = exp_approx(row[p] - highest);
        vf total = {0};
        for (p = 0; p + VLEN <= n; p += VLEN) total += load(row + p);
        float sum = lane_sum(total);
        for (; p < n; p++) sum += row[p];
        const float inverse = 1.0f / sum;
        for (p = 0; p < n; p++) row[p] *= inverse;
    }
    /* each value row read once for HEAD_TILE heads: their accumulators stay in registers over the context */
    for (int64_t h0 = 0; h0 < group; h0 += HEAD_TILE) {
        const float *weights = scores + h0 * row_len;
        int64_t c = 0;
        for (; c + VALUE_CHUNK * VLEN <= D; c += VALUE_CHUNK * VLEN) {
            vf sums[HEAD_TILE][VALUE_CHUNK] = {{{0}}};
            for (int64_t p = 0; p < n; p++) {
                const void *v = head_row(v_cache, p);
                if (p + VLEN < n) __builtin_prefetch(cache_row(head_row(v_cache, p + VLEN), c, half), 0, 3);
                vf values[VALUE_CHUNK];
                for (int i = 0; i < VALUE_CHUNK; i++) values[i] = load_cached(v, c + i * VLEN, half);
                for (int hh = 0; hh < HEAD_TILE; hh++) {
                    const vf w = splat(weights[hh * row_len + p]);
                    for (int i = 0; i < VALUE_CHUNK; i++) sums[hh][i] += w * values[i];
                }
            }
            for (int hh = 0; hh < HEAD_TILE; hh++)
                for (int i = 0; i < VALUE_CHUNK; i++) store(acc + (h0 + hh) * D + c + i * VLEN, sums[hh][i]);
        }
        for (; c < D; c++)
            for (int hh = 0; hh < HEAD_TILE; hh++) {
                float sum = 0.0f;
                for (int64_t p = 0; p < n; p++) sum += weights[hh * row_len + p] * cached(head_row(v_cache, p), c, half);
                acc[(h0 + hh) * D + c] = sum;
            }
    }
#undef head_row
    memcpy(out, acc, (size_t)(group * D * 4));
}

/* One-token queries: q [S] rows of q_stride floats, heads of D at h * D; sequence s attends to its first
 * context_lens[s] positions; block_tables: [S][table_stride] int64; out: [S][H][D]. */
void paged_decode_attention(const float *q, int64_t q_stride, int64_t S, int64_t H, int64_t D,
                            const void *k_cache, const void *v_cache, int64_t block_size, int64_t kv_heads,
                            const int64_t *block_tables, int64_t table_stride, const int32_t *context_lens,
                            int64_t max_context, float scale, float *out, int64_t half) {
    const int64_t group = H / kv_heads;
#pragma omp parallel
    {
        const AttentionScratch scratch = scratch_for(group, D, max_context);
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < S * kv_heads; task++) {
            const int64_t s = task / kv_heads, g = task % kv_heads;
            const float *qs = q + s * q_stride + g * group * D;
            const int64_t *table = block_tables + s * table_stride;
            float *at = out + (s * H + g * group) * D;
            if (half)
                attend(qs, group, D, context_lens[s], table, k_cache, v_cache, block_size, kv_heads, g, scale, scratch,
                       at, 1);
            else
                attend(qs, group, D, context_lens[s], table, k_cache, v_cache, block_size, kv_heads, g, scale, scratch,
                       at, 0);
        }
        free_scratch(scratch);
    }
}

/* Prefill chunks, causal: chunk c's queries are rows query_starts[c] .. + query_lens[c] of q (rows of q_stride
 * floats) and the last query_lens[c] of its context_lens[c] positions (those before: a cached prefix or earlier
 * chunks); each attends to its own position and the ones before. block_tables: [chunks][table_stride] int64;
 * out: [rows][H][D]. */
void paged_prefill_attention(const float *q, int64_t q_stride, int64_t chunks, const int32_t *query_starts,
                             const int32_t *query_lens, const int32_t *context_lens, int64_t H, int64_t D,
                             const void *k_cache, const void *v_cache, int64_t block_size, int64_t kv_heads,
                             const int64_t *block_tables, int64_t table_stride, float scale, float *out,
                             int64_t half) {
    const int64_t group = H / kv_heads;
    int64_t rows = 0, max_context = 0;
    for (int64_t c = 0; c < chunks; c++) {
        rows = query_starts[c] + query_lens[c] > rows ? query_starts[c] + query_lens[c] : rows;
        max_context = context_lens[c] > max_context ? context_lens[c] : max_context;
    }
#pragma omp parallel
    {
        const AttentionScratch scratch = scratch_for(group, D, max_context);
        int64_t c = 0; /* the chunk of the last task (tasks come in row order to each thread) */
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < rows * kv_heads; task++) {
            const int64_t row = task / kv_heads, g = task % kv_heads;
            if (row < query_starts[c]) c = 0;
            while (row >= query_starts[c] + query_lens[c]) c++;
            const int64_t position = context_lens[c] - query_lens[c] + (row - query_starts[c]);
            const float *qs = q + row * q_stride + g * group * D;
            const int64_t *table = block_tables + c * table_stride;
            float *at = out + (row * H + g * group) * D;
            if (half)
                attend(qs, group, D, position + 1, table, k_cache, v_cache, block_size, kv_heads, g, scale, scratch,
                       at, 1);
            else
                attend(qs, group, D, position + 1, table, k_cache, v_cache, block_size, kv_heads, g, scale, scratch,
                       at, 0);
        }
        free_scratch(scratch);
    }
}

/* ---- per-token elementwise ops (rows of `width`; a strided input has its row stride passed) ---- */

/* out = weight * x / rms(x); with a residual: x += residual first and the sum is written to summed. */
void rms_norm(const float *x, const float *residual, const float *weight, int64_t rows, int64_t width, float eps,
              float *out, float *summed) {
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * width;
        float *o = out + r * width;
        if (residual) {
            float *sr = summed + r * width;
            const float *rr = residual + r * width;
            for (int64_t i = 0; i < width; i++) sr[i] = xr[i] + rr[i];
            xr = sr;
        }
        const float inverse = 1.0f / sqrtf(dot(xr, xr, width) / (float)width + eps);
        for (int64_t i = 0; i < width; i++) o[i] = weight[i] * (xr[i] * inverse);
    }
}

/* Neox rotation in place: each head's first half x1 and second half x2 become x1 c - x2 s, x2 c + x1 s.
 * q: [T] rows of q_stride, q_heads heads of D; k likewise; cos, sin: [T][D / 2]. */
void rotary_embedding(float *q, int64_t q_stride, int64_t q_heads, float *k, int64_t k_stride, int64_t k_heads,
                      int64_t T, int64_t D, const float *cos, const float *sin) {
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) if (T > 1)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * half, *s = sin + t * half;
        for (int which = 0; which < 2; which++) {
            float *row = which ? k + t * k_stride : q + t * q_stride;
            const int64_t heads = which ? k_heads : q_heads;
            for (int64_t h = 0; h < heads; h++) {
                float *x1 = row + h * D, *x2 = x1 + half;
                for (int64_t i = 0; i < half; i++) {
                    const float a = x1[i], b = x2[i];
                    x1[i] = a * c[i] - b * s[i];
                    x2[i] = b * c[i] + a * s[i];
                }
            }
        }
    }
}

/* n floats as float16, rounded to nearest even */
static void to_half(const float *from, int64_t n, uint16_t *to) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(to + i), _mm256_cvtps_ph(_mm256_loadu_ps(from + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) to[i] = _cvtss_sh(from[i], _MM_FROUND_TO_NEAREST_INT);
}

/* k, v: [T] rows of their strides holding `width` floats each; written to row slot_mapping[t] of the caches (as
 * float16 when `half`). */
void store_kv_cache(const float *k, int64_t k_stride, const float *v, int64_t v_stride, int64_t T, int64_t width,
                    void *k_cache, void *v_cache, const int64_t *slot_mapping, int64_t half) {
    for (int64_t t = 0; t < T; t++) {
        if (half) {
            to_half(k + t * k_stride, width, (uint16_t *)k_cache + slot_mapping[t] * width);
            to_half(v + t * v_stride, width, (uint16_t *)v_cache + slot_mapping[t] * width);
        } else {
            memcpy((float *)k_cache + slot_mapping[t] * width, k + t * k_stride, (size_t)(width * 4));
            memcpy((float *)v_cache + slot_mapping[t] * width, v + t * v_stride, (size_t)(width * 4));
        }
    }
}

/* x: [rows][2 * width] (gate, up) → out: [rows][width] = silu(gate) * up. */
void silu_and_mul(const float *x, int64_t rows, int64_t width, float *out) {
#pragma omp parallel for schedule(static) if (rows * width > 32768)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * 2 * width, *up = gate + width;
        float *o = out + r * width;
        int64_t i = 0;
        for (; i + VLEN <= width; i += VLEN) {
            const vf g = load(gate + i);
            store(o + i, g / (1.0f + exp_lanes(-g)) * load(up + i));
        }
        for (; i < width; i++) o[i] = gate[i] / (1.0f + exp_approx(-gate[i])) * up[i];
    }
}

/* ---- a whole decode forward of a dense Llama-style decoder over int4 weights: the ops above in the model's
 * order, one call for every layer (what Python would otherwise dispatch ~10 times a layer). The arithmetic is the
 * ops' own, so the results equal the op-by-op forward to the bit. ---- */

typedef struct {
    const float *input_norm, *post_attention_norm; /* [hidden] */
    const uint8_t *qkv, *o, *gate_up, *down;       /* Q4 blocks */
    void *k_cache, *v_cache;                       /* [blocks][block_size][kv_heads][head_dim], float32 or 16 */
} DecoderLayer;

/* hidden: [T][hidden] the embeddings in, the last layer's MLP output out; residual: [T][hidden] out (their sum is
 * the decoder's output). cos, sin: [T][head_dim / 2]. half_cache: the layers' KV caches are float16.
 * int8_activations: the projections quantize their inputs (q4_q8_matmul), else fp32 (q4_matmul). */
void llama_decode(const DecoderLayer *layers, int64_t num_layers, int64_t T, int64_t hidden_size, int64_t heads,
                  int64_t kv_heads, int64_t head_dim, int64_t intermediate, float eps, float scale,
                  const float *cos, const float *sin, const int64_t *slot_mapping, int64_t block_size,
                  const int64_t *block_tables, int64_t table_stride, const int32_t *context_lens,
                  int64_t max_context, float *hidden, float *residual, int64_t half_cache,
                  int64_t int8_activations) {
    void (*const matmul)(const float *, int64_t, int64_t, const uint8_t *, int64_t, float *) =
        int8_activations ? q4_q8_matmul : q4_matmul;
    const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim, qkv_width = q_width + 2 * kv_width;
    float *normed = malloc((size_t)(T * hidden_size * 4)), *qkv = malloc((size_t)(T * qkv_width * 4));
    float *attention = malloc((size_t)(T * q_width * 4)), *gate_up = malloc((size_t)(T * 2 * intermediate * 4));
    float *activated = malloc((size_t)(T * intermediate * 4));
    for (int64_t l = 0; l < num_layers; l++) {
        const DecoderLayer *layer = layers + l;
        if (l == 0) { /* the embeddings are the first residual */
            rms_norm(hidden, NULL, layer->input_norm, T, hidden_size, eps, normed, NULL);
            memcpy(residual, hidden, (size_t)(T * hidden_size * 4));
        } else {
            rms_norm(hidden, residual, layer->input_norm, T, hidden_size, eps, normed, residual);
        }
        matmul(normed, T, hidden_size, layer->qkv, qkv_width, qkv);
        rotary_embedding(qkv, qkv_width, heads, qkv + q_width, qkv_width, kv_heads, T, head_dim, cos, sin);
        store_kv_cache(qkv + q_width, qkv_width, qkv + q_width + kv_width, qkv_width, T, kv_width, layer->k_cache,
                       layer->v_cache, slot_mapping, half_cache);
        paged_decode_attention(qkv, qkv_width, T, heads, head_dim, layer->k_cache, layer->v_cache, block_size,
                               kv_heads, block_tables, table_stride, context_lens, max_context, scale, attention,
                               half_cache);
        matmul(attention, T, q_width, layer->o, hidden_size, hidden);
        rms_norm(hidden, residual, layer->post_attention_norm, T, hidden_size, eps, normed, residual);
        matmul(normed, T, hidden_size, layer->gate_up, 2 * intermediate, gate_up);
        silu_and_mul(gate_up, T, intermediate, activated);
        matmul(activated, T, intermediate, layer->down, hidden_size, hidden);
    }
    free(activated);
    free(gate_up);
    free(attention);
    free(qkv);
    free(normed);
}

/* ---- sampling: each row's token (its argmax, or drawn with a temperature by inverse CDF) and the log of its
 * softmax normalizer over the raw logits, in a few passes over the row while it is in cache (torch takes a dozen
 * passes over the whole batch, each through memory, for the same). ---- */

#define SAMPLE_CHUNK 256 /* entries per partial sum: the draw finds its chunk, then its entry in it */

/* exp(x) for x <= 0, exactly 0 below -87 (a banned token, -inf, never counts). */
static inline vf exp_nonpositive(vf x) {
    const vi underflows = x < -87.0f;
    return (vf)((vi)exp_lanes(x) & ~underflows);
}

/* row[i .. i + VLEN) with entries at or past n read as -inf */
static inline vf load_padded(const float *row, int64_t i, int64_t n) {
    if (i + VLEN <= n) return load(row + i);
    vf v = splat(-INFINITY);
    for (int64_t j = i; j < n; j++) v[j - i] = row[j];
    return v;
}

static inline float row_max(const float *row, int64_t n) {
    vf m = splat(-INFINITY);
    for (int64_t i = 0; i < n; i += VLEN) m = vmax(m, load_padded(row, i, n));
    float best = -INFINITY;
    for (int j = 0; j < VLEN; j++) best = m[j] > best ? m[j] : best;
    return best;
}

/* Σ exp((row[i] - max) * scale) over one chunk (lanes, then lane_sum), its terms kept in `terms` if given */
static inline float chunk_exp_sum(const float *row, int64_t start, int64_t n, float max, float scale, float *terms) {
    vf sum = {0};
    const int64_t end = start + SAMPLE_CHUNK < n ? start + SAMPLE_CHUNK : n;
    for (int64_t i = start; i < end; i += VLEN) {
        const vf e = exp_nonpositive((load_padded(row, i, end) - max) * scale);
        if (terms) store(terms + (i - start), e);
        sum += e;
    }
    return lane_sum(sum);
}

/* The entry that inverse-CDF sampling with uniform u picks from softmax(row * inverse_temperature): the first whose
 * running sum of exp terms exceeds u times their total (the last positive term if rounding leaves none). */
static int64_t draw(const float *row, int64_t n, float max, float inverse_temperature, float u) {
    const int64_t chunks = (n + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK;
    float *sums = malloc((size_t)chunks * 4);
    float total = 0.0f;
    for (int64_t c = 0; c < chunks; c++) total += sums[c] = chunk_exp_sum(row, c * SAMPLE_CHUNK, n, max,
                                                                          inverse_temperature, NULL);
    const float target = u * total;
    float below = 0.0f, terms[SAMPLE_CHUNK] __attribute__((aligned(64)));
    int64_t chosen = -1;
    for (int64_t c = 0; c < chunks && chosen < 0; c++) {
        if (below + sums[c] <= target) {
            below += sums[c];
            continue;
        }
        chunk_exp_sum(row, c * SAMPLE_CHUNK, n, max, inverse_temperature, terms);
        const int64_t start = c * SAMPLE_CHUNK, size = n - start < SAMPLE_CHUNK ? n - start : SAMPLE_CHUNK;
        float running = below;
        for (int64_t i = 0; i < size && chosen < 0; i++) {
            running += terms[i];
            if (terms[i] > 0.0f && running > target) chosen = start + i;
        }
        below = running;
    }
    for (int64_t c = chunks - 1; chosen < 0 && c >= 0; c--) { /* target >= the total, by rounding */
        if (sums[c] == 0.0f) continue;
        chunk_exp_sum(row, c * SAMPLE_CHUNK, n, max, inverse_temperature, terms);
        for (int64_t i = (n - c * SAMPLE_CHUNK < SAMPLE_CHUNK ? n - c * SAMPLE_CHUNK : SAMPLE_CHUNK) - 1; i >= 0; i--)
            if (terms[i] > 0.0f) {
                chosen = c * SAMPLE_CHUNK + i;
                break;
            }
    }
    free(sums);
    return chosen;
}

/* logits, raw: [rows][vocab] (raw: before any adjustment; may be logits itself). inverse_temperatures[r] = 0:
 * greedy (the first maximal entry, as torch.argmax); else drawn with uniforms[r]. tokens[r], and
 * log_normalizers[r] = log Σ exp(raw[r]). */
void sample_rows(const float *logits, const float *raw, int64_t rows, int64_t vocab, const float *inverse_temperatures,
                 const float *uniforms, int64_t *tokens, float *log_normalizers) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = logits + r * vocab, *raw_row = raw + r * vocab;
        const float max = row_max(row, vocab);
        if (inverse_temperatures[r] == 0.0f) {
            int64_t i = 0;
            while (i + 1 < vocab && row[i] != max) i++;
            tokens[r] = i;
        } else {
            tokens[r] = draw(row, vocab, max, inverse_temperatures[r], uniforms[r]);
        }
        const float raw_max = raw_row == row ? max : row_max(raw_row, vocab);
        float sum = 0.0f;
        for (int64_t start = 0; start < vocab; start += SAMPLE_CHUNK)
            sum += chunk_exp_sum(raw_row, start, vocab, raw_max, 1.0f, NULL);
        log_normalizers[r] = raw_max + logf(sum);
    }
}
