/* Decode attention in one call (engine/model/attention.py's `_decode`): each decode row's query heads over the keys
   and values of its own blocks of the paged KV cache, read in place. At a decode step's few rows torch's path (two
   index_select gathers of the blocks, a mask, scaled_dot_product_attention's flash kernel) cost ~0.1-0.2 ms a layer
   in dispatch and copies for a few thousand multiply-adds.

   q [rows, heads, D] float32; the cache's k and v [blocks, block_size, kv_heads, D] float32; tables [rows or 1,
   count] int64 block ids (one row: every row reads the same blocks); mask [rows, count * block_size] bytes (0: not
   attended); out [rows, heads, D]. Query head h reads kv head h / (heads / kv_heads). For each (row, head) alone, in
   one fixed order whatever the row count or thread: scores s_j = (q . k_j) * scaling over the attended positions j
   in order (`dot`), m = max s_j, p_j = expf(s_j - m), out = (sum_j p_j v_j) / sum_j p_j.
   A row's result depends on its own keys alone (batch invariance), and positions it does not attend are skipped
   (the padding a span group adds changes nothing). D is a multiple of 8. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define PARALLEL_MACS (1 << 19)

/* q . k over D values: four eight-lane sums (d in steps of 32, a last 8..24 into the first), added pairwise, then
   the lanes in order (four chains: a long span's dot products are not one FMA latency apart). */
static inline float dot(const float *q, const float *k, int64_t D)
{
    __m256 sum[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t d = 0;
    for (; d + 32 <= D; d += 32)
        for (int i = 0; i < 4; i++)
            sum[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8 * i), _mm256_loadu_ps(k + d + 8 * i), sum[i]);
    for (; d < D; d += 8) sum[0] = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), sum[0]);
    const __m256 all = _mm256_add_ps(_mm256_add_ps(sum[0], sum[1]), _mm256_add_ps(sum[2], sum[3]));
    float lanes[8], total = 0.0f;
    _mm256_storeu_ps(lanes, all);
    for (int i = 0; i < 8; i++) total += lanes[i];
    return total;
}

/* One query head of one row over its attended positions (`scores`: scratch of count * block_size floats). */
static void head(const float *q, const float *k, const float *v, int64_t kv_heads, int64_t kvh, int64_t D,
                 int64_t block_size, const int64_t *table, int64_t span, const uint8_t *mask, float scaling,
                 float *scores, float *out)
{
    float top = -INFINITY;
    for (int64_t j = 0; j < span; j++) {
        if (!mask[j]) continue;
        const int64_t at = ((table[j / block_size] * block_size + j % block_size) * kv_heads + kvh) * D;
        scores[j] = dot(q, k + at, D) * scaling;
        top = scores[j] > top ? scores[j] : top;
    }
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(out + d, _mm256_setzero_ps());
    float total = 0.0f;
    for (int64_t j = 0; j < span; j++) {
        if (!mask[j]) continue;
        const float p = expf(scores[j] - top);
        total += p;
        const int64_t at = ((table[j / block_size] * block_size + j % block_size) * kv_heads + kvh) * D;
        const __m256 weight = _mm256_set1_ps(p);
        for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(out + d, _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + at + d), _mm256_loadu_ps(out + d)));
    }
    const __m256 inverse = _mm256_set1_ps(1.0f / total);
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_loadu_ps(out + d), inverse));
}

void decode_attention(const float *q, int64_t rows, int64_t heads, int64_t kv_heads, int64_t D, const float *k,
                      const float *v, int64_t block_size, const int64_t *tables, int64_t table_rows, int64_t count,
                      const uint8_t *mask, float scaling, float *out)
{
    const int64_t span = count * block_size, group = heads / kv_heads;
    /* threads only where the work is worth waking them (a 1B row at context 40: ~50k multiply-adds, a few us); each
       (row, head) is computed alike on any thread */
    #pragma omp parallel if (rows * heads * span * D >= PARALLEL_MACS)
    {
        float *scores = malloc(span * sizeof(float));
        #pragma omp for schedule(static)
        for (int64_t task = 0; task < rows * heads; task++) {
            const int64_t row = task / heads, h = task % heads;
            head(q + task * D, k, v, kv_heads, h / group, D, block_size, tables + (table_rows == 1 ? 0 : row) * count,
                 span, mask + row * span, scaling, scores, out + task * D);
        }
        free(scores);
    }
}
