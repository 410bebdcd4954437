/* The CPU's fused ops, compiled for the machine they run on (kernels/cpu/__init__.py builds this file with
 * -O3 -march=native -fopenmp; the OpenMP runtime is the one torch already loaded, so they share its team).
 *
 * Every op computes each output row on its own, in a fixed order: a token's result does not depend on what it
 * is batched with, to the bit. Reductions are written with explicit vectors (the compiler may not reorder a
 * float sum by itself), elementwise loops are left to its vectorizer. All tensors are float32 unless named. */

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
#define ROW_TILE 4
#define TOKEN_TILE 2 /* AVX2's 16 registers: 4 x 2 accumulators + 4 weight vectors */
#endif
#define TOKEN_CHUNK 64 /* tokens whose activations stay in L2 while every weight row streams past them */
#define Q4_BLOCK 32
#define PREFETCH_AHEAD 2048 /* bytes of a thread's weight stream requested ahead: the hardware alone kept too few in flight */
#define Q4_BLOCK_BYTES 20 /* fp16 d, fp16 m, 16 bytes of nibbles: element j low, element j + 16 high */

typedef float vf __attribute__((vector_size(VLEN * 4)));
typedef float vf_unaligned __attribute__((vector_size(VLEN * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VLEN * 4)));

static inline vf load(const float *p) { return *(const vf_unaligned *)p; }
static inline void store(float *p, vf v) { *(vf_unaligned *)p = v; }
static inline vf splat(float x) { return (vf){0} + x; }

/* A vector's lanes summed as a tree (halves added, then their halves...): a fixed order, in a few shuffles. */
static inline float lane_sum(vf v) {
#if VLEN == 16
    return _mm512_reduce_add_ps((__m512)v);
#else
    __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
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

/* exp(x) for x <= 88 to ~2 ulp: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its Taylor series to r^7 / 7!.
 * Plain arithmetic, so loops calling it vectorize. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float shifted = x * 1.44269504089f + 12582912.0f; /* 1.5 * 2^23: rounds x / ln2 to an integer */
    float n = shifted - 12582912.0f;
    float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f; /* ln2 in two parts */
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.66666667e-1f + r * (4.16666667e-2f + r * (8.33333333e-3f
                  + r * (1.38888889e-3f + r * 1.98412698e-4f))))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

/* ---- int4 (Q4_1) projections: y[T][N] = x[T][K] . W[N][K]^T, w = d * q + m per block of 32 inputs ---- */

typedef uint8_t vbytes __attribute__((vector_size(VLEN), aligned(1)));

/* A block's fp16 d and m as floats. One vector conversion of both: a scalar one merges into its destination
 * register, which chains every block to the one before. */
/* bytes → floats through int32 (a direct conversion is scalarized) */
static inline vf to_float(vbytes bytes) { return __builtin_convertvector(__builtin_convertvector(bytes, vi), vf); }

static inline void block_scales(const uint8_t *block, float *d, float *m) {
#if defined(__F16C__)
    int32_t both;
    memcpy(&both, block, 4);
    const __m128 scales = _mm_cvtph_ps(_mm_cvtsi32_si128(both));
    *d = scales[0];
    *m = scales[1];
#else
    _Float16 d16, m16;
    memcpy(&d16, block, 2);
    memcpy(&m16, block + 2, 2);
    *d = (float)d16;
    *m = (float)m16;
#endif
}

static inline void dequantize_row(const uint8_t *row, int64_t blocks, float *w) {
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = row + b * Q4_BLOCK_BYTES;
        __builtin_prefetch(block + PREFETCH_AHEAD, 0, 0);
        float d, m;
        block_scales(block, &d, &m);
        const vf dv = splat(d), mv = splat(m);
        float *out = w + b * Q4_BLOCK;
#if VLEN == 16
        const vbytes nibbles = *(const vbytes *)(block + 4);
        store(out, to_float(nibbles & 15) * dv + mv);
        store(out + 16, to_float(nibbles >> 4) * dv + mv);
#else /* AVX2: split the 16 bytes by hand (GCC scalarizes byte shifts and conversions of 8-byte vectors) */
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(block + 4)), low_bits = _mm_set1_epi8(15);
        const __m128i halves[2] = {_mm_and_si128(bytes, low_bits), _mm_and_si128(_mm_srli_epi16(bytes, 4), low_bits)};
        for (int half = 0; half < 2; half++) {
            store(out + 16 * half, (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(halves[half])) * dv + mv);
            store(out + 16 * half + 8,
                  (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(halves[half], 8))) * dv + mv);
        }
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
            for (int r = 0; r < ROWS; r++) wv[r] = load(w + r * K + k);                                         \
            for (int t = 0; t < TOKENS; t++) {                                                                  \
                vf xv = load(x + t * K + k);                                                                    \
                for (int r = 0; r < ROWS; r++) acc[r][t] += wv[r] * xv;                                         \
            }                                                                                                   \
        }                                                                                                       \
        for (int t = 0; t < TOKENS; t++)                                                                        \
            for (int r = 0; r < ROWS; r++) y[t * N + r] = lane_sum(acc[r][t]);                                  \
    }

MICROKERNEL(ROW_TILE, TOKEN_TILE)
MICROKERNEL(ROW_TILE, 1)
MICROKERNEL(1, TOKEN_TILE)
MICROKERNEL(1, 1)

/* weights: [N][K / 32] blocks of Q4_BLOCK_BYTES; K a multiple of 32 (and so of VLEN). */
void q4_matmul(const float *x, int64_t T, int64_t K, const uint8_t *weights, int64_t N, float *y) {
    const int64_t blocks = K / Q4_BLOCK, row_bytes = blocks * Q4_BLOCK_BYTES;
    const int64_t tiles = (N + ROW_TILE - 1) / ROW_TILE;
    for (int64_t t0 = 0; t0 < T; t0 += TOKEN_CHUNK) {
        const int64_t tokens = T - t0 < TOKEN_CHUNK ? T - t0 : TOKEN_CHUNK;
        const float *xc = x + t0 * K;
        float *yc = y + t0 * N;
#pragma omp parallel
        {
            float *w = aligned_alloc(64, (size_t)(ROW_TILE * K * 4));
#pragma omp for schedule(static)
            for (int64_t tile = 0; tile < tiles; tile++) {
                const int64_t n0 = tile * ROW_TILE;
                const int64_t rows = N - n0 < ROW_TILE ? N - n0 : ROW_TILE;
                for (int64_t r = 0; r < rows; r++) dequantize_row(weights + (n0 + r) * row_bytes, blocks, w + r * K);
                if (rows == ROW_TILE) {
                    int64_t t = 0;
                    for (; t + TOKEN_TILE <= tokens; t += TOKEN_TILE)
                        TILE(ROW_TILE, TOKEN_TILE)(w, K, xc + t * K, yc + t * N + n0, N);
                    for (; t < tokens; t++) TILE(ROW_TILE, 1)(w, K, xc + t * K, yc + t * N + n0, N);
                } else {
                    for (int64_t r = 0; r < rows; r++) {
                        int64_t t = 0;
                        for (; t + TOKEN_TILE <= tokens; t += TOKEN_TILE)
                            TILE(1, TOKEN_TILE)(w + r * K, K, xc + t * K, yc + t * N + n0 + r, N);
                        for (; t < tokens; t++) TILE(1, 1)(w + r * K, K, xc + t * K, yc + t * N + n0 + r, N);
                    }
                }
            }
            free(w);
        }
    }
}

/* ---- attention of one-token queries over the paged cache ----
 * q: [S] rows of q_stride floats, heads of D at h * D; caches: [blocks][block_size][kv_heads][D];
 * block_tables: [S][table_stride] int64; out: [S][H][D]. Query heads g * G .. g * G + G - 1 read kv head g. */
void paged_decode_attention(const float *q, int64_t q_stride, int64_t S, int64_t H, int64_t D,
                            const float *k_cache, const float *v_cache, int64_t block_size, int64_t kv_heads,
                            const int64_t *block_tables, int64_t table_stride, const int32_t *context_lens,
                            int64_t max_context, float scale, float *out) {
    const int64_t group = H / kv_heads;
#pragma omp parallel
    {
        float *scores = malloc((size_t)(group * max_context * 4));
        float *acc = malloc((size_t)(group * D * 4));
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < S * kv_heads; task++) {
            const int64_t s = task / kv_heads, g = task % kv_heads, n = context_lens[s];
            const float *qs = q + s * q_stride + g * group * D;
            const int64_t *table = block_tables + s * table_stride;
            for (int64_t p = 0; p < n; p++) {
                const int64_t slot = table[p / block_size] * block_size + p % block_size;
                const float *k = k_cache + (slot * kv_heads + g) * D;
                for (int64_t h = 0; h < group; h++) scores[h * max_context + p] = dot(qs + h * D, k, D) * scale;
            }
            for (int64_t h = 0; h < group; h++) {
                float *row = scores + h * max_context;
                vf top = splat(-INFINITY);
                int64_t p = 0;
                for (; p + VLEN <= n; p += VLEN) top = vmax(top, load(row + p));
                float highest = -INFINITY;
                for (int i = 0; i < VLEN; i++) highest = top[i] > highest ? top[i] : highest;
                for (; p < n; p++) highest = row[p] > highest ? row[p] : highest;
                for (p = 0; p < n; p++) row[p] = exp_approx(row[p] - highest);
                vf total = {0};
                for (p = 0; p + VLEN <= n; p += VLEN) total += load(row + p);
                float sum = lane_sum(total);
                for (; p < n; p++) sum += row[p];
                const float inverse = 1.0f / sum;
                for (p = 0; p < n; p++) row[p] *= inverse;
            }
            for (int64_t h = 0; h < group; h++) {
                const float *weights = scores + h * max_context;
                float *a = acc + h * D;
                int64_t c = 0;
                for (; c + 4 * VLEN <= D; c += 4 * VLEN) { /* four accumulators held in registers over the context */
                    vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                    for (int64_t p = 0; p < n; p++) {
                        const float *v = v_cache + ((table[p / block_size] * block_size + p % block_size) * kv_heads + g) * D + c;
                        const vf w = splat(weights[p]);
                        a0 += w * load(v);
                        a1 += w * load(v + VLEN);
                        a2 += w * load(v + 2 * VLEN);
                        a3 += w * load(v + 3 * VLEN);
                    }
                    store(a + c, a0);
                    store(a + c + VLEN, a1);
                    store(a + c + 2 * VLEN, a2);
                    store(a + c + 3 * VLEN, a3);
                }
                for (; c < D; c++) {
                    float sum = 0.0f;
                    for (int64_t p = 0; p < n; p++)
                        sum += weights[p] * v_cache[((table[p / block_size] * block_size + p % block_size) * kv_heads + g) * D + c];
                    a[c] = sum;
                }
            }
            memcpy(out + (s * H + g * group) * D, acc, (size_t)(group * D * 4));
        }
        free(acc);
        free(scores);
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

/* k, v: [T] rows of their strides holding `width` floats each; written to row slot_mapping[t] of the caches. */
void store_kv_cache(const float *k, int64_t k_stride, const float *v, int64_t v_stride, int64_t T, int64_t width,
                    float *k_cache, float *v_cache, const int64_t *slot_mapping) {
    for (int64_t t = 0; t < T; t++) {
        memcpy(k_cache + slot_mapping[t] * width, k + t * k_stride, (size_t)(width * 4));
        memcpy(v_cache + slot_mapping[t] * width, v + t * v_stride, (size_t)(width * 4));
    }
}

/* x: [rows][2 * width] (gate, up) → out: [rows][width] = silu(gate) * up. */
void silu_and_mul(const float *x, int64_t rows, int64_t width, float *out) {
#pragma omp parallel for schedule(static) if (rows * width > 32768)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * 2 * width, *up = gate + width;
        float *o = out + r * width;
        for (int64_t i = 0; i < width; i++) o[i] = gate[i] / (1.0f + exp_approx(-gate[i])) * up[i];
    }
}

/* ---- a whole decode forward of a dense Llama-style decoder over int4 weights: the ops above in the model's
 * order, one call for every layer (what Python would otherwise dispatch ~10 times a layer). The arithmetic is the
 * ops' own, so the results equal the op-by-op forward to the bit. ---- */

typedef struct {
    const float *input_norm, *post_attention_norm; /* [hidden] */
    const uint8_t *qkv, *o, *gate_up, *down;       /* Q4 blocks */
    float *k_cache, *v_cache;                      /* [blocks][block_size][kv_heads][head_dim] */
} DecoderLayer;

/* hidden: [T][hidden] the embeddings in, the last layer's MLP output out; residual: [T][hidden] out (their sum is
 * the decoder's output). cos, sin: [T][head_dim / 2]. */
void llama_decode(const DecoderLayer *layers, int64_t num_layers, int64_t T, int64_t hidden_size, int64_t heads,
                  int64_t kv_heads, int64_t head_dim, int64_t intermediate, float eps, float scale,
                  const float *cos, const float *sin, const int64_t *slot_mapping, int64_t block_size,
                  const int64_t *block_tables, int64_t table_stride, const int32_t *context_lens,
                  int64_t max_context, float *hidden, float *residual) {
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
        q4_matmul(normed, T, hidden_size, layer->qkv, qkv_width, qkv);
        rotary_embedding(qkv, qkv_width, heads, qkv + q_width, qkv_width, kv_heads, T, head_dim, cos, sin);
        store_kv_cache(qkv + q_width, qkv_width, qkv + q_width + kv_width, qkv_width, T, kv_width, layer->k_cache,
                       layer->v_cache, slot_mapping);
        paged_decode_attention(qkv, qkv_width, T, heads, head_dim, layer->k_cache, layer->v_cache, block_size,
                               kv_heads, block_tables, table_stride, context_lens, max_context, scale, attention);
        q4_matmul(attention, T, q_width, layer->o, hidden_size, hidden);
        rms_norm(hidden, residual, layer->post_attention_norm, T, hidden_size, eps, normed, residual);
        q4_matmul(normed, T, hidden_size, layer->gate_up, 2 * intermediate, gate_up);
        silu_and_mul(gate_up, T, intermediate, activated);
        q4_matmul(activated, T, intermediate, layer->down, hidden_size, hidden);
    }
    free(activated);
    free(gate_up);
    free(attention);
    free(qkv);
    free(normed);
}
