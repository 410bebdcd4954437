#include "cpu_ops.h"

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
