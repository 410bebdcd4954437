#include <omp.h>

#include "cpu_ops.h"

/* ---- attention over the paged cache ----
 * Caches: [blocks][block_size][kv_heads][D]; a sequence's block table lists its blocks. Query heads g * G ..
 * g * G + G - 1 read kv head g. */

/* A KV cache's elements are float32, or float16 when `half` (half the bytes that attention, bound by memory
 * reads, streams; F16C converts VLEN of them in one instruction, rounding to nearest even like torch). */
static inline const void *cache_row(const void *cache, int64_t element, int half) {
    return (const char *)cache + element * (half ? 2 : 4);
}

static inline float cached(const void *row, int64_t i, int half) {
    return half ? _cvtsh_ss(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

#if VLEN == 8 /* a prefill chunk's consecutive query positions reading each K/V tile together: with AVX2's register
               * tiles, at 8,000 tokens 32 took 0.65x the CPU of 8 (more reuse of each K/V load; the same at 2,048) */
#define QUERY_TILE 32
#else
#define QUERY_TILE 8
#endif
#define KEY_TILE 64   /* positions a query tile reads from L1: 16 KiB of one kv head's fp32 keys (whole vectors) */

#define KEY_SPLIT 512 /* positions per softmax partial, a multiple of KEY_TILE: a tile's scores over them stay in L2 */

typedef struct { /* one thread's scratch: a tile's rows (query i's head h: row i * padded_group + h) over a split */
    float *scores, *acc; /* [rows][row_len] scores, then exp(score - top); [rows][D] weighted value sums */
    float *keys_by_dim;  /* a key tile transposed: [D][KEY_TILE] (query tiles of several positions, AVX2) */
    int64_t *rows;       /* each context position's element offset in the caches (for this task's kv head) */
    float *top, *total;  /* [rows]: a split's highest score (-INFINITY: the split is past the row's query), sum */
    float *state;        /* [rows][PARTIAL]: the splits folded so far */
    int64_t row_len, query_stride;
} AttentionScratch;

#define PARTIAL(D) ((D) + 2) /* a row's partial softmax: highest score, sum of exp(score - highest), weighted sums */

static AttentionScratch scratch_for(int64_t queries, int64_t group, int64_t D, int64_t max_context) {
    const int64_t padded_group = (group + HEAD_TILE - 1) / HEAD_TILE * HEAD_TILE, rows = queries * padded_group;
    const int64_t row_len = KEY_SPLIT + VLEN; /* a score row: whole vectors of positions */
    /* calloc: the padding heads' weights stay 0 */
    return (AttentionScratch){calloc((size_t)(rows * row_len), 4),
                              malloc((size_t)(rows * D * 4)),
                              queries > 1 ? malloc((size_t)(D * KEY_TILE * 4)) : NULL,
                              malloc((size_t)((max_context + VLEN) * 8)),
                              malloc((size_t)(rows * 4)),
                              malloc((size_t)(rows * 4)),
                              malloc((size_t)(rows * PARTIAL(D) * 4)),
                              row_len,
                              padded_group * row_len};
}

static void free_scratch(AttentionScratch scratch) {
    free(scratch.state);
    free(scratch.total);
    free(scratch.top);
    free(scratch.keys_by_dim);
    free(scratch.rows);
    free(scratch.acc);
    free(scratch.scores);
}

/* partial[j]: the lanes of q · keys[j] for j < count (the rest 0), each summed over D's vectors in order, then
 * its tail in lane 0. A whole vector of keys goes interleaved: VLEN independent sums keep the FMA units busy where
 * one key's sum at a time waits on each FMA's latency. */
INLINED void key_partials(const float *q, int64_t D, const void *const *keys, int64_t count, vf *partial,
                          const int half) {
    for (int j = 0; j < VLEN; j++) partial[j] = (vf){0};
    const int64_t whole = D / VLEN * VLEN;
    if (count == VLEN)
        for (int64_t c = 0; c < whole; c += VLEN) {
            const vf qc = load(q + c);
            for (int j = 0; j < VLEN; j++) partial[j] += qc * load_cached(keys[j], c, half);
        }
    else
        for (int64_t j = 0; j < count; j++)
            for (int64_t c = 0; c < whole; c += VLEN) partial[j] += load(q + c) * load_cached(keys[j], c, half);
    for (int64_t c = whole; c < D; c++)
        for (int64_t j = 0; j < count; j++) partial[j][0] += q[c] * cached(keys[j], c, half);
}

#if VLEN == 8
/* keys_by_dim [D][KEY_TILE] = the tile's `count` keys (rows[0 ..]) transposed, fp32; keys past count 0. 8 x 8
 * blocks through registers. The next tile's `ahead` keys (rows[KEY_TILE ..]) are requested meanwhile: the cache
 * misses of a long context's keys were most of the transpose's time. */
INLINED void transpose_key_tile(const void *k_cache, const int64_t *rows, int64_t count, int64_t ahead, int64_t D,
                                float *keys_by_dim, const int half) {
    for (int64_t j0 = 0; j0 < KEY_TILE; j0 += 8)
        for (int64_t d0 = 0; d0 < D; d0 += 8) {
            for (int64_t j = j0; d0 == 0 && j < j0 + 8 && j < ahead; j++)
                for (int64_t byte = 0; byte < D * (half ? 2 : 4); byte += 64)
                    __builtin_prefetch((const char *)cache_row(k_cache, rows[KEY_TILE + j], half) + byte, 0, 2);
            __m256 r[8], u[8], w[8];
            for (int j = 0; j < 8; j++)
                r[j] = j0 + j < count ? (__m256)load_cached(cache_row(k_cache, rows[j0 + j], half), d0, half)
                                      : _mm256_setzero_ps();
            for (int j = 0; j < 8; j += 2) {
                u[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
                u[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
            }
            for (int j = 0; j < 8; j += 4) {
                w[j] = _mm256_shuffle_ps(u[j], u[j + 2], _MM_SHUFFLE(1, 0, 1, 0));
                w[j + 1] = _mm256_shuffle_ps(u[j], u[j + 2], _MM_SHUFFLE(3, 2, 3, 2));
                w[j + 2] = _mm256_shuffle_ps(u[j + 1], u[j + 3], _MM_SHUFFLE(1, 0, 1, 0));
                w[j + 3] = _mm256_shuffle_ps(u[j + 1], u[j + 3], _MM_SHUFFLE(3, 2, 3, 2));
            }
            for (int d = 0; d < 4; d++) {
                _mm256_storeu_ps(keys_by_dim + (d0 + d) * KEY_TILE + j0, _mm256_permute2f128_ps(w[d], w[d + 4], 0x20));
                _mm256_storeu_ps(keys_by_dim + (d0 + d + 4) * KEY_TILE + j0,
                                 _mm256_permute2f128_ps(w[d], w[d + 4], 0x31));
            }
        }
}

#define SCORE_ROWS 6 /* query heads per register tile of scores: 4 x 2 vectors of keys */
#define MAX_TILE_ROWS 512 /* a query tile's query heads taking tile_scores (more: key_partials) */

/* Scores of `rows` query heads (row r's D at query[r]) against the tile's keys (keys_by_dim), key vector k to
 * out[r] + first + k * VLEN, scaled: each lane l's partial sum q[l] k[l] + q[8 + l] k[8 + l] + ... in that
 * order, then lane_sums' tree over the 8 partials, so each score has key_partials' bits, with no horizontal sum. */
static __attribute__((noinline)) void tile_scores(const float *const *query, int64_t rows, int64_t D,
                                                               const float *keys_by_dim, int64_t key_vectors,
                                                               float scale, float *const *out, int64_t first) {
    for (int64_t r0 = 0; r0 < rows; r0 += SCORE_ROWS)
        for (int64_t k0 = 0; k0 < key_vectors; k0 += 2) {
            const int R = rows - r0 < SCORE_ROWS ? (int)(rows - r0) : SCORE_ROWS;
            const int K = key_vectors - k0 < 2 ? 1 : 2;
            vf partial[8][SCORE_ROWS][2];
            for (int l = 0; l < 8; l++) {
                vf acc[SCORE_ROWS][2] = {{{0}}};
                for (int64_t d = l; d < D; d += 8) {
                    vf k_first = load(keys_by_dim + d * KEY_TILE + k0 * 8);
                    vf k_second = load(keys_by_dim + d * KEY_TILE + k0 * 8 + 8);
                    __asm__("" : "+v"(k_first), "+v"(k_second)); /* in registers: GCC re-read them per row */
                    for (int r = 0; r < SCORE_ROWS; r++) {
                        const vf q = splat(query[r0 + (r < R ? r : 0)][d]);
                        acc[r][0] += q * k_first;
                        acc[r][1] += q * k_second;
                    }
                }
                for (int r = 0; r < SCORE_ROWS; r++) {
                    partial[l][r][0] = acc[r][0];
                    partial[l][r][1] = acc[r][1];
                }
            }
            for (int r = 0; r < R; r++)
                for (int k = 0; k < K; k++) {
                    const vf sum = ((partial[0][r][k] + partial[4][r][k]) + (partial[2][r][k] + partial[6][r][k])) +
                                   ((partial[1][r][k] + partial[5][r][k]) + (partial[3][r][k] + partial[7][r][k]));
                    store(out[r0 + r] + first + (k0 + k) * VLEN, sum * scale);
                }
        }
}
#define VALUE_ROWS 6 /* query heads per register tile of weighted value sums: 6 x 2 vectors */

/* sums[r] (D floats) += weights[r][p] V[p] for p in [start, end) of rows (V rows: rows[p] in v_cache), each
 * element's sum carried in p's order, as the one-query loop does: `count` query heads share each V load. */
INLINED void tile_value_sums_of(const float *const *weights, float *const *sums, int64_t count, int64_t D,
                                const void *v_cache, const int64_t *rows, int64_t start, int64_t end,
                                int64_t prefetch_end, const int half) {
    for (int64_t r0 = 0; r0 < count; r0 += VALUE_ROWS) {
        const int R = count - r0 < VALUE_ROWS ? (int)(count - r0) : VALUE_ROWS;
        for (int64_t c = 0; c < D; c += 2 * VLEN) {
            vf acc[VALUE_ROWS][2];
            const float *w_rows[VALUE_ROWS];
            for (int r = 0; r < VALUE_ROWS; r++) {
                w_rows[r] = weights[r0 + (r < R ? r : 0)];
                const float *at = sums[r0 + (r < R ? r : 0)] + c;
                acc[r][0] = load(at);
                acc[r][1] = load(at + VLEN);
            }
            for (int64_t p = start; p < end; p++) {
                const void *v = cache_row(v_cache, rows[p], half);
                if (r0 == 0 && c == 0 && p + KEY_TILE < prefetch_end) /* the next tile's values */
                    for (int64_t byte = 0; byte < D * (half ? 2 : 4); byte += 64)
                        __builtin_prefetch((const char *)cache_row(v_cache, rows[p + KEY_TILE], half) + byte, 0, 2);
                vf v_first = load_cached(v, c, half), v_second = load_cached(v, c + VLEN, half);
                __asm__("" : "+v"(v_first), "+v"(v_second)); /* in registers, not re-read per row */
                for (int r = 0; r < VALUE_ROWS; r++) {
                    const vf w = splat(w_rows[r][p]);
                    acc[r][0] += w * v_first;
                    acc[r][1] += w * v_second;
                }
            }
            for (int r = 0; r < R; r++) {
                store(sums[r0 + r] + c, acc[r][0]);
                store(sums[r0 + r] + c + VLEN, acc[r][1]);
            }
        }
    }
}

/* a copy per cache type, out of line: inlined into attend, the loop ran short of registers */
static __attribute__((noinline)) void tile_value_sums(const float *const *weights, float *const *sums, int64_t count,
                                                      int64_t D, const void *v_cache, const int64_t *rows,
                                                      int64_t start, int64_t end, int64_t prefetch_end, int half) {
    if (half)
        tile_value_sums_of(weights, sums, count, D, v_cache, rows, start, end, prefetch_end, 1);
    else
        tile_value_sums_of(weights, sums, count, D, v_cache, rows, start, end, prefetch_end, 0);
}
#endif

/* rows[p] for positions [from, to) of a sequence (table: its blocks) through kv head g */
static void context_rows(int64_t *rows, int64_t from, int64_t to, const int64_t *table, int64_t block_size,
                         int64_t kv_heads, int64_t g, int64_t D) {
    for (int64_t block = from / block_size, p = from; p < to; block++) /* walking the table: no division per position */
        for (int64_t slot = p % block_size; slot < block_size && p < to; slot++, p++)
            rows[p] = ((table[block] * block_size + slot) * kv_heads + g) * D;
}

/* One split of a tile's context, positions [s0, s1), s1 = min(s0 + KEY_SPLIT, n + queries - 1): query positions
 * 0 .. queries - 1 (query i: G heads of D back to back at qs + i * q_stride) attend through kv head g to the first
 * n + i positions; rows[] is known up to `known` (>= s1: what lies past s1 is only prefetched). Each row (query i's
 * head h) that reaches past s0 gets its split's partial softmax: top (its highest score), total (the sum of
 * exp(score - top)) and acc (sum of exp(score - top) V, in position order); the others top -INFINITY. Each query's
 * arithmetic is the same whatever the tile (its dot products and weighted sums in the same order, a sum carried
 * through memory between key tiles unrounded): decode rows (a tile of one) and prefill rows give a position the
 * same bits, however it was batched or chunked; the tile only shares the loads, each K and V row read from memory
 * once per tile instead of once per query. Inlined with `half` a constant: a copy per cache type. */
INLINED void split_partials_of(
    const float *qs, int64_t q_stride, int64_t queries, int64_t group, int64_t D, int64_t n, int64_t s0,
    int64_t known, const void *k_cache, const void *v_cache, float scale, AttentionScratch scratch, const int half) {
    float *const scores = scratch.scores, *const acc = scratch.acc;
    const int64_t *const rows = scratch.rows;
    const int64_t row_len = scratch.row_len, query_stride = scratch.query_stride, last_n = n + queries - 1;
    const int64_t padded_group = query_stride / row_len, row_bytes = D * (half ? 2 : 4);
    const int64_t chunk_bytes = VALUE_CHUNK * VLEN * (half ? 2 : 4);
    const int64_t s1 = s0 + KEY_SPLIT < last_n ? s0 + KEY_SPLIT : last_n;
#if VLEN == 8
    /* several queries: their query heads' scores and value sums on register tiles, row r query r / G's head r % G */
    const int tiled = scratch.keys_by_dim && D % (2 * VLEN) == 0 && queries * group <= MAX_TILE_ROWS;
    const int64_t tile_rows = tiled ? queries * group : 0;
    const float *query[MAX_TILE_ROWS];
    float *score_rows[MAX_TILE_ROWS], *sums[MAX_TILE_ROWS];
    for (int64_t r = 0; r < tile_rows; r++) {
        const int64_t i = r / group, h = r % group;
        query[r] = qs + i * q_stride + h * D;
        score_rows[r] = scores + i * query_stride + h * row_len;
        sums[r] = acc + (i * padded_group + h) * D;
    }
#endif
    for (int64_t t0 = s0; t0 < s1; t0 += KEY_TILE) {
#if VLEN == 8
        if (tiled) {
            const int64_t count = s1 - t0 < KEY_TILE ? s1 - t0 : KEY_TILE;
            const int64_t ahead = known - t0 - KEY_TILE < 0 ? 0 : known - t0 - KEY_TILE;
            transpose_key_tile(k_cache, rows + t0, count, ahead < KEY_TILE ? ahead : KEY_TILE, D, scratch.keys_by_dim,
                               half);
            tile_scores(query, tile_rows, D, scratch.keys_by_dim, (count + VLEN - 1) / VLEN, scale, score_rows,
                        t0 - s0);
            continue;
        }
#endif
        for (int64_t i = 0; i < queries; i++) {
            const float *q = qs + i * q_stride;
            float *const query_scores = scores + i * query_stride;
            const int64_t n_i = n + i, end = t0 + KEY_TILE < n_i ? t0 + KEY_TILE : n_i;
            for (int64_t p0 = t0; p0 < end; p0 += VLEN) { /* VLEN positions' dot products, summed together */
                for (int64_t p = p0 + KEY_TILE; i == 0 && p < p0 + KEY_TILE + VLEN && p < known; p++)
                    for (int64_t byte = 0; byte < row_bytes; byte += 64) /* the next tile's keys */
                        __builtin_prefetch((const char *)cache_row(k_cache, rows[p], half) + byte, 0, 3);
                const int64_t count = n_i - p0 < VLEN ? n_i - p0 : VLEN;
                const void *keys[VLEN];
                for (int64_t j = 0; j < count; j++) keys[j] = cache_row(k_cache, rows[p0 + j], half);
                for (int64_t h = 0; h < group; h++) {
                    vf partial[VLEN];
                    key_partials(q + h * D, D, keys, count, partial, half);
                    store(query_scores + h * row_len + p0 - s0, lane_sums(partial) * scale);
                }
            }
        }
    }
    for (int64_t i = 0; i < queries; i++)
        for (int64_t h = 0; h < group; h++) {
            const int64_t row_index = i * padded_group + h, n_i = n + i, len = (s1 < n_i ? s1 : n_i) - s0;
            if (len <= 0) {
                scratch.top[row_index] = -INFINITY;
                continue;
            }
            float *row = scores + i * query_stride + h * row_len;
            vf top = splat(-INFINITY);
            int64_t p = 0;
            for (; p + VLEN <= len; p += VLEN) top = vmax(top, load(row + p));
            float highest = -INFINITY;
            for (int l = 0; l < VLEN; l++) highest = top[l] > highest ? top[l] : highest;
            for (; p < len; p++) highest = row[p] > highest ? row[p] : highest;
            for (p = 0; p + VLEN <= len; p += VLEN) store(row + p, exp_lanes(load(row + p) - highest));
            for (; p < len; p++) row[p] = exp_approx(row[p] - highest);
            vf total = {0};
            for (p = 0; p + VLEN <= len; p += VLEN) total += load(row + p);
            float sum = lane_sum(total);
            for (; p < len; p++) sum += row[p];
            scratch.top[row_index] = highest;
            scratch.total[row_index] = sum;
        }
    /* each value row read once per tile for HEAD_TILE heads of each query: their sums stay in registers over a key
     * tile's positions, in memory between tiles */
    memset(acc, 0, (size_t)(queries * padded_group * D * 4));
#if VLEN == 8
    if (tiled) {
        const float *const *weights = (const float *const *)score_rows;
        for (int64_t t0 = s0; t0 < s1; t0 += KEY_TILE) {
            /* positions every query reads, then each later query's own last ones */
            const int64_t shared_end = t0 + KEY_TILE < n ? t0 + KEY_TILE : n, own = shared_end > t0 ? shared_end : t0;
            tile_value_sums(weights, sums, tile_rows, D, v_cache, rows + s0, t0 - s0, shared_end - s0, known - s0,
                            half);
            for (int64_t i = 1; i < queries; i++) {
                const int64_t end = t0 + KEY_TILE < n + i ? t0 + KEY_TILE : n + i;
                if (end > own)
                    tile_value_sums(weights + i * group, sums + i * group, group, D, v_cache, rows + s0, own - s0,
                                    end - s0, 0, half);
            }
        }
    } else
#endif
    for (int64_t t0 = s0; t0 < s1; t0 += KEY_TILE) {
        for (int64_t i = 0; i < queries; i++) {
            const int64_t n_i = n + i, end = t0 + KEY_TILE < n_i ? t0 + KEY_TILE : n_i;
            for (int64_t h0 = 0; h0 < group; h0 += HEAD_TILE) {
                const float *weights = scores + i * query_stride + h0 * row_len;
                float *sums_at = acc + (i * padded_group + h0) * D;
                int64_t c = 0;
                for (; c + VALUE_CHUNK * VLEN <= D; c += VALUE_CHUNK * VLEN) {
                    vf sums[HEAD_TILE][VALUE_CHUNK];
                    for (int hh = 0; hh < HEAD_TILE; hh++)
                        for (int l = 0; l < VALUE_CHUNK; l++) sums[hh][l] = load(sums_at + hh * D + c + l * VLEN);
                    for (int64_t p = t0; p < end; p++) {
                        const void *v = cache_row(v_cache, rows[p], half);
                        if (i == 0 && p + KEY_TILE < known) { /* the next tile's values */
                            const char *ahead = cache_row(v_cache, rows[p + KEY_TILE] + c, half);
                            for (int64_t byte = 0; byte < chunk_bytes; byte += 64)
                                __builtin_prefetch(ahead + byte, 0, 3);
                        }
                        vf values[VALUE_CHUNK];
                        for (int l = 0; l < VALUE_CHUNK; l++) values[l] = load_cached(v, c + l * VLEN, half);
                        for (int hh = 0; hh < HEAD_TILE; hh++) {
                            const vf w = splat(weights[hh * row_len + p - s0]);
                            for (int l = 0; l < VALUE_CHUNK; l++) sums[hh][l] += w * values[l];
                        }
                    }
                    for (int hh = 0; hh < HEAD_TILE; hh++)
                        for (int l = 0; l < VALUE_CHUNK; l++) store(sums_at + hh * D + c + l * VLEN, sums[hh][l]);
                }
                for (; c < D; c++)
                    for (int hh = 0; hh < HEAD_TILE; hh++) {
                        float sum = sums_at[hh * D + c];
                        for (int64_t p = t0; p < end; p++)
                            sum += weights[hh * row_len + p - s0] * cached(cache_row(v_cache, rows[p], half), c, half);
                        sums_at[hh * D + c] = sum;
                    }
            }
        }
    }
}

/* a copy per cache type, out of line: one body for every caller, so a split's partials have the same bits whichever
 * task computed them */
static __attribute__((noinline)) void split_partials(const float *qs, int64_t q_stride, int64_t queries,
                                                     int64_t group, int64_t D, int64_t n, int64_t s0, int64_t known,
                                                     const void *k_cache, const void *v_cache, float scale,
                                                     AttentionScratch scratch, int half) {
    if (half)
        split_partials_of(qs, q_stride, queries, group, D, n, s0, known, k_cache, v_cache, scale, scratch, 1);
    else
        split_partials_of(qs, q_stride, queries, group, D, n, s0, known, k_cache, v_cache, scale, scratch, 0);
}

/* state (a row's splits so far, PARTIAL floats; highest -INFINITY: none) and the next split's partial folded, in
 * the splits' order: one body, so a row's softmax has the same bits whether one task walked its splits or a task
 * each computed them */
static __attribute__((noinline)) void fold_split(float *state, float top, float total, const float *sums, int64_t D) {
    if (top == -INFINITY) return; /* the split is past the row's query */
    if (state[0] == -INFINITY) {
        state[0] = top, state[1] = total;
        memcpy(state + 2, sums, (size_t)(D * 4));
        return;
    }
    const float highest = state[0] > top ? state[0] : top;
    const float old_weight = exp_approx(state[0] - highest), new_weight = exp_approx(top - highest);
    state[0] = highest;
    state[1] = state[1] * old_weight + total * new_weight;
    for (int64_t c = 0; c < D; c++) state[2 + c] = state[2 + c] * old_weight + sums[c] * new_weight;
}

/* the attention output of a row whose splits are all folded */
static inline void finish_row(const float *state, int64_t D, float *out) {
    const float inverse = 1.0f / state[1];
    for (int64_t c = 0; c < D; c++) out[c] = state[2 + c] * inverse;
}

typedef struct { /* a task's queries: rows row .. row + queries - 1 of q and out, attending to the first n + i
                  * positions of sequence `sequence` */
    int64_t row, queries, n, sequence;
} QueryTile;

/* Every tile's queries (at most `widest` a tile) attending through each kv head, out: [rows][H][D]. A task
 * is a tile and a kv head, walking its context's splits; where such tasks are too few to keep the threads busy (a
 * long context's decode, a small chunk of a long prompt) a task is one split of them, and the partials are folded
 * after, in the same order by the same code. */
static void attend_tiles(const QueryTile *tiles, int64_t count, int64_t widest, const float *q, int64_t q_stride,
                         int64_t H, int64_t D, const void *k_cache, const void *v_cache, int64_t block_size,
                         int64_t kv_heads, const int64_t *block_tables, int64_t table_stride, int64_t max_context,
                         float scale, float *out, int half) {
    const int64_t group = H / kv_heads, tasks = count * kv_heads, splits = (max_context + KEY_SPLIT - 1) / KEY_SPLIT;
    const int64_t padded_group = (group + HEAD_TILE - 1) / HEAD_TILE * HEAD_TILE, tile_rows = widest * padded_group;
    const int split_tasks = splits > 1 && tasks < 4 * omp_get_max_threads();
    float *partials = split_tasks ? malloc((size_t)(tasks * splits * tile_rows * PARTIAL(D) * 4)) : NULL;
#pragma omp parallel
    {
        const AttentionScratch scratch = scratch_for(widest, group, D, max_context);
#pragma omp for schedule(dynamic)
        for (int64_t job = 0; job < (split_tasks ? tasks * splits : tasks); job++) {
            const int64_t task = split_tasks ? job / splits : job, s = split_tasks ? job % splits : 0;
            const QueryTile tile = tiles[task / kv_heads];
            const int64_t g = task % kv_heads, last_n = tile.n + tile.queries - 1;
            const float *qs = q + tile.row * q_stride + g * group * D;
            const int64_t *table = block_tables + tile.sequence * table_stride;
            if (split_tasks) { /* this split's partials, kept for the fold */
                float *at = partials + job * tile_rows * PARTIAL(D);
                const int64_t s0 = s * KEY_SPLIT, known = s0 + KEY_SPLIT + KEY_TILE < last_n ? s0 + KEY_SPLIT + KEY_TILE
                                                                                              : last_n;
                for (int64_t r = 0; r < tile_rows; r++) at[r * PARTIAL(D)] = -INFINITY;
                if (s0 >= last_n) continue;
                context_rows(scratch.rows, s0, known, table, block_size, kv_heads, g, D);
                split_partials(qs, q_stride, tile.queries, group, D, tile.n, s0, known, k_cache, v_cache, scale,
                               scratch, half);
                for (int64_t r = 0; r < tile.queries * padded_group; r++) {
                    at[r * PARTIAL(D)] = r % padded_group < group ? scratch.top[r] : -INFINITY;
                    at[r * PARTIAL(D) + 1] = scratch.total[r];
                    memcpy(at + r * PARTIAL(D) + 2, scratch.acc + r * D, (size_t)(D * 4));
                }
                continue;
            }
            context_rows(scratch.rows, 0, last_n, table, block_size, kv_heads, g, D);
            for (int64_t r = 0; r < tile_rows; r++) scratch.state[r * PARTIAL(D)] = -INFINITY;
            for (int64_t s0 = 0; s0 < last_n; s0 += KEY_SPLIT) {
                split_partials(qs, q_stride, tile.queries, group, D, tile.n, s0, last_n, k_cache, v_cache, scale,
                               scratch, half);
                for (int64_t i = 0; i < tile.queries; i++)
                    for (int64_t h = 0; h < group; h++) {
                        const int64_t r = i * padded_group + h;
                        fold_split(scratch.state + r * PARTIAL(D), scratch.top[r], scratch.total[r],
                                   scratch.acc + r * D, D);
                    }
            }
            for (int64_t i = 0; i < tile.queries; i++)
                for (int64_t h = 0; h < group; h++)
                    finish_row(scratch.state + (i * padded_group + h) * PARTIAL(D), D,
                               out + ((tile.row + i) * H + g * group + h) * D);
        }
        if (split_tasks) {
#pragma omp for schedule(dynamic)
            for (int64_t task = 0; task < tasks; task++) {
                const QueryTile tile = tiles[task / kv_heads];
                const int64_t g = task % kv_heads;
                for (int64_t i = 0; i < tile.queries; i++)
                    for (int64_t h = 0; h < group; h++) {
                        const int64_t r = i * padded_group + h;
                        float *state = scratch.state + r * PARTIAL(D);
                        state[0] = -INFINITY;
                        for (int64_t s = 0; s < splits; s++) {
                            const float *part = partials + ((task * splits + s) * tile_rows + r) * PARTIAL(D);
                            fold_split(state, part[0], part[1], part + 2, D);
                        }
                        finish_row(state, D, out + ((tile.row + i) * H + g * group + h) * D);
                    }
            }
        }
        free_scratch(scratch);
    }
    free(partials);
}

/* One-token queries: q [S] rows of q_stride floats, heads of D at h * D; sequence s attends to its first
 * context_lens[s] positions; block_tables: [S][table_stride] int64; out: [S][H][D]. */
void paged_decode_attention(const float *q, int64_t q_stride, int64_t S, int64_t H, int64_t D,
                            const void *k_cache, const void *v_cache, int64_t block_size, int64_t kv_heads,
                            const int64_t *block_tables, int64_t table_stride, const int32_t *context_lens,
                            int64_t max_context, float scale, float *out, int64_t half) {
    QueryTile *tiles = malloc((size_t)S * sizeof(QueryTile));
    for (int64_t s = 0; s < S; s++) tiles[s] = (QueryTile){s, 1, context_lens[s], s};
    attend_tiles(tiles, S, 1, q, q_stride, H, D, k_cache, v_cache, block_size, kv_heads, block_tables, table_stride,
                 max_context, scale, out, (int)half);
    free(tiles);
}

/* Prefill chunks, causal: chunk c's queries are rows query_starts[c] .. + query_lens[c] of q (rows of q_stride
 * floats) and the last query_lens[c] of its context_lens[c] positions (those before: a cached prefix or earlier
 * chunks); each attends to its own position and the ones before. block_tables: [chunks][table_stride] int64;
 * out: [rows][H][D]. A tile: QUERY_TILE consecutive queries of a chunk. */
void paged_prefill_attention(const float *q, int64_t q_stride, int64_t chunks, const int32_t *query_starts,
                             const int32_t *query_lens, const int32_t *context_lens, int64_t H, int64_t D,
                             const void *k_cache, const void *v_cache, int64_t block_size, int64_t kv_heads,
                             const int64_t *block_tables, int64_t table_stride, float scale, float *out,
                             int64_t half) {
    int64_t count = 0, max_context = 0, widest = 1; /* widest: the most queries a tile has (its scratch's rows) */
    for (int64_t c = 0; c < chunks; c++) {
        count += (query_lens[c] + QUERY_TILE - 1) / QUERY_TILE;
        max_context = context_lens[c] > max_context ? context_lens[c] : max_context;
        widest = query_lens[c] > widest ? (query_lens[c] < QUERY_TILE ? query_lens[c] : QUERY_TILE) : widest;
    }
    QueryTile *tiles = malloc((size_t)count * sizeof(QueryTile));
    for (int64_t c = 0, t = 0; c < chunks; c++)
        for (int64_t first = 0; first < query_lens[c]; first += QUERY_TILE) /* the tile's first query in its chunk */
            tiles[t++] = (QueryTile){query_starts[c] + first,
                                     query_lens[c] - first < QUERY_TILE ? query_lens[c] - first : QUERY_TILE,
                                     context_lens[c] - query_lens[c] + first + 1, c};
    attend_tiles(tiles, count, widest, q, q_stride, H, D, k_cache, v_cache, block_size, kv_heads, block_tables,
                 table_stride, max_context, scale, out, (int)half);
    free(tiles);
}
