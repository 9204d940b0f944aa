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
#include <math.h>
#include <stdio.h>

#include "avx2_common.h"

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

/* `rows` x (`groups` * 8) outputs from int8 weights `w` ([groups][K][8]), widened to float32 per k; or, with `wf`
   set, from a panel of those weights already widened ([groups][K][8] float32, unscaled: int8 -> float32 is exact):
   the same products summed in the same order into the same accumulators, so the same bits either way, without
   widening every weight again for every 4 rows (a prefill chunk's calls). */
static inline __attribute__((always_inline)) void tile_from(
    const int rows, const int groups, const float *x, int64_t K, const int8_t *w, const float *wf,
    const float *scale, void *y, int64_t y0, int64_t N, int y_bf16)
{
    __m256 acc[ROWS][WIDE];
    for (int m = 0; m < rows; m++)
        for (int g = 0; g < groups; g++) acc[m][g] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m256 wk[WIDE];
        for (int g = 0; g < groups; g++)
            wk[g] = wf ? _mm256_loadu_ps(wf + (g * K + k) * 8)
                       : _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + (g * K + k) * 8))));
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

static inline __attribute__((always_inline)) void tile(
    const int rows, const int groups, const float *x, int64_t K, const int8_t *w,
    const float *scale, void *y, int64_t y0, int64_t N, int y_bf16)
{
    tile_from(rows, groups, x, K, w, 0, scale, y, y0, N, y_bf16);
}

static inline __attribute__((always_inline)) void tile_panel(
    const int rows, const int groups, const float *x, int64_t K, const float *wf,
    const float *scale, void *y, int64_t y0, int64_t N, int y_bf16)
{
    tile_from(rows, groups, x, K, 0, wf, scale, y, y0, N, y_bf16);
}

#define PANEL_CASE(r, g) case (r) * 16 + (g): tile_panel(r, g, x, K, wf, scale, y, y0, N, y_bf16); break;

static void tile_panel_avx2(int r, int g, const float *x, int64_t K, const float *wf, const float *scale, void *y,
                            int64_t y0, int64_t N, int y_bf16)
{
    switch (r * 16 + g) {
        PANEL_CASE(1, 1) PANEL_CASE(1, 2) PANEL_CASE(1, 3) PANEL_CASE(2, 1) PANEL_CASE(2, 2) PANEL_CASE(2, 3)
        PANEL_CASE(3, 1) PANEL_CASE(3, 2) PANEL_CASE(3, 3) PANEL_CASE(4, 1) PANEL_CASE(4, 2) PANEL_CASE(4, 3)
        default: no_tile("tile_panel_avx2", r, g);
    }
}

#define PANEL_ROWS 16 /* from this many rows of x each thread widens its tile's weights once, into a panel */

/* The AVX2 product for many rows: threads share tiles of NARROW groups; each widens its tile's weights into a
   float32 panel once and runs every row over it. */
static void run_panels(const float *x, int64_t M, int64_t K, const int8_t *w, const float *scale, int64_t N, void *y,
                       int y_bf16)
{
    const int64_t groups = N / 8, tiles = (groups + NARROW - 1) / NARROW;
    #pragma omp parallel
    {
        float *wf = malloc(NARROW * K * 8 * sizeof(float));
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t g0 = t * NARROW;
            const int g = groups - g0 < NARROW ? (int)(groups - g0) : NARROW;
            const int8_t *wt = w + g0 * K * 8;
            for (int64_t i = 0; i < g * K * 8; i += 8)
                _mm256_storeu_ps(wf + i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(wt + i)))));
            for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
                const int r = M - m0 < ROWS ? (int)(M - m0) : ROWS;
                tile_panel_avx2(r, g, x + m0 * K, K, wf, scale + g0 * 8, y, m0 * N + g0 * 8, N, y_bf16);
            }
        }
        free(wf);
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
        default: no_tile("tile_avx2", r, g);
    }
}

/* Threads share tiles of `wide` (one row) or `narrow` (several) groups of 8 outputs; each tile runs over the rows
   ROWS at a time. */
static void run(tile_fn tile_of, int64_t wide, int64_t narrow, const void *x_in, int64_t M, int64_t K,
                const int8_t *w, const float *scale, int64_t N, void *y, int x_bf16, int y_bf16)
{
    float *owned;
    const float *x = as_float(x_in, M * K, x_bf16, &owned);
    if (tile_of == tile_avx2 && M >= PANEL_ROWS) {
        run_panels(x, M, K, w, scale, N, y, y_bf16);
        free(owned);
        return;
    }
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
        default: no_tile("tile_avx512", r, g);
    }
}

/* As woq_int8_linear, with AVX512F; K even. */
void woq_int8_linear_avx512(const void *x, int64_t M, int64_t K, const int8_t *w, const float *scale, int64_t N,
                            void *y, int x_bf16, int y_bf16)
{
    run(tile_avx512, WIDE512, NARROW512, x, M, K, w, scale, N, y, x_bf16, y_bf16);
}

/* ---- int8 x int8 (llama.cpp's Q8 style), for the lm_head: 262,144 x 640, 63% of a token's weight bytes ----------

   The kernels above widen every weight to float32 before multiplying: at one row that widening, not memory, is the
   limit. Here the activations are quantized too, per block of 32 input columns (one float scale a block, as GGUF's
   Q8_0), and VNNI's vpdpbusd multiplies 64 int8 pairs into 16 int32 sums in one instruction. The weight is laid out
   as [N/16][K/4][16][4]: one 64-byte load is four input columns of sixteen outputs. vpdpbusd takes unsigned x
   signed bytes: |x| times w with x's sign moved onto w (llama.cpp's trick). A block's int32 sums are scaled by the
   block's activation scale into float accumulators; each output's result is one fixed order of sums whatever M,
   tile or thread (batch invariance holds). K must be a multiple of 32. */
#define Q8_BLOCK 32
#define WIDE_Q8 8   /* groups of 16 outputs per tile for a single row: 8 int + 8 float accumulators */
#define NARROW_Q8 3 /* for several rows: ROWS * NARROW_Q8 * 2 = 24 accumulators of the 32 registers */

/* x [M, K] (float32 or bf16) -> int8 [M, K] and one scale per block of 32 columns [M, K / 32]. */
static void quantize_q8(const void *x, int64_t M, int64_t K, int x_bf16, int8_t *q, float *scales)
{
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = 0; b < K / Q8_BLOCK; b++) {
            float v[Q8_BLOCK], amax = 0.0f;
            for (int i = 0; i < Q8_BLOCK; i++) {
                const int64_t at = m * K + b * Q8_BLOCK + i;
                if (x_bf16) {
                    const uint32_t bits = (uint32_t)((const uint16_t *)x)[at] << 16;
                    memcpy(v + i, &bits, sizeof(float));
                } else {
                    v[i] = ((const float *)x)[at];
                }
                const float a = v[i] < 0 ? -v[i] : v[i];
                if (a > amax) amax = a;
            }
            const float scale = amax / 127.0f, inverse = amax > 0 ? 127.0f / amax : 0.0f;
            scales[m * (K / Q8_BLOCK) + b] = scale;
            for (int i = 0; i < Q8_BLOCK; i++) {
                const float r = v[i] * inverse;
                q[m * K + b * Q8_BLOCK + i] = (int8_t)(r < 0 ? r - 0.5f : r + 0.5f);
            }
        }
    }
}

static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vnni"))) void tile_q8(
    const int rows, const int groups, const int8_t *xq, const float *xs, int64_t K, const int8_t *w,
    const float *scale, void *y, int64_t y0, int64_t N, int y_bf16)
{
    const int64_t quads = K / 4, blocks = K / Q8_BLOCK;
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc[ROWS][WIDE_Q8];
    for (int m = 0; m < rows; m++)
        for (int g = 0; g < groups; g++) acc[m][g] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i sums[ROWS][WIDE_Q8];
        for (int m = 0; m < rows; m++)
            for (int g = 0; g < groups; g++) sums[m][g] = zero;
        for (int64_t kq = b * (Q8_BLOCK / 4); kq < (b + 1) * (Q8_BLOCK / 4); kq++) {
            __m512i magnitude[ROWS];
            __mmask64 negative[ROWS];
            for (int m = 0; m < rows; m++) {
                int32_t four;
                memcpy(&four, xq + m * K + kq * 4, sizeof four);
                const __m512i xb = _mm512_set1_epi32(four);
                negative[m] = _mm512_movepi8_mask(xb);
                magnitude[m] = _mm512_abs_epi8(xb);
            }
            for (int g = 0; g < groups; g++) {
                const __m512i wv = _mm512_loadu_si512((const void *)(w + (g * quads + kq) * 64));
                for (int m = 0; m < rows; m++)
                    sums[m][g] = _mm512_dpbusd_epi32(sums[m][g], magnitude[m], _mm512_mask_sub_epi8(wv, negative[m], zero, wv));
            }
        }
        for (int m = 0; m < rows; m++) {
            const __m512 s = _mm512_set1_ps(xs[m * blocks + b]);
            for (int g = 0; g < groups; g++) acc[m][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[m][g]), s, acc[m][g]);
        }
    }
    for (int g = 0; g < groups; g++) {
        const __m512 s = _mm512_loadu_ps(scale + g * 16);
        for (int m = 0; m < rows; m++) {
            const __m512 v = _mm512_mul_ps(acc[m][g], s);
            store8(y, y0 + m * N + g * 16, _mm512_castps512_ps256(v), y_bf16);
            store8(y, y0 + m * N + g * 16 + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)), y_bf16);
        }
    }
}

#define CASE_Q8(r, g) case (r) * 16 + (g): tile_q8(r, g, xq, xs, K, w, scale, y, y0, N, y_bf16); break;

__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void tile_q8_of(int r, int g, const int8_t *xq, const float *xs, int64_t K, const int8_t *w,
                       const float *scale, void *y, int64_t y0, int64_t N, int y_bf16)
{
    switch (r * 16 + g) {
        CASE_Q8(1, 1) CASE_Q8(1, 2) CASE_Q8(1, 3) CASE_Q8(1, 4) CASE_Q8(1, 5) CASE_Q8(1, 6) CASE_Q8(1, 7) CASE_Q8(1, 8)
        CASE_Q8(2, 1) CASE_Q8(2, 2) CASE_Q8(2, 3)
        CASE_Q8(3, 1) CASE_Q8(3, 2) CASE_Q8(3, 3)
        CASE_Q8(4, 1) CASE_Q8(4, 2) CASE_Q8(4, 3)
        default: no_tile("tile_q8_of", r, g);
    }
}

/* The same product with AVX2 only (EPYCs without AVX512): vpmaddubsw multiplies 32 byte pairs into 16 int16 pair
   sums (at most 2 * 127 * 127: no saturation) and vpmaddwd with ones widens them to int32; each 16-output group is
   two 32-byte loads of the same layout. */
static inline __attribute__((always_inline)) void tile_q8_avx2(
    const int rows, const int groups, const int8_t *xq, const float *xs, int64_t K, const int8_t *w,
    const float *scale, void *y, int64_t y0, int64_t N, int y_bf16)
{
    const int64_t quads = K / 4, blocks = K / Q8_BLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[3][4];
    for (int m = 0; m < rows; m++)
        for (int h = 0; h < 2 * groups; h++) acc[m][h] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m256i sums[3][4];
        for (int m = 0; m < rows; m++)
            for (int h = 0; h < 2 * groups; h++) sums[m][h] = _mm256_setzero_si256();
        for (int64_t kq = b * (Q8_BLOCK / 4); kq < (b + 1) * (Q8_BLOCK / 4); kq++) {
            __m256i xb[3];
            for (int m = 0; m < rows; m++) {
                int32_t four;
                memcpy(&four, xq + m * K + kq * 4, sizeof four);
                xb[m] = _mm256_set1_epi32(four);
            }
            for (int h = 0; h < 2 * groups; h++) {
                const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + ((h / 2) * quads + kq) * 64 + (h % 2) * 32));
                for (int m = 0; m < rows; m++) {
                    const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(xb[m], xb[m]), _mm256_sign_epi8(wv, xb[m]));
                    sums[m][h] = _mm256_add_epi32(sums[m][h], _mm256_madd_epi16(pairs, ones));
                }
            }
        }
        for (int m = 0; m < rows; m++) {
            const __m256 s = _mm256_set1_ps(xs[m * blocks + b]);
            for (int h = 0; h < 2 * groups; h++) acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[m][h]), s, acc[m][h]);
        }
    }
    for (int h = 0; h < 2 * groups; h++) {
        const __m256 s = _mm256_loadu_ps(scale + h * 8);
        for (int m = 0; m < rows; m++) store8(y, y0 + m * N + h * 8, _mm256_mul_ps(acc[m][h], s), y_bf16);
    }
}

#define CASE_Q8_AVX2(r, g) case (r) * 16 + (g): tile_q8_avx2(r, g, xq, xs, K, w, scale, y, y0, N, y_bf16); break;

static void tile_q8_avx2_of(int r, int g, const int8_t *xq, const float *xs, int64_t K, const int8_t *w,
                            const float *scale, void *y, int64_t y0, int64_t N, int y_bf16)
{
    switch (r * 16 + g) {
        CASE_Q8_AVX2(1, 1) CASE_Q8_AVX2(1, 2) CASE_Q8_AVX2(2, 1) CASE_Q8_AVX2(3, 1)
        default: no_tile("tile_q8_avx2_of", r, g);
    }
}

typedef void (*q8_tile_fn)(int r, int g, const int8_t *xq, const float *xs, int64_t K, const int8_t *w,
                           const float *scale, void *y, int64_t y0, int64_t N, int y_bf16);

static void run_q8(q8_tile_fn tile_of, int rows_per_tile, int64_t wide, int64_t narrow, const void *x, int64_t M,
                   int64_t K, const int8_t *w, const float *scale, int64_t N, void *y, int x_bf16, int y_bf16)
{
    int8_t *xq = malloc(M * K);
    float *xs = malloc(M * (K / Q8_BLOCK) * sizeof(float));
    quantize_q8(x, M, K, x_bf16, xq, xs);
    const int64_t per_tile = M == 1 ? wide : narrow;
    const int64_t groups = N / 16, tiles = (groups + per_tile - 1) / per_tile;
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t g0 = t * per_tile;
        const int g = groups - g0 < per_tile ? (int)(groups - g0) : (int)per_tile;
        for (int64_t m0 = 0; m0 < M; m0 += rows_per_tile) {
            const int r = M - m0 < rows_per_tile ? (int)(M - m0) : rows_per_tile;
            tile_of(r, g, xq + m0 * K, xs + m0 * (K / Q8_BLOCK), K, w + g0 * K * 16, scale + g0 * 16, y,
                    m0 * N + g0 * 16, N, y_bf16);
        }
    }
    free(xq);
    free(xs);
}

/* x [M, K] float32 (bf16 if x_bf16), w [N/16, K/4, 16, 4] int8, scale [N] float32 -> y [M, N] float32 (bf16 if
   y_bf16); N a multiple of 16, K of 32. `vnni`: the AVX512 VNNI tiles (the CPU has avx512_vnni and avx512bw), else
   AVX2's. */
void q8_linear(const void *x, int64_t M, int64_t K, const int8_t *w, const float *scale, int64_t N, void *y,
               int x_bf16, int y_bf16, int vnni)
{
    if (vnni)
        run_q8(tile_q8_of, ROWS, WIDE_Q8, NARROW_Q8, x, M, K, w, scale, N, y, x_bf16, y_bf16);
    else
        run_q8(tile_q8_avx2_of, 3, 2, 1, x, M, K, w, scale, N, y, x_bf16, y_bf16);
}

/* ---- Gemma-3's RMSNorm in one call ---------------------------------------------------------------------------

   y = x * rsqrt(mean(x^2) + eps) * scale, in float32 (x widened from bf16, y rounded back to it), as
   engine/model/gemma3.py's `rms_norm` computes it with eight torch ops: one decode step runs 108 of them on
   gemma-3-270m, and at one row each op's dispatch costs more than its arithmetic. Rows of D values (D a multiple of
   8); each row's sum in one fixed order (batch invariance holds). */
void rms_norm_rows(const void *x, int64_t rows, int64_t D, const float *scale, float eps, void *y, int bf16)
{
    for (int64_t r = 0; r < rows; r++) {
        __m256 squares = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            __m256 v;
            if (bf16)
                v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + r * D + d))), 16));
            else
                v = _mm256_loadu_ps((const float *)x + r * D + d);
            squares = _mm256_fmadd_ps(v, v, squares);
        }
        float lanes[8], sum = 0.0f;
        _mm256_storeu_ps(lanes, squares);
        for (int i = 0; i < 8; i++) sum += lanes[i];
        const __m256 inverse = _mm256_set1_ps(1.0f / sqrtf(sum / (float)D + eps));
        for (int64_t d = 0; d < D; d += 8) {
            __m256 v;
            if (bf16)
                v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + r * D + d))), 16));
            else
                v = _mm256_loadu_ps((const float *)x + r * D + d);
            store8(y, r * D + d, _mm256_mul_ps(_mm256_mul_ps(v, inverse), _mm256_loadu_ps(scale + d)), bf16);
        }
    }
}
