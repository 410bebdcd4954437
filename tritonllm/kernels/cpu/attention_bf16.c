#include "cpu_ops.h"
#include "bf16.h"

/* ---- causal prefill attention on the CPU's bf16 matrix units (prompts computed in bfloat16) ----
 * Same inputs and meaning as paged_prefill_attention (attention.c), for head size 64; returns 0, or 1 where this
 * build has no AVX512-BF16 (the caller then runs another op). Its two matrix products run on AMX tiles where the OS
 * gives them and `tiles` allows, else as AVX512-BF16 dot products (vdpbf16ps: Zen 4/5, Intel without AMX), one
 * vector a row of the same tile; both sum the same products in fp32, in a different order.
 *
 * Each call first copies its chunks' contexts out of the paged cache into bf16: K as rows [key][64], V transposed
 * [64][key], both zero past the context up to a whole number of key blocks. A task is 16 consecutive query
 * positions of one head. It computes transposed scores, keys by queries (so the online softmax's maxima and sums
 * run down columns, one vector holds one value for each query, with no lane shuffles), and keeps the transposed
 * output O^T [64][16] in four fp32 tiles across the key blocks: per block of 64 keys from key 0,
 *     S^T = K Q^T (Q prescaled by scale * log2 e), m' = max(m, max_k S^T), P^T = 2^(S^T - m'),
 *     O^T = O^T * 2^(m - m') (only where some query's maximum moved), O^T += V^T P^T, l = l * 2^(m - m') + sum_k P^T.
 * A tile's element depends only on its row of the left operand, its column of the right and its own value, so a
 * query's result is computed alike whatever tile, chunk or step it runs in: a block a query does not see (past its
 * position) leaves its m, l and O exactly as they were (2^0 is exactly 1 and its P is 0). */

#ifdef BF16_BUILD

#define AMX_HEAD 64    /* head size: four 16-column output tiles */
#define AMX_QUERIES 16 /* query positions per task: a tile's columns */
#define AMX_KEYS 64    /* keys per softmax step: four 16-row score tiles, two 32-key right operands for V^T P^T */

/* 2^x to 4e-6 (a minimax polynomial on the reduced range), 2^0 exactly 1; -inf gives NaN (callers mask it) */
static inline __m512 exp2_lanes(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(0.009570087306201458f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.05591787025332451f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.2402474582195282f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.6931217908859253f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n); /* underflows to 0 under the tasks' flush-to-zero */
}

/* Keys key0 .. key0 + AMX_KEYS - 1 of kv head g as one block of left operands, each 16 rows of 64 bytes in a row
 * (zeros from `context` on): K as [16-key group][half of the head][16 keys][32 dims], then V^T as
 * [32-key half][64 dims][32 keys], transposed 16 keys by 16 dims at a time. */
static void copy_key_block(const void *k_cache, const void *v_cache, const int64_t *table, int64_t block_size,
                           int64_t kv_heads, int64_t g, int64_t key0, int64_t context, uint16_t *block, int half) {
    uint16_t *v_columns = block + AMX_KEYS * AMX_HEAD;
    for (int64_t k0 = 0; k0 < AMX_KEYS; k0 += 16) {
        int64_t element[16];
        for (int64_t k = k0; k < k0 + 16; k++) {
            const int64_t key = key0 + k;
            uint16_t *k_row = block + (k / 16 * 2 * 16 + k % 16) * 32; /* its first half; the second 16 rows on */
            element[k - k0] = -1;
            if (key >= context) {
                memset(k_row, 0, 64);
                memset(k_row + 16 * 32, 0, 64);
                continue;
            }
            element[k - k0] = ((table[key / block_size] * block_size + key % block_size) * kv_heads + g) * AMX_HEAD;
            for (int d = 0; d < AMX_HEAD; d += 16)
                _mm256_storeu_si256((__m256i *)(k_row + d / 32 * 16 * 32 + d % 32),
                                    to_bf16((__m512)load_cached(k_cache, element[k - k0] + d, half)));
        }
        for (int d0 = 0; d0 < AMX_HEAD; d0 += 16) {
            __m512 rows[16];
            for (int i = 0; i < 16; i++)
                rows[i] = element[i] < 0 ? _mm512_setzero_ps() : (__m512)load_cached(v_cache, element[i] + d0, half);
            transpose16(rows);
            for (int d = 0; d < 16; d++)
                _mm256_storeu_si256((__m256i *)(v_columns + (k0 / 32 * AMX_HEAD + d0 + d) * 32 + k0 % 32),
                                    to_bf16(rows[d]));
        }
    }
}

/* The right operand of Q^T: [32 dims as 16 pairs][16 queries][2], for dims 32 * half_ .. + 31 */
static void pack_queries(const float *q, int64_t q_stride, int64_t count, float prescale,
                         uint16_t packed[2][16][AMX_QUERIES * 2]) {
    uint16_t rows[AMX_QUERIES][AMX_HEAD] __attribute__((aligned(64))) = {{0}};
    for (int64_t j = 0; j < count; j++)
        for (int d = 0; d < AMX_HEAD; d += 16)
            _mm256_store_si256((__m256i *)(rows[j] + d),
                               to_bf16(_mm512_mul_ps(_mm512_loadu_ps(q + j * q_stride + d), _mm512_set1_ps(prescale))));
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < 16; r++)
            for (int j = 0; j < AMX_QUERIES; j++) {
                packed[h][r][2 * j] = rows[j][32 * h + 2 * r];
                packed[h][r][2 * j + 1] = rows[j][32 * h + 2 * r + 1];
            }
}

/* The two matrix products of a key block, AMX's way: S^T for its 64 keys into scores[key][query]; O^T += V^T P^T in
 * tiles 4-7 (the output's 16-dim quarters) */
#ifdef AMX_BUILD
static inline void scores_on_tiles(const uint16_t *keys, const uint16_t queries[2][16][AMX_QUERIES * 2],
                                   float scores[AMX_KEYS][AMX_QUERIES]) {
    for (int h = 0; h < 2; h++) { /* keys 32 h .. + 31 */
        _tile_zero(2);
        _tile_zero(3);
        for (int half_ = 0; half_ < 2; half_++) {
            _tile_loadd(1, queries[half_], 64);
            _tile_loadd(0, keys + ((4 * h + half_) * 16) * 32, 64);
            _tile_dpbf16ps(2, 0, 1);
            _tile_loadd(0, keys + ((4 * h + 2 + half_) * 16) * 32, 64);
            _tile_dpbf16ps(3, 0, 1);
        }
        _tile_stored(2, scores[32 * h], 64);
        _tile_stored(3, scores[32 * h + 16], 64);
    }
}

static inline void accumulate_on_tiles(const uint16_t *values, const uint16_t probabilities[2][16][AMX_QUERIES * 2]) {
    for (int h = 0; h < 2; h++) { /* keys 32 h .. + 31 */
        const uint16_t *dims = values + h * AMX_HEAD * 32;
        _tile_loadd(1, probabilities[h], 64);
        _tile_loadd(0, dims, 64);
        _tile_dpbf16ps(4, 0, 1);
        _tile_loadd(0, dims + 16 * 32, 64);
        _tile_dpbf16ps(5, 0, 1);
        _tile_loadd(0, dims + 32 * 32, 64);
        _tile_dpbf16ps(6, 0, 1);
        _tile_loadd(0, dims + 48 * 32, 64);
        _tile_dpbf16ps(7, 0, 1);
    }
}

static inline void output_from_tiles(float output[AMX_HEAD][AMX_QUERIES]) {
    _tile_stored(4, output[0], 64);
    _tile_stored(5, output[16], 64);
    _tile_stored(6, output[32], 64);
    _tile_stored(7, output[48], 64);
}

static inline void output_to_tiles(float output[AMX_HEAD][AMX_QUERIES]) {
    _tile_loadd(4, output[0], 64);
    _tile_loadd(5, output[16], 64);
    _tile_loadd(6, output[32], 64);
    _tile_loadd(7, output[48], 64);
}
#else
static inline void scores_on_tiles(const uint16_t *keys, const uint16_t queries[2][16][AMX_QUERIES * 2],
                                   float scores[AMX_KEYS][AMX_QUERIES]) {}
static inline void accumulate_on_tiles(const uint16_t *values,
                                       const uint16_t probabilities[2][16][AMX_QUERIES * 2]) {}
static inline void output_from_tiles(float output[AMX_HEAD][AMX_QUERIES]) {}
static inline void output_to_tiles(float output[AMX_HEAD][AMX_QUERIES]) {}
#endif

/* The same products as dot products: a vector is a row of a tile (16 queries), each of its lanes summing its query's
 * pairs of products with one pair of the left operand's row, broadcast. Rows i = 0 .. 15 of the left operands
 * halves[0] and halves[1] (rows of 32 bf16: pairs 0 .. 15 of each half) times the right operands right[0], right[1]
 * (per pair, 16 queries' pairs), over both halves' pairs, into out[i] (added to it where `add`). */
static inline void rows_by_dot_products(const uint16_t *const halves[2], const uint16_t right[2][16][AMX_QUERIES * 2],
                                        float out[16][AMX_QUERIES], const int add) {
    __m512 sums[16];
    for (int i = 0; i < 16; i++) sums[i] = add ? _mm512_load_ps(out[i]) : _mm512_setzero_ps();
    for (int h = 0; h < 2; h++)
        for (int p = 0; p < 16; p++) {
            const __m512bh pairs = (__m512bh)_mm512_load_si512(right[h][p]);
            for (int i = 0; i < 16; i++)
                sums[i] = _mm512_dpbf16_ps(sums[i], (__m512bh)_mm512_set1_epi32(bf16_pair(halves[h] + i * 32 + 2 * p)),
                                           pairs);
        }
    for (int i = 0; i < 16; i++) _mm512_store_ps(out[i], sums[i]);
}

/* S^T for the block's keys: each 16 keys' rows, the head's dims in two halves of 32 */
static inline void scores_by_dot_products(const uint16_t *keys, const uint16_t queries[2][16][AMX_QUERIES * 2],
                                          float scores[AMX_KEYS][AMX_QUERIES]) {
    for (int k0 = 0; k0 < AMX_KEYS; k0 += 16) {
        const uint16_t *const halves[2] = {keys + (k0 / 16 * 2) * 16 * 32, keys + (k0 / 16 * 2 + 1) * 16 * 32};
        rows_by_dot_products(halves, queries, &scores[k0], 0);
    }
}

/* O^T += V^T P^T: each 16 dims' rows, the block's keys in two halves of 32 */
static inline void accumulate_by_dot_products(const uint16_t *values,
                                              const uint16_t probabilities[2][16][AMX_QUERIES * 2],
                                              float output[AMX_HEAD][AMX_QUERIES]) {
    for (int d0 = 0; d0 < AMX_HEAD; d0 += 16) {
        const uint16_t *const halves[2] = {values + d0 * 32, values + (AMX_HEAD + d0) * 32};
        rows_by_dot_products(halves, probabilities, &output[d0], 1);
    }
}

/* One task: queries at positions first .. first + count - 1 (rows q, q + q_stride, ...) of one head, over the
 * copied key blocks of its kv head; out rows out_stride floats apart. Inlined with `tiles` a constant. */
INLINED void attend_tile(const float *q, int64_t q_stride, int64_t count, int64_t first, const uint16_t *blocks,
                         float scale, float *out, int64_t out_stride, const int tiles) {
    uint16_t queries[2][16][AMX_QUERIES * 2] __attribute__((aligned(64)));
    uint16_t probabilities[2][16][AMX_QUERIES * 2] __attribute__((aligned(64)));
    float scores[AMX_KEYS][AMX_QUERIES] __attribute__((aligned(64)));
    float output[AMX_HEAD][AMX_QUERIES] __attribute__((aligned(64)));
    pack_queries(q, q_stride, count, scale * 1.4426950408889634f, queries);
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    /* each query's position (lanes past count repeat the last: they are computed, never written) */
    const __m512i positions = _mm512_add_epi32(_mm512_set1_epi32((int32_t)first),
                                               _mm512_min_epi32(lanes, _mm512_set1_epi32((int32_t)count - 1)));
    const __m512i interleave = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                                38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    __m512 maximum = _mm512_set1_ps(-INFINITY), total = _mm512_setzero_ps();
    memset(output, 0, sizeof(output));
    if (tiles) output_to_tiles(output);
    const int64_t last = first + count - 1;
    for (int64_t key0 = 0; key0 <= last; key0 += AMX_KEYS) {
        const uint16_t *keys = blocks + key0 * 2 * AMX_HEAD, *values = keys + AMX_KEYS * AMX_HEAD;
        if (tiles)
            scores_on_tiles(keys, queries, scores);
        else
            scores_by_dot_products(keys, queries, scores);
        const int masked = key0 + AMX_KEYS - 1 > first; /* some query here is before some key */
        __m512 block_maximum = _mm512_set1_ps(-INFINITY);
        for (int k = 0; k < AMX_KEYS; k++) {
            __m512 s = _mm512_load_ps(scores[k]);
            if (masked) {
                s = _mm512_mask_blend_ps(_mm512_cmpge_epi32_mask(positions, _mm512_set1_epi32((int32_t)(key0 + k))),
                                         _mm512_set1_ps(-INFINITY), s);
                _mm512_store_ps(scores[k], s);
            }
            block_maximum = _mm512_max_ps(block_maximum, s);
        }
        const __m512 moved_to = _mm512_max_ps(maximum, block_maximum);
        /* 0 where the maximum was -inf (the first block: O and l are 0) */
        const __m512 rescale = exp2_lanes(_mm512_max_ps(_mm512_sub_ps(maximum, moved_to), _mm512_set1_ps(-127.0f)));
        maximum = moved_to;
        total = _mm512_mul_ps(total, rescale);
        for (int k = 0; k < AMX_KEYS; k += 2) {
            __m512 p0 = exp2_lanes(_mm512_sub_ps(_mm512_load_ps(scores[k]), maximum));
            __m512 p1 = exp2_lanes(_mm512_sub_ps(_mm512_load_ps(scores[k + 1]), maximum));
            if (masked) {
                p0 = _mm512_maskz_mov_ps(
                    _mm512_cmpge_epi32_mask(positions, _mm512_set1_epi32((int32_t)(key0 + k))), p0);
                p1 = _mm512_maskz_mov_ps(
                    _mm512_cmpge_epi32_mask(positions, _mm512_set1_epi32((int32_t)(key0 + k + 1))), p1);
            }
            total = _mm512_add_ps(_mm512_add_ps(total, p0), p1);
            const __m512i pair = _mm512_permutex2var_epi16(_mm512_castsi256_si512(to_bf16(p0)), interleave,
                                                           _mm512_castsi256_si512(to_bf16(p1)));
            _mm512_store_si512(probabilities[k / 32][(k % 32) / 2], pair);
        }
        if (_mm512_cmp_ps_mask(rescale, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ)) {
            if (tiles) output_from_tiles(output);
            for (int d = 0; d < AMX_HEAD; d++)
                _mm512_store_ps(output[d], _mm512_mul_ps(_mm512_load_ps(output[d]), rescale));
            if (tiles) output_to_tiles(output);
        }
        if (tiles)
            accumulate_on_tiles(values, probabilities);
        else
            accumulate_by_dot_products(values, probabilities, output);
    }
    if (tiles) output_from_tiles(output);
    float inverse[AMX_QUERIES] __attribute__((aligned(64)));
    _mm512_store_ps(inverse, _mm512_div_ps(_mm512_set1_ps(1.0f), total));
    for (int64_t j = 0; j < count; j++)
        for (int d = 0; d < AMX_HEAD; d++) out[j * out_stride + d] = output[d][j] * inverse[j];
}

int64_t paged_prefill_attention_bf16(const float *q, int64_t q_stride, int64_t chunks, const int32_t *query_starts,
                                     const int32_t *query_lens, const int32_t *context_lens, int64_t H, int64_t D,
                                     const void *k_cache, const void *v_cache, int64_t block_size, int64_t kv_heads,
                                     const int64_t *block_tables, int64_t table_stride, float scale, float *out,
                                     int64_t half, int64_t tiles) {
    if (D != AMX_HEAD) return 1;
#ifdef AMX_BUILD
    tiles = tiles && amx_permitted();
#else
    tiles = 0;
#endif
    const int64_t group = H / kv_heads;
    /* chunk c's copy: kv_heads x padded[c] / AMX_KEYS key blocks (copy_key_block), from copy_start[c] */
    int64_t *padded = malloc((size_t)(chunks * 8)), *copy_start = malloc((size_t)((chunks + 1) * 8));
    int64_t *first_task = malloc((size_t)((chunks + 1) * 8)), *first_block = malloc((size_t)((chunks + 1) * 8));
    copy_start[0] = first_task[0] = first_block[0] = 0;
    for (int64_t c = 0; c < chunks; c++) {
        padded[c] = (context_lens[c] + AMX_KEYS - 1) / AMX_KEYS * AMX_KEYS;
        copy_start[c + 1] = copy_start[c] + kv_heads * 2 * padded[c] * AMX_HEAD;
        first_task[c + 1] = first_task[c] + H * ((query_lens[c] + AMX_QUERIES - 1) / AMX_QUERIES);
        first_block[c + 1] = first_block[c] + kv_heads * padded[c] / AMX_KEYS;
    }
    uint16_t *copy = aligned_alloc(64, (size_t)(copy_start[chunks] * 2 + 64));
#pragma omp parallel
    {
        int64_t c = 0;
#pragma omp for schedule(static)
        for (int64_t task = 0; task < first_block[chunks]; task++) {
            while (task >= first_block[c + 1]) c++;
            const int64_t blocks = padded[c] / AMX_KEYS, g = (task - first_block[c]) / blocks;
            const int64_t key0 = (task - first_block[c]) % blocks * AMX_KEYS;
            copy_key_block(k_cache, v_cache, block_tables + c * table_stride, block_size, kv_heads, g, key0,
                           context_lens[c], copy + copy_start[c] + (g * padded[c] + key0) * 2 * AMX_HEAD, (int)half);
        }
#ifdef AMX_BUILD
        if (tiles) configure_tiles();
#endif
        const unsigned int float_control = _mm_getcsr();
        _mm_setcsr(float_control | 0x8040); /* denormals as 0 (flush-to-zero, denormals-are-zero): no slow assists */
        c = 0;
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < first_task[chunks]; task++) {
            while (task >= first_task[c + 1]) c++;
            const int64_t query_tiles = (first_task[c + 1] - first_task[c]) / H, index = task - first_task[c];
            const int64_t tile = query_tiles - 1 - index / H, head = index % H; /* a chunk's longest tiles first */
            const int64_t i0 = tile * AMX_QUERIES, row = query_starts[c] + i0;
            const int64_t count = query_lens[c] - i0 < AMX_QUERIES ? query_lens[c] - i0 : AMX_QUERIES;
            const float *queries = q + row * q_stride + head * AMX_HEAD;
            const uint16_t *blocks = copy + copy_start[c] + head / group * padded[c] * 2 * AMX_HEAD;
            const int64_t first = context_lens[c] - query_lens[c] + i0;
            if (tiles)
                attend_tile(queries, q_stride, count, first, blocks, scale, out + (row * H + head) * AMX_HEAD,
                            H * AMX_HEAD, 1);
            else
                attend_tile(queries, q_stride, count, first, blocks, scale, out + (row * H + head) * AMX_HEAD,
                            H * AMX_HEAD, 0);
        }
        _mm_setcsr(float_control);
#ifdef AMX_BUILD
        if (tiles) _tile_release();
#endif
    }
    free(copy);
    free(first_block);
    free(first_task);
    free(copy_start);
    free(padded);
    return 0;
}

#else

int64_t paged_prefill_attention_bf16(const float *q, int64_t q_stride, int64_t chunks, const int32_t *query_starts,
                                     const int32_t *query_lens, const int32_t *context_lens, int64_t H, int64_t D,
                                     const void *k_cache, const void *v_cache, int64_t block_size, int64_t kv_heads,
                                     const int64_t *block_tables, int64_t table_stride, float scale, float *out,
                                     int64_t half, int64_t tiles) {
    return 1;
}

#endif
