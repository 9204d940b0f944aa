/* Integer dot-product linears for AVX2 CPUs (VNNI where the build targets it): y = x @ W^T with the activations quantized per row, per
   block of 32 inputs, to int8 (one float scale a block: GGUF's Q8_0), and the products taken in integers
   (vpmaddubsw: u8 x s8 pairs summed to int16, vpmaddwd: pairs of int16 summed to int32), as llama.cpp's
   Q8_0 / Q4_0 x Q8_0 dot products do on AVX2.

   Three weight layouts, all in groups of 8 output channels:
   - `q8`: int8 weights, one float32 scale per output channel, [N/8][K/4][8][4]: one 32-byte load is four input
     columns of eight outputs. vpmaddubsw takes unsigned x signed bytes: |x| times w with x's sign moved onto w
     (vpsignb). A block's int32 sums are exact; each is scaled by the block's activation scale into a float
     accumulator, and the per-channel scale multiplies the end.
   - `q4`: 4-bit weights in blocks of 32 inputs per output (GGUF's Q4_1: a float16 scale d and min m a block,
     levels q in 0..15 standing for d * q + m), [N/8][K/32][160 bytes]: 128 bytes of levels (byte j of the block's
     32-byte row r holds quad 2r (low nibble) and quad 2r+1 (high nibble) of the [8 outputs][4 inputs] quads), then
     the eight outputs' float16 scales, then their float16 mins: a group of 8 outputs is one sequential stream.
     The unsigned levels multiply the signed activations directly (15 * 127 * 2 fits int16, and a block's eight
     quads summed in int16 still fit: 30,480); the min multiplies the block's activation sum (its scale times its
     integer sum), one more FMA a block.
   - `q5`: `q4` with 5-bit levels (GGUF's Q5_1, 0..31; `q4-mix`'s lm_head), [N/8][K/32][192 bytes]: q4's 128 bytes of
     low nibbles, then 32 bytes of the levels' fifth bits (byte j's bit i: quad i's value j), then the scales and mins.

   Every output is one fixed sequence of float operations over the blocks in order (the integer sums are exact),
   whatever the row count, tile or thread, and each row is quantized alone: a row's result does not depend on
   the rows beside it (batch invariance). K must be a multiple of 32, N of 8. x and y may be bf16 instead of
   float32. Built with the family flags (AVX2, FMA); the q4 tiles also use F16C, which every AVX2 CPU has.

   VNNI: where the build targets AVX-VNNI or AVX512-VNNI with VL (sources.py adds the flags where the CPU has them),
   each four u8 x s8 products go straight into int32 with one vpdpbusd (`dot_u8s8`), and q4 / q5 sum their quads
   in int32 instead of int16 (`Q4_DIRECT`). The integer sums are exact either way, so every output has the AVX2
   build's bits. An AVX512-VNNI build (with BW) runs calls of several rows in 512-bit tiles (`WIDE`: two groups a
   register, WIDE_ROWS x WIDE_PAIRS; 1.5-2.2x the 256-bit tiles' throughput at 8-512 rows on an AVX512 EPYC), lane
   for lane the 256-bit tile's float operations on the same exact integer sums, so their bits too. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>

#include "avx2_common.h"

#define BLOCK 32

#ifndef Q4_DIRECT /* q4 / q5: each row's quads into the int32 sums directly (1), or through int16 first (0) */
#define Q4_DIRECT VNNI
#endif

/* The quantized activations of M rows: x [M, K] -> q int8 [M, K], |q| [M, K], one scale per block [M, K/32] and
   the block's sum of q [M, K/32] (the Q4 kernel's offset). Each row alone, in one fixed order. */
typedef struct {
    int8_t *q, *magnitude;
    float *scale;
    int32_t *sum;
} activations;

/* One block of 32 values (float32) quantized: the scalar steps (r = v * (127 / amax); q = (int8)(r +- 0.5f), truncated)
   in eight lanes at a time, so the same bits. */
static inline __attribute__((always_inline)) void quantize_block(const __m256 v[4], int8_t *q, int8_t *magnitude,
                                                                 float *scale, int32_t *sum)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const float amax = abs_max32(v);
    const __m256 inverse = _mm256_set1_ps(amax > 0 ? 127.0f / amax : 0.0f), half = _mm256_set1_ps(0.5f);
    __m256i q32[4];
    for (int i = 0; i < 4; i++) {
        const __m256 r = _mm256_mul_ps(v[i], inverse);
        q32[i] = _mm256_cvttps_epi32(_mm256_add_ps(r, _mm256_or_ps(half, _mm256_and_ps(sign, r))));
    }
    /* packs interleave 128-bit lanes: the permute puts the 32 values back in order */
    const __m256i q16a = _mm256_packs_epi32(q32[0], q32[1]), q16b = _mm256_packs_epi32(q32[2], q32[3]);
    const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16a, q16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, q8);
    _mm256_storeu_si256((__m256i *)magnitude, _mm256_abs_epi8(q8));
    const __m256i s32 = _mm256_add_epi32(_mm256_add_epi32(q32[0], q32[1]), _mm256_add_epi32(q32[2], q32[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    *scale = amax / 127.0f;
    *sum = _mm_cvtsi128_si32(t);
}

static void quantize_rows(const void *x, int64_t M, int64_t K, int x_bf16, activations *a)
{
    const int64_t blocks = K / BLOCK;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t at = m * K + b * BLOCK;
            __m256 v[4];
            for (int i = 0; i < 4; i++) {
                if (x_bf16) {
                    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + at + i * 8));
                    v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
                } else {
                    v[i] = _mm256_loadu_ps((const float *)x + at + i * 8);
                }
            }
            quantize_block(v, a->q + at, a->magnitude + at, a->scale + m * blocks + b, a->sum + m * blocks + b);
        }
    }
}

#ifndef SCHEDULE
#define SCHEDULE static
#endif
#ifdef TIMING /* the benchmark's build (benchmarks/gemv_ab.py): where a call's time goes, thread by thread */
#include <omp.h>
#include <time.h>
static double timing[3], marks[8];
static double now(clockid_t clock) { struct timespec t; clock_gettime(clock, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
#define TIMING_START const double cpu_ = now(CLOCK_THREAD_CPUTIME_ID), wall_ = now(CLOCK_MONOTONIC); \
                     if (omp_get_thread_num() < 2) marks[2 + 2 * omp_get_thread_num()] = wall_;
#define TIMING_END { const double w1_ = now(CLOCK_MONOTONIC), c_ = now(CLOCK_THREAD_CPUTIME_ID) - cpu_, w_ = w1_ - wall_; \
                     if (omp_get_thread_num() < 2) marks[3 + 2 * omp_get_thread_num()] = w1_; \
                     _Pragma("omp atomic") timing[0] += c_; _Pragma("omp atomic") timing[1] += w_; }
#define CALL_START const double call_ = now(CLOCK_MONOTONIC); marks[0] = call_; marks[2] = marks[3] = marks[4] = marks[5] = 0;
#define REGION_START marks[1] = now(CLOCK_MONOTONIC);
#define CALL_END { const double end_ = now(CLOCK_MONOTONIC); timing[2] += end_ - call_; marks[6] = end_; }
/* [tile CPU seconds, tile wall seconds, call wall seconds] since the last read, then zeroed */
void int_dot_timing(double *out) { for (int i = 0; i < 3; i++) { out[i] = timing[i]; timing[i] = 0; } }
/* the last call's marks: its start, the parallel region's, threads 0 and 1's entry to and exit from the tiles, its end */
void int_dot_marks(double *out) { for (int i = 0; i < 7; i++) out[i] = marks[i]; }
#else
#define TIMING_START
#define TIMING_END
#define CALL_START
#define REGION_START
#define CALL_END
#endif

#define MAX_ROWS 4
#define MAX_GROUPS 4
#define Q4_BYTES 160 /* a q4 block of 8 outputs x 32 inputs: 128 bytes of levels, 8 float16 scales, 8 float16 mins */
#define Q5_BYTES 192 /* a q5 block: q4's with 32 bytes of the levels' fifth bits after the nibbles */
#ifndef PREFETCH
#define PREFETCH 1024
#endif
#ifndef INTERLEAVE
#define INTERLEAVE 0
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_T0
#endif
/* Software prefetch PREFETCH bytes ahead of a stream (0: none), the `bytes` a block of it reads: one line per 64. */
static inline __attribute__((always_inline)) void prefetch_ahead(const void *at, int bytes)
{
    if (PREFETCH == 0) return;
    for (int i = 0; i < bytes; i += 64) _mm_prefetch((const char *)at + PREFETCH + i, PREFETCH_HINT);
}

/* ---- q8: int8 weights per output channel --------------------------------------------------------------------- */
static inline __attribute__((always_inline)) void tile_q8(
    const int rows, const int groups, const activations *a, int64_t m0, int64_t K, const int8_t *w,
    const float *scale, void *y, int64_t y0, int64_t N, int y_bf16)
{
    const int64_t quads = K / 4, blocks = K / BLOCK;
    __m256 acc[MAX_ROWS][MAX_GROUPS];
    for (int m = 0; m < rows; m++)
        for (int g = 0; g < groups; g++) acc[m][g] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m256i sums[MAX_ROWS][MAX_GROUPS];
        for (int m = 0; m < rows; m++)
            for (int g = 0; g < groups; g++) sums[m][g] = _mm256_setzero_si256();
        for (int g = 0; g < groups; g++) prefetch_ahead(w + (g * quads + b * (BLOCK / 4)) * 32, BLOCK * 8);
        for (int64_t kq = b * (BLOCK / 4); kq < (b + 1) * (BLOCK / 4); kq++) {
            __m256i wv[MAX_GROUPS];
            for (int g = 0; g < groups; g++) wv[g] = _mm256_loadu_si256((const __m256i *)(w + (g * quads + kq) * 32));
            for (int m = 0; m < rows; m++) {
                int32_t four, four_abs;
                memcpy(&four, a->q + (m0 + m) * K + kq * 4, sizeof four);
                memcpy(&four_abs, a->magnitude + (m0 + m) * K + kq * 4, sizeof four_abs);
                const __m256i xb = _mm256_set1_epi32(four), xa = _mm256_set1_epi32(four_abs);
                for (int g = 0; g < groups; g++) sums[m][g] = dot_u8s8(sums[m][g], xa, _mm256_sign_epi8(wv[g], xb));
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
/* Bit `bit` of each byte moved to bit 4 (16-bit shifts: bit 4 of either byte takes only that byte's own bit). */
static inline __attribute__((always_inline)) __m256i to_bit4(__m256i v, const int bit)
{
    return bit < 4 ? _mm256_slli_epi16(v, 4 - bit) : bit == 4 ? v : _mm256_srli_epi16(v, bit - 4);
}

/* Row r of a block's levels (`at`: the block's first byte) as two vectors of unsigned bytes: quads 2r and 2r + 1
   (the low and high nibbles; with `five` the fifth bits put at bit 4 of each). */
static inline __attribute__((always_inline)) void levels_row(const uint8_t *at, const int r, const int five,
                                                             __m256i *lo, __m256i *hi)
{
    const __m256i low = _mm256_set1_epi8(0x0f), bit4 = _mm256_set1_epi8(0x10);
    const __m256i packed = _mm256_loadu_si256((const __m256i *)(at + r * 32));
    *lo = _mm256_and_si256(packed, low);
    *hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
    if (five) { /* read again each r (from L1) rather than held: sixteen registers are few here */
        const __m256i fifth = _mm256_loadu_si256((const __m256i *)(at + 128));
        *lo = _mm256_or_si256(*lo, _mm256_and_si256(to_bit4(fifth, 2 * r), bit4));
        *hi = _mm256_or_si256(*hi, _mm256_and_si256(to_bit4(fifth, 2 * r + 1), bit4));
    }
}

/* acc += each block sum (int32 [rows][groups]) times the block's activation scale and weight scale, plus the weight
   min times the activation's block sum (scale times integer sum); the scales and mins at byte `at` of each group. */
static inline __attribute__((always_inline, target("f16c"))) void scale_block(
    const int rows, const int groups, const activations *a, int64_t m0, int64_t blocks, int64_t b,
    const uint8_t *const group[MAX_GROUPS], int64_t at, __m256i dots[MAX_ROWS][MAX_GROUPS], __m256 acc[MAX_ROWS][MAX_GROUPS])
{
    __m256 ws[MAX_GROUPS], wm[MAX_GROUPS];
    for (int g = 0; g < groups; g++) {
        ws[g] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(group[g] + at)));
        wm[g] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(group[g] + at + 16)));
    }
    for (int m = 0; m < rows; m++) {
        const float xs = a->scale[(m0 + m) * blocks + b];
        const __m256 s = _mm256_set1_ps(xs), s_sum = _mm256_set1_ps(xs * (float)a->sum[(m0 + m) * blocks + b]);
        for (int g = 0; g < groups; g++) {
            acc[m][g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[m][g]), _mm256_mul_ps(ws[g], s), acc[m][g]);
            acc[m][g] = _mm256_fmadd_ps(wm[g], s_sum, acc[m][g]);
        }
    }
}

/* `five` (the q5 layout, GGUF's Q5_1 levels 0..31): a block is Q5_BYTES, its 32 bytes after the nibbles the levels'
   fifth bits (byte j's bit i: quad i's value j), the scales and mins after them; row r's quads 2r and 2r + 1 take
   bits 2r and 2r + 1 of it to bit 4. Five-bit products fill int16 in two rows r (8 x 31 x 127 a lane), so the
   sums widen to int32 after rows 1 and 3 (four-bit ones after all four: 16 x 15 x 127); `Q4_DIRECT` (VNNI) sums
   in int32 throughout. */
static inline __attribute__((always_inline, target("f16c"))) void tile_q4(
    const int rows, const int groups, const activations *a, int64_t m0, int64_t K, const uint8_t *w,
    void *y, int64_t y0, int64_t N, int y_bf16, const int five)
{
    const int64_t blocks = K / BLOCK;
    const int block_bytes = five ? Q5_BYTES : Q4_BYTES, scales_at = five ? 160 : 128;
    const __m256i ones = _mm256_set1_epi16(1);
    const uint8_t *group[MAX_GROUPS];
    /* INTERLEAVE (an experiment: benchmarks/gemv_ab.py lays the weight out for a `-DINTERLEAVE=1` build): a tile's
       four groups block by block, one sequential stream */
    const int64_t stride = INTERLEAVE ? MAX_GROUPS * block_bytes : block_bytes;
    for (int g = 0; g < groups; g++) group[g] = w + g * (INTERLEAVE ? block_bytes : blocks * block_bytes);
    __m256 acc[MAX_ROWS][MAX_GROUPS];
    for (int m = 0; m < rows; m++)
        for (int g = 0; g < groups; g++) acc[m][g] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m256i sums[MAX_ROWS][MAX_GROUPS], sums32[MAX_ROWS][MAX_GROUPS];
        for (int g = 0; g < groups; g++) {
            prefetch_ahead(group[g] + b * stride, block_bytes);
            for (int m = 0; m < rows; m++) sums[m][g] = _mm256_setzero_si256();
        }
        #pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            __m256i lo[MAX_GROUPS], hi[MAX_GROUPS];
            for (int g = 0; g < groups; g++) levels_row(group[g] + b * stride, r, five, &lo[g], &hi[g]);
            for (int m = 0; m < rows; m++) {
                int32_t q0, q1;
                memcpy(&q0, a->q + (m0 + m) * K + b * BLOCK + r * 8, sizeof q0);
                memcpy(&q1, a->q + (m0 + m) * K + b * BLOCK + r * 8 + 4, sizeof q1);
                const __m256i x0 = _mm256_set1_epi32(q0), x1 = _mm256_set1_epi32(q1);
                for (int g = 0; g < groups; g++) {
                    if (Q4_DIRECT) {
                        sums[m][g] = dot_u8s8(dot_u8s8(sums[m][g], lo[g], x0), hi[g], x1);
                        continue;
                    }
                    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo[g], x0), _mm256_maddubs_epi16(hi[g], x1));
                    sums[m][g] = _mm256_add_epi16(sums[m][g], pairs);
                    if (five && r == 1) {
                        sums32[m][g] = _mm256_madd_epi16(sums[m][g], ones);
                        sums[m][g] = _mm256_setzero_si256();
                    }
                }
            }
        }
        for (int m = 0; m < rows && !Q4_DIRECT; m++)
            for (int g = 0; g < groups; g++) {
                const __m256i dot = _mm256_madd_epi16(sums[m][g], ones);
                sums[m][g] = five ? _mm256_add_epi32(dot, sums32[m][g]) : dot;
            }
        scale_block(rows, groups, a, m0, blocks, b, group, b * stride + scales_at, sums, acc);
    }
    for (int g = 0; g < groups; g++)
        for (int m = 0; m < rows; m++) store8(y, y0 + m * N + g * 8, acc[m][g], y_bf16);
}

#define CASES(T, R) case (R) * 16 + 1: T(R, 1); break; case (R) * 16 + 2: T(R, 2); break; \
                    case (R) * 16 + 3: T(R, 3); break; case (R) * 16 + 4: T(R, 4); break;
#define Q8(r, g) tile_q8(r, g, a, m0, K, (const int8_t *)w, (const float *)scale, y, y0, N, y_bf16)
#define Q4(r, g) tile_q4(r, g, a, m0, K, (const uint8_t *)w, y, y0, N, y_bf16, 0)
#define Q5(r, g) tile_q4(r, g, a, m0, K, (const uint8_t *)w, y, y0, N, y_bf16, 1)

__attribute__((target("f16c")))
static void tile_of(int q4, int r, int g, const activations *a, int64_t m0, int64_t K, const void *w,
                    const void *scale, void *y, int64_t y0, int64_t N, int y_bf16)
{
    if (q4 == 5) {
        switch (r * 16 + g) { CASES(Q5, 1) CASES(Q5, 2) CASES(Q5, 3) CASES(Q5, 4) default: no_tile("tile_q5", r, g); }
    } else if (q4) {
        switch (r * 16 + g) { CASES(Q4, 1) CASES(Q4, 2) CASES(Q4, 3) CASES(Q4, 4) default: no_tile("tile_q4", r, g); }
    } else {
        switch (r * 16 + g) { CASES(Q8, 1) CASES(Q8, 2) CASES(Q8, 3) CASES(Q8, 4) default: no_tile("tile_q8", r, g); }
    }
}

/* ---- WIDE: the AVX512 tiles of several rows (the AVX512-VNNI build with BW) ----------------------------------------
   Two groups of eight outputs side by side in one 512-bit register, so a prefill chunk's rows take half the
   instructions of the 256-bit tiles. Each lane gets the same exact integer block sums and then runs the 256-bit
   tile's float steps on them in the same order, so every output has their bits: a row's result is the same at one
   row (the 256-bit tile) as among many (this one). 4 rows x 3 pairs measured fastest of seven shapes (or within 2%). */
#define WIDE (WIDE_ISA && !INTERLEAVE)

#if WIDE

static inline __attribute__((always_inline)) __m512i to_bit4_wide(__m512i v, const int bit)
{
    return bit < 4 ? _mm512_slli_epi16(v, 4 - bit) : bit == 4 ? v : _mm512_srli_epi16(v, bit - 4);
}

/* tile_q8's block sums, two groups a register (`pairs` pairs of groups), without its sign trick: each weight byte
   flipped to unsigned (w ^ 0x80 is w + 128) times the signed activations, then 128 times the block's activation sum
   (exact, `activations.sum`) taken off: the same exact integers, then tile_q8's float steps. */
static inline __attribute__((always_inline)) void tile_q8_wide(
    const int rows, const int pairs, const activations *a, int64_t m0, int64_t K, const int8_t *w,
    const float *scale, void *y, int64_t y0, int64_t N, int y_bf16)
{
    const int64_t quads = K / 4, blocks = K / BLOCK;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[MAX_ROWS][WIDE_MAX_PAIRS];
    for (int m = 0; m < rows; m++)
        for (int p = 0; p < pairs; p++) acc[m][p] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i sums[MAX_ROWS][WIDE_MAX_PAIRS];
        for (int m = 0; m < rows; m++)
            for (int p = 0; p < pairs; p++) sums[m][p] = _mm512_setzero_si512();
        for (int g = 0; g < 2 * pairs; g++) prefetch_ahead(w + (g * quads + b * (BLOCK / 4)) * 32, BLOCK * 8);
        for (int64_t kq = b * (BLOCK / 4); kq < (b + 1) * (BLOCK / 4); kq++) {
            __m512i wv[WIDE_MAX_PAIRS];
            for (int p = 0; p < pairs; p++)
                wv[p] = _mm512_xor_si512(load_pair(w + (2 * p * quads + kq) * 32, w + ((2 * p + 1) * quads + kq) * 32), flip);
            for (int m = 0; m < rows; m++) {
                int32_t four;
                memcpy(&four, a->q + (m0 + m) * K + kq * 4, sizeof four);
                const __m512i xb = _mm512_set1_epi32(four);
                for (int p = 0; p < pairs; p++) sums[m][p] = _mm512_dpbusd_epi32(sums[m][p], wv[p], xb);
            }
        }
        for (int m = 0; m < rows; m++) {
            const __m512i offset = _mm512_set1_epi32(128 * a->sum[(m0 + m) * blocks + b]);
            const __m512 s = _mm512_set1_ps(a->scale[(m0 + m) * blocks + b]);
            for (int p = 0; p < pairs; p++)
                acc[m][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sums[m][p], offset)), s, acc[m][p]);
        }
    }
    for (int p = 0; p < pairs; p++) {
        const __m512 s = _mm512_loadu_ps(scale + p * 16);
        for (int m = 0; m < rows; m++) store16(y, y0 + m * N + p * 16, _mm512_mul_ps(acc[m][p], s), y_bf16);
    }
}

/* tile_q4's operations (Q4_DIRECT), two groups a register */
static inline __attribute__((always_inline)) void tile_q4_wide(
    const int rows, const int pairs, const activations *a, int64_t m0, int64_t K, const uint8_t *w,
    void *y, int64_t y0, int64_t N, int y_bf16, const int five)
{
    const int64_t blocks = K / BLOCK;
    const int block_bytes = five ? Q5_BYTES : Q4_BYTES, scales_at = five ? 160 : 128;
    const __m512i low = _mm512_set1_epi8(0x0f), bit4 = _mm512_set1_epi8(0x10);
    const uint8_t *group[2 * WIDE_MAX_PAIRS];
    for (int g = 0; g < 2 * pairs; g++) group[g] = w + g * blocks * block_bytes;
    __m512 acc[MAX_ROWS][WIDE_MAX_PAIRS];
    for (int m = 0; m < rows; m++)
        for (int p = 0; p < pairs; p++) acc[m][p] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t at = b * block_bytes;
        __m512i sums[MAX_ROWS][WIDE_MAX_PAIRS];
        for (int g = 0; g < 2 * pairs; g++) prefetch_ahead(group[g] + at, block_bytes);
        for (int m = 0; m < rows; m++)
            for (int p = 0; p < pairs; p++) sums[m][p] = _mm512_setzero_si512();
        #pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            __m512i lo[WIDE_MAX_PAIRS], hi[WIDE_MAX_PAIRS];
            for (int p = 0; p < pairs; p++) {
                const __m512i packed = load_pair(group[2 * p] + at + r * 32, group[2 * p + 1] + at + r * 32);
                lo[p] = _mm512_and_si512(packed, low);
                hi[p] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
                if (five) {
                    const __m512i fifth = load_pair(group[2 * p] + at + 128, group[2 * p + 1] + at + 128);
                    lo[p] = _mm512_or_si512(lo[p], _mm512_and_si512(to_bit4_wide(fifth, 2 * r), bit4));
                    hi[p] = _mm512_or_si512(hi[p], _mm512_and_si512(to_bit4_wide(fifth, 2 * r + 1), bit4));
                }
            }
            for (int m = 0; m < rows; m++) {
                int32_t q0, q1;
                memcpy(&q0, a->q + (m0 + m) * K + b * BLOCK + r * 8, sizeof q0);
                memcpy(&q1, a->q + (m0 + m) * K + b * BLOCK + r * 8 + 4, sizeof q1);
                const __m512i x0 = _mm512_set1_epi32(q0), x1 = _mm512_set1_epi32(q1);
                for (int p = 0; p < pairs; p++)
                    sums[m][p] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sums[m][p], lo[p], x0), hi[p], x1);
            }
        }
        __m512 ws[WIDE_MAX_PAIRS], wm[WIDE_MAX_PAIRS];
        for (int p = 0; p < pairs; p++) {
            ws[p] = _mm512_cvtph_ps(load_pair128(group[2 * p] + at + scales_at, group[2 * p + 1] + at + scales_at));
            wm[p] = _mm512_cvtph_ps(load_pair128(group[2 * p] + at + scales_at + 16, group[2 * p + 1] + at + scales_at + 16));
        }
        for (int m = 0; m < rows; m++) {
            const float xs = a->scale[(m0 + m) * blocks + b];
            const __m512 s = _mm512_set1_ps(xs), s_sum = _mm512_set1_ps(xs * (float)a->sum[(m0 + m) * blocks + b]);
            for (int p = 0; p < pairs; p++) {
                acc[m][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[m][p]), _mm512_mul_ps(ws[p], s), acc[m][p]);
                acc[m][p] = _mm512_fmadd_ps(wm[p], s_sum, acc[m][p]);
            }
        }
    }
    for (int p = 0; p < pairs; p++)
        for (int m = 0; m < rows; m++) store16(y, y0 + m * N + p * 16, acc[m][p], y_bf16);
}

#define WCASES(T, R) case (R) * 16 + 1: T(R, 1); break; case (R) * 16 + 2: T(R, 2); break; \
                     case (R) * 16 + 3: T(R, 3); break;
#define WQ8(r, p) tile_q8_wide(r, p, a, m0, K, (const int8_t *)w, (const float *)scale, y, y0, N, y_bf16)
#define WQ4(r, p) tile_q4_wide(r, p, a, m0, K, (const uint8_t *)w, y, y0, N, y_bf16, 0)
#define WQ5(r, p) tile_q4_wide(r, p, a, m0, K, (const uint8_t *)w, y, y0, N, y_bf16, 1)

static void wide_tile_of(int q4, int r, int p, const activations *a, int64_t m0, int64_t K, const void *w,
                         const void *scale, void *y, int64_t y0, int64_t N, int y_bf16)
{
    if (q4 == 5) {
        switch (r * 16 + p) { WCASES(WQ5, 1) WCASES(WQ5, 2) WCASES(WQ5, 3) WCASES(WQ5, 4) default: no_tile("tile_q5_wide", r, p); }
    } else if (q4) {
        switch (r * 16 + p) { WCASES(WQ4, 1) WCASES(WQ4, 2) WCASES(WQ4, 3) WCASES(WQ4, 4) default: no_tile("tile_q4_wide", r, p); }
    } else {
        switch (r * 16 + p) { WCASES(WQ8, 1) WCASES(WQ8, 2) WCASES(WQ8, 3) WCASES(WQ8, 4) default: no_tile("tile_q8_wide", r, p); }
    }
}
#endif

/* Where group g of eight outputs starts in a layout's weights (`q4`: 0 q8, 4 q4, 5 q5) and in q8's per-output scales
   (q4 and q5 keep theirs inside the blocks: NULL). */
static inline const void *group_weights(int q4, const void *w, int64_t g, int64_t K)
{
    return q4 ? (const void *)((const uint8_t *)w + g * (K / BLOCK) * (q4 == 5 ? Q5_BYTES : Q4_BYTES))
              : (const void *)((const int8_t *)w + g * K * 8);
}

static inline const void *group_scales(int q4, const void *scale, int64_t g)
{
    return q4 ? NULL : (const void *)((const float *)scale + g * 8);
}

/* Threads share tiles of `groups` groups of 8 outputs; each tile runs over the rows `rows` at a time. `q4`: 0 the q8
   layout, 4 the q4, 5 the q5. */
static void run(int q4, int tile_rows, int tile_groups, const void *x, int64_t M, int64_t K, const void *w,
                const void *scale, int64_t N, void *y, int x_bf16, int y_bf16)
{
    CALL_START
    activations a;
    const int64_t blocks = K / BLOCK;
    a.q = malloc(M * K);
    a.magnitude = malloc(M * K);
    a.scale = malloc(M * blocks * sizeof(float));
    a.sum = malloc(M * blocks * sizeof(int32_t));
    quantize_rows(x, M, K, x_bf16, &a);
    const int wide = WIDE && tile_rows > 1; /* several rows: the 512-bit tiles, in pairs of groups */
    if (wide) {
        tile_rows = WIDE_ROWS;
        tile_groups = 2 * WIDE_PAIRS;
    }
    const int64_t groups = N / 8, tiles = (groups + tile_groups - 1) / tile_groups;
    REGION_START
    #pragma omp parallel
    {
    TIMING_START
#ifdef CHUNKS
    const int64_t chunk = tiles / CHUNKS > 1 ? tiles / CHUNKS : 1;
    #pragma omp for schedule(dynamic, chunk) nowait
#else
    #pragma omp for schedule(SCHEDULE) nowait
#endif
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t g0 = t * tile_groups;
        const int g = groups - g0 < tile_groups ? (int)(groups - g0) : tile_groups;
        const void *wt = group_weights(q4, w, g0, K), *st = group_scales(q4, scale, g0);
        for (int64_t m0 = 0; m0 < M; m0 += tile_rows) {
            const int r = M - m0 < tile_rows ? (int)(M - m0) : tile_rows;
#if WIDE
            if (wide) { /* the pairs, then a last group left alone in its 256-bit tile */
                const int pairs = g / 2;
                if (pairs) wide_tile_of(q4, r, pairs, &a, m0, K, wt, st, y, m0 * N + g0 * 8, N, y_bf16);
                if (g % 2) {
                    const int64_t last = g0 + g - 1;
                    tile_of(q4, r, 1, &a, m0, K, group_weights(q4, w, last, K), group_scales(q4, scale, last), y,
                            m0 * N + last * 8, N, y_bf16);
                }
                continue;
            }
#endif
            tile_of(q4, r, g, &a, m0, K, wt, st, y, m0 * N + g0 * 8, N, y_bf16);
        }
    }
    TIMING_END
    }
    free(a.q);
    free(a.magnitude);
    free(a.scale);
    free(a.sum);
    CALL_END
}

/* x [M, K] float32 (bf16 if x_bf16), w [N/8, K/4, 8, 4] int8, scale [N] float32 -> y [M, N] float32 (bf16 if
   y_bf16). tile_rows x tile_groups: the register tile (rows of x by groups of 8 outputs), 1..4 each. */
void q8_dot_linear(const void *x, int64_t M, int64_t K, const int8_t *w, const float *scale, int64_t N, void *y,
                   int x_bf16, int y_bf16, int tile_rows, int tile_groups)
{
    run(0, tile_rows, tile_groups, x, M, K, w, scale, N, y, x_bf16, y_bf16);
}

/* x [M, K], w [N/8, K/32, 160] uint8 (128 bytes of two 4-bit levels a byte, 8 float16 scales, 8 mins) -> y [M, N];
   `scale` is unused (the scales are in w). */
void q4_dot_linear(const void *x, int64_t M, int64_t K, const uint8_t *w, const uint16_t *scale, int64_t N, void *y,
                   int x_bf16, int y_bf16, int tile_rows, int tile_groups)
{
    run(4, tile_rows, tile_groups, x, M, K, w, scale, N, y, x_bf16, y_bf16);
}

/* x [M, K], w [N/8, K/32, 192] uint8 (q4's nibbles, 32 bytes of fifth bits, 8 float16 scales, 8 mins) -> y [M, N]. */
void q5_dot_linear(const void *x, int64_t M, int64_t K, const uint8_t *w, const uint16_t *scale, int64_t N, void *y,
                   int x_bf16, int y_bf16, int tile_rows, int tile_groups)
{
    run(5, tile_rows, tile_groups, x, M, K, w, scale, N, y, x_bf16, y_bf16);
}
