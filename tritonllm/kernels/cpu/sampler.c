#include "cpu_ops.h"

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
