/* What the ops over bf16 share: bf16 conversions and a transpose where the build has AVX512-BF16 (BF16_BUILD);
 * AMX tiles' OS permission and configuration (every tile 16 rows of 64 bytes) where it has AMX too (AMX_BUILD).
 * Callers guard their code with these. */

#pragma once

#include "vector.h"

#if defined(__AVX512BF16__)
#define BF16_BUILD 1

/* Two consecutive bf16 as one 32-bit word, the first in its low half: a pair of a vdpbf16ps operand, broadcast */
static inline int32_t bf16_pair(const uint16_t *pair) {
    int32_t bits;
    memcpy(&bits, pair, 4);
    return bits;
}

static inline __m256i to_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

/* r[i] = column i of the 16 x 16 floats in r (unpacks of lanes, pairs, then 128-bit quarters, twice) */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = (__m512)_mm512_unpacklo_pd((__m512d)t[4 * i], (__m512d)t[4 * i + 2]);
        r[4 * i + 1] = (__m512)_mm512_unpackhi_pd((__m512d)t[4 * i], (__m512d)t[4 * i + 2]);
        r[4 * i + 2] = (__m512)_mm512_unpacklo_pd((__m512d)t[4 * i + 1], (__m512d)t[4 * i + 3]);
        r[4 * i + 3] = (__m512)_mm512_unpackhi_pd((__m512d)t[4 * i + 1], (__m512d)t[4 * i + 3]);
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
            t[8 * i + 4 + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define AMX_BUILD 1
#include <sys/syscall.h>
#include <unistd.h>

typedef struct __attribute__((packed, aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Linux gives a process the AMX register state only when asked (once; every thread then has it). */
static inline int amx_permitted(void) {
    static int permitted = -1;
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return permitted;
}

/* Every tile 16 rows of 64 bytes: a left operand 16 rows of 32 bf16, a right one 16 pairs of rows (interleaved:
 * row pair p holds element (2p, n) then (2p + 1, n) for each column n), an output 16 x 16 fp32. */
static inline void configure_tiles(void) {
    TileConfig config = {.palette = 1};
    for (int t = 0; t < 8; t++) config.colsb[t] = 64, config.rows[t] = 16;
    _tile_loadconfig(&config);
}

#endif
#endif
