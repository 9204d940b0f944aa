/* Integer dot-product linears for AVX2 CPUs (no VNNI): y = x @ W^T with the activations quantized per row, per
   block of 32 inputs, to int8 (one float scale a block: GGUF's Q8_0), and the products taken in integers
   (vpmaddubsw: u8 x s8 pairs summed to int16, vpmaddwd: pairs of int16 summed to int32), as llama.cpp's
   Q8_0 / Q4_0 x Q8_0 dot products do on AVX2.

   Two weight layouts, both in groups of 8 output channels:
   - `q8`: int8 weights, one float32 scale per output channel, [N/8][K/4][8][4]: one 32-byte load is four input
     columns of eight outputs. vpmaddubsw takes unsigned x signed bytes: |x| times w with x's sign moved onto w
     (vpsignb). A block's int32 sums are exact; each is scaled by the block's activation scale into a float
     accumulator, and the per-channel scale multiplies the end.
   - `q4`: 4-bit weights in blocks of 32 inputs per output (GGUF's Q4_0: a float16 scale a block, levels 0..15
     standing for (q - 8) * scale), [N/8][K/32][128 bytes]: byte j of the block's 32-byte row r holds quad 2r
     (low nibble) and quad 2r+1 (high nibble) of the [8 outputs][4 inputs] quads; scales [N/8][K/32][8] float16.
     The unsigned levels multiply the signed activations directly (no sign trick: 15 * 127 * 2 fits int16, and a
     block's eight quads summed in int16 still fit: 30,480); the offset 8 is taken off with the block's
     activation sum.

   Every output is one fixed sequence of float operations over the blocks in order (the integer sums are exact),
   whatever the row count, tile or thread, and each row is quantized alone: a row's result does not depend on
   the rows beside it (batch invariance). K must be a multiple of 32, N of 8. x and y may be bf16 instead of
   float32. Built with the family flags (AVX2, FMA); the q4 tiles also use F16C, which every AVX2 CPU has. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>

#include "avx2_common.h"

#define BLOCK 32

/* The quantized activations of M rows: x [M, K] -> q int8 [M, K], |q| [M, K], one scale per block [M, K/32] and
   the block's sum of q [M, K/32] (the Q4 kernel's offset). Each row alone, in one fixed order. */
typedef struct {
    int8_t *q, *magnitude;
    float *scale;
    int32_t *sum;
} activations;

static void quantize_rows(const void *x, int64_t M, int64_t K, int x_bf16, activations *a)
{
    const int64_t blocks = K / BLOCK;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = 0; b < blocks; b++) {
            float v[BLOCK], amax = 0.0f;
            for (int i = 0; i < BLOCK; i++) {
                const int64_t at = m * K + b * BLOCK + i;
                if (x_bf16) {
                    const uint32_t bits = (uint32_t)((const uint16_t *)x)[at] << 16;
                    memcpy(v + i, &bits, sizeof(float));
                } else {
                    v[i] = ((const float *)x)[at];
                }
                const float abs = v[i] < 0 ? -v[i] : v[i];
                if (abs > amax) amax = abs;
            }
            const float inverse = amax > 0 ? 127.0f / amax : 0.0f;
            int32_t sum = 0;
            for (int i = 0; i < BLOCK; i++) {
                const float r = v[i] * inverse;
                const int8_t q = (int8_t)(r < 0 ? r - 0.5f : r + 0.5f);
                a->q[m * K + b * BLOCK + i] = q;
                a->magnitude[m * K + b * BLOCK + i] = (int8_t)(q < 0 ? -q : q);
                sum += q;
            }
            a->scale[m * blocks + b] = amax / 127.0f;
            a->sum[m * blocks + b] = sum;
        }
    }
}

#define MAX_ROWS 4
#define MAX_GROUPS 4

/* ---- q8: int8 weights per output channel --------------------------------------------------------------------- */
static inline __attribute__((always_inline)) void tile_q8(
    const int rows, const int groups, const activations *a, int64_t m0, int64_t K, const int8_t *w,
    const float *scale, void *y, int64_t y0, int64_t N, int y_bf16)
{
    const int64_t quads = K / 4, blocks = K / BLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
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
                int32_t four, four_abs;
                memcpy(&four, a->q + (m0 + m) * K + kq * 4, sizeof four);
                memcpy(&four_abs, a->magnitude + (m0 + m) * K + kq * 4, sizeof four_abs);
                const __m256i xb = _mm256_set1_epi32(four), xa = _mm256_set1_epi32(four_abs);
                for (int g = 0; g < groups; g++) {
                    const __m256i pairs = _mm256_maddubs_epi16(xa, _mm256_sign_epi8(wv[g], xb));
                    sums[m][g] = _mm256_add_epi32(sums[m][g], _mm256_madd_epi16(pairs, ones));
                }
            }
        }
        for (int m = 0; m < rows; m++) {
            const __m256 s = _mm256_set1_ps(a->scale[(m0 + m) * blocks + b]);
            for (int g = 0; g < groups; g++) acc[m][g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[m][g]), s, acc[m][g]);
        }
    }
    for (int g = 0; g < groups; g++) {
        const __m256 s = _mm256_loadu_ps(scale + g * 8);
        for (int m = 0; m < rows; m++) store8(y, y0 + m * N + g * 8, _mm256_mul_ps(acc[m][g], s), y_bf16);
    }
}

/* ---- q4: 4-bit weights in blocks of 32, a float16 scale a block (F16C widens them) ---------------------------- */
static inline __attribute__((always_inline, target("f16c"))) void tile_q4(
    const int rows, const int groups, const activations *a, int64_t m0, int64_t K, const uint8_t *w,
    const uint16_t *wscale, void *y, int64_t y0, int64_t N, int y_bf16)
{
    const int64_t blocks = K / BLOCK;
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0f), eight = _mm256_set1_epi32(8);
    __m256 acc[MAX_ROWS][MAX_GROUPS];
    for (int m = 0; m < rows; m++)
        for (int g = 0; g < groups; g++) acc[m][g] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m256i sums[MAX_ROWS][MAX_GROUPS];
        for (int m = 0; m < rows; m++)
            for (int g = 0; g < groups; g++) sums[m][g] = _mm256_setzero_si256();
        for (int r = 0; r < 4; r++) {
            __m256i lo[MAX_GROUPS], hi[MAX_GROUPS];
            for (int g = 0; g < groups; g++) {
                const __m256i packed = _mm256_loadu_si256((const __m256i *)(w + ((g * blocks + b) * 4 + r) * 32));
                lo[g] = _mm256_and_si256(packed, low);
                hi[g] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
            }
            for (int m = 0; m < rows; m++) {
                int32_t q0, q1;
                memcpy(&q0, a->q + (m0 + m) * K + b * BLOCK + r * 8, sizeof q0);
                memcpy(&q1, a->q + (m0 + m) * K + b * BLOCK + r * 8 + 4, sizeof q1);
                const __m256i x0 = _mm256_set1_epi32(q0), x1 = _mm256_set1_epi32(q1);
                for (int g = 0; g < groups; g++)
                    sums[m][g] = _mm256_add_epi16(sums[m][g], _mm256_add_epi16(_mm256_maddubs_epi16(lo[g], x0),
                                                                               _mm256_maddubs_epi16(hi[g], x1)));
            }
        }
        __m256 ws[MAX_GROUPS];
        for (int g = 0; g < groups; g++)
            ws[g] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wscale + (g * blocks + b) * 8)));
        for (int m = 0; m < rows; m++) {
            const __m256 s = _mm256_set1_ps(a->scale[(m0 + m) * blocks + b]);
            const __m256i offset = _mm256_mullo_epi32(_mm256_set1_epi32(a->sum[(m0 + m) * blocks + b]), eight);
            for (int g = 0; g < groups; g++) {
                const __m256i dot = _mm256_sub_epi32(_mm256_madd_epi16(sums[m][g], ones), offset);
                acc[m][g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(ws[g], s), acc[m][g]);
            }
        }
    }
    for (int g = 0; g < groups; g++)
        for (int m = 0; m < rows; m++) store8(y, y0 + m * N + g * 8, acc[m][g], y_bf16);
}

#define CASES(T, R) case (R) * 16 + 1: T(R, 1); break; case (R) * 16 + 2: T(R, 2); break; \
                    case (R) * 16 + 3: T(R, 3); break; case (R) * 16 + 4: T(R, 4); break;
#define Q8(r, g) tile_q8(r, g, a, m0, K, (const int8_t *)w, (const float *)scale, y, y0, N, y_bf16)
#define Q4(r, g) tile_q4(r, g, a, m0, K, (const uint8_t *)w, (const uint16_t *)scale, y, y0, N, y_bf16)

__attribute__((target("f16c")))
static void tile_of(int q4, int r, int g, const activations *a, int64_t m0, int64_t K, const void *w,
                    const void *scale, void *y, int64_t y0, int64_t N, int y_bf16)
{
    if (q4) {
        switch (r * 16 + g) { CASES(Q4, 1) CASES(Q4, 2) CASES(Q4, 3) CASES(Q4, 4) default: no_tile("tile_q4", r, g); }
    } else {
        switch (r * 16 + g) { CASES(Q8, 1) CASES(Q8, 2) CASES(Q8, 3) CASES(Q8, 4) default: no_tile("tile_q8", r, g); }
    }
}

/* Threads share tiles of `groups` groups of 8 outputs; each tile runs over the rows `rows` at a time. */
static void run(int q4, int tile_rows, int tile_groups, const void *x, int64_t M, int64_t K, const void *w,
                const void *scale, int64_t N, void *y, int x_bf16, int y_bf16)
{
    activations a;
    const int64_t blocks = K / BLOCK;
    a.q = malloc(M * K);
    a.magnitude = malloc(M * K);
    a.scale = malloc(M * blocks * sizeof(float));
    a.sum = malloc(M * blocks * sizeof(int32_t));
    quantize_rows(x, M, K, x_bf16, &a);
    const int64_t groups = N / 8, tiles = (groups + tile_groups - 1) / tile_groups;
    /* a group's weight bytes: K (q8) or K/2 + K/16 scales' 2 bytes per 8 (q4, separate arrays) */
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t g0 = t * tile_groups;
        const int g = groups - g0 < tile_groups ? (int)(groups - g0) : tile_groups;
        const void *wt = q4 ? (const void *)((const uint8_t *)w + g0 * K * 4) : (const void *)((const int8_t *)w + g0 * K * 8);
        const void *st = q4 ? (const void *)((const uint16_t *)scale + g0 * blocks * 8) : (const void *)((const float *)scale + g0 * 8);
        for (int64_t m0 = 0; m0 < M; m0 += tile_rows) {
            const int r = M - m0 < tile_rows ? (int)(M - m0) : tile_rows;
            tile_of(q4, r, g, &a, m0, K, wt, st, y, m0 * N + g0 * 8, N, y_bf16);
        }
    }
    free(a.q);
    free(a.magnitude);
    free(a.scale);
    free(a.sum);
}

/* x [M, K] float32 (bf16 if x_bf16), w [N/8, K/4, 8, 4] int8, scale [N] float32 -> y [M, N] float32 (bf16 if
   y_bf16). tile_rows x tile_groups: the register tile (rows of x by groups of 8 outputs), 1..4 each. */
void q8_dot_linear(const void *x, int64_t M, int64_t K, const int8_t *w, const float *scale, int64_t N, void *y,
                   int x_bf16, int y_bf16, int tile_rows, int tile_groups)
{
    run(0, tile_rows, tile_groups, x, M, K, w, scale, N, y, x_bf16, y_bf16);
}

/* x [M, K], w [N/8, K/32, 128] uint8 (two 4-bit levels a byte), scale [N/8, K/32, 8] float16 -> y [M, N]. */
void q4_dot_linear(const void *x, int64_t M, int64_t K, const uint8_t *w, const uint16_t *scale, int64_t N, void *y,
                   int x_bf16, int y_bf16, int tile_rows, int tile_groups)
{
    run(1, tile_rows, tile_groups, x, M, K, w, scale, N, y, x_bf16, y_bf16);
}
