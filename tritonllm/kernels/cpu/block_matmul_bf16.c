#include "cpu_ops.h"
#include "bf16.h"
#include "blocks.h"

/* ---- prompt rows' projections over a GGUF's blocks on the CPU's bf16 matrix units (prompts computed in bfloat16) ----
 * y[T][N] (rows y_stride floats apart) = x[T][K] . W[N][K]^T, x rounded to bf16 (denormals to 0), each weight
 * dequantized from its block (the file's number, exactly) and rounded to bf16, products summed in fp32: what a bf16
 * matmul over a bf16 copy of the weights computes, without the copy (2 bytes a weight). N a multiple of 16; y has
 * rows up to a whole number of AMX_TOKENS (rows past T are scratch, left out by the caller).
 * The tokens are first rounded into a buffer of left operands' rows (the op's own, kept between calls). A task is 32
 * output rows: their weights are dequantized into right operands (per block of 32 inputs, 16 rows as 16 pairs of
 * inputs: 1 KiB, the task's K * 64 bytes staying in L2) once per AMX_CHUNK tokens, then every 32 of those tokens
 * accumulate 2 x 2 output tiles over K in block order. Without AMX tiles (or where `tiles` says not to use them),
 * AVX512-BF16 dot products (vdpbf16ps: Zen 4/5) compute the same: DOT_TOKENS tokens x 32 output rows of sums in
 * registers, each adding a token's pair of inputs (broadcast) times the operand's row of 16 output rows' pairs.
 * A row's result depends on its own inputs and the weights alone: batch-invariant. Returns 1 where the build has no
 * AVX512-BF16. */

#ifdef BF16_BUILD

#define AMX_TOKENS 32       /* a step's tokens: two left operands of 16 rows */
#define TASK_ROWS 32        /* a task's output rows: two right operands of 16 columns */
#define OPERAND_WORDS 512   /* bf16 in a right operand (16 pairs of rows x 32) */
#define ROW_PAD 32          /* bf16 after each token's inputs */
#define AMX_CHUNK 512       /* tokens a task's weights serve before the next task's (their left operands then stay
                             * in L2; fewer dequantize each task's weights too often where K is large) */

typedef void (*RightOperands)(const uint8_t *rows, int64_t row_bytes, int64_t blocks, uint16_t *operands,
                              int64_t stride);

/* Rows 0 .. 15 of `rows` as right operands, `stride` words apart (one per block of 32 inputs): a row's 32 weights of
 * a block, rounded to bf16, are 16 pairs (32-bit lanes) in input order; the operand holds each pair of inputs as a
 * row of the 16 weight rows' pairs, so the pairs are transposed 16 x 16. */
#define RIGHT_OPERANDS(NAME, DEQUANTIZE, SCALES, SUPER_BYTES, SUB, UNIT)                                          \
    static void NAME(const uint8_t *rows, int64_t row_bytes, int64_t blocks, uint16_t *operands, int64_t stride) { \
        for (int64_t s = 0; s < blocks / (SUB); s++) {                                                           \
            __m512 pairs[SUB][16];                                                                               \
            for (int n = 0; n < 16; n++) {                                                                       \
                const uint8_t *super = rows + n * row_bytes + s * (SUPER_BYTES);                                 \
                float table[SCALE_TABLE];                                                                        \
                SCALES(super, table);                                                                            \
                for (int j = 0; j < (SUB); j += (UNIT)) {                                                        \
                    vf w[(UNIT) * BLOCK_VECTORS];                                                                \
                    DEQUANTIZE(super, j, table, w);                                                              \
                    for (int u = 0; u < (UNIT); u++) /* block j + u: its 32 weights, inputs 0-15 in the low half */ \
                        pairs[j + u][n] = (__m512)_mm512_cvtne2ps_pbh((__m512)w[2 * u + 1], (__m512)w[2 * u]);  \
                }                                                                                                \
            }                                                                                                    \
            for (int j = 0; j < (SUB); j++) {                                                                    \
                transpose16(pairs[j]);                                                                           \
                uint16_t *operand = operands + (s * (SUB) + j) * stride;                                         \
                for (int p = 0; p < 16; p++) _mm512_store_si512(operand + 32 * p, (__m512i)pairs[j][p]);         \
            }                                                                                                    \
        }                                                                                                        \
    }

#define KIND_OPERANDS(KIND, OP, NAME, ...) RIGHT_OPERANDS(NAME##_operands, __VA_ARGS__)
BLOCK_FORMATS(KIND_OPERANDS)

/* A group of 16 rows in blocks.h's row groups (the int8-activation ops' weights) as right operands: lane r of a
 * chunk holds row r's codes of 4 inputs, so each input's 16 weights are one vector (d, m a lane each), and two
 * inputs' rounded to bf16 are an operand's row of pairs as they are: no transpose. */
static inline void store_pair(uint16_t *row, __m512 first, __m512 second) {
    const __m512i low = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(first));
    const __m512i high = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(second));
    _mm512_store_si512(row, _mm512_or_si512(low, _mm512_slli_epi32(high, 16)));
}

static inline __m512 code_of_lanes(__m512i codes, int byte) { /* byte `byte` of each lane, as a float */
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(codes, 8 * byte), _mm512_set1_epi32(0xff)));
}

/* A block of int4's chunks of nibbles (`codes`), w = d q + m per lane, as one operand */
static inline void nibble_block_operand(const uint8_t *codes, __m512 d, __m512 m, uint16_t *operand) {
    const __m512i nibble = _mm512_set1_epi8(15);
    for (int c = 0; c < 4; c++) {
        const __m512i both = _mm512_loadu_si512(codes + c * GROUP_CHUNK);
        const __m512i halves[2] = {_mm512_and_si512(both, nibble),
                                   _mm512_and_si512(_mm512_srli_epi32(both, 4), nibble)};
        for (int h = 0; h < 2; h++) /* inputs 16h + 4c + i: pairs 8h + 2c, 8h + 2c + 1 */
            for (int i = 0; i < 4; i += 2)
                store_pair(operand + 32 * (8 * h + 2 * c + i / 2), _mm512_fmadd_ps(code_of_lanes(halves[h], i), d, m),
                           _mm512_fmadd_ps(code_of_lanes(halves[h], i + 1), d, m));
    }
}

static inline __m512 half_lanes(const uint8_t *p) { /* 16 fp16 as floats */
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline __m512 byte_lanes(const uint8_t *p) { /* 16 int8 as floats */
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

static void int4_groups_operands(const uint8_t *group, int64_t row_bytes, int64_t blocks, uint16_t *operands,
                                 int64_t stride) {
    (void)row_bytes;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = group + b * Q4_GROUP_BYTES;
        nibble_block_operand(block, half_lanes(block + 4 * GROUP_CHUNK), half_lanes(block + 4 * GROUP_CHUNK + 32),
                             operands + b * stride);
    }
}

static void int5_groups_operands(const uint8_t *group, int64_t row_bytes, int64_t blocks, uint16_t *operands,
                                 int64_t stride) {
    (void)row_bytes;
    const __m512i nibble = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = group + b * Q5_GROUP_BYTES;
        const __m512 d = half_lanes(block + 5 * GROUP_CHUNK), m = half_lanes(block + 5 * GROUP_CHUNK + 32);
        const __m512i fifths = _mm512_loadu_si512(block + 4 * GROUP_CHUNK);
        for (int c = 0; c < 8; c++) { /* inputs 4c + i: the low 4 bits from chunk c % 4, the fifth bit c */
            const __m512i both = _mm512_loadu_si512(block + (c % 4) * GROUP_CHUNK);
            const __m512i low = _mm512_and_si512(c < 4 ? both : _mm512_srli_epi32(both, 4), nibble);
            const __m512i fifth = _mm512_and_si512(_mm512_srli_epi32(fifths, c), one);
            const __m512i codes = _mm512_or_si512(low, _mm512_slli_epi32(fifth, 4));
            for (int i = 0; i < 4; i += 2) /* w = d q + m: pairs 2c, 2c + 1 */
                store_pair(operands + b * stride + 32 * (2 * c + i / 2), _mm512_fmadd_ps(code_of_lanes(codes, i), d, m),
                           _mm512_fmadd_ps(code_of_lanes(codes, i + 1), d, m));
        }
    }
}

static void q4_k_groups_operands(const uint8_t *group, int64_t row_bytes, int64_t blocks, uint16_t *operands,
                                 int64_t stride) {
    (void)row_bytes;
    for (int64_t s = 0; s < blocks / SUPER_BLOCKS; s++) {
        const uint8_t *unit = group + s * Q4_K_GROUP_BYTES;
        const __m512 d = half_lanes(unit + Q4_K_GROUP_D), dmin = half_lanes(unit + Q4_K_GROUP_D + 32);
        for (int j = 0; j < SUPER_BLOCKS; j++) /* d' = d·sc, m' = −dmin·mn: exact */
            nibble_block_operand(unit + j * 4 * GROUP_CHUNK,
                                 _mm512_mul_ps(d, byte_lanes(unit + Q4_K_GROUP_SC + 16 * j)),
                                 _mm512_sub_ps(_mm512_setzero_ps(),
                                               _mm512_mul_ps(dmin, byte_lanes(unit + Q4_K_GROUP_MN + 16 * j))),
                                 operands + (s * SUPER_BLOCKS + j) * stride);
    }
}

static void q8_groups_operands(const uint8_t *group, int64_t row_bytes, int64_t blocks, uint16_t *operands,
                               int64_t stride) {
    (void)row_bytes;
    const __m512 offset = _mm512_set1_ps(128.0f);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = group + b * Q8_GROUP_BYTES;
        const __m512 d = half_lanes(block + 8 * GROUP_CHUNK);
        for (int c = 0; c < 8; c++) { /* inputs 4c + i (codes + 128): pairs 2c, 2c + 1 */
            const __m512i codes = _mm512_loadu_si512(block + c * GROUP_CHUNK);
            for (int i = 0; i < 4; i += 2)
                store_pair(operands + b * stride + 32 * (2 * c + i / 2),
                           _mm512_mul_ps(_mm512_sub_ps(code_of_lanes(codes, i), offset), d),
                           _mm512_mul_ps(_mm512_sub_ps(code_of_lanes(codes, i + 1), offset), d));
        }
    }
}

static void q6_groups_operands(const uint8_t *group, int64_t row_bytes, int64_t blocks, uint16_t *operands,
                               int64_t stride) {
    (void)row_bytes;
    const __m512i nibble = _mm512_set1_epi8(15), pair = _mm512_set1_epi8(3);
    const __m512 offset = _mm512_set1_ps(32.0f);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = group + b * Q6_GROUP_BYTES;
        const __m512 d = half_lanes(block + Q6_GROUP_D);
        const __m512 scales[2] = {_mm512_mul_ps(d, byte_lanes(block + Q6_GROUP_SC)), /* d' = d·sc, exact */
                                  _mm512_mul_ps(d, byte_lanes(block + Q6_GROUP_SC + 16))};
        for (int c = 0; c < 8; c++) { /* inputs 4c + i: the low 4 bits from chunk c % 4, the top 2 from 4 + c / 4 */
            const __m512i both = _mm512_loadu_si512(block + (c % 4) * GROUP_CHUNK);
            const __m512i low = _mm512_and_si512(c < 4 ? both : _mm512_srli_epi32(both, 4), nibble);
            const __m512i pairs = _mm512_loadu_si512(block + (4 + c / 4) * GROUP_CHUNK);
            const __m512i top = _mm512_and_si512(_mm512_srli_epi32(pairs, 2 * (c % 4)), pair);
            const __m512i codes = _mm512_or_si512(low, _mm512_slli_epi32(top, 4));
            for (int i = 0; i < 4; i += 2) /* w = d' (q − 32): pairs 2c, 2c + 1 */
                store_pair(operands + b * stride + 32 * (2 * c + i / 2),
                           _mm512_mul_ps(_mm512_sub_ps(code_of_lanes(codes, i), offset), scales[c / 4]),
                           _mm512_mul_ps(_mm512_sub_ps(code_of_lanes(codes, i + 1), offset), scales[c / 4]));
        }
    }
}

/* A kind's right operands, and its bytes a row of `blocks` blocks of 32 inputs (row groups: a group's over 16, so
 * that row n0, a multiple of 16, is its group's start); NULL for no kind of blocks.h's. */
static RightOperands right_operands(int64_t kind, int64_t blocks, int64_t *row_bytes) {
    switch (kind) {
#define KIND_CASE(KIND, OP, NAME, DEQUANTIZE, SCALES, SUPER_BYTES, SUB, UNIT)                                       \
    case KIND: *row_bytes = blocks / (SUB) * (SUPER_BYTES); return NAME##_operands;
        BLOCK_FORMATS(KIND_CASE)
    case INT4_ROW_GROUPS: *row_bytes = blocks * Q4_GROUP_BYTES / GROUP_ROWS; return int4_groups_operands;
    case Q8_ROW_GROUPS: *row_bytes = blocks * Q8_GROUP_BYTES / GROUP_ROWS; return q8_groups_operands;
    case Q6_ROW_GROUPS: *row_bytes = blocks * Q6_GROUP_BYTES / GROUP_ROWS; return q6_groups_operands;
    case INT5_ROW_GROUPS: *row_bytes = blocks * Q5_GROUP_BYTES / GROUP_ROWS; return int5_groups_operands;
    case Q4_K_ROW_GROUPS:
        *row_bytes = blocks / SUPER_BLOCKS * Q4_K_GROUP_BYTES / GROUP_ROWS;
        return q4_k_groups_operands;
    default: return NULL;
    }
}

/* At least `bytes` of 64-byte aligned memory owned by the calling thread and kept for its next call: a fresh
 * allocation of this size is an mmap, whose page faults on every call cost more than small matmuls take. */
typedef struct {
    void *memory;
    size_t bytes;
} Scratch;

static void *scratch(Scratch *kept, size_t bytes) {
    if (kept->bytes < bytes) {
        free(kept->memory);
        kept->memory = aligned_alloc(64, (bytes + 63) / 64 * 64);
        kept->bytes = bytes;
    }
    return kept->memory;
}

static _Thread_local Scratch left_scratch, operand_scratch; /* the caller's tokens; each OpenMP thread's weights */

/* Tokens t0 .. t1 - 1 (whole AMX_TOKENS) of the left operands times a task's right operands (its last 16 rows only
 * unless `wide`), into y's rows t0 .. and the task's columns. */
#ifdef AMX_BUILD
static void multiply_task_on_tiles(const uint16_t *left, int64_t blocks, const uint16_t *operands, int wide,
                                   int64_t t0, int64_t t1, float *y, int64_t y_stride) {
    const int64_t stride = blocks * QUANT_BLOCK + ROW_PAD;
    for (; t0 < t1; t0 += AMX_TOKENS) {
        const uint16_t *tokens = left + t0 * stride;
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t b = 0; b < blocks; b++) {
            const uint16_t *right = operands + b * 2 * OPERAND_WORDS;
            _tile_loadd(0, tokens + b * QUANT_BLOCK, stride * 2);
            _tile_loadd(1, tokens + 16 * stride + b * QUANT_BLOCK, stride * 2);
            _tile_loadd(2, right, 64);
            _tile_dpbf16ps(4, 0, 2);
            _tile_dpbf16ps(6, 1, 2);
            if (wide) {
                _tile_loadd(3, right + OPERAND_WORDS, 64);
                _tile_dpbf16ps(5, 0, 3);
                _tile_dpbf16ps(7, 1, 3);
            }
        }
        float *out = y + t0 * y_stride;
        _tile_stored(4, out, y_stride * 4);
        _tile_stored(6, out + 16 * y_stride, y_stride * 4);
        if (wide) {
            _tile_stored(5, out + 16, y_stride * 4);
            _tile_stored(7, out + 16 * y_stride + 16, y_stride * 4);
        }
    }
}
#endif

#define DOT_TOKENS 8 /* tokens x 2 x 16 output rows: 16 vectors of sums */

INLINED void dot_tokens(const uint16_t *tokens, int64_t stride, int64_t blocks, const uint16_t *operands,
                        const int groups, float *out, int64_t y_stride) {
    __m512 sums[DOT_TOKENS][2];
    for (int t = 0; t < DOT_TOKENS; t++) sums[t][0] = sums[t][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint16_t *right = operands + b * 2 * OPERAND_WORDS;
        for (int p = 0; p < 16; p++) {
            const __m512bh first = (__m512bh)_mm512_load_si512(right + 32 * p);
            const __m512bh second = groups == 2 ? (__m512bh)_mm512_load_si512(right + OPERAND_WORDS + 32 * p) : first;
            for (int t = 0; t < DOT_TOKENS; t++) {
                const uint16_t *inputs = tokens + t * stride + b * QUANT_BLOCK + 2 * p;
                const __m512bh pair = (__m512bh)_mm512_set1_epi32(bf16_pair(inputs));
                sums[t][0] = _mm512_dpbf16_ps(sums[t][0], pair, first);
                if (groups == 2) sums[t][1] = _mm512_dpbf16_ps(sums[t][1], pair, second);
            }
        }
    }
    for (int t = 0; t < DOT_TOKENS; t++) {
        _mm512_storeu_ps(out + t * y_stride, sums[t][0]);
        if (groups == 2) _mm512_storeu_ps(out + t * y_stride + 16, sums[t][1]);
    }
}

/* multiply_task_on_tiles's products as dot products */
static void multiply_task_by_dot_products(const uint16_t *left, int64_t blocks, const uint16_t *operands, int wide,
                                          int64_t t0, int64_t t1, float *y, int64_t y_stride) {
    const int64_t stride = blocks * QUANT_BLOCK + ROW_PAD;
    for (; t0 < t1; t0 += DOT_TOKENS) {
        if (wide)
            dot_tokens(left + t0 * stride, stride, blocks, operands, 2, y + t0 * y_stride, y_stride);
        else
            dot_tokens(left + t0 * stride, stride, blocks, operands, 1, y + t0 * y_stride, y_stride);
    }
}

int64_t block_matmul_bf16(const float *x, int64_t T, int64_t K, int64_t kind, const uint8_t *weights, int64_t N,
                          float *y, int64_t y_stride, int64_t tiles) {
#ifdef AMX_BUILD
    tiles = tiles && amx_permitted();
#else
    tiles = 0;
#endif
    if (T == 0) return 0;
    const int64_t blocks = K / QUANT_BLOCK, tasks = (N + TASK_ROWS - 1) / TASK_ROWS;
    int64_t row_bytes;
    const RightOperands operands_of = right_operands(kind, blocks, &row_bytes);
    if (operands_of == NULL) return 1; /* (the binding passes only BLOCK_KINDS) */
    /* the tokens rounded to bf16 (zeros past T), the left operands' rows, ROW_PAD apart more than K (rows a power
     * of two bytes apart would send a tile load's 16 rows to the same cache sets) */
    const int64_t padded = (T + AMX_TOKENS - 1) / AMX_TOKENS * AMX_TOKENS;
    uint16_t *left = scratch(&left_scratch, (size_t)padded * (K + ROW_PAD) * 2);
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < padded / 16; tile++)
            for (int64_t b = 0; b < blocks; b++)
                for (int r = 0; r < 16; r++) {
                    const int64_t t = tile * 16 + r;
                    const float *inputs = x + t * K + b * QUANT_BLOCK;
                    const __m512i row = t < T ? (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(inputs + 16),
                                                                               _mm512_loadu_ps(inputs))
                                              : _mm512_setzero_si512();
                    _mm512_storeu_si512(left + t * (K + ROW_PAD) + b * QUANT_BLOCK, row);
                }
        uint16_t *operands = scratch(&operand_scratch, (size_t)blocks * TASK_ROWS / 16 * OPERAND_WORDS * 2);
#ifdef AMX_BUILD
        if (tiles) configure_tiles(); /* tmm0-1 the tokens, tmm2-3 the weights, tmm4-7 the outputs */
#endif
        for (int64_t chunk = 0; chunk < padded; chunk += AMX_CHUNK) {
#pragma omp for schedule(static)
            for (int64_t task = 0; task < tasks; task++) {
                const int64_t n0 = task * TASK_ROWS;
                const int wide = N - n0 >= TASK_ROWS; /* else its last 16 rows */
                for (int half = 0; half <= wide; half++)
                    operands_of(weights + (n0 + 16 * half) * row_bytes, row_bytes, blocks,
                                operands + half * OPERAND_WORDS, 2 * OPERAND_WORDS);
                const int64_t end = padded - chunk < AMX_CHUNK ? padded : chunk + AMX_CHUNK;
#ifdef AMX_BUILD
                if (tiles) {
                    multiply_task_on_tiles(left, blocks, operands, wide, chunk, end, y + n0, y_stride);
                    continue;
                }
#endif
                /* dot products need no whole left operands: the tokens up to T's next DOT_TOKENS */
                const int64_t dot_end = (T + DOT_TOKENS - 1) / DOT_TOKENS * DOT_TOKENS;
                multiply_task_by_dot_products(left, blocks, operands, wide, chunk, end < dot_end ? end : dot_end,
                                              y + n0, y_stride);
            }
        }
#ifdef AMX_BUILD
        if (tiles) _tile_release();
#endif
    }
    return 0;
}

#else

int64_t block_matmul_bf16(const float *x, int64_t T, int64_t K, int64_t kind, const uint8_t *weights, int64_t N,
                          float *y, int64_t y_stride, int64_t tiles) {
    return 1;
}

#endif

int64_t amx_tiles_available(void) {
#ifdef AMX_BUILD
    return amx_permitted();
#else
    return 0;
#endif
}
