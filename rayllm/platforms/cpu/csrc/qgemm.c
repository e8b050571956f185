/* A 4-bit weight x 8-bit activation GEMM for steps of few rows on CPUs with AVX-512 VNNI.
 *
 * Weights: 4-bit values q in groups of 32 inputs, w = d * (q - o) + z (o = 0: GGUF's Q4_1 form, z its m;
 * o = 8: torch's int4 kernel's form, whose bf16 d and z fp16 holds exactly while its m = z - 8d would be
 * rounded), laid out in tiles of 16 output columns: per tile and group, 256 bytes of nibbles, then d and
 * z as 16 fp16 each; m = z - o * d is formed in fp32.
 * Byte c*4 + j of the tile's 64-byte word i holds column c's inputs 4i + j (low nibble, i < 4) and
 * 4(i + 4) + j (high nibble), so one load and two masks give two VNNI operands of 16 columns x 4 inputs.
 * Activations: each row quantized to int8 in groups of 32 (scale = max |x| / 127), as llama.cpp's Q8_1,
 * then per group: d * dx * sum(q * qx) + m * dx * sum(qx).
 *
 * The int8 products cost one instruction per 64 multiply-adds, twice the rate of bf16's, and the
 * weights are a quarter of bf16's bytes. Each row's result does not depend on the other rows or on
 * the thread count (tiles split by columns; each row's sums run in one fixed order).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAVE_QGEMM 1
#include <immintrin.h>
#endif

#define QGEMM_GROUP 32
#define QGEMM_TILE 16
#define QGEMM_ROWS 16 /* rows per pass over a tile: 16 fp32 accumulators, 8 weight registers */

int qgemm_available(void) {
#ifdef HAVE_QGEMM
    return 1;
#else
    return 0;
#endif
}

#ifdef HAVE_QGEMM
/* One group of 32 fp32 values into int8 xq [32] with scale dx = max |x| / 127 (returned); with `res`, what
 * the int8 values miss (x - dx * q, in [-dx / 2, dx / 2)) is written there, and dx is the power of two at
 * or above max |x| / 127 with ties rounded up: every value of the bf16 row within 2^8 of the group's
 * largest then lies on the two passes' grid (dx / 256), so the two passes hold it exactly. *qsum: the
 * sum of the int8 values. */
static inline float quant_group(__m512 a, __m512 b, int8_t *xq, int *qsum, float *res) {
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    __m512i qa, qb;
    float dx = amax / 127.f;
    if (res && amax > 0.f) {
        int e;
        frexpf(dx, &e); /* dx < 2^e, so |x| / 2^e < 127 */
        dx = ldexpf(1.f, e);
        __m512 inv = _mm512_set1_ps(ldexpf(1.f, -e)), half = _mm512_set1_ps(0.5f);
        /* floor(x / dx + 0.5): exact in fp32, ties up, so the residual never reaches +dx / 2 */
        qa = _mm512_cvt_roundps_epi32(_mm512_fmadd_ps(a, inv, half), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        qb = _mm512_cvt_roundps_epi32(_mm512_fmadd_ps(b, inv, half), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    } else {
        __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)); /* round to nearest even */
        qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
    }
    _mm_storeu_si128((__m128i *)xq, _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(xq + 16), _mm512_cvtepi32_epi8(qb));
    *qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    if (res) {
        __m512 d = _mm512_set1_ps(dx);
        _mm512_storeu_ps(res, _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qa), d, a));
        _mm512_storeu_ps(res + 16, _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qb), d, b));
    }
    return dx;
}

/* The residual (-dx / 2 <= r < dx / 2) in int8 at the fixed scale dx / 256, saturating at -128 / 127, so that
 * 256 * q + q2 is the group in 16-bit steps of dx / 256 and both passes sum into one int32. */
static inline int quant_residual(const float *res, float dx, int8_t *xq) {
    __m512 inv = _mm512_set1_ps(dx > 0.f ? 256.f / dx : 0.f);
    __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(res), inv));
    __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(res + 16), inv));
    qa = _mm512_max_epi32(_mm512_min_epi32(qa, _mm512_set1_epi32(127)), _mm512_set1_epi32(-128));
    qb = _mm512_max_epi32(_mm512_min_epi32(qb, _mm512_set1_epi32(127)), _mm512_set1_epi32(-128));
    _mm_storeu_si128((__m128i *)xq, _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(xq + 16), _mm512_cvtepi32_epi8(qb));
    return _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
}

/* One row of bf16 into `passes` int8 rows of K: the row, then (passes 2) its quantization residual at
 * 1/256 of the row's scale. Outlier channels (the residual stream's, up to ~60x the median at gate/up's
 * input) set a group's scale; the second pass recovers the small values that the first rounds away.
 * xs [K/32][2]: the scale of one unit of the summed int32 dot product (dx, or dx / 256 with two passes),
 * and the sum of the group's quantized values (for the weights' zero point m). */
static void quant_row(const uint16_t *x, int K, int passes, int8_t *xq, float *xs) {
    const int G = K / QGEMM_GROUP;
    for (int g = 0; g < G; g++) {
        const __m256i *src = (const __m256i *)(x + g * QGEMM_GROUP);
        __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(src)), 16));
        __m512 b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(src + 1)), 16));
        float res[QGEMM_GROUP];
        int qsum;
        float dx = quant_group(a, b, xq + g * QGEMM_GROUP, &qsum, passes > 1 ? res : NULL);
        if (passes > 1) {
            int rsum = quant_residual(res, dx, xq + K + g * QGEMM_GROUP);
            xs[2 * g] = dx / 256.f;
            xs[2 * g + 1] = dx * (float)qsum + dx / 256.f * (float)rsum;
        } else {
            xs[2 * g] = dx;
            xs[2 * g + 1] = dx * (float)qsum;
        }
    }
}

/* fp32 -> bf16, rounding to nearest even (finite inputs): AVX-512 BF16's instruction where the CPU has
 * it, else the same rounding in integers (VNNI without BF16: Cascade Lake, Ice Lake). */
static inline __m256i to_bf16(__m512 v) {
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
#endif
}

/* R rows (a compile-time constant at each instantiation) against one tile: out [R][16] in bf16. */
static inline __attribute__((always_inline)) void tile_rows(const int R, const int P, int G, const uint8_t *tile,
                                                             const int8_t *xq, const float *xs, int K,
                                                             uint16_t *out, int64_t out_stride, float o) {
    __m512 acc[QGEMM_ROWS];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int g = 0; g < G; g++) {
        const uint8_t *blk = tile + (size_t)g * (256 + 64);
        __m512i w[8];
        for (int i = 0; i < 4; i++) {
            __m512i p = _mm512_loadu_si512(blk + 64 * i);
            w[i] = _mm512_and_si512(p, low);
            w[i + 4] = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 256)));
        const __m512 m = _mm512_fnmadd_ps(_mm512_set1_ps(o), d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 288))));
#pragma GCC unroll 16 /* keeps acc[] in registers */
        for (int r = 0; r < R; r++) {
            const int32_t *x4 = (const int32_t *)(xq + (size_t)r * P * K + g * QGEMM_GROUP);
            const float *s = xs + ((size_t)r * G + g) * 2;
            __m512i dot = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) dot = _mm512_dpbusd_epi32(dot, w[i], _mm512_set1_epi32(x4[i]));
            if (P == 2) { /* the residual pass: its own chain, then 256 * first + second (< 2^24: exact in fp32) */
                const int32_t *y4 = (const int32_t *)((const int8_t *)x4 + K);
                __m512i dot2 = _mm512_setzero_si512();
#pragma GCC unroll 8
                for (int i = 0; i < 8; i++) dot2 = _mm512_dpbusd_epi32(dot2, w[i], _mm512_set1_epi32(y4[i]));
                dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 8), dot2);
            }
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(s[0])), acc[r]);
            acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(s[1]), acc[r]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
        _mm256_storeu_si256((__m256i *)(out + (size_t)r * out_stride), to_bf16(acc[r]));
}

#define TILE_FN(R)                                                                                          \
    static void tile_##R(int G, const uint8_t *t, const int8_t *xq, const float *xs, int K, uint16_t *o,   \
                         int64_t os, float zo) {                                                            \
        tile_rows(R, 1, G, t, xq, xs, K, o, os, zo);                                                        \
    }                                                                                                       \
    static void tile2_##R(int G, const uint8_t *t, const int8_t *xq, const float *xs, int K, uint16_t *o,  \
                          int64_t os, float zo) {                                                           \
        tile_rows(R, 2, G, t, xq, xs, K, o, os, zo);                                                        \
    }
TILE_FN(1) TILE_FN(2) TILE_FN(3) TILE_FN(4) TILE_FN(5) TILE_FN(6) TILE_FN(7) TILE_FN(8)
TILE_FN(9) TILE_FN(10) TILE_FN(11) TILE_FN(12) TILE_FN(13) TILE_FN(14) TILE_FN(15) TILE_FN(16)
typedef void (*tile_fn)(int, const uint8_t *, const int8_t *, const float *, int, uint16_t *, int64_t, float);
static const tile_fn TILES[QGEMM_ROWS + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6, tile_7,
                                              tile_8, tile_9, tile_10, tile_11, tile_12, tile_13, tile_14,
                                              tile_15, tile_16};
static const tile_fn TILES2[QGEMM_ROWS + 1] = {0, tile2_1, tile2_2, tile2_3, tile2_4, tile2_5, tile2_6, tile2_7,
                                               tile2_8, tile2_9, tile2_10, tile2_11, tile2_12, tile2_13, tile2_14,
                                               tile2_15, tile2_16};
#endif

typedef void (*pool_fn)(void *ctx, int chunk);
void pool_run(int threads, int chunks, pool_fn fn, void *ctx); /* pool.c */

#ifdef HAVE_QGEMM
typedef struct {
    const tile_fn *fns;
    const uint8_t *packed;
    const int8_t *xq;
    const float *xs;
    uint16_t *out;
    size_t tile_bytes;
    int M, N, K, G, passes, tiles, per_chunk;
    float zero_offset;
} qgemm_job;

/* Tiles [t0, t1) for every row: the unit of work that threads split (by output columns, so each thread
 * reads only its tiles' weights, and each row's result is the same whichever thread computes it). */
static void qgemm_tiles(const qgemm_job *j, int t0, int t1) {
    for (int t = t0; t < t1; t++)
        for (int r0 = 0; r0 < j->M; r0 += QGEMM_ROWS) {
            int R = j->M - r0 < QGEMM_ROWS ? j->M - r0 : QGEMM_ROWS;
            j->fns[R](j->G, j->packed + t * j->tile_bytes, j->xq + (size_t)r0 * j->passes * j->K,
                      j->xs + (size_t)r0 * j->G * 2, j->K, j->out + (size_t)r0 * j->N + (size_t)t * QGEMM_TILE, j->N,
                      j->zero_offset);
        }
}

static void qgemm_chunk(void *ctx, int chunk) {
    const qgemm_job *j = ctx;
    int t0 = chunk * j->per_chunk, t1 = t0 + j->per_chunk;
    qgemm_tiles(j, t0, t1 < j->tiles ? t1 : j->tiles);
}
#endif

/* x: bf16 [M][K], rows x_stride apart; packed: [N/16][K/32][320 bytes]; out: bf16 [M][N], contiguous.
 * passes: 1 (each row in int8) or 2 (and its quantization residual in int8: near bf16's precision).
 * zero_offset: o in w = d * (q - o) + z (0 or 8).
 * num_threads: OpenMP threads (the caller's torch thread count); pool_threads > 1 instead splits the tiles
 * in chunks over the caller and pool.c's helpers (a step that runs on one torch thread).
 * Returns 0, 1 when out of memory, 5 when the shape is unsupported or the build has no VNNI. */
int qgemm_int4_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *packed, uint16_t *out, int M, int N,
                    int K, int passes, int zero_offset, int num_threads, int pool_threads) {
#ifdef HAVE_QGEMM
    if (M <= 0 || N % QGEMM_TILE || K % QGEMM_GROUP || K <= 0 || passes < 1 || passes > 2) return 5;
    const int G = K / QGEMM_GROUP, tiles = N / QGEMM_TILE;
    int8_t *xq = malloc((size_t)M * passes * K + 64);
    float *xs = malloc((size_t)M * G * 2 * sizeof(float));
    if (!xq || !xs) {
        free(xq);
        free(xs);
        return 1;
    }
    for (int r = 0; r < M; r++)
        quant_row(x + (size_t)r * x_stride, K, passes, xq + (size_t)r * passes * K, xs + (size_t)r * G * 2);
    qgemm_job j = {passes == 2 ? TILES2 : TILES, packed, xq, xs, out, (size_t)G * (256 + 64), M, N, K, G, passes,
                   tiles, 1, (float)zero_offset};
    if (pool_threads > 1 && tiles >= 8) {
        /* ~8 chunks a thread: a helper that starts late still finds work, and the caller's wait for a
         * helper's last chunk stays short */
        int chunks = pool_threads * 8 < tiles ? pool_threads * 8 : tiles;
        j.per_chunk = (tiles + chunks - 1) / chunks;
        pool_run(pool_threads, (tiles + j.per_chunk - 1) / j.per_chunk, qgemm_chunk, &j);
    } else if (num_threads > 1 && tiles >= 8) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int t = 0; t < tiles; t++) qgemm_tiles(&j, t, t + 1);
    } else {
        qgemm_tiles(&j, 0, tiles);
    }
    free(xq);
    free(xs);
    return 0;
#else
    (void)x, (void)x_stride, (void)packed, (void)out, (void)M, (void)N, (void)K, (void)passes, (void)zero_offset;
    (void)num_threads, (void)pool_threads;
    return 5;
#endif
}
