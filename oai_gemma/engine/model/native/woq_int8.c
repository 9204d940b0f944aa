/* Weight-only int8 linear for CPUs that compute in float32 (AVX2 + FMA): y = x @ (w * scale)^T.

   w is int8, one scale per output channel, laid out as [N/8][K][8]: eight output channels side by side for
   each input column, so one 8-byte load is one column of eight outputs, widened to float32 and multiplied
   into eight accumulators per row of x. A step streams a quarter of float32's bytes, and every output is one
   sum over k in order whatever M, the tile or the thread, so a row's result does not depend on the rows
   beside it (batch invariance). Threads share the output channels through the OpenMP runtime torch already
   loaded (same soname), with torch's thread count. x and y may each be bf16 instead (a bf16 model's
   activations): x is widened once per call, y rounded to nearest even as it is stored, so the caller needs no
   conversion ops of its own. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* x [M, K] as float32: itself, or widened from bf16 into *owned (freed by the caller). */
static const float *as_float(const void *x, int64_t count, int bf16, float **owned)
{
    *owned = NULL;
    if (!bf16) return (const float *)x;
    float *wide = malloc(count * sizeof(float));
    const uint16_t *half = (const uint16_t *)x;
    for (int64_t i = 0; i < count; i++) {
        const uint32_t bits = (uint32_t)half[i] << 16;
        memcpy(wide + i, &bits, sizeof(float));
    }
    return *owned = wide;
}

#define ROWS 4   /* rows of x per tile (the widened weights are reused this many times) */
#define WIDE 8   /* groups of 8 outputs per tile for a single row: enough independent sums to hide FMA latency */
#define NARROW 3 /* groups per tile for several rows: ROWS * NARROW accumulators fill the 16 registers */

static inline __attribute__((always_inline)) void tile(
    const int rows, const int groups, const float *x, int64_t K, const int8_t *w,
    const float *scale, void *y, int64_t y0, int64_t N, int y_bf16)
{
    __m256 acc[ROWS][WIDE];
    for (int m = 0; m < rows; m++)
        for (int g = 0; g < groups; g++) acc[m][g] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m256 wk[WIDE];
        for (int g = 0; g < groups; g++)
            wk[g] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + (g * K + k) * 8))));
        for (int m = 0; m < rows; m++) {
            const __m256 xk = _mm256_broadcast_ss(x + m * K + k);
            for (int g = 0; g < groups; g++) acc[m][g] = _mm256_fmadd_ps(xk, wk[g], acc[m][g]);
        }
    }
    for (int g = 0; g < groups; g++) {
        const __m256 s = _mm256_loadu_ps(scale + g * 8);
        for (int m = 0; m < rows; m++) store8(y, y0 + m * N + g * 8, _mm256_mul_ps(acc[m][g], s), y_bf16);
    }
}

/* The tile for r rows and g groups, their counts constants inside (the loops unroll). */
typedef void (*tile_fn)(int r, int g, const float *x, int64_t K, const int8_t *w, const float *scale, void *y,
                        int64_t y0, int64_t N, int y_bf16);

#define CASE(fn, r, g) case (r) * 16 + (g): fn(r, g, x, K, w, scale, y, y0, N, y_bf16); break;

static void tile_avx2(int r, int g, const float *x, int64_t K, const int8_t *w, const float *scale, void *y,
                      int64_t y0, int64_t N, int y_bf16)
{
    switch (r * 16 + g) {
        CASE(tile, 1, 1) CASE(tile, 1, 2) CASE(tile, 1, 3) CASE(tile, 1, 4) CASE(tile, 1, 5) CASE(tile, 1, 6)
        CASE(tile, 1, 7) CASE(tile, 1, 8)
        CASE(tile, 2, 1) CASE(tile, 2, 2) CASE(tile, 2, 3)
        CASE(tile, 3, 1) CASE(tile, 3, 2) CASE(tile, 3, 3)
        CASE(tile, 4, 1) CASE(tile, 4, 2) CASE(tile, 4, 3)
    }
}

/* Threads share tiles of `wide` (one row) or `narrow` (several) groups of 8 outputs; each tile runs over the rows
   ROWS at a time. */
static void run(tile_fn tile_of, int64_t wide, int64_t narrow, const void *x_in, int64_t M, int64_t K,
                const int8_t *w, const float *scale, int64_t N, void *y, int x_bf16, int y_bf16)
{
    float *owned;
    const float *x = as_float(x_in, M * K, x_bf16, &owned);
    const int64_t per_tile = M == 1 ? wide : narrow;
    const int64_t groups = N / 8, tiles = (groups + per_tile - 1) / per_tile;
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t g0 = t * per_tile;
        const int g = groups - g0 < per_tile ? (int)(groups - g0) : (int)per_tile;
        for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
            const int r = M - m0 < ROWS ? (int)(M - m0) : ROWS;
            tile_of(r, g, x + m0 * K, K, w + g0 * K * 8, scale + g0 * 8, y, m0 * N + g0 * 8, N, y_bf16);
        }
    }
    free(owned);
}

/* x [M, K] float32 (bf16 if x_bf16), w [N/8, K, 8] int8, scale [N] float32 -> y [M, N] float32 (bf16 if
   y_bf16); N a multiple of 8. */
void woq_int8_linear(const void *x, int64_t M, int64_t K, const int8_t *w, const float *scale, int64_t N, void *y,
                     int x_bf16, int y_bf16)
{
    run(tile_avx2, WIDE, NARROW, x, M, K, w, scale, N, y, x_bf16, y_bf16);
}

/* The same product with AVX512F, the same [N/8][K][8] layout (one stored form for both): one 16-byte load is two
   input columns (k, k+1) of eight outputs, widened into one 512-bit register and multiplied by x[k] and x[k+1]
   broadcast into its two halves; the halves are summed at the end. Twice the products per instruction of the
   AVX2 loop, for steps of a few rows, where widening, not memory, is the limit. Each output is still one fixed
   order of sums (even k, odd k, then both) whatever M, tile or thread. K must be even. */
#define WIDE512 8
#define NARROW512 6 /* ROWS * NARROW512 = 24 accumulators of the 32 registers */

static inline __attribute__((always_inline, target("avx512f"))) void tile512(
    const int rows, const int groups, const float *x, int64_t K, const int8_t *w,
    const float *scale, void *y, int64_t y0, int64_t N, int y_bf16)
{
    const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc[ROWS][WIDE512];
    for (int m = 0; m < rows; m++)
        for (int g = 0; g < groups; g++) acc[m][g] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 2) {
        __m512 wk[WIDE512];
        for (int g = 0; g < groups; g++)
            wk[g] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + (g * K + k) * 8))));
        for (int m = 0; m < rows; m++) {
            const __m512 pair = _mm512_castpd_ps(_mm512_set1_pd(*(const double *)(x + m * K + k)));
            const __m512 xk = _mm512_permutexvar_ps(halves, pair);
            for (int g = 0; g < groups; g++) acc[m][g] = _mm512_fmadd_ps(xk, wk[g], acc[m][g]);
        }
    }
    for (int g = 0; g < groups; g++) {
        const __m256 s = _mm256_loadu_ps(scale + g * 8);
        for (int m = 0; m < rows; m++) {
            const __m256 sum = _mm256_add_ps(_mm512_castps512_ps256(acc[m][g]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[m][g]), 1)));
            store8(y, y0 + m * N + g * 8, _mm256_mul_ps(sum, s), y_bf16);
        }
    }
}

__attribute__((target("avx512f")))
static void tile_avx512(int r, int g, const float *x, int64_t K, const int8_t *w, const float *scale, void *y,
                        int64_t y0, int64_t N, int y_bf16)
{
    switch (r * 16 + g) {
        CASE(tile512, 1, 1) CASE(tile512, 1, 2) CASE(tile512, 1, 3) CASE(tile512, 1, 4) CASE(tile512, 1, 5)
        CASE(tile512, 1, 6) CASE(tile512, 1, 7) CASE(tile512, 1, 8)
        CASE(tile512, 2, 1) CASE(tile512, 2, 2) CASE(tile512, 2, 3) CASE(tile512, 2, 4) CASE(tile512, 2, 5)
        CASE(tile512, 2, 6)
        CASE(tile512, 3, 1) CASE(tile512, 3, 2) CASE(tile512, 3, 3) CASE(tile512, 3, 4) CASE(tile512, 3, 5)
        CASE(tile512, 3, 6)
        CASE(tile512, 4, 1) CASE(tile512, 4, 2) CASE(tile512, 4, 3) CASE(tile512, 4, 4) CASE(tile512, 4, 5)
        CASE(tile512, 4, 6)
    }
}

/* As woq_int8_linear, with AVX512F; K even. */
void woq_int8_linear_avx512(const void *x, int64_t M, int64_t K, const int8_t *w, const float *scale, int64_t N,
                            void *y, int x_bf16, int y_bf16)
{
    run(tile_avx512, WIDE512, NARROW512, x, M, K, w, scale, N, y, x_bf16, y_bf16);
}
