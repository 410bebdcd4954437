/* What every CPU op builds on: the target's vector width and tiles, float vectors, fixed-order lane sums, dot
 * products and exp. Header-only (static inline), so each op's file inlines them. */

#pragma once

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* a helper inlined whatever its size: the register tiles it is part of are only tiles once inlined */
#define INLINED static inline __attribute__((always_inline))

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
#define ONE_TOKEN_AHEAD 4096 /* the same for one token's stream, per row of a one-token tile (into the row taking
                              * its place in the next tile past its end), up to the matrix's end. With every line
                              * of a block requested (one per block before), at the 1B model's shapes (Zen 4) a Q4_K
                              * layer took 1.96 ms against 2.48 and a one-stream decode 21.0 tok/s against 13.5 */

/* Requests every cache line of bytes [p, p + bytes) ahead of use, none at or past `end` (a prefetch per block
 * touched under half the lines of a block larger than one: a 144-byte Q4_K super-block spans 2-3). */
static inline void prefetch_lines(const uint8_t *p, int64_t bytes, const uint8_t *end) {
    for (int64_t line = 0; line < bytes; line += 64)
        if (p + line < end) __builtin_prefetch(p + line, 0, 3);
}

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

/* VLEN elements of a KV cache row from element i: float32, or float16 when `half` (see attention.c) */
static inline vf load_cached(const void *row, int64_t i, int half) {
    if (!half) return load((const float *)row + i);
#if VLEN == 16
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i)));
#else
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
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
    /* The same tree in in-lane shuffles: z[i] = [s of v[i] | s of v[i + 4]], s_k = v[k] + v[k + 4]; w[i] = [t of
     * v[2i], v[2i + 1] | t of v[2i + 4], v[2i + 5]], t = (s0 + s2, s1 + s3); then t0 + t1, in lane order. (GCC
     * lowered the generic shuffles to vpermd with index registers and spilled the partial sums.) */
    __m256 z[4], w[2];
    for (int i = 0; i < 4; i++) {
        const __m256 a = (__m256)v[i], b = (__m256)v[i + 4];
        z[i] = _mm256_add_ps(_mm256_insertf128_ps(a, _mm256_castps256_ps128(b), 1),
                             _mm256_permute2f128_ps(a, b, 0x31));
    }
    for (int i = 0; i < 2; i++)
        w[i] = _mm256_add_ps(_mm256_shuffle_ps(z[2 * i], z[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(z[2 * i], z[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return (vf)_mm256_add_ps(_mm256_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm256_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
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

