#include "cpu_ops.h"

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
