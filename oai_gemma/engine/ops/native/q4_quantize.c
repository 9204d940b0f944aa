/* GGUF's Q4_1 quantization of a weight (`model.quantization = q4`, engine/ops/int_dot.py's `q4_blocks`; Q5_1's with
   levels 0..31 and 31 for 15 throughout, `q5_1_blocks`, the `q5` lm_head): each
   block of 32 weights w gets a float16 scale d and min m and 4-bit levels q in 0..15 standing for d * q + m, the pair
   chosen by least squares among a few roundings, as llama.cpp's make_qkx searches:

     lo = min(w, 0), spread = max(w) - lo
     for each candidate inverse scale (15 + step / 10) / spread, step in -10..10:
       q = clamp(round((w - lo) * iscale), 0, 15)
       (d, m) = the least-squares fit of w on q (spread / 15 and lo where q is constant), each rounded to float16
       q = clamp(round((w - m) / d), 0, 15) again against them; the squared error of d * q + m
     the candidate of least error is kept (the first on a tie).

   Each block alone in one fixed order of float operations (the same bits whatever the thread count), eight lanes
   at a time; blocks split over the OpenMP threads. The torch version this replaces took half an hour for the 1B's
   projections on two cores; this takes seconds. Built with AVX2, FMA and F16C (every AVX2 CPU has F16C). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define BLOCK 32
#define LANES 4 /* __m256 vectors a block */

static inline float hsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 levels_of(__m256 v, __m256 offset, __m256 times, int divide, float top)
{
    const __m256 shifted = _mm256_sub_ps(v, offset);
    const __m256 r = _mm256_round_ps(divide ? _mm256_div_ps(shifted, times) : _mm256_mul_ps(shifted, times),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_min_ps(_mm256_max_ps(r, _mm256_setzero_ps()), _mm256_set1_ps(top));
}

static inline __attribute__((target("f16c"))) uint16_t to_half(float x)
{
    return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
}

static inline __attribute__((target("f16c"))) float from_half(uint16_t h)
{
    return _cvtsh_ss(h);
}

static void quantize_block(const float *w, float top, uint8_t *levels, uint16_t *scale, uint16_t *min)
{
    __m256 v[LANES], lo8 = _mm256_setzero_ps(), hi8 = _mm256_loadu_ps(w), sum8 = _mm256_setzero_ps();
    for (int k = 0; k < LANES; k++) {
        v[k] = _mm256_loadu_ps(w + 8 * k);
        lo8 = _mm256_min_ps(lo8, v[k]);
        hi8 = _mm256_max_ps(hi8, v[k]);
        sum8 = _mm256_add_ps(sum8, v[k]);
    }
    float lo = 0.0f, hi = w[0], lanes[8];
    _mm256_storeu_ps(lanes, lo8);
    for (int j = 0; j < 8; j++) lo = fminf(lo, lanes[j]);
    _mm256_storeu_ps(lanes, hi8);
    for (int j = 0; j < 8; j++) hi = fmaxf(hi, lanes[j]);
    const float sx = hsum(sum8), spread = fmaxf(hi - lo, 1e-12f);
    float best_error = INFINITY;
    uint16_t best_d = 0, best_m = 0;
    __m256 best[LANES] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int step = -10; step <= 10; step++) {
        const __m256 iscale = _mm256_set1_ps((top + 0.1f * (float)step) / spread), lo_v = _mm256_set1_ps(lo);
        __m256 sl8 = _mm256_setzero_ps(), sll8 = _mm256_setzero_ps(), slx8 = _mm256_setzero_ps();
        for (int k = 0; k < LANES; k++) {
            const __m256 q = levels_of(v[k], lo_v, iscale, 0, top);
            sl8 = _mm256_add_ps(sl8, q);
            sll8 = _mm256_fmadd_ps(q, q, sll8);
            slx8 = _mm256_fmadd_ps(q, v[k], slx8);
        }
        const float sl = hsum(sl8), sll = hsum(sll8), slx = hsum(slx8);
        const float det = BLOCK * sll - sl * sl;
        float d = spread / top, m = lo;
        if (det > 0.0f) {
            d = (BLOCK * slx - sl * sx) / det;
            m = (sx - d * sl) / BLOCK;
        }
        const uint16_t dh = to_half(d), mh = to_half(m);
        const float df = from_half(dh), mf = from_half(mh);
        const __m256 d8 = _mm256_set1_ps(df), m8 = _mm256_set1_ps(mf), safe = _mm256_set1_ps(df != 0.0f ? df : 1.0f);
        __m256 q[LANES], error8 = _mm256_setzero_ps();
        for (int k = 0; k < LANES; k++) {
            q[k] = levels_of(v[k], m8, safe, 1, top);
            const __m256 diff = _mm256_sub_ps(v[k], _mm256_fmadd_ps(d8, q[k], m8));
            error8 = _mm256_fmadd_ps(diff, diff, error8);
        }
        const float error = hsum(error8);
        if (step == -10 || error < best_error) {
            best_error = error, best_d = dh, best_m = mh;
            for (int k = 0; k < LANES; k++) best[k] = q[k];
        }
    }
    for (int k = 0; k < LANES; k++) {
        float out[8];
        _mm256_storeu_ps(out, best[k]);
        for (int j = 0; j < 8; j++) levels[8 * k + j] = (uint8_t)out[j];
    }
    *scale = best_d;
    *min = best_m;
}

static void blocks_of(const float *w, int64_t blocks, float top, uint8_t *levels, uint16_t *scale, uint16_t *min)
{
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < blocks; i++)
        quantize_block(w + i * BLOCK, top, levels + i * BLOCK, scale + i, min + i);
}

/* w [blocks, 32] float32 -> levels [blocks, 32] uint8 (0..15), scale and min [blocks] float16 (as raw bits). */
void q4_1_blocks(const float *w, int64_t blocks, uint8_t *levels, uint16_t *scale, uint16_t *min)
{
    blocks_of(w, blocks, 15.0f, levels, scale, min);
}

/* The same search with 5-bit levels (0..31: GGUF's Q5_1, the `q5` lm_head), candidates (31 + step / 10) / spread. */
void q5_1_blocks(const float *w, int64_t blocks, uint8_t *levels, uint16_t *scale, uint16_t *min)
{
    blocks_of(w, blocks, 31.0f, levels, scale, min);
}
