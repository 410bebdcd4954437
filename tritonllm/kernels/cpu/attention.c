#include "cpu_ops.h"

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
