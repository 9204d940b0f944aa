/* What the AVX2 kernel families share (woq_int8.c, int_dot.c, vision_dot.c): the failing default of their tile switches, the
   store of eight float32 results as float32 or bf16 and a block's largest magnitude. Each family's library compiles its own copy (static). */
#ifndef OAI_GEMMA_AVX2_COMMON_H
#define OAI_GEMMA_AVX2_COMMON_H

#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* A tile shape no case covers: a caller's bug, never a silent no-op that leaves y as it was. */
static void no_tile(const char *kernel, int r, int g)
{
    fprintf(stderr, "%s has no tile for %d rows x %d groups\n", kernel, r, g);
    abort();
}

/* Eight float32 results stored at y[index..index+8), as float32 or rounded to bf16 (nearest even). */
static inline __attribute__((always_inline)) void store8(void *y, int64_t index, __m256 v, int bf16)
{
    if (!bf16) {
        _mm256_storeu_ps((float *)y + index, v);
        return;
    }
    __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
    _mm_storeu_si128((__m128i *)((uint16_t *)y + index), packed);
}

/* The largest |v| of a block of 32 float32 values (four vectors): a block's activation scale (int_dot.c, vision_dot.c). */
static inline __attribute__((always_inline)) float abs_max32(const __m256 v[4])
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                             _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

#endif
