/* A decoder layer's small float32 steps in one call each (engine/model/gemma3.py): at a decode step's one row
   each torch op's dispatch and allocation cost more than its arithmetic, and a 1B step ran ~1,000 of them.

   - `qk_norm_rope`: the q and k heads of a fused q/k/v projection's rows, each RMSNorm'd with its scale, then
     rotated (rope: x * cos + roll(x, D/2) * signed_sin), into contiguous q [rows, heads, D] and k [rows, kv, D];
   - `residual_norm`: hidden + RMSNorm(delta) * scale (a residual branch), and optionally the sum's own RMSNorm
     times the next norm's scale (the next sublayer's input).

   Each value is computed with the same float32 operations, in the same order, as the torch ops it replaces
   (gemma3.py's `rms_norm` through woq_int8.c's `rms_norm_rows`, then torch's elementwise mul and add): the same
   bits, tested. This family is compiled with -ffp-contract=off (sources.py), so no multiply and add become one
   FMA here; the one FMA (the sum of squares) is rms_norm_rows' own. Each row is computed alone (batch
   invariance holds). D is a multiple of 8 (a head's, in `qk_norm_rope`, at most MAX_D).

   - `gelu_tanh_mul`: the MLP's gelu(gate) * up, the one step here that is not torch's bits (its own exp, closer to
     the exact function than torch's float32 tanh form); each value alone. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define MAX_D 1024

/* rms_norm_rows' 1 / sqrt(mean(x^2) + eps) of one row of D values, in its steps exactly. */
static inline __m256 row_inverse(const float *x, int64_t D, float eps)
{
    __m256 squares = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 v = _mm256_loadu_ps(x + d);
        squares = _mm256_fmadd_ps(v, v, squares);
    }
    float lanes[8], sum = 0.0f;
    _mm256_storeu_ps(lanes, squares);
    for (int i = 0; i < 8; i++) sum += lanes[i];
    return _mm256_set1_ps(1.0f / sqrtf(sum / (float)D + eps));
}

/* Eight normed values: x * inverse * scale (rms_norm_rows' order). */
static inline __m256 normed8(const float *x, __m256 inverse, const float *scale)
{
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x), inverse), _mm256_loadu_ps(scale));
}

/* One head normed then rotated: out = n * cos + roll(n, D/2) * sin (sin's first half negated by the caller). */
static inline void norm_rope_head(const float *x, int64_t D, const float *scale, float eps, const float *cos,
                                  const float *sin, float *out)
{
    float normed[MAX_D];
    const __m256 inverse = row_inverse(x, D, eps);
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(normed + d, normed8(x + d, inverse, scale + d));
    const int64_t half = D / 2;
    for (int64_t d = 0; d < D; d += 8) {
        const int64_t rolled = d < half ? d + half : d - half;
        const __m256 a = _mm256_mul_ps(_mm256_loadu_ps(normed + d), _mm256_loadu_ps(cos + d));
        const __m256 b = _mm256_mul_ps(_mm256_loadu_ps(normed + rolled), _mm256_loadu_ps(sin + d));
        _mm256_storeu_ps(out + d, _mm256_add_ps(a, b));
    }
}

/* q_in [rows, q_stride] and k_in [rows, k_stride] (each row's heads * D values contiguous at its start: the
   columns of a fused q/k/v projection's output, or their own tensors), cos and sin [rows, D] -> q [rows, heads, D]
   and k [rows, kv_heads, D]. */
void qk_norm_rope(const float *q_in, int64_t q_stride, const float *k_in, int64_t k_stride, int64_t rows,
                  int64_t heads, int64_t kv_heads, int64_t D, const float *q_scale, const float *k_scale, float eps,
                  const float *cos, const float *sin, float *q, float *k)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * D, *s = sin + r * D;
        for (int64_t h = 0; h < heads; h++)
            norm_rope_head(q_in + r * q_stride + h * D, D, q_scale, eps, c, s, q + (r * heads + h) * D);
        for (int64_t h = 0; h < kv_heads; h++)
            norm_rope_head(k_in + r * k_stride + h * D, D, k_scale, eps, c, s, k + (r * kv_heads + h) * D);
    }
}

/* hidden, delta [rows, D] -> out = hidden + norm(delta) * delta_scale; with next_scale, normed = norm(out) *
   next_scale. out may be hidden itself. */
void residual_norm(const float *hidden, const float *delta, int64_t rows, int64_t D, const float *delta_scale,
                   const float *next_scale, float eps, float *out, float *normed)
{
    for (int64_t r = 0; r < rows; r++) {
        const int64_t at = r * D;
        const __m256 inverse = row_inverse(delta + at, D, eps);
        for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(out + at + d, _mm256_add_ps(_mm256_loadu_ps(hidden + at + d), normed8(delta + at + d, inverse, delta_scale + d)));
        if (!next_scale) continue;
        const __m256 next = row_inverse(out + at, D, eps);
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(normed + at + d, normed8(out + at + d, next, next_scale + d));
    }
}

/* e^x for eight floats (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, 2^n into the exponent), within
   ~2 ulp; x clamped to [-87, 88] (beyond: ~0 and ~2^127, which gelu's x / (1 + e) reads as 0 and x). */
static inline __m256 exp8(__m256 x)
{
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

/* out [rows, n] = gelu_tanh(gate) * up, gate and up [rows, n] with rows `gate_stride` and `up_stride` apart (a fused
   gate/up output's columns; n a multiple of 8): gelu_tanh(x) = x (1 + tanh(y)) / 2 with y = sqrt(2 / pi) (x +
   0.044715 x^3), computed as x / (1 + e^(-2y)) (the same function, without tanh's cancellation near -1). Not torch's
   bits (its own exp), each value alone: the rows beside it and the threads' split change none. */
void gelu_tanh_mul(const float *gate, int64_t gate_stride, const float *up, int64_t up_stride, int64_t rows, int64_t n,
                   float *out)
{
    #pragma omp parallel for schedule(static) if (rows * n >= (1 << 16))
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n; i += 8) {
            const __m256 x = _mm256_loadu_ps(gate + r * gate_stride + i);
            const __m256 inner = _mm256_mul_ps(x, _mm256_fmadd_ps(_mm256_mul_ps(x, x), _mm256_set1_ps(0.044715f), _mm256_set1_ps(1.0f)));
            const __m256 e = exp8(_mm256_mul_ps(inner, _mm256_set1_ps(-1.5957691216057308f)));
            const __m256 g = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(out + r * n + i, _mm256_mul_ps(g, _mm256_loadu_ps(up + r * up_stride + i)));
        }
}
