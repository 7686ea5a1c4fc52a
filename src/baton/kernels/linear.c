/* A matmul for a few rows -- decode, speculative verification, draft steps -- that reads
 * the weight once for all of them:
 *
 *   y[m, n] = epilogue(sum_k x[m, k] * w[n, k] + bias[n], other[m, n])
 *
 * epilogue: none, add (a residual), mul (the gated MLP's up times act(gate)), silu, gelu
 * (tanh approximation). Rows are processed in groups of up to GROUP: each weight row is
 * loaded once per group and multiplied into every row of the group, so a 4-row
 * verification step costs about what one row does (the BLAS sgemm it replaces takes 2-4x a
 * row's time for 2-8 rows here, and ~20-30 us per call of fixed cost for any). Output rows
 * are split in blocks of BLOCK over pool.c's threads (a small step's calls: see there why
 * not OpenMP's); a call below ~64 K multiply-adds runs on one thread.
 *
 * x (m rows, row stride x_stride, k contiguous), other (row stride other_stride) and y
 * (row stride y_stride) are bf16 (act_bf16) or fp32; w ([n, k] row-major, torch's Linear
 * layout) and bias are bf16 (w_bf16) or fp32. Arithmetic is fp32. Rounding follows the torch
 * path this replaces (baton/model/layers.py FrozenLinear, unpacked): the matmul's result is
 * rounded to the activation dtype, then each epilogue op rounds again. The sum over k runs
 * in another order than BLAS's, so fp32 results differ in the last bits (tests compare
 * within tolerance, and greedy tokens).
 * Built and loaded by baton/kernels/__init__.py; Python side: baton/kernels/linear.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fastmath.h"
#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif

enum { GROUP = 8, BLOCK = 16, MIN_PARALLEL_MACS = 65536 };

#ifdef HAVE_AVX2
static inline __m256 load8(const void *w, int64_t i, int w_bf16) {
    if (w_bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)w + i);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* out[i] = the sum of v[i]'s lanes for `count` vectors; four at a time share one tree of
 * horizontal adds (a fifth of the instructions of four hsum). */
static inline void hsums(const __m256 *v, int count, float *out) {
    int i = 0;
    for (; i + 4 <= count; i += 4) {
        const __m256 ab = _mm256_hadd_ps(v[i], v[i + 1]), cd = _mm256_hadd_ps(v[i + 2], v[i + 3]);
        const __m256 abcd = _mm256_hadd_ps(ab, cd); /* a0123 b0123 c0123 d0123 | a4567 ... */
        _mm_storeu_ps(out + i, _mm_add_ps(_mm256_castps256_ps128(abcd),
                                          _mm256_extractf128_ps(abcd, 1)));
    }
    for (; i < count; i++) out[i] = hsum(v[i]);
}

/* dots[j * R + r] = x[r] . w[row j] for NB consecutive weight rows (at: the first one's
 * offset) and the group's R rows of fp32 x, k apart. R and NB are constants in each
 * instance, so the R x NB accumulators stay in registers: independent chains, so that
 * the multiply-adds are not waiting on each other's latency (one row alone takes 8 weight
 * rows at a time). */
#define DEFINE_DOTS(R, NB)                                                                  \
    static void dots_##R##_##NB(const float *x, int k, const void *w, int64_t at,           \
                                int w_bf16, float *dots) {                                  \
        __m256 acc[NB][R];                                                                  \
        for (int j = 0; j < NB; j++)                                                        \
            for (int r = 0; r < R; r++) acc[j][r] = _mm256_setzero_ps();                    \
        int i = 0;                                                                          \
        for (; i + 8 <= k; i += 8) {                                                        \
            __m256 xv[R];                                                                   \
            for (int r = 0; r < R; r++) xv[r] = _mm256_loadu_ps(x + (int64_t)r * k + i);    \
            for (int j = 0; j < NB; j++) {                                                  \
                const __m256 wv = load8(w, at + (int64_t)j * k + i, w_bf16);                \
                for (int r = 0; r < R; r++) acc[j][r] = _mm256_fmadd_ps(wv, xv[r], acc[j][r]); \
            }                                                                               \
        }                                                                                   \
        hsums(&acc[0][0], NB * R, dots);                                                    \
        for (; i < k; i++)                                                                  \
            for (int j = 0; j < NB; j++) {                                                  \
                const float wf = to_f32(w, at + (int64_t)j * k + i, w_bf16);                \
                for (int r = 0; r < R; r++) dots[j * R + r] += wf * x[(int64_t)r * k + i];  \
            }                                                                               \
    }
#else
#define DEFINE_DOTS(R, NB)                                                                  \
    static void dots_##R##_##NB(const float *x, int k, const void *w, int64_t at,           \
                                int w_bf16, float *dots) {                                  \
        for (int j = 0; j < NB; j++)                                                        \
            for (int r = 0; r < R; r++) {                                                   \
                float acc = 0.0f;                                                           \
                const float *xr = x + (int64_t)r * k;                                       \
                const int64_t row = at + (int64_t)j * k;                                    \
                if (w_bf16) {                                                               \
                    _Pragma("omp simd reduction(+ : acc)") for (int i = 0; i < k; i++) acc += \
                        to_f32(w, row + i, 1) * xr[i];                                      \
                } else {                                                                    \
                    const float *wr = (const float *)w + row;                               \
                    _Pragma("omp simd reduction(+ : acc)") for (int i = 0; i < k; i++) acc += \
                        wr[i] * xr[i];                                                      \
                }                                                                           \
                dots[j * R + r] = acc;                                                      \
            }                                                                               \
    }
#endif

/* Weight rows per call for a group of R rows: R x NB accumulators within 8-12 registers. */
#define NB_OF(R) ((R) == 1 ? 8 : (R) <= 3 ? 3 : (R) <= 4 ? 2 : 1)
DEFINE_DOTS(1, 8)
DEFINE_DOTS(2, 3)
DEFINE_DOTS(3, 3)
DEFINE_DOTS(4, 2)
DEFINE_DOTS(5, 1)
DEFINE_DOTS(6, 1)
DEFINE_DOTS(7, 1)
DEFINE_DOTS(8, 1)
DEFINE_DOTS(1, 1) /* the leftover weight rows of a block */
DEFINE_DOTS(2, 1)
DEFINE_DOTS(3, 1)
DEFINE_DOTS(4, 1)

typedef void (*dots_fn)(const float *, int, const void *, int64_t, int, float *);
static const dots_fn DOTS[GROUP + 1] = {NULL,         dots_1_8,     dots_2_3,
                                        dots_3_3,     dots_4_2,     dots_5_1,
                                        dots_6_1,     dots_7_1,     dots_8_1};
static const dots_fn DOTS_ONE[GROUP + 1] = {NULL,     dots_1_1, dots_2_1, dots_3_1, dots_4_1,
                                            dots_5_1, dots_6_1, dots_7_1, dots_8_1};

/* y[row, j0 + i] = epilogue(round(d[i] + bias[j0 + i]), other[row, j0 + i]) for i < count:
 * one output row's stretch of a block, the epilogue chosen once for the stretch. */
static void finish(const float *d, int j0, int count, const void *bias, int w_bf16, int op,
                   const void *other, int64_t other_at, void *y, int64_t y_at, int bf) {
    float v[BLOCK];
    for (int i = 0; i < count; i++)
        v[i] = round_to(d[i] + (bias != NULL ? to_f32(bias, j0 + i, w_bf16) : 0.0f), bf);
    switch (op) {
    case EPI_ADD:
        for (int i = 0; i < count; i++) v[i] = round_to(v[i] + to_f32(other, other_at + i, bf), bf);
        break;
    case EPI_MUL:
        for (int i = 0; i < count; i++) v[i] = round_to(v[i] * to_f32(other, other_at + i, bf), bf);
        break;
    case EPI_SILU:
        for (int i = 0; i < count; i++) v[i] = round_to(v[i] / (1.0f + expf(-v[i])), bf);
        break;
    case EPI_GELU: {
        const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
        for (int i = 0; i < count; i++) {
            const float u = v[i];
            v[i] = round_to(0.5f * u * (1.0f + tanhf(c * (u + 0.044715f * u * u * u))), bf);
        }
        break;
    }
    default:
        break;
    }
    if (bf)
        for (int i = 0; i < count; i++) put(y, y_at + i, v[i], 1);
    else
        memcpy((float *)y + y_at, v, (size_t)count * sizeof(float));
}

typedef struct {
    const float *xf; /* the rows in fp32, contiguous */
    int32_t m, k, n, op, act_bf16, w_bf16;
    const void *w, *bias, *other;
    int64_t other_stride, y_stride;
    void *y;
} Job;

/* One task: output columns [blk * BLOCK, +BLOCK) of every row. */
static void one_block(void *ctx, int blk, int worker) {
    (void)worker;
    const Job *J = ctx;
    const int m = J->m, k = J->k, n = J->n;
    float dots[8 * GROUP], block[GROUP][BLOCK]; /* block: the group's rows' outputs */
    const int begin = blk * BLOCK, stop = begin + BLOCK < n ? begin + BLOCK : n;
    for (int g = 0; g < m; g += GROUP) {
        const int rows = m - g < GROUP ? m - g : GROUP;
        const float *xg = J->xf + (int64_t)g * k;
        const int nb = NB_OF(rows);
        for (int j0 = begin; j0 < stop;) {
            const int step = j0 + nb <= stop ? nb : 1;
            (step == nb ? DOTS : DOTS_ONE)[rows](xg, k, J->w, (int64_t)j0 * k, J->w_bf16, dots);
            for (int jj = 0; jj < step; jj++)
                for (int r = 0; r < rows; r++) block[r][j0 - begin + jj] = dots[jj * rows + r];
            j0 += step;
        }
        for (int r = 0; r < rows; r++) {
            const int64_t row = g + r;
            finish(block[r], begin, stop - begin, J->bias, J->w_bf16, J->op, J->other,
                   row * J->other_stride + begin, J->y, row * J->y_stride + begin, J->act_bf16);
        }
    }
}

/* Returns 0, or 1 when no scratch memory could be had. */
int baton_linear_rows(const void *x, int64_t x_stride, int32_t m, int32_t k, const void *w,
                      int32_t n, const void *bias, const void *other, int64_t other_stride,
                      int32_t op, void *y, int64_t y_stride, int32_t act_bf16, int32_t w_bf16,
                      int32_t num_threads) {
    /* The rows in fp32, contiguous: every weight row is multiplied into all of them. */
    float *xf = malloc((size_t)m * (size_t)k * sizeof(float));
    if (xf == NULL) return 1;
    for (int r = 0; r < m; r++)
        for (int i = 0; i < k; i++)
            xf[(int64_t)r * k + i] = to_f32(x, (int64_t)r * x_stride + i, act_bf16);
    const int64_t macs = (int64_t)m * n * k;
    const Job job = {xf, m, k, n, op, act_bf16, w_bf16, w, bias, other, other_stride, y_stride, y};
    baton_parallel(one_block, (void *)&job, (n + BLOCK - 1) / BLOCK,
                   macs < MIN_PARALLEL_MACS ? 1 : num_threads);
    free(xf);
    return 0;
}
