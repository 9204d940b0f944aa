/* What the AVX2 kernel families share (woq_int8.c, int_dot.c, vision_dot.c): the failing default of their tile switches, the
   store of eight float32 results as float32 or bf16, a block's largest magnitude, the four-byte integer products (VNNI
   where the build targets it) and, in an AVX512 build, the loads and stores of two groups a register. Each family's
   library compiles its own copy (static). */
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

#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define VNNI 1
#else
#define VNNI 0
#endif

/* acc + each int32 lane's four products of unsigned bytes u and signed bytes s: one vpdpbusd with VNNI, else
   vpmaddubsw (pairs summed to int16, saturating: the callers' products stay below it) and vpmaddwd. */
static inline __attribute__((always_inline)) __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s)
{
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif VNNI
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* The 512-bit tiles of several rows (int_dot.c, vision_dot.c): an AVX512-VNNI build with BW, WIDE_ROWS rows x
   WIDE_PAIRS pairs of groups of eight outputs (4 x 3 the fastest of the shapes measured for both, or within 2%). */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define WIDE_ISA 1
#else
#define WIDE_ISA 0
#endif
#ifndef WIDE_ROWS
#define WIDE_ROWS 4
#endif
#ifndef WIDE_PAIRS
#define WIDE_PAIRS 3
#endif
#define WIDE_MAX_ROWS 4 /* the tiles' switches cover 1..WIDE_MAX_ROWS rows and 1..WIDE_MAX_PAIRS pairs */
#define WIDE_MAX_PAIRS 3
#if WIDE_ROWS > WIDE_MAX_ROWS || WIDE_PAIRS > WIDE_MAX_PAIRS
#error "the 512-bit tiles' switches cover 1..WIDE_MAX_ROWS rows and 1..WIDE_MAX_PAIRS pairs"
#endif

#if defined(__AVX512F__)
/* 32 bytes at a, then 32 at b */
static inline __attribute__((always_inline)) __m512i load_pair(const void *a, const void *b)
{
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

/* 16 bytes at a, then 16 at b */
static inline __attribute__((always_inline)) __m256i load_pair128(const void *a, const void *b)
{
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                   _mm_loadu_si128((const __m128i *)b), 1);
}

/* Two groups' sixteen results, each group's eight stored as store8 stores them. */
static inline __attribute__((always_inline)) void store16(void *y, int64_t index, __m512 v, int bf16)
{
    store8(y, index, _mm512_castps512_ps256(v), bf16);
    store8(y, index + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)), bf16);
}
#endif

#endif
