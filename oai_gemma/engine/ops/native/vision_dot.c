/* The vision tower's linears (engine/model/vision_layout.py) for AVX2 CPUs: y = x @ W^T + bias with int8 weights
   per output channel (int_dot.c's `q8` layout, [N/8][K/4][8][4]) times activations quantized per row and block of
   32 inputs to 7 bits (-63..63, one float scale a block) and stored offset by 64 as unsigned bytes (1..127).

   Why 7 bits: vpmaddubsw multiplies unsigned by signed bytes and sums pairs into saturating int16. With the
   activations unsigned (x + 64 <= 127) and the weights signed (|w| <= 127), a pair is at most 2 * 127 * 127 =
   32,258: exact, with no vpsignb to move the activations' signs onto the weights (int_dot.c's q8 needs one a
   product), so a block of 32 products is two instructions (vpmaddubsw, vpmaddwd) and an add. The offset adds
   64 * (the block's weight sum) to each dot product; that sum is stored with the weights (`wsum`, int16 per
   output and block: |sum| <= 32 * 127) and taken off in integers, so the sums are exact.

   Every output is one fixed sequence of float operations over the blocks in order, whatever the row count, tile or
   thread, and each row is quantized alone: a row's result does not depend on the rows beside it. K must be a
   multiple of 32, N of 8.

   VNNI (sources.ISA_FLAGS, as int_dot.c): a quad's four products go into int32 with one vpdpbusd (`dot_u8s8`), and an
   AVX512-VNNI build with BW runs 512-bit tiles (`WIDE`: two groups of eight outputs a register, WIDE_ROWS x
   WIDE_PAIRS), lane for lane the 256-bit tile's float steps on the same exact integer sums: the AVX2 build's bits. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "avx2_common.h"

#define BLOCK 32
#define LEVELS 63.0f
#define OFFSET 64

/* One row's blocks: x [K] float32 -> u [K] (q + 64), scale [K/32] (amax / 63). */
static void quantize_row(const float *x, int64_t K, uint8_t *u, float *scale)
{
    const __m256 sign = _mm256_set1_ps(-0.0f), half = _mm256_set1_ps(0.5f);
    for (int64_t b = 0; b < K / BLOCK; b++) {
        __m256 v[4];
        for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(x + b * BLOCK + i * 8);
        const float amax = abs_max32(v);
        const __m256 inverse = _mm256_set1_ps(amax > 0 ? LEVELS / amax : 0.0f);
        __m256i q32[4];
        for (int i = 0; i < 4; i++) {
            const __m256 r = _mm256_mul_ps(v[i], inverse);
            q32[i] = _mm256_add_epi32(_mm256_cvttps_epi32(_mm256_add_ps(r, _mm256_or_ps(half, _mm256_and_ps(sign, r)))),
                                      _mm256_set1_epi32(OFFSET));
        }
        const __m256i q16a = _mm256_packs_epi32(q32[0], q32[1]), q16b = _mm256_packs_epi32(q32[2], q32[3]);
        const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(q16a, q16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(u + b * BLOCK), q8);
        scale[b] = amax / LEVELS;
    }
}

#define MAX_ROWS 4
#define MAX_GROUPS 4

static inline __attribute__((always_inline)) void tile(
    const int rows, const int groups, const uint8_t *u, const float *xs, int64_t m0, int64_t K, const int8_t *w,
    const int16_t *wsum, const float *scale, const float *bias, float *y, int64_t y0, int64_t N)
{
    const int64_t quads = K / 4, blocks = K / BLOCK;
    __m256 acc[MAX_ROWS][MAX_GROUPS];
    for (int m = 0; m < rows; m++)
        for (int g = 0; g < groups; g++) acc[m][g] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m256i sums[MAX_ROWS][MAX_GROUPS];
        for (int m = 0; m < rows; m++)
            for (int g = 0; g < groups; g++) sums[m][g] = _mm256_setzero_si256();
        for (int64_t kq = b * (BLOCK / 4); kq < (b + 1) * (BLOCK / 4); kq++) {
            __m256i wv[MAX_GROUPS];
            for (int g = 0; g < groups; g++) wv[g] = _mm256_loadu_si256((const __m256i *)(w + (g * quads + kq) * 32));
            for (int m = 0; m < rows; m++) {
                int32_t four;
                memcpy(&four, u + (m0 + m) * K + kq * 4, sizeof four);
                const __m256i xb = _mm256_set1_epi32(four);
                for (int g = 0; g < groups; g++) sums[m][g] = dot_u8s8(sums[m][g], xb, wv[g]);
            }
        }
        for (int g = 0; g < groups; g++) {
            const __m256i sum = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(wsum + (g * blocks + b) * 8)));
            const __m256i offset = _mm256_slli_epi32(sum, 6);
            for (int m = 0; m < rows; m++) {
                const __m256 s = _mm256_set1_ps(xs[(m0 + m) * blocks + b]);
                acc[m][g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sums[m][g], offset)), s, acc[m][g]);
            }
        }
    }
    for (int g = 0; g < groups; g++) {
        const __m256 s = _mm256_loadu_ps(scale + g * 8), c = _mm256_loadu_ps(bias + g * 8);
        for (int m = 0; m < rows; m++) _mm256_storeu_ps(y + y0 + m * N + g * 8, _mm256_fmadd_ps(acc[m][g], s, c));
    }
}

#define CASES(R) case (R) * 16 + 1: T(R, 1); break; case (R) * 16 + 2: T(R, 2); break; \
                 case (R) * 16 + 3: T(R, 3); break; case (R) * 16 + 4: T(R, 4); break;
#define T(r, g) tile(r, g, u, xs, m0, K, w, wsum, scale, bias, y, y0, N)

static void tile_of(int r, int g, const uint8_t *u, const float *xs, int64_t m0, int64_t K, const int8_t *w,
                    const int16_t *wsum, const float *scale, const float *bias, float *y, int64_t y0, int64_t N)
{
    switch (r * 16 + g) { CASES(1) CASES(2) CASES(3) CASES(4) default: no_tile("vision_dot", r, g); }
}

#define WIDE WIDE_ISA

#if WIDE

/* tile's operations, two groups a register (`pairs` pairs of groups) */
static inline __attribute__((always_inline)) void tile_wide(
    const int rows, const int pairs, const uint8_t *u, const float *xs, int64_t m0, int64_t K, const int8_t *w,
    const int16_t *wsum, const float *scale, const float *bias, float *y, int64_t y0, int64_t N)
{
    const int64_t quads = K / 4, blocks = K / BLOCK;
    __m512 acc[MAX_ROWS][WIDE_MAX_PAIRS];
    for (int m = 0; m < rows; m++)
        for (int p = 0; p < pairs; p++) acc[m][p] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i sums[MAX_ROWS][WIDE_MAX_PAIRS];
        for (int m = 0; m < rows; m++)
            for (int p = 0; p < pairs; p++) sums[m][p] = _mm512_setzero_si512();
        for (int64_t kq = b * (BLOCK / 4); kq < (b + 1) * (BLOCK / 4); kq++) {
            __m512i wv[WIDE_MAX_PAIRS];
            for (int p = 0; p < pairs; p++) wv[p] = load_pair(w + (2 * p * quads + kq) * 32, w + ((2 * p + 1) * quads + kq) * 32);
            for (int m = 0; m < rows; m++) {
                int32_t four;
                memcpy(&four, u + (m0 + m) * K + kq * 4, sizeof four);
                const __m512i xb = _mm512_set1_epi32(four);
                for (int p = 0; p < pairs; p++) sums[m][p] = _mm512_dpbusd_epi32(sums[m][p], xb, wv[p]);
            }
        }
        for (int p = 0; p < pairs; p++) {
            const __m512i sum = _mm512_cvtepi16_epi32(load_pair128(wsum + (2 * p * blocks + b) * 8, wsum + ((2 * p + 1) * blocks + b) * 8));
            const __m512i offset = _mm512_slli_epi32(sum, 6);
            for (int m = 0; m < rows; m++) {
                const __m512 s = _mm512_set1_ps(xs[(m0 + m) * blocks + b]);
                acc[m][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sums[m][p], offset)), s, acc[m][p]);
            }
        }
    }
    for (int p = 0; p < pairs; p++) {
        const __m512 s = _mm512_loadu_ps(scale + p * 16), c = _mm512_loadu_ps(bias + p * 16);
        for (int m = 0; m < rows; m++) store16(y, y0 + m * N + p * 16, _mm512_fmadd_ps(acc[m][p], s, c), 0);
    }
}

#define WCASES(R) case (R) * 16 + 1: W(R, 1); break; case (R) * 16 + 2: W(R, 2); break; case (R) * 16 + 3: W(R, 3); break;
#define W(r, p) tile_wide(r, p, u, xs, m0, K, w, wsum, scale, bias, y, y0, N)

static void wide_tile_of(int r, int p, const uint8_t *u, const float *xs, int64_t m0, int64_t K, const int8_t *w,
                         const int16_t *wsum, const float *scale, const float *bias, float *y, int64_t y0, int64_t N)
{
    switch (r * 16 + p) { WCASES(1) WCASES(2) WCASES(3) WCASES(4) default: no_tile("vision_dot_wide", r, p); }
}
#endif

/* x [M, K] float32, w [N/8, K/4, 8, 4] int8, wsum [N/8, K/32, 8] int16 (each output's block sums of w), scale [N]
   and bias [N] float32 -> y [M, N] float32. tile_rows x tile_groups: the register tile, 1..4 each. */
void q7_dot_linear(const float *x, int64_t M, int64_t K, const int8_t *w, const int16_t *wsum, const float *scale,
                   const float *bias, int64_t N, float *y, int tile_rows, int tile_groups)
{
    const int wide = WIDE && M > 1; /* several rows: the 512-bit tiles, in pairs of groups */
    if (wide) {
        tile_rows = WIDE_ROWS;
        tile_groups = 2 * WIDE_PAIRS;
    }
    const int64_t blocks = K / BLOCK, groups = N / 8, tiles = (groups + tile_groups - 1) / tile_groups;
    /* group g's weights, block sums, scales and biases: the tile functions' arguments after K */
#define GROUP(g) w + (g) * K * 8, wsum + (g) * blocks * 8, scale + (g) * 8, bias + (g) * 8
    uint8_t *u = malloc(M * K);
    float *xs = malloc(M * blocks * sizeof(float));
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, u + m * K, xs + m * blocks);
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t g0 = t * tile_groups;
            const int g = groups - g0 < tile_groups ? (int)(groups - g0) : tile_groups;
            for (int64_t m0 = 0; m0 < M; m0 += tile_rows) {
                const int r = M - m0 < tile_rows ? (int)(M - m0) : tile_rows;
#if WIDE
                if (wide) { /* the pairs, then a last group left alone in its 256-bit tile */
                    const int64_t last = g0 + g - 1;
                    if (g / 2) wide_tile_of(r, g / 2, u, xs, m0, K, GROUP(g0), y, m0 * N + g0 * 8, N);
                    if (g % 2) tile_of(r, 1, u, xs, m0, K, GROUP(last), y, m0 * N + last * 8, N);
                    continue;
                }
#endif
                tile_of(r, g, u, xs, m0, K, GROUP(g0), y, m0 * N + g0 * 8, N);
            }
        }
    }
    free(u);
    free(xs);
#undef GROUP
}
