/* LoRA's shrink and expand for a step's few rows, each row on its own adapter (engine/lora/apply.py).

   A decode step of one row on an adapter runs ~200 small matmuls through torch (a shrink per group of projections
   that share their input, an expand per projection, the conversions and adds around them): their dispatch, not
   their arithmetic, cost ~20% of the step. Here each projection is one call (`lora_project`: its expand, after
   its group's shrink in the group's first projection's call), on the stack's own tensors (engine/lora/stack.py:
   A of every adapter side by side [blocks x width, K], one B^T [width, N] per projection) in the model's dtype
   (bf16: half the bytes of float32), summed in float32.

   Row m reads only its adapter's columns [start[m], end[m]) of each block (none for a base row: start == end), so
   a stack of several adapters costs each row its own rank, not every adapter's. `order` lists the rows grouped by
   adapter: consecutive rows of one adapter share each weight load (up to RT rows at a time).

   The tiles (lora_tiles.h) are written once with GCC's vector extensions and included twice: 16 floats a vector
   in the AVX512 functions, 8 in the AVX2 ones. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define RT 4 /* rows of one adapter per tile */

static inline float scalar(const void *p, int64_t i, int bf16)
{
    if (!bf16) return ((const float *)p)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw")
typedef float v16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t h16 __attribute__((vector_size(32)));
#define V v16
#define U u32x16
#define H h16
#define LANES 16
#define WIDE 4
#define SUFFIX avx512
#include "lora_tiles.h"
#undef V
#undef U
#undef H
#undef LANES
#undef WIDE
#undef SUFFIX
#pragma GCC pop_options

typedef float v8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t h8 __attribute__((vector_size(16)));
#define V v8
#define U u32x8
#define H h8
#define LANES 8
#define WIDE 2
#define SUFFIX avx2
#include "lora_tiles.h"

typedef void (*shrink_fn)(int rows, int cols, const void *x, const int32_t *rowv, int64_t K, const void *a,
                          int64_t a0, int w_bf16, float *s, int64_t S, int64_t col);
typedef void (*expand_fn)(int rows, int vecs, const float *s, int64_t S, int64_t col, const int32_t *rowv,
                          int64_t rank, const void *b, int64_t b0, int64_t N, int64_t n0, void *y, int w_bf16,
                          int y_bf16);

/* Runs of `order`: up to RT consecutive rows of one adapter (the same start and end); returns their count. */
static int64_t runs_of(const int32_t *order, int64_t M, const int32_t *start, const int32_t *end, int64_t *runs)
{
    int64_t count = 0;
    for (int64_t i = 0; i < M;) {
        const int32_t m = order[i];
        int64_t n = 1;
        while (i + n < M && n < RT && start[order[i + n]] == start[m] && end[order[i + n]] == end[m]) n++;
        if (end[m] > start[m]) runs[count++] = i | (n << 32);
        i += n;
    }
    return count;
}

#define RUN_ROWS(run) ((int)((run) >> 32))
#define RUN_FIRST(run) ((run) & 0xffffffff)

/* x [M, K] and A [blocks * width, K] (both bf16 if w_bf16, else float32) -> s [M, blocks * width] float32:
   row m's columns [start, end) of each block (the others are not written). */
static void shrink(shrink_fn tile, const void *x, int64_t M, int64_t K, const void *a, int64_t width,
                   int64_t blocks, int w_bf16, const int32_t *start, const int32_t *end, const int32_t *order, float *s,
                   int cols)
{
    int64_t *runs = malloc(M * sizeof(int64_t));
    const int64_t count = runs_of(order, M, start, end, runs), S = blocks * width;
    #pragma omp parallel for schedule(static) if (count * blocks > 1)
    for (int64_t item = 0; item < count * blocks; item++) {
        const int64_t run = runs[item / blocks], block = item % blocks;
        const int32_t *rowv = order + RUN_FIRST(run), first = rowv[0];
        for (int64_t j = start[first]; j < end[first]; j += cols) {
            const int c = end[first] - j < cols ? (int)(end[first] - j) : cols;
            tile(RUN_ROWS(run), c, x, rowv, K, a, block * width + j, w_bf16, s, S, block * width + j);
        }
    }
    free(runs);
}

/* y [M, N] (bf16 if y_bf16) += for each row m: s[m, col + start .. col + end) B^T[start .. end) (B^T [width, N],
   bf16 if w_bf16). The threads share the outputs, `vecs` vectors of `lanes` a tile. */
static void expand(expand_fn tile, const float *s, int64_t M, int64_t S, int64_t col, const void *b, int64_t N,
                   int w_bf16, const int32_t *start, const int32_t *end, const int32_t *order, void *y, int y_bf16,
                   int lanes, int vecs)
{
    int64_t *runs = malloc(M * sizeof(int64_t));
    const int64_t count = runs_of(order, M, start, end, runs), tiles = (N / lanes + vecs - 1) / vecs;
    #pragma omp parallel for schedule(static) if (tiles > 1)
    for (int64_t t = 0; t < tiles; t++) {
        const int v = N / lanes - t * vecs < vecs ? (int)(N / lanes - t * vecs) : vecs;
        for (int64_t i = 0; i < count; i++) {
            const int32_t *rowv = order + RUN_FIRST(runs[i]), first = rowv[0];
            tile(RUN_ROWS(runs[i]), v, s, S, col + start[first], rowv, end[first] - start[first], b, start[first], N,
                 t * vecs * lanes, y, w_bf16, y_bf16);
        }
    }
    for (int64_t m = 0; m < M; m++)  /* N's last N % lanes outputs one at a time */
        for (int64_t n = N - N % lanes; n < N; n++) {
            float sum = scalar(y, m * N + n, y_bf16);
            for (int32_t j = start[m]; j < end[m]; j++) sum += s[m * S + col + j] * scalar(b, j * N + n, w_bf16);
            if (y_bf16) {
                uint32_t bits;
                memcpy(&bits, &sum, sizeof bits);
                ((uint16_t *)y)[m * N + n] = (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
            } else {
                ((float *)y)[m * N + n] = sum;
            }
        }
    free(runs);
}

/* One projection's update for a step's part: shrink x by the group's A first when `first` (the group's first
   projection of the layer: s is kept for the others), then y += s B^T. Two arrays of int64 hold what does not change
   from call to call (the caller builds them once: one ctypes call of five arguments is ~1 us, of thirteen ~3 us):
   rows = {M, start, end, order, s, bf16, avx512} (pointers as integers; s [M, >= blocks x width]),
   weights = {A, K, width, blocks, B^T, N, col} (A [blocks x width, K], B^T [width, N], its block's first column col).
   x [M, K], y [M, N] (contiguous), A and B^T all bf16 or all float32 (the model's dtype). */
void lora_project(const int64_t *rows, const int64_t *weights, const void *x, void *y, int first)
{
    const int64_t M = rows[0], K = weights[1], width = weights[2], blocks = weights[3];
    const int32_t *start = (const int32_t *)rows[1], *end = (const int32_t *)rows[2], *order = (const int32_t *)rows[3];
    float *s = (float *)rows[4];
    const int bf16 = (int)rows[5], avx512 = (int)rows[6];
    const void *a = (const void *)weights[0], *b = (const void *)weights[4];
    if (first) {
        if (avx512) shrink(shrink_tiles_avx512, x, M, K, a, width, blocks, bf16, start, end, order, s, 4);
        else shrink(shrink_tiles_avx2, x, M, K, a, width, blocks, bf16, start, end, order, s, 2);
    }
    if (avx512) expand(expand_tiles_avx512, s, M, blocks * width, weights[6], b, weights[5], bf16, start, end, order, y, bf16, 16, 4);
    else expand(expand_tiles_avx2, s, M, blocks * width, weights[6], b, weights[5], bf16, start, end, order, y, bf16, 8, 2);
}
