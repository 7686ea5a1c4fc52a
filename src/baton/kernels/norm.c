/* RMSNorm, and Qwen3's per-head q/k norm followed by rotary, each in one pass over memory.
 *
 * The torch path they replace (baton/model/layers.py, attention.py) runs five to nine
 * elementwise kernels, each a pass over the activations; these do the same arithmetic in
 * the same order, rounding to the activation dtype exactly where torch does:
 *
 *   h   = x * rsqrt(mean(x^2) + eps)            fp32 (x converted from bf16)
 *   out = round(w * round(h))                   Llama / Qwen weight, or
 *   out = round(h * (offset + w))               Gemma's (1 + w), all in fp32
 *   rot = round(round(n * cos) + round(rotate_half(n) * sin))     rotary of a normed head
 *
 * `round` is round-to-nearest-even to bf16 (identity for fp32). The one difference: the sum
 * of squares is added up in another order than torch's, so h may differ in its last bit.
 * Rows: `outer` groups of `inner` rows; row (o, i) starts at x + o * outer_stride +
 * i * inner_stride (elements), `dim` contiguous elements. Output rows are contiguous.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fastmath.h"
#include "kernels.h"

/* Every product rounded before it is added, as torch does: no fused multiply-adds. */
#pragma GCC optimize("fp-contract=off")

/* The sum of a row's squares, added in the order of torch's CPU sum kernel (ATen's
 * SumKernel.cpp: vectors of `lanes` floats -- its Vectorized<float>, 16 with AVX-512, else 8
 * -- into 4 accumulators, cascaded in levels of 16 steps; then the leftover vectors, the
 * accumulators in turn, the leftover elements and the lanes one by one). transformers'
 * RMSNorm is `x.pow(2).mean(-1)`, a sum divided by dim: adding in its order makes the normed
 * rows bitwise equal to its, so greedy tokens part from transformers' only where other
 * kernels round differently. NOTE: the sequential additions make this ~a third of a row. */
static inline __attribute__((always_inline)) float sum_of_squares(const void *x, int64_t at,
                                                                  int dim, int is_bf16,
                                                                  const int lanes) {
    enum { LEVELS = 4, ILP = 4, STEP_POWER = 4 }; /* level_power = max(4, ceil_log2(n) / 4) */
    const int num_vectors = dim / lanes, n = num_vectors / ILP;
    int power = 1;
    while ((1 << power) < n) power++; /* ceil_log2, 1 for n <= 2 */
    const int level_power = power / LEVELS > STEP_POWER ? power / LEVELS : STEP_POWER;
    const int step = 1 << level_power, mask = step - 1;
    float acc[LEVELS][ILP][16];
    for (int k = 0; k < ILP; k++)
        for (int l = 0; l < lanes; l++) acc[0][k][l] = 0.0f;
    int i = 0;
    if (n >= step) { /* rows of 64+ vectors: the cascade's upper levels */
        for (int level = 1; level < LEVELS; level++)
            for (int k = 0; k < ILP; k++)
                for (int l = 0; l < lanes; l++) acc[level][k][l] = 0.0f;
        while (i + step <= n) {
            for (int j = 0; j < step; j++, i++)
                for (int k = 0; k < ILP; k++) {
#pragma omp simd
                    for (int l = 0; l < lanes; l++) {
                        const float v =
                            to_f32(x, at + (int64_t)(i * ILP + k) * lanes + l, is_bf16);
                        acc[0][k][l] += v * v;
                    }
                }
            for (int level = 1; level < LEVELS; level++) {
                for (int k = 0; k < ILP; k++)
                    for (int l = 0; l < lanes; l++) {
                        acc[level][k][l] += acc[level - 1][k][l];
                        acc[level - 1][k][l] = 0.0f;
                    }
                if ((i & (mask << (level * level_power))) != 0) break;
            }
        }
    }
    for (; i < n; i++)
        for (int k = 0; k < ILP; k++) {
#pragma omp simd
            for (int l = 0; l < lanes; l++) {
                const float v = to_f32(x, at + (int64_t)(i * ILP + k) * lanes + l, is_bf16);
                acc[0][k][l] += v * v;
            }
        }
    if (n >= step)
        for (int level = 1; level < LEVELS; level++)
            for (int k = 0; k < ILP; k++)
                for (int l = 0; l < lanes; l++) acc[0][k][l] += acc[level][k][l];
    for (int vec = n * ILP; vec < num_vectors; vec++)
        for (int l = 0; l < lanes; l++) {
            const float v = to_f32(x, at + (int64_t)vec * lanes + l, is_bf16);
            acc[0][0][l] += v * v;
        }
    for (int k = 1; k < ILP; k++)
        for (int l = 0; l < lanes; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (int e = num_vectors * lanes; e < dim; e++) {
        const float v = to_f32(x, at + e, is_bf16);
        total += v * v;
    }
    for (int l = 0; l < lanes; l++) total += acc[0][0][l];
    return total;
}

/* The normed row (weight applied, rounded): into `out` at out_at in the dtype when `out` is
 * given, else into `row` (fp32 values of the dtype). */
static inline __attribute__((always_inline)) void norm_row(
    const void *x, int64_t at, const void *weight, int64_t w_at, int dim, float eps,
    float offset, int is_bf16, int lanes, float *row, void *out, int64_t out_at) {
    const float squares = lanes == 16 ? sum_of_squares(x, at, dim, is_bf16, 16)
                                      : sum_of_squares(x, at, dim, is_bf16, 8);
    const float rstd = 1.0f / sqrtf(squares / (float)dim + eps);
#pragma omp simd
    for (int e = 0; e < dim; e++) {
        const float v = to_f32(x, at + e, is_bf16), w = to_f32(weight, w_at + e, is_bf16);
        const float r = offset != 0.0f ? round_to(v * rstd * (offset + w), is_bf16)
                                       : round_to(w * round_to(v * rstd, is_bf16), is_bf16);
        if (out)
            put(out, out_at + e, r, is_bf16);
        else
            row[e] = r;
    }
}

/* One head: normed, times its weight row, rotated (constant sizes unroll at the call). */
static inline __attribute__((always_inline)) void norm_rotary_row(
    const void *x, int64_t at, const void *weight, int64_t w_at, const void *cos,
    const void *sin, int64_t t, void *out, int64_t out_at, const int dim, float eps,
    const int is_bf16, int lanes) {
    float row[dim], rotated[dim];
    const int half = dim / 2;
    if (weight == NULL) /* no q/k norm (Llama, Qwen2, Mistral): the rotary alone */
        for (int e = 0; e < dim; e++) row[e] = to_f32(x, at + e, is_bf16);
    else
        norm_row(x, at, weight, w_at, dim, eps, 0.0f, is_bf16, lanes, row, NULL, 0);
#pragma omp simd
    for (int e = 0; e < half; e++) { /* rotate_half: (-x2, x1) */
        rotated[e] = -row[e + half];
        rotated[e + half] = row[e];
    }
#pragma omp simd
    for (int e = 0; e < dim; e++) {
        const float a = round_to(row[e] * to_f32(cos, t + e, is_bf16), is_bf16);
        const float b = round_to(rotated[e] * to_f32(sin, t + e, is_bf16), is_bf16);
        put(out, out_at + e, round_to(a + b, is_bf16), is_bf16);
    }
}

/* A norm call's arguments, for its rows' tasks (cos / sin: the rotary's, else unused). */
typedef struct {
    const void *x, *weight, *cos, *sin;
    void *out;
    int64_t outer_stride, inner, inner_stride, weight_inner_stride, table_stride;
    int dim, is_bf16, lanes;
    float eps, offset;
} Norm;

/* Rows [first, stop) of baton_rms_norm. */
static void norm_rows(const Norm *N, int64_t first, int64_t stop) {
    const void *x = N->x, *weight = N->weight;
    const int dim = N->dim, lanes = N->lanes;
    const float eps = N->eps, offset = N->offset;
    for (int64_t r = first; r < stop; r++) {
        const int64_t at = (r / N->inner) * N->outer_stride + (r % N->inner) * N->inner_stride;
        const int64_t w_at = (r % N->inner) * N->weight_inner_stride;
        /* constant dtypes and offsets: branch-free loops */
        if (N->is_bf16 && offset == 0.0f)
            norm_row(x, at, weight, w_at, dim, eps, 0.0f, 1, lanes, NULL, N->out, r * dim);
        else if (N->is_bf16)
            norm_row(x, at, weight, w_at, dim, eps, offset, 1, lanes, NULL, N->out, r * dim);
        else
            norm_row(x, at, weight, w_at, dim, eps, offset, 0, lanes, NULL, N->out, r * dim);
    }
}

/* Outer rows [first, stop) of baton_rms_norm_rotary: each its `inner` heads. */
static void norm_rotary_rows(const Norm *N, int64_t first, int64_t stop) {
    const void *x = N->x, *weight = N->weight, *cos = N->cos, *sin = N->sin;
    const int dim = N->dim, lanes = N->lanes, bf = N->is_bf16;
    const float eps = N->eps;
    for (int64_t o = first; o < stop; o++)
        for (int64_t i = 0; i < N->inner; i++) {
            const int64_t at = o * N->outer_stride + i * N->inner_stride;
            const int64_t w_at = i * N->weight_inner_stride, t = o * N->table_stride;
            const int64_t out_at = (o * N->inner + i) * dim;
            if (bf && dim == 64)
                norm_rotary_row(x, at, weight, w_at, cos, sin, t, N->out, out_at, 64, eps, 1,
                                lanes);
            else if (bf && dim == 128)
                norm_rotary_row(x, at, weight, w_at, cos, sin, t, N->out, out_at, 128, eps, 1,
                                lanes);
            else
                norm_rotary_row(x, at, weight, w_at, cos, sin, t, N->out, out_at, dim, eps, bf,
                                lanes);
        }
}

typedef struct {
    const Norm *N;
    int64_t rows, rows_per_task;
    void (*rows_fn)(const Norm *, int64_t, int64_t);
} NormJob;

static void norm_task(void *ctx, int task, int worker) {
    (void)worker;
    const NormJob *J = ctx;
    const int64_t first = task * J->rows_per_task, stop = first + J->rows_per_task;
    J->rows_fn(J->N, first, stop < J->rows ? stop : J->rows);
}

/* `rows` rows by rows_fn: here where the call is narrow (32 K elements or fewer); else a
 * few tasks per thread on pool.c's threads (pooled: a small step's call, from layer.c or
 * chain.c) or on OpenMP's (a call among torch's ops, from Python). NOTE: an OpenMP region
 * inside a small step woke torch's worker, which then spun on the core pool.c's helper
 * needed: on a 2-core Zen 4 with AVX2 kernels, Qwen3-0.6B's 32-row decode step (q/k norm:
 * 32 x 24 heads x 128 > 32 K) took 471 ms, and 354 ms with that worker passive. */
static void run_norm(const Norm *N, int64_t rows,
                     void (*rows_fn)(const Norm *, int64_t, int64_t), int64_t elements,
                     int num_threads, int pooled) {
    if (num_threads <= 1 || elements <= 32768 || rows <= 1) {
        rows_fn(N, 0, rows);
        return;
    }
    const int64_t wanted = 4 * (int64_t)num_threads < rows ? 4 * (int64_t)num_threads : rows;
    const NormJob job = {N, rows, (rows + wanted - 1) / wanted, rows_fn};
    const int tasks = (int)((rows + job.rows_per_task - 1) / job.rows_per_task);
    (pooled ? baton_parallel : baton_parallel_openmp)(norm_task, (void *)&job, tasks, num_threads);
}

/* out[o, i, :] = norm(x[o, i, :]) * weight[i or 0, :]; weight_inner_stride 0 shares one row. */
void baton_rms_norm_on(const void *x, int64_t outer, int64_t outer_stride, int64_t inner,
                       int64_t inner_stride, const void *weight, int64_t weight_inner_stride,
                       void *out, int dim, float eps, float offset, int is_bf16, int lanes,
                       int num_threads, int pooled) {
    if (dim > 4096) return; /* the caller checks; never here */
    Norm N = {.x = x, .weight = weight, .out = out, .outer_stride = outer_stride,
              .inner = inner, .inner_stride = inner_stride,
              .weight_inner_stride = weight_inner_stride, .dim = dim, .is_bf16 = is_bf16,
              .lanes = lanes, .eps = eps, .offset = offset};
    run_norm(&N, outer * inner, norm_rows, outer * inner * dim, num_threads, pooled);
}

void baton_rms_norm(const void *x, int64_t outer, int64_t outer_stride, int64_t inner,
                    int64_t inner_stride, const void *weight, int64_t weight_inner_stride,
                    void *out, int dim, float eps, float offset, int is_bf16, int lanes,
                    int num_threads) {
    baton_rms_norm_on(x, outer, outer_stride, inner, inner_stride, weight, weight_inner_stride,
                      out, dim, eps, offset, is_bf16, lanes, num_threads, 0);
}

/* The q/k heads of x (as baton_rms_norm, per-head weight rows) normed, then rotated:
 * cos/sin are [outer, dim] rows of the token's table (rotate_half layout). weight NULL: no
 * norm, the heads rotated as they are. */
void baton_rms_norm_rotary_on(const void *x, int64_t outer, int64_t outer_stride, int64_t inner,
                              int64_t inner_stride, const void *weight,
                              int64_t weight_inner_stride, const void *cos, const void *sin,
                              int64_t table_stride, void *out, int dim, float eps, int is_bf16,
                              int lanes, int num_threads, int pooled) {
    if (dim > 4096 || dim % 2) return; /* the caller checks; never here */
    Norm N = {.x = x, .weight = weight, .cos = cos, .sin = sin, .out = out,
              .outer_stride = outer_stride, .inner = inner, .inner_stride = inner_stride,
              .weight_inner_stride = weight_inner_stride, .table_stride = table_stride,
              .dim = dim, .is_bf16 = is_bf16, .lanes = lanes, .eps = eps};
    run_norm(&N, outer, norm_rotary_rows, outer * inner * dim, num_threads, pooled);
}

void baton_rms_norm_rotary(const void *x, int64_t outer, int64_t outer_stride, int64_t inner,
                           int64_t inner_stride, const void *weight, int64_t weight_inner_stride,
                           const void *cos, const void *sin, int64_t table_stride, void *out,
                           int dim, float eps, int is_bf16, int lanes, int num_threads) {
    baton_rms_norm_rotary_on(x, outer, outer_stride, inner, inner_stride, weight,
                             weight_inner_stride, cos, sin, table_stride, out, dim, eps,
                             is_bf16, lanes, num_threads, 0);
}
