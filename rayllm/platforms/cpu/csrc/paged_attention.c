/* Paged KV-cache kernels for CPU: write new keys/values by slot, and every query row of a step
 * (decode rows and prefill chunks alike) attending over its sequence's blocks in place. The torch
 * version gathers each decode context into a fresh tensor per layer (index_select) and runs small
 * matmuls, a mask and a softmax, then one SDPA call per prefill chunk: ~10 ops per layer plus ~10
 * more per prefilling sequence. Here each (sequence, KV head) reads its blocks in place, for all the
 * query heads that share them (GQA), with fp32 accumulation, in one call per layer.
 *
 * Layouts: q [T, Hq, D] with rows q_stride elements apart (a view into the fused qkv output);
 * out [T, Hq, D] contiguous; caches [Hk, num_blocks, block_size, D]; per sequence (int32): block
 * tables [S, max_blocks], context lengths, first query row, query rows; new k/v [T, Hk, D] with
 * rows row_stride apart; slots [T] int64.
 * Built at first use by rayllm/platforms/cpu/kernels.py; ELEM is uint16_t (bf16) or float. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Return codes of the kernels that can fail (kernels.py raises on them; nothing is written then,
 * except that an allocation failure can leave `out` partly written). */
#define KERNEL_OK 0
#define KERNEL_ENOMEM 1     /* malloc / aligned_alloc returned NULL */
#define KERNEL_ESLOT 2      /* a cache slot >= num_blocks * block_size */
#define KERNEL_EBLOCK 3     /* a block-table entry in use outside [0, num_blocks) */
#define KERNEL_ESEQ 4       /* a sequence's lengths or query rows are inconsistent */
#define KERNEL_EHEAD_DIM 5  /* a head dim larger than the kernel's stack buffer */

static inline float bf16_load(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t bf16_store(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(u >> 16);
}

static inline float f32_load(float x) { return x; }
static inline float f32_store(float x) { return x; }

#define DEFINE_KERNELS(SUFFIX, ELEM, LOAD, STORE)                                                      \
    int write_kv_##SUFFIX(const ELEM *k, const ELEM *v, int64_t row_stride, ELEM *k_cache,             \
                          ELEM *v_cache, const int64_t *slots, int T, int Hk, int D, int num_blocks,   \
                          int block_size) {                                                            \
        size_t cache_head = (size_t)num_blocks * block_size * D;                                       \
        for (int t = 0; t < T; t++) /* negative slots are padding, skipped */                          \
            if (slots[t] >= (int64_t)num_blocks * block_size) return KERNEL_ESLOT;                     \
        for (int t = 0; t < T; t++) {                                                                  \
            if (slots[t] < 0) continue;                                                                \
            for (int h = 0; h < Hk; h++) {                                                             \
                size_t dst = h * cache_head + (size_t)slots[t] * D;                                    \
                memcpy(k_cache + dst, k + t * row_stride + (size_t)h * D, D * sizeof(ELEM));           \
                memcpy(v_cache + dst, v + t * row_stride + (size_t)h * D, D * sizeof(ELEM));           \
            }                                                                                          \
        }                                                                                              \
        return KERNEL_OK;                                                                              \
    }                                                                                                  \
                                                                                                       \
    /* One query row of G heads over its L context positions; scratch: G * L + 2 * G * D + D floats. */ \
    static void attend_row_##SUFFIX(const ELEM *qb, const ELEM *kh, const ELEM *vh, const int32_t *table,    \
                                    int L, int G, int D, int block_size, float scale, float *scratch,       \
                                    ELEM *ob) {                                                            \
        float *scores = scratch, *qf = scratch + (size_t)G * L, *acc = qf + (size_t)G * D;                 \
        float *row = acc + (size_t)G * D;                                                                  \
        for (int i = 0; i < G * D; i++) qf[i] = LOAD(qb[i]) * scale;                                       \
        for (int t = 0; t < L; t++) {                                                                      \
            const ELEM *kr = kh + ((size_t)table[t / block_size] * block_size + t % block_size) * D;       \
            for (int d = 0; d < D; d++) row[d] = LOAD(kr[d]);                                              \
            for (int g = 0; g < G; g++) {                                                                  \
                float s = 0.f;                                                                             \
                _Pragma("omp simd reduction(+ : s)")                                                       \
                for (int d = 0; d < D; d++) s += qf[g * D + d] * row[d];                                   \
                scores[(size_t)g * L + t] = s;                                                             \
            }                                                                                              \
        }                                                                                                  \
        for (int g = 0; g < G; g++) {                                                                      \
            float *sg = scores + (size_t)g * L, m = -INFINITY, sum = 0.f;                                  \
            for (int t = 0; t < L; t++) m = sg[t] > m ? sg[t] : m;                                         \
            for (int t = 0; t < L; t++) {                                                                  \
                sg[t] = expf(sg[t] - m);                                                                   \
                sum += sg[t];                                                                              \
            }                                                                                              \
            for (int t = 0; t < L; t++) sg[t] /= sum;                                                      \
        }                                                                                                  \
        memset(acc, 0, sizeof(float) * G * D);                                                             \
        for (int t = 0; t < L; t++) {                                                                      \
            const ELEM *vr = vh + ((size_t)table[t / block_size] * block_size + t % block_size) * D;       \
            for (int d = 0; d < D; d++) row[d] = LOAD(vr[d]);                                              \
            for (int g = 0; g < G; g++) {                                                                  \
                float p = scores[(size_t)g * L + t];                                                       \
                _Pragma("omp simd")                                                                        \
                for (int d = 0; d < D; d++) acc[g * D + d] += p * row[d];                                  \
            }                                                                                              \
        }                                                                                                  \
        for (int i = 0; i < G * D; i++) ob[i] = STORE(acc[i]);                                             \
    }                                                                                                      \
    DEFINE_PAGED_ATTENTION(SUFFIX, ELEM, attend_row_##SUFFIX)

/* Work is split across threads by tiles of up to ROW_TILE query rows of one (sequence, KV head):
 * decode has one row per sequence, a prefill chunk many. Row r of sequence s sits at position
 * ctx_len - q_len + r and attends to positions 0..that (causal within the chunk, the cached prefix
 * before it). */
#define ROW_TILE 16
typedef struct {
    int32_t seq, row0, row1;
} RowTile;

static RowTile *row_tiles(int S, const int32_t *q_lens, int *count) {
    int n = 0;
    for (int s = 0; s < S; s++) n += (q_lens[s] + ROW_TILE - 1) / ROW_TILE;
    RowTile *tiles = malloc(sizeof(RowTile) * (size_t)(n ? n : 1));
    if (tiles == NULL) return NULL;
    n = 0;
    for (int s = 0; s < S; s++)
        for (int r = 0; r < q_lens[s]; r += ROW_TILE)
            tiles[n++] = (RowTile){s, r, r + ROW_TILE < q_lens[s] ? r + ROW_TILE : q_lens[s]};
    *count = n;
    return tiles;
}

/* Every index the attention will follow, checked once per sequence and block (not per position):
 * query rows inside [0, T), 0 <= q_len <= ctx_len <= max_blocks * block_size, and the block-table
 * entries covering ctx_len inside [0, num_blocks). */
static int check_sequences(int T, int S, const int32_t *block_tables, const int32_t *ctx_lens, const int32_t *q_starts,
                           const int32_t *q_lens, int num_blocks, int block_size, int max_blocks) {
    for (int s = 0; s < S; s++) {
        int ctx = ctx_lens[s], q = q_lens[s];
        if (q < 0 || ctx < q || ctx > (int64_t)max_blocks * block_size || q_starts[s] < 0 ||
            (int64_t)q_starts[s] + q > T)
            return KERNEL_ESEQ;
        const int32_t *table = block_tables + (size_t)s * max_blocks;
        for (int b = 0; b < (ctx + block_size - 1) / block_size; b++)
            if (table[b] < 0 || table[b] >= num_blocks) return KERNEL_EBLOCK;
    }
    return KERNEL_OK;
}

/* q [T, Hq, D] rows q_stride apart; sequence s owns rows q_starts[s] .. + q_lens[s] and attends to
 * ctx_lens[s] positions through its block table; out [T, Hq, D] contiguous. ATTEND_ROW(q row, K head,
 * V head, table, L, G, D, block_size, scale, scratch, out row) does one row's G heads. */
#define DEFINE_PAGED_ATTENTION(SUFFIX, ELEM, ATTEND_ROW)                                                   \
    int paged_attention_##SUFFIX(const ELEM *q, int64_t q_stride, const ELEM *k_cache, const ELEM *v_cache,  \
                                 const int32_t *block_tables, const int32_t *ctx_lens,                     \
                                 const int32_t *q_starts, const int32_t *q_lens, ELEM *out, int T, int S,  \
                                 int Hq, int Hk, int D, int num_blocks, int block_size, int max_blocks,    \
                                 float scale, int num_threads) {                                           \
        int G = Hq / Hk, num_tiles, failed = 0;                                                            \
        int bad = check_sequences(T, S, block_tables, ctx_lens, q_starts, q_lens, num_blocks, block_size,  \
                                  max_blocks);                                                             \
        if (bad) return bad;                                                                               \
        RowTile *tiles = row_tiles(S, q_lens, &num_tiles);                                                 \
        if (tiles == NULL) return KERNEL_ENOMEM;                                                           \
        size_t cache_head = (size_t)num_blocks * block_size * D;                                           \
        size_t scratch_floats = 2 * (size_t)G * ((size_t)max_blocks * block_size + 16) + 2 * (size_t)G * D + D; \
        _Pragma("omp parallel num_threads(num_threads)") {                                                 \
            float *scratch = aligned_alloc(64, (sizeof(float) * scratch_floats + 63) & ~(size_t)63);       \
            _Pragma("omp for schedule(dynamic)")                                                           \
            for (int task = 0; task < num_tiles * Hk; task++) {                                            \
                if (scratch == NULL) { /* this thread's tasks cannot run: report, never write through NULL */ \
                    _Pragma("omp atomic write")                                                            \
                    failed = 1;                                                                            \
                    continue;                                                                              \
                }                                                                                          \
                RowTile tile = tiles[task / Hk];                                                           \
                int h = task % Hk, s = tile.seq;                                                           \
                const int32_t *table = block_tables + (size_t)s * max_blocks;                              \
                for (int r = tile.row0; r < tile.row1; r++) {                                              \
                    size_t row = (size_t)q_starts[s] + r;                                                  \
                    int L = ctx_lens[s] - q_lens[s] + r + 1;                                               \
                    ATTEND_ROW(q + row * q_stride + (size_t)h * G * D, k_cache + h * cache_head,           \
                               v_cache + h * cache_head, table, L, G, D, block_size, scale, scratch,       \
                               out + (row * Hq + (size_t)h * G) * D);                                      \
                }                                                                                          \
            }                                                                                              \
            free(scratch);                                                                                 \
        }                                                                                                  \
        free(tiles);                                                                                       \
        return failed ? KERNEL_ENOMEM : KERNEL_OK;                                                         \
    }

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_AVX512_BF16 1
DEFINE_KERNELS(bf16_generic, uint16_t, bf16_load, bf16_store)
#else
DEFINE_KERNELS(bf16, uint16_t, bf16_load, bf16_store)
#endif
DEFINE_KERNELS(f32, float, f32_load, f32_store)

#ifdef HAVE_AVX512_BF16
#include <immintrin.h>

/* e^x for x <= 88 (below -87 it is taken as e^-87): 2^(x log2 e) split into integer and fraction,
 * the fraction by its Taylor series to degree 6 (relative error < 2e-7), scaled by 2^integer. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5403530e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 bf16x16_to_f32(const uint16_t *src) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* Sixteen fp32 dot-product accumulators -> one vector of their sixteen sums (lane i = sum of a[i]).
 * A transpose-and-add tree: 15 adds and 30 shuffles for sixteen positions, where a horizontal add per
 * position costs a dependent chain of eight. */
static inline __m512 sum16(__m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++) /* pairs of lanes: lanes (0,1) of a[2i], a[2i+1] interleaved */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]))),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]))));
    /* each 128-bit lane of c[i] now holds partial sums of a[4i..4i+3]; combine 128-bit lanes */
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88), _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xdd));
}

/* One (sequence, KV head): its G query heads over the L cached positions, block by block (no
 * division per position). D and G are compile-time constants at each call site, so q, the scores'
 * accumulators and the p.v accumulators stay in registers.
 *   q.k: vdpbf16ps over bf16 pairs, sixteen positions reduced together (sum16).
 *   softmax: fp32; the probabilities are rounded to bf16, as the torch path rounds them before p.v.
 *   p.v: vdpbf16ps too, two positions per instruction: rows t and t+1 of V interleaved into bf16
 *   pairs (unpacklo/hi, which permutes the head dim within 128-bit lanes; undone once at the end)
 *   against the pair (p_t, p_t+1) broadcast: a third of the instructions of converting V to fp32
 *   for FMAs (the kernel at batch 64, contexts 40-105, 2 threads: 208 -> 195 us; it is bound by
 *   reading the cache from L3: ~3.6 MB per call).
 * scores: G * Lp floats; probs: G * Lp bf16 (Lp = L rounded up to 16). block_size must be even. */
static inline __attribute__((always_inline)) void attend_bf16(
    const int D, const int G, const uint16_t *qb, const uint16_t *kh, const uint16_t *vh, const int32_t *table,
    int L, int block_size, float scale, float *scores, uint16_t *probs, uint16_t *ob) {
    const int nc = D / 32;
    int Lp = (L + 15) & ~15;
    float inv_sum[G];
    for (int g = 0; g < G; g++) {
        __m512bh qv[4];
        for (int c = 0; c < nc; c++) qv[c] = (__m512bh)_mm512_loadu_si512(qb + g * D + 32 * c);
        float *sg = scores + (size_t)g * Lp;
        __m512 acc[16];
        int filled = 0;
        for (int t = 0; t < L;) {
            const uint16_t *kb = kh + (size_t)table[t / block_size] * block_size * D;
            int n = L - t < block_size ? L - t : block_size;
            for (int i = 0; i < n; i++, t++) {
                const uint16_t *kr = kb + (size_t)i * D;
                __m512 a = _mm512_setzero_ps();
                for (int c = 0; c < nc; c++) a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(kr + 32 * c));
                acc[filled++] = a;
                if (filled == 16) {
                    _mm512_store_ps(sg + t - 15, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
                    filled = 0;
                }
            }
        }
        if (filled) {
            for (int i = filled; i < 16; i++) acc[i] = _mm512_setzero_ps();
            _mm512_store_ps(sg + L - filled, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
        }
        for (int t = L; t < Lp; t++) sg[t] = -INFINITY;
        __m512 m = _mm512_set1_ps(-INFINITY);
        for (int t = 0; t < Lp; t += 16) m = _mm512_max_ps(m, _mm512_load_ps(sg + t));
        __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m)), sum = _mm512_setzero_ps();
        uint16_t *pg = probs + (size_t)g * Lp;
        for (int t = 0; t < Lp; t += 16) { /* padding lanes: e^-inf = 0 */
            __m256i e = (__m256i)_mm512_cvtneps_pbh(exp512(_mm512_sub_ps(_mm512_load_ps(sg + t), mx)));
            _mm256_storeu_si256((__m256i *)(pg + t), e);
            sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(e), 16)));
        }
        inv_sum[g] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    /* Output lanes back in head-dim order: lo/hi accumulators hold dims 8k+i / 8k+4+i in lane 4k+i. */
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int slab = 0; slab < D; slab += 64) { /* 4 accumulators per query head per 64 dims */
        __m512 o[G][4];
        for (int g = 0; g < G; g++)
            for (int j = 0; j < 4; j++) o[g][j] = _mm512_setzero_ps();
        for (int t = 0; t < L;) {
            const uint16_t *vb = vh + (size_t)table[t / block_size] * block_size * D + slab;
            int n = L - t < block_size ? L - t : block_size;
            for (int i = 0; i < n; i += 2) {
                const uint16_t *r0 = vb + (size_t)i * D, *r1 = i + 1 < n ? r0 + D : r0; /* odd tail: p = 0 */
                __m512i a0 = _mm512_loadu_si512(r0), a1 = _mm512_loadu_si512(r0 + 32);
                __m512i b0 = _mm512_loadu_si512(r1), b1 = _mm512_loadu_si512(r1 + 32);
                __m512bh vp[4] = {(__m512bh)_mm512_unpacklo_epi16(a0, b0), (__m512bh)_mm512_unpackhi_epi16(a0, b0),
                                  (__m512bh)_mm512_unpacklo_epi16(a1, b1), (__m512bh)_mm512_unpackhi_epi16(a1, b1)};
                for (int g = 0; g < G; g++) {
                    uint32_t pair;
                    memcpy(&pair, probs + (size_t)g * Lp + t + i, 4);
                    __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pair);
                    for (int j = 0; j < 4; j++) o[g][j] = _mm512_dpbf16_ps(o[g][j], pp, vp[j]);
                }
            }
            t += n;
        }
        for (int g = 0; g < G; g++) {
            __m512 inv = _mm512_set1_ps(inv_sum[g]);
            uint16_t *dst = ob + g * D + slab;
            for (int c = 0; c < 2; c++) {
                __m512 lo = _mm512_mul_ps(o[g][2 * c], inv), hi = _mm512_mul_ps(o[g][2 * c + 1], inv);
                _mm256_storeu_si256((__m256i *)(dst + 32 * c), (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(lo, first, hi)));
                _mm256_storeu_si256((__m256i *)(dst + 32 * c + 16),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(lo, second, hi)));
            }
        }
    }
}

#define ATTEND_CASE(DIM, GROUP)                                                                   \
    case GROUP:                                                                                   \
        attend_bf16(DIM, GROUP, qb, kh, vh, table, L, block_size, scale, scores, probs, ob);      \
        break;
#define ATTEND_GROUPS(DIM) \
    switch (G) { ATTEND_CASE(DIM, 1) ATTEND_CASE(DIM, 2) ATTEND_CASE(DIM, 3) ATTEND_CASE(DIM, 4) \
                 ATTEND_CASE(DIM, 5) ATTEND_CASE(DIM, 6) ATTEND_CASE(DIM, 7) ATTEND_CASE(DIM, 8) }

/* One query row through the specialised kernel; scratch holds G * Lp scores, then G * Lp probs. */
static void attend_row_bf16_avx512(const uint16_t *qb, const uint16_t *kh, const uint16_t *vh, const int32_t *table,
                                   int L, int G, int D, int block_size, float scale, float *scratch, uint16_t *ob) {
    float *scores = scratch;
    uint16_t *probs = (uint16_t *)(scratch + (size_t)G * ((L + 15) & ~15));
    if (D == 64) {
        ATTEND_GROUPS(64)
    } else {
        ATTEND_GROUPS(128)
    }
}

DEFINE_PAGED_ATTENTION(bf16_avx512, uint16_t, attend_row_bf16_avx512)

/* AVX-512 BF16, specialised for head dims 64 and 128 with 1-8 query heads per KV head (Llama,
 * SmolLM2, Mistral, Qwen2) and even block sizes; anything else takes the generic path. */
int paged_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                         const int32_t *block_tables, const int32_t *ctx_lens, const int32_t *q_starts,
                         const int32_t *q_lens, uint16_t *out, int T, int S, int Hq, int Hk, int D, int num_blocks,
                         int block_size, int max_blocks, float scale, int num_threads) {
    int G = Hq / Hk;
    int special = (D == 64 || D == 128) && G <= 8 && block_size % 2 == 0;
    return (special ? paged_attention_bf16_avx512 : paged_attention_bf16_generic)(
        q, q_stride, k_cache, v_cache, block_tables, ctx_lens, q_starts, q_lens, out, T, S, Hq, Hk, D, num_blocks,
        block_size, max_blocks, scale, num_threads);
}

int write_kv_bf16(const uint16_t *k, const uint16_t *v, int64_t row_stride, uint16_t *k_cache, uint16_t *v_cache,
                  const int64_t *slots, int T, int Hk, int D, int num_blocks, int block_size) {
    return write_kv_bf16_generic(k, v, row_stride, k_cache, v_cache, slots, T, Hk, D, num_blocks, block_size);
}
#endif

/* Row-wise kernels split rows across torch's threads (the OpenMP runtime is shared with torch, so
 * torch.set_num_threads applies) once there are enough rows to repay waking the other threads. */
#define PARALLEL_ROWS 8

/* ---- Fused per-layer element-wise steps (bf16). Each replaces 3-6 torch ops, whose dispatch
 * (~5 us each) is a large share of a small-batch decode step; the arithmetic follows the torch
 * code it replaces (fp32 inside, rounded to bf16 where torch rounds). */

/* residual = x + residual (bf16, in place); normed = weight * bf16(rms_norm(residual) in fp32). */
static void add_rms_norm_scalar(const uint16_t *x, uint16_t *residual, const uint16_t *weight, uint16_t *normed, int T, int H,
                       float eps, int has_residual) {
    for (int t = 0; t < T; t++) {
        const uint16_t *xr = x + (size_t)t * H;
        uint16_t *rr = residual + (size_t)t * H, *nr = normed + (size_t)t * H;
        float ss = 0.f;
        for (int i = 0; i < H; i++) {
            uint16_t sum = has_residual ? bf16_store(bf16_load(xr[i]) + bf16_load(rr[i])) : xr[i];
            rr[i] = sum;
            float f = bf16_load(sum);
            ss += f * f;
        }
        float inv = 1.0f / sqrtf(ss / H + eps);
        for (int i = 0; i < H; i++)
            nr[i] = bf16_store(bf16_load(weight[i]) * bf16_load(bf16_store(bf16_load(rr[i]) * inv)));
    }
}

/* out[t, i] = silu(gate[t, i]) * up[t, i], with x[t] = [gate | up] (each I wide). */
static void silu_and_mul_scalar(const uint16_t *x, uint16_t *out, int T, int I) {
    for (int t = 0; t < T; t++) {
        const uint16_t *gate = x + (size_t)t * 2 * I, *up = gate + I;
        uint16_t *o = out + (size_t)t * I;
        for (int i = 0; i < I; i++) {
            float g = bf16_load(gate[i]);
            o[i] = bf16_store(bf16_load(bf16_store(g / (1.0f + expf(-g)))) * bf16_load(up[i]));
        }
    }
}

/* Neox rotary in place on the first H heads of each row (q and k heads, side by side in the qkv
 * output; rows row_stride apart): x * cos + rotate_half(x) * sin, with cos [T, D] and sin [T, D]
 * already laid out over the whole head (sin negated on the first half), as RotaryEmbedding.tables. */
#define ROTARY_MAX_DIM 512

int rotary_bf16(uint16_t *x, int64_t row_stride, const float *cos, const float *sin, int T, int H, int D) {
    int half = D / 2;
    if (D > ROTARY_MAX_DIM || D % 2) return KERNEL_EHEAD_DIM; /* f[] below is a fixed stack buffer */
#pragma omp parallel for schedule(static) if (T >= PARALLEL_ROWS)
    for (int t = 0; t < T; t++) {
        const float *c = cos + (size_t)t * D, *s = sin + (size_t)t * D;
        for (int h = 0; h < H; h++) {
            uint16_t *xh = x + t * row_stride + (size_t)h * D;
#ifdef HAVE_AVX512_BF16
            if (half % 16 == 0) { /* both halves at once: lo' = lo*c - hi*s, hi' = hi*c + lo*s */
                for (int i = 0; i < half; i += 16) {
                    __m512 lo = bf16x16_to_f32(xh + i), hi = bf16x16_to_f32(xh + half + i);
                    __m512 nlo = _mm512_fmadd_ps(hi, _mm512_loadu_ps(s + i), _mm512_mul_ps(lo, _mm512_loadu_ps(c + i)));
                    __m512 nhi = _mm512_fmadd_ps(lo, _mm512_loadu_ps(s + half + i),
                                                 _mm512_mul_ps(hi, _mm512_loadu_ps(c + half + i)));
                    _mm256_storeu_si256((__m256i *)(xh + i), (__m256i)_mm512_cvtneps_pbh(nlo));
                    _mm256_storeu_si256((__m256i *)(xh + half + i), (__m256i)_mm512_cvtneps_pbh(nhi));
                }
                continue;
            }
#endif
            float f[ROTARY_MAX_DIM];
            for (int i = 0; i < D; i++) f[i] = bf16_load(xh[i]);
            for (int i = 0; i < D; i++) {
                float rot = i < half ? f[i + half] : f[i - half];
                xh[i] = bf16_store(f[i] * c[i] + rot * s[i]);
            }
        }
    }
    return KERNEL_OK;
}

#ifdef HAVE_AVX512_BF16
static inline __m512 round_bf16(__m512 x) { /* to bf16 (nearest even) and back, as torch rounds */
    __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline void store_bf16x16(uint16_t *dst, __m512 x) {
    _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh(x));
}
#endif

void add_rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *weight, uint16_t *normed, int T, int H,
                       float eps, int has_residual) {
#ifdef HAVE_AVX512_BF16
    if (H % 16 == 0) {
#pragma omp parallel for schedule(static) if (T >= PARALLEL_ROWS)
        for (int t = 0; t < T; t++) {
            const uint16_t *xr = x + (size_t)t * H;
            uint16_t *rr = residual + (size_t)t * H, *nr = normed + (size_t)t * H;
            __m512 ss = _mm512_setzero_ps();
            for (int i = 0; i < H; i += 16) {
                __m512 v = bf16x16_to_f32(xr + i);
                if (has_residual) v = round_bf16(_mm512_add_ps(v, bf16x16_to_f32(rr + i)));
                store_bf16x16(rr + i, v);
                ss = _mm512_fmadd_ps(v, v, ss);
            }
            __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / H + eps));
            for (int i = 0; i < H; i += 16) {
                __m512 n = round_bf16(_mm512_mul_ps(bf16x16_to_f32(rr + i), inv));
                store_bf16x16(nr + i, _mm512_mul_ps(bf16x16_to_f32(weight + i), n));
            }
        }
        return;
    }
#endif
    add_rms_norm_scalar(x, residual, weight, normed, T, H, eps, has_residual);
}

void silu_and_mul_bf16(const uint16_t *x, uint16_t *out, int T, int I) {
#ifdef HAVE_AVX512_BF16
    if (I % 16 == 0) {
        __m512 one = _mm512_set1_ps(1.0f);
#pragma omp parallel for schedule(static) if (T >= PARALLEL_ROWS)
        for (int t = 0; t < T; t++) {
            const uint16_t *gate = x + (size_t)t * 2 * I, *up = gate + I;
            uint16_t *o = out + (size_t)t * I;
            for (int i = 0; i < I; i += 16) {
                __m512 g = bf16x16_to_f32(gate + i);
                __m512 silu = round_bf16(_mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
                store_bf16x16(o + i, _mm512_mul_ps(silu, bf16x16_to_f32(up + i)));
            }
        }
        return;
    }
#endif
    silu_and_mul_scalar(x, out, T, I);
}

/* Greedy decoding's argmax straight from bf16 logits [R, V] (rows row_stride apart), rows split across
 * threads. torch needs an fp32 copy first (its bf16 argmax is scalar): 4.7 ms per step at 64 x 49,152
 * on 2 cores, against one read of the logits here. Ties keep the first index, as torch does; NaN
 * counts as the largest value, as in torch. */
void argmax_rows_bf16(const uint16_t *x, int64_t row_stride, int R, int V, int64_t *out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int r = 0; r < R; r++) {
        const uint16_t *row = x + (size_t)r * row_stride;
        int start = 0;
        float best = -INFINITY;
        int64_t best_i = 0;
#ifdef HAVE_AVX512_BF16
        if (V >= 16) {
            __m512 vmax = _mm512_set1_ps(-INFINITY);
            __m512i vidx = _mm512_setzero_si512(), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            __mmask16 nan = 0;
            __m512i step = _mm512_set1_epi32(16);
            for (; start + 16 <= V; start += 16) {
                __m512 v = bf16x16_to_f32(row + start);
                __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
                nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                vmax = _mm512_mask_mov_ps(vmax, gt, v);
                vidx = _mm512_mask_mov_epi32(vidx, gt, idx);
                idx = _mm512_add_epi32(idx, step);
            }
            if (nan) { /* rare: let the scalar loop below find the first NaN */
                start = 0;
            } else {
                float m[16];
                int32_t ix[16];
                _mm512_storeu_ps(m, vmax);
                _mm512_storeu_si512(ix, vidx);
                for (int i = 0; i < 16; i++)
                    if (m[i] > best || (m[i] == best && ix[i] < best_i)) best = m[i], best_i = ix[i];
            }
        }
#endif
        for (int i = start; i < V; i++) {
            float v = bf16_load(row[i]);
            if (v != v) { best_i = i; break; }
            if (v > best || (i == 0 && start == 0)) best = v, best_i = i;
        }
        out[r] = best_i;
    }
}

/* 1 when built with the AVX-512 BF16 paths: without them, norm and SiLU above are scalar loops that
 * lose to torch's vectorised ops beyond a few tokens, so the engine keeps torch's for those. */
int kernels_vectorized(void) {
#ifdef HAVE_AVX512_BF16
    return 1;
#else
    return 0;
#endif
}
