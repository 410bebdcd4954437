/* The CPU's fused ops, compiled for the machine they run on (tritonllm/kernels/cpu/__init__.py builds the .c files
 * of this folder into one library with -O3 -march=native -fopenmp; the OpenMP runtime is the one torch already
 * loaded, so they share its team).
 *
 * Every op computes each output row on its own, in a fixed order: a token's result does not depend on what it
 * is batched with, to the bit. Reductions are written with explicit vectors (the compiler may not reorder a
 * float sum by itself), elementwise loops are left to its vectorizer. All tensors are float32 unless named; the KV
 * cache is float32 or float16 (`half`).
 *
 * One file a concept: quant_matmul.c (projections over quantized blocks, fp32 or int8 activations), blocks.h (the
 * blocks' layouts and dequantization), block_matmul_bf16.c (bf16 prompts' projections over blocks on AMX tiles or
 * AVX512-BF16 dot products), attention.c (paged attention), attention_bf16.c (bf16 prompts' prefill attention, the
 * same two ways; bf16.h what they share), elementwise.c (norms, rotary, KV store, SiLU), sampler.c (the draw),
 * llama_forward.c (those ops over a whole step's layers). This header declares what Python calls
 * (kernels/cpu/__init__.py's SIGNATURES) and what one file calls of another. */

#pragma once

#include "vector.h"

void q4_matmul(const float *x, int64_t T, int64_t K, const uint8_t *weights, int64_t N, float *y);
void q5_1_matmul(const float *x, int64_t T, int64_t K, const uint8_t *weights, int64_t N, float *y);
void q8_matmul(const float *x, int64_t T, int64_t K, const uint8_t *weights, int64_t N, float *y);
void q5_matmul(const float *x, int64_t T, int64_t K, const uint8_t *weights, int64_t N, float *y);
void q4_k_matmul(const float *x, int64_t T, int64_t K, const uint8_t *weights, int64_t N, float *y);
void q5_k_matmul(const float *x, int64_t T, int64_t K, const uint8_t *weights, int64_t N, float *y);
void q6_k_matmul(const float *x, int64_t T, int64_t K, const uint8_t *weights, int64_t N, float *y);
int64_t dequantize_blocks(int64_t kind, const uint8_t *weights, int64_t N, int64_t K, float *w);
void q4_q8_matmul(const float *x, int64_t T, int64_t K, const uint8_t *weights, int64_t N, float *y,
                  int64_t levels);
void q8_q8_matmul(const float *x, int64_t T, int64_t K, const uint8_t *weights, int64_t N, float *y,
                  int64_t levels);
void q6_q8_matmul(const float *x, int64_t T, int64_t K, const uint8_t *weights, int64_t N, float *y,
                  int64_t levels);
void q5_q8_matmul(const float *x, int64_t T, int64_t K, const uint8_t *weights, int64_t N, float *y,
                  int64_t levels);
void q4_k_q8_matmul(const float *x, int64_t T, int64_t K, const uint8_t *weights, int64_t N, float *y,
                    int64_t levels);

void paged_decode_attention(const float *q, int64_t q_stride, int64_t S, int64_t H, int64_t D,
                            const void *k_cache, const void *v_cache, int64_t block_size, int64_t kv_heads,
                            const int64_t *block_tables, int64_t table_stride, const int32_t *context_lens,
                            int64_t max_context, float scale, float *out, int64_t half);
void paged_prefill_attention(const float *q, int64_t q_stride, int64_t chunks, const int32_t *query_starts,
                             const int32_t *query_lens, const int32_t *context_lens, int64_t H, int64_t D,
                             const void *k_cache, const void *v_cache, int64_t block_size, int64_t kv_heads,
                             const int64_t *block_tables, int64_t table_stride, float scale, float *out,
                             int64_t half);
int64_t paged_prefill_attention_bf16(const float *q, int64_t q_stride, int64_t chunks, const int32_t *query_starts,
                                     const int32_t *query_lens, const int32_t *context_lens, int64_t H, int64_t D,
                                     const void *k_cache, const void *v_cache, int64_t block_size, int64_t kv_heads,
                                     const int64_t *block_tables, int64_t table_stride, float scale, float *out,
                                     int64_t half, int64_t tiles);
int64_t block_matmul_bf16(const float *x, int64_t T, int64_t K, int64_t kind, const uint8_t *weights, int64_t N,
                          float *y, int64_t y_stride, int64_t tiles);
int64_t amx_tiles_available(void);

void rms_norm(const float *x, const float *residual, const float *weight, int64_t rows, int64_t width, float eps,
              float *out, float *summed);
void rotary_embedding(float *q, int64_t q_stride, int64_t q_heads, float *k, int64_t k_stride, int64_t k_heads,
                      int64_t T, int64_t D, const float *cos, const float *sin);
void store_kv_cache(const float *k, int64_t k_stride, const float *v, int64_t v_stride, int64_t T, int64_t width,
                    void *k_cache, void *v_cache, const int64_t *slot_mapping, int64_t half);
void silu_and_mul(const float *x, int64_t rows, int64_t width, float *out);

void sample_rows(const float *logits, const float *raw, int64_t rows, int64_t vocab, const float *inverse_temperatures,
                 const float *uniforms, int64_t *tokens, float *log_normalizers);
