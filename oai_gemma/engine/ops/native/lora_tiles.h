/* The tiles of lora.c for one ISA, included once per ISA with V (a vector of LANES floats), its bf16 and integer
   forms H and U, WIDE (columns of A, or vectors of outputs, per tile) and SUFFIX defined. */
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define NAME(name) CAT(name, SUFFIX)

static inline __attribute__((always_inline)) V NAME(load)(const void *p, int64_t i, const int bf16)
{
    V v;
    if (bf16) {
        H h;
        memcpy(&h, (const uint16_t *)p + i, sizeof h);
        const U bits = __builtin_convertvector(h, U) << 16;
        memcpy(&v, &bits, sizeof v);
    } else {
        memcpy(&v, (const float *)p + i, sizeof v);
    }
    return v;
}

/* y[i .. i + LANES) += v, float32 or bf16 (rounded to nearest even once, as torch's add_ of float32 into bf16). */
static inline __attribute__((always_inline)) void NAME(add)(void *y, int64_t i, V v, const int bf16)
{
    v += NAME(load)(y, i, bf16);
    if (!bf16) {
        memcpy((float *)y + i, &v, sizeof v);
        return;
    }
    U bits;
    memcpy(&bits, &v, sizeof bits);
    bits = (bits + 0x7fff + ((bits >> 16) & 1)) >> 16;
    const H h = __builtin_convertvector(bits, H);
    memcpy((uint16_t *)y + i, &h, sizeof h);
}

/* s[row, col + j] = x[row] . A[a0 + j] for `rows` rows (of one adapter) and `cols` rows of A, both bf16 or both
   float32 (K's last K % LANES columns one at a time). */
static inline __attribute__((always_inline)) void NAME(shrink_tile)(
    const int rows, const int cols, const void *x, const int32_t *rowv, int64_t K, const void *a, int64_t a0,
    const int bf16, float *s, int64_t S, int64_t col)
{
    V acc[RT][WIDE];
    memset(acc, 0, sizeof acc);
    const int64_t whole = K - K % LANES;
    for (int64_t k = 0; k < whole; k += LANES) {
        V av[WIDE];
        for (int j = 0; j < cols; j++) av[j] = NAME(load)(a, (a0 + j) * K + k, bf16);
        for (int r = 0; r < rows; r++) {
            const V xv = NAME(load)(x, rowv[r] * K + k, bf16);
            for (int j = 0; j < cols; j++) acc[r][j] += xv * av[j];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < cols; j++) {
            float sum = 0.0f;
            for (int i = 0; i < LANES; i++) sum += acc[r][j][i];
            for (int64_t k = whole; k < K; k++) sum += scalar(x, rowv[r] * K + k, bf16) * scalar(a, (a0 + j) * K + k, bf16);
            s[rowv[r] * S + col + j] = sum;
        }
}

/* y[row, n0 .. n0 + LANES * vecs) += s[row, col .. col + rank) B^T[b0 .. b0 + rank, the same columns]. */
static inline __attribute__((always_inline)) void NAME(expand_tile)(
    const int rows, const int vecs, const float *s, int64_t S, int64_t col, const int32_t *rowv, int64_t rank,
    const void *b, int64_t b0, int64_t N, int64_t n0, void *y, const int w_bf16, const int y_bf16)
{
    V acc[RT][WIDE];
    memset(acc, 0, sizeof acc);
    for (int64_t j = 0; j < rank; j++) {
        V bv[WIDE];
        for (int t = 0; t < vecs; t++) bv[t] = NAME(load)(b, (b0 + j) * N + n0 + LANES * t, w_bf16);
        for (int r = 0; r < rows; r++) {
            const float sj = s[rowv[r] * S + col + j];
            for (int t = 0; t < vecs; t++) acc[r][t] += sj * bv[t];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < vecs; t++) NAME(add)(y, rowv[r] * N + n0 + LANES * t, acc[r][t], y_bf16);
}

/* The tiles with their sizes and dtypes as constants (the loops unroll). */
#define SHRINK(r, c, w) case ((r) * 8 + (c)) * 2 + (w): NAME(shrink_tile)(r, c, x, rowv, K, a, a0, w, s, S, col); break;
#define EXPAND(r, v, w, yb) case (((r) * 8 + (v)) * 2 + (w)) * 2 + (yb): \
    NAME(expand_tile)(r, v, s, S, col, rowv, rank, b, b0, N, n0, y, w, yb); break;
#if WIDE == 4
#define SHRINK_R(r, w) SHRINK(r, 1, w) SHRINK(r, 2, w) SHRINK(r, 3, w) SHRINK(r, 4, w)
#define EXPAND_R(r, w, yb) EXPAND(r, 1, w, yb) EXPAND(r, 2, w, yb) EXPAND(r, 3, w, yb) EXPAND(r, 4, w, yb)
#else
#define SHRINK_R(r, w) SHRINK(r, 1, w) SHRINK(r, 2, w)
#define EXPAND_R(r, w, yb) EXPAND(r, 1, w, yb) EXPAND(r, 2, w, yb)
#endif
#define EXPAND_W(w, yb) EXPAND_R(1, w, yb) EXPAND_R(2, w, yb) EXPAND_R(3, w, yb) EXPAND_R(4, w, yb)

static void NAME(shrink_tiles)(int rows, int cols, const void *x, const int32_t *rowv, int64_t K, const void *a,
                               int64_t a0, int w_bf16, float *s, int64_t S, int64_t col)
{
    switch ((rows * 8 + cols) * 2 + w_bf16) {
        SHRINK_R(1, 0) SHRINK_R(2, 0) SHRINK_R(3, 0) SHRINK_R(4, 0)
        SHRINK_R(1, 1) SHRINK_R(2, 1) SHRINK_R(3, 1) SHRINK_R(4, 1)
    }
}

static void NAME(expand_tiles)(int rows, int vecs, const float *s, int64_t S, int64_t col, const int32_t *rowv,
                               int64_t rank, const void *b, int64_t b0, int64_t N, int64_t n0, void *y, int w_bf16,
                               int y_bf16)
{
    switch ((((rows * 8 + vecs) * 2 + w_bf16) * 2) + y_bf16) { EXPAND_W(0, 0) EXPAND_W(1, 1) } /* one dtype for both */
}

#undef SHRINK
#undef EXPAND
#undef SHRINK_R
#undef EXPAND_R
#undef EXPAND_W
