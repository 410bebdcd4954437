#include "cpu_ops.h"
#include "blocks.h"

/* ---- a whole forward of a dense Llama-style decoder over quantized blocks: the ops above in the model's order, one
 * call for every layer (what Python would otherwise dispatch ~10 times a layer), for a step's decode rows and prompt
 * chunks alike. The arithmetic is the ops' own, so the results equal the op-by-op forward to the bit. ---- */

/* A fused projection's run of output rows in one kind of blocks (a projection is up to 3, rows 0 ending them). */
typedef struct {
    const uint8_t *blocks;
    int64_t rows, kind;
} ProjectionPart;

typedef struct {
    const float *input_norm, *post_attention_norm;             /* [hidden] */
    ProjectionPart qkv[3], o[3], gate_up[3], down[3];
    void *k_cache, *v_cache; /* [blocks][block_size][kv_heads][head_dim], float32 or 16 */
} DecoderLayer;

/* A step's rows as attention reads them: `decodes` one-token queries first (decode_tables: [decodes][stride]), then
 * prompt chunks, chunk c rows decodes + query_starts[c] .. + query_lens[c] (chunk_tables: [chunks][stride]). */
typedef struct {
    int64_t decodes;
    const int64_t *decode_tables;
    int64_t decode_table_stride;
    const int32_t *decode_context_lens;
    int64_t max_decode_context;
    int64_t chunks;
    const int32_t *query_starts, *query_lens, *chunk_context_lens;
    const int64_t *chunk_tables;
    int64_t chunk_table_stride;
} AttentionRows;

typedef void (*BlockMatmul)(const float *, int64_t, int64_t, const uint8_t *, int64_t, float *);
typedef void (*Int8BlockMatmul)(const float *, int64_t, int64_t, const uint8_t *, int64_t, float *, int64_t);

static BlockMatmul block_matmul(int64_t kind) {
    switch (kind) {
    case INT4_BLOCKS: return q4_matmul;
    case Q8_0_BLOCKS: return q8_matmul;
    case Q6_K_BLOCKS: return q6_k_matmul;
    case INT5_BLOCKS: return q5_1_matmul;
    case Q4_K_BLOCKS: return q4_k_matmul;
    case Q5_0_BLOCKS: return q5_matmul;
    default: return q5_k_matmul;
    }
}

/* with int8 activations (none for Q5_0, Q5_K: those run as int5 row groups then) */
static Int8BlockMatmul int8_block_matmul(int64_t kind) {
    switch (kind) {
    case INT4_BLOCKS: return q4_q8_matmul;
    case Q8_0_BLOCKS: return q8_q8_matmul;
    case Q6_K_BLOCKS: return q6_q8_matmul;
    case INT5_BLOCKS: return q5_q8_matmul;
    case Q4_K_BLOCKS: return q4_k_q8_matmul;
    default: return NULL;
    }
}

/* a part's rows; int8_levels: 0 fp32 activations, else the levels of int8 codes the int8-activation ops take */
static void part_matmul(const ProjectionPart *part, const float *x, int64_t T, int64_t K, int64_t N, float *y,
                        int64_t int8_levels) {
    const Int8BlockMatmul int8_op = int8_levels ? int8_block_matmul(part->kind) : NULL;
    if (int8_op)
        int8_op(x, T, K, part->blocks, N, y, int8_levels);
    else
        block_matmul(part->kind)(x, T, K, part->blocks, N, y);
}

/* y [T][N] = x [T][K] through a projection's parts, each part's outputs side by side (through scratch [T][rows]
 * when several tokens' rows interleave), as the op-by-op forward concatenates them. */
static void project(const ProjectionPart *parts, const float *x, int64_t T, int64_t K, int64_t N, float *y,
                    float *scratch, int64_t int8_levels) {
    if (parts[0].rows == N) {
        part_matmul(parts, x, T, K, N, y, int8_levels);
        return;
    }
    for (int64_t p = 0, offset = 0; p < 3 && parts[p].rows; offset += parts[p].rows, p++) {
        const int64_t rows = parts[p].rows;
        part_matmul(parts + p, x, T, K, rows, scratch, int8_levels);
        for (int64_t t = 0; t < T; t++) memcpy(y + t * N + offset, scratch + t * rows, (size_t)(rows * 4));
    }
}

/* hidden: [T][hidden] the embeddings in, the last layer's MLP output out; residual: [T][hidden] out (their sum is
 * the decoder's output). cos, sin: [T][head_dim / 2]. rows: which rows are decodes and which prompt chunks.
 * half_cache: the layers' KV caches are float16. int8_levels: 0, the projections take fp32 inputs; 1 or 2, they
 * quantize them to that many levels of int8 codes (q4_q8_matmul, q4_k_q8_matmul, q5_q8_matmul, q8_q8_matmul,
 * q6_q8_matmul). */
void llama_forward(const DecoderLayer *layers, int64_t num_layers, int64_t T, int64_t hidden_size, int64_t heads,
                   int64_t kv_heads, int64_t head_dim, int64_t intermediate, float eps, float scale,
                   const float *cos, const float *sin, const int64_t *slot_mapping, int64_t block_size,
                   const AttentionRows *rows, float *hidden, float *residual, int64_t half_cache,
                   int64_t int8_levels) {
    const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim, qkv_width = q_width + 2 * kv_width;
    float *normed = malloc((size_t)(T * hidden_size * 4)), *qkv = malloc((size_t)(T * qkv_width * 4));
    float *attention = malloc((size_t)(T * q_width * 4)), *gate_up = malloc((size_t)(T * 2 * intermediate * 4));
    float *activated = malloc((size_t)(T * intermediate * 4));
    const int64_t widest = qkv_width > 2 * intermediate ? qkv_width : 2 * intermediate;
    float *scratch = malloc((size_t)(T * (widest > hidden_size ? widest : hidden_size) * 4));
    for (int64_t l = 0; l < num_layers; l++) {
        const DecoderLayer *layer = layers + l;
        if (l == 0) { /* the embeddings are the first residual */
            rms_norm(hidden, NULL, layer->input_norm, T, hidden_size, eps, normed, NULL);
            memcpy(residual, hidden, (size_t)(T * hidden_size * 4));
        } else {
            rms_norm(hidden, residual, layer->input_norm, T, hidden_size, eps, normed, residual);
        }
        project(layer->qkv, normed, T, hidden_size, qkv_width, qkv, scratch, int8_levels);
        rotary_embedding(qkv, qkv_width, heads, qkv + q_width, qkv_width, kv_heads, T, head_dim, cos, sin);
        store_kv_cache(qkv + q_width, qkv_width, qkv + q_width + kv_width, qkv_width, T, kv_width, layer->k_cache,
                       layer->v_cache, slot_mapping, half_cache);
        const int64_t decodes = rows->decodes;
        if (decodes)
            paged_decode_attention(qkv, qkv_width, decodes, heads, head_dim, layer->k_cache, layer->v_cache,
                                   block_size, kv_heads, rows->decode_tables, rows->decode_table_stride,
                                   rows->decode_context_lens, rows->max_decode_context, scale, attention, half_cache);
        if (rows->chunks)
            paged_prefill_attention(qkv + decodes * qkv_width, qkv_width, rows->chunks, rows->query_starts,
                                    rows->query_lens, rows->chunk_context_lens, heads, head_dim, layer->k_cache,
                                    layer->v_cache, block_size, kv_heads, rows->chunk_tables, rows->chunk_table_stride,
                                    scale, attention + decodes * q_width, half_cache);
        project(layer->o, attention, T, q_width, hidden_size, hidden, scratch, int8_levels);
        rms_norm(hidden, residual, layer->post_attention_norm, T, hidden_size, eps, normed, residual);
        project(layer->gate_up, normed, T, hidden_size, 2 * intermediate, gate_up, scratch, int8_levels);
        silu_and_mul(gate_up, T, intermediate, activated);
        project(layer->down, activated, T, intermediate, hidden_size, hidden, scratch, int8_levels);
    }
    free(scratch);
    free(activated);
    free(gate_up);
    free(attention);
    free(qkv);
    free(normed);
}
