/* Greedy decoding's epilogue, straight from the head's scores: per row of a [rows, vocab]
 * matrix (bf16 or fp32), the first index of its maximum, and the row's log-sum-exp -- so
 * the log-probability of the argmax is max - lse. Torch's path (baton/engine/runner.py)
 * first copies the whole matrix to fp32, then runs argmax and log_softmax over it: three
 * passes and a write of rows x vocab floats, for one index and one float per row.
 *
 * Ties go to the lowest index, as torch.argmax. NaN scores are not looked for (the model
 * produces none); a row of -inf has lse -inf.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "fastmath.h"
#include "kernels.h"

enum { BLOCK = 64 };

static inline __attribute__((always_inline)) void argmax_row(const void *x, int64_t at,
                                                              int64_t vocab, const int is_bf16,
                                                              int64_t *best, float *best_value) {
    float m = -INFINITY;
    int64_t block = 0;
    for (int64_t b0 = 0; b0 < vocab; b0 += BLOCK) {
        const int n = vocab - b0 < BLOCK ? (int)(vocab - b0) : BLOCK;
        float bm = -INFINITY;
#pragma omp simd reduction(max : bm)
        for (int e = 0; e < n; e++) {
            const float v = to_f32(x, at + b0 + e, is_bf16);
            bm = v > bm ? v : bm; /* NOTE: fmaxf would not vectorise (NaN rules): 40x slower */
        }
        if (bm > m) { /* strictly: the first block holding the maximum */
            m = bm;
            block = b0;
        }
    }
    int64_t i = block;
    const int64_t end = block + BLOCK < vocab ? block + BLOCK : vocab;
    while (i < end - 1 && to_f32(x, at + i, is_bf16) != m) i++;
    *best = i;
    *best_value = m;
}

/* The row's log-sum-exp given its maximum m. */
static inline __attribute__((always_inline)) float logsumexp_given(const void *x, int64_t at,
                                                                    int64_t vocab,
                                                                    const int is_bf16, float m) {
    if (m == -INFINITY) return -INFINITY;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t e = 0; e < vocab; e++) sum += exp_nonpositive(to_f32(x, at + e, is_bf16) - m);
    return m + logf(sum);
}

static inline __attribute__((always_inline)) float logsumexp_row(const void *x, int64_t at,
                                                                  int64_t vocab,
                                                                  const int is_bf16) {
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t e = 0; e < vocab; e++) {
        const float v = to_f32(x, at + e, is_bf16);
        m = v > m ? v : m;
    }
    return logsumexp_given(x, at, vocab, is_bf16, m);
}

typedef struct {
    const void *x;
    int64_t vocab, row_stride;
    int is_bf16;
    int64_t *best;
    float *best_value;
} Argmax;

static void argmax_task(void *ctx, int r, int worker) {
    (void)worker;
    const Argmax *A = ctx;
    if (A->is_bf16) /* a constant dtype: branch-free loops */
        argmax_row(A->x, r * A->row_stride, A->vocab, 1, &A->best[r], &A->best_value[r]);
    else
        argmax_row(A->x, r * A->row_stride, A->vocab, 0, &A->best[r], &A->best_value[r]);
}

/* best[r], best_value[r]: argmax and maximum of row r (rows row_stride elements apart); a row
 * a task, on pool.c's threads where pooled (a small step's call: chain.c) -- an OpenMP region
 * there would wake torch's worker onto pool.c's cores (norm.c's run_norm says what that
 * cost) -- else on OpenMP's (the Python callers', among torch's ops). */
void baton_argmax_rows_on(const void *x, int64_t rows, int64_t vocab, int64_t row_stride,
                          int is_bf16, int64_t *best, float *best_value, int num_threads,
                          int pooled) {
    Argmax A = {x, vocab, row_stride, is_bf16, best, best_value};
    if (num_threads <= 1 || rows * vocab <= 65536 || rows <= 1)
        for (int r = 0; r < rows; r++) argmax_task(&A, r, 0);
    else
        (pooled ? baton_parallel : baton_parallel_openmp)(argmax_task, &A, (int)rows,
                                                          num_threads);
}

void baton_argmax_rows(const void *x, int64_t rows, int64_t vocab, int64_t row_stride,
                       int is_bf16, int64_t *best, float *best_value, int num_threads) {
    baton_argmax_rows_on(x, rows, vocab, row_stride, is_bf16, best, best_value, num_threads, 0);
}

/* out[i] = log-sum-exp of row row_ids[i]. */
void baton_logsumexp_rows(const void *x, const int64_t *row_ids, int64_t n, int64_t vocab,
                          int64_t row_stride, int is_bf16, float *out, int num_threads) {
    PARALLEL_FOR(i, n, n * vocab > 65536, {
        const int64_t at = row_ids[i] * row_stride;
        out[i] = is_bf16 ? logsumexp_row(x, at, vocab, 1) : logsumexp_row(x, at, vocab, 0);
    });
}

typedef struct {
    const void *scores;
    int64_t vocab;
    int is_bf16;
    int64_t *best;
    float *logprob;
} Greedy;

static void greedy_row(void *ctx, int r, int worker) {
    (void)worker;
    const Greedy *G = ctx;
    const int64_t at = (int64_t)r * G->vocab;
    float best_value, lse;
    if (G->is_bf16) { /* the argmax's maximum is the log-sum-exp's */
        argmax_row(G->scores, at, G->vocab, 1, &G->best[r], &best_value);
        lse = logsumexp_given(G->scores, at, G->vocab, 1, best_value);
    } else {
        argmax_row(G->scores, at, G->vocab, 0, &G->best[r], &best_value);
        lse = logsumexp_given(G->scores, at, G->vocab, 0, best_value);
    }
    G->logprob[r] = best_value - lse;
}

/* Greedy decoding of m rows in one call: the head's scores (baton_linear_rows into `scores`,
 * [m, vocab]), then per row its argmax and the argmax's log-probability (maximum minus
 * log-sum-exp, in fp32) -- the values of baton_linear_rows, baton_argmax_rows and
 * baton_logsumexp_rows called in turn (runner.py's three calls before), the rows on pool.c's
 * threads. 0, or 1 without scratch memory. */
int baton_head_greedy(const void *x, int64_t x_stride, int32_t m, int32_t k, const void *w,
                      int32_t vocab, const void *bias, int32_t op, void *scores,
                      int32_t act_bf16, int32_t w_format, int64_t *best, float *logprob,
                      int32_t num_threads) {
    void *own = scores == NULL ? malloc((size_t)m * vocab * (act_bf16 ? 2 : 4)) : NULL;
    if (scores == NULL && own == NULL) return 1;
    scores = scores != NULL ? scores : own; /* NULL: the scores are scratch, freed here */
    const int status = baton_linear_rows(x, x_stride, m, k, w, vocab, bias, NULL, 0, op, scores,
                                         vocab, act_bf16, w_format, num_threads);
    if (status == 0) {
        const Greedy G = {scores, vocab, act_bf16, best, logprob};
        /* past 4096 scores, a thread per 2048 of them (all for a large vocabulary) */
        const int64_t n = (int64_t)m * vocab;
        baton_parallel(greedy_row, (void *)&G, m,
                       n > 4096 ? baton_threads_for(n, 2048, num_threads) : 1);
    }
    free(own);
    return status;
}
