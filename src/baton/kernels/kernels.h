/* What the kernel sources share: the paged attention call's arguments and the entry points
 * one kernel calls from another (layer.c runs norm, matmuls and attention in one call). */
#ifndef BATON_KERNELS_H
#define BATON_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* The arguments of baton_paged_attention (field for field baton/kernels/paged_attention.py
 * ``_Args``); the layout is described in paged_attention.c. */
typedef struct {
    const void *q;
    int64_t q_token_stride, q_head_stride;
    void *out;
    int64_t out_token_stride, out_head_stride;
    void *k, *v; /* the pool's rows of this layer */
    int64_t unit_stride, row_stride, head_stride;
    const void *fresh_k, *fresh_v; /* the step's own keys and values */
    int64_t fk_token_stride, fk_head_stride, fv_token_stride, fv_head_stride;
    const int32_t *units;     /* [batch, max_units] */
    const int32_t *num_units; /* [batch] units of each segment (the rest is padding) */
    const int32_t *key_base;  /* [batch] pages: position held by the first unit's row 0 */
    const int32_t *q_offset;  /* [batch] step token of each segment's first query */
    const int32_t *q_start;   /* [batch] position of the segment's first query */
    const int32_t *q_count;   /* [batch] queries of the segment */
    const int32_t *first;     /* [batch] lowest visible position */
    const int32_t *store_token, *store_unit, *store_row; /* [num_stores] fresh rows kept */
    int32_t num_stores;
    int32_t max_units, rows, heads, kv_heads, head_dim, window;
    int32_t is_ring; /* one unit of `rows` rows per segment, row = position % rows */
    float scale, softcap;
    int32_t is_bf16;
    int32_t kv_int8; /* the pool's rows are int8 + an fp32 scale (paged_attention.c's top) */
    int32_t kv_bf16; /* the pool's rows are bf16 (under fp32 activations: rounded) */
} Args;

/* pooled: run on pool.c's threads (a small step's call) instead of OpenMP's. */
int baton_paged_attention_on(const Args *a, int32_t batch, int32_t num_threads, int pooled);
int baton_paged_attention(const Args *a, int32_t batch, int32_t num_threads);
/* A plan's index lists from the segments' unit tables (paged_attention.c). */
int baton_paged_plan(Args *a, int32_t batch, const int64_t *tables, const int32_t *table_lens,
                     const int32_t *segs, int32_t keep, int32_t covers_own, int32_t *buffer,
                     int64_t capacity);

void baton_rms_norm(const void *x, int64_t outer, int64_t outer_stride, int64_t inner,
                    int64_t inner_stride, const void *weight, int64_t weight_inner_stride,
                    void *out, int dim, float eps, float offset, int is_bf16, int lanes,
                    int num_threads);

void baton_rms_norm_rotary(const void *x, int64_t outer, int64_t outer_stride, int64_t inner,
                           int64_t inner_stride, const void *weight, int64_t weight_inner_stride,
                           const void *cos, const void *sin, int64_t table_stride, void *out,
                           int dim, float eps, int is_bf16, int lanes, int num_threads);

/* The same, pooled: on pool.c's threads (a small step's call: layer.c, chain.c) rather than
 * OpenMP's (the Python callers', among torch's ops). */
void baton_rms_norm_on(const void *x, int64_t outer, int64_t outer_stride, int64_t inner,
                       int64_t inner_stride, const void *weight, int64_t weight_inner_stride,
                       void *out, int dim, float eps, float offset, int is_bf16, int lanes,
                       int num_threads, int pooled);
void baton_rms_norm_rotary_on(const void *x, int64_t outer, int64_t outer_stride, int64_t inner,
                              int64_t inner_stride, const void *weight,
                              int64_t weight_inner_stride, const void *cos, const void *sin,
                              int64_t table_stride, void *out, int dim, float eps, int is_bf16,
                              int lanes, int num_threads, int pooled);

/* y = epilogue(x w^T + bias, other) for m rows, w packed in linear.c's panels; 0, or 1 without
 * scratch memory. */
int baton_linear_rows(const void *x, int64_t x_stride, int32_t m, int32_t k, const void *w,
                      int32_t n, const void *bias, const void *other, int64_t other_stride,
                      int32_t op, void *y, int64_t y_stride, int32_t act_bf16, int32_t w_format,
                      int32_t num_threads);

/* delta_rule.c: a gated delta net's sequence core token by token (see there). */
int baton_gated_delta_steps(const float *x, const float *a, const float *b,
                            const float *conv_w, const float *a_log, const float *dt_bias,
                            float *conv_state, float *state, float *out, int32_t T, int32_t C,
                            int32_t K, int32_t hk, int32_t hv, int32_t dk, int32_t dv,
                            int32_t is_bf16, const uint8_t *keep, float *saved_conv,
                            float *saved_state);

/* Rows [row0, row0 + rows) of an int8 / int4 weight in linear.c's panels, dequantized into
 * out ([rows, k]: fp32, or bf16 where out_bf16). */
int baton_dequantize_rows(const void *w, int32_t k, int32_t w_format, int32_t row0,
                          int32_t rows, void *out, int32_t out_bf16, int32_t num_threads);

/* The prompt path's W8A8 matmul around oneDNN's int8 one (linear.c): rows quantized, a
 * weight's rows as int8 (int4 requantized per row), int32 sums scaled into y. */
int baton_quantize_rows(const void *x, int64_t x_stride, int32_t m, int32_t k, int32_t kq,
                        int32_t x_bf16, int8_t *xq, float *xs, int32_t num_threads);
int baton_int8_rows(const void *w, int32_t k, int32_t w_format, int32_t row0, int32_t rows,
                    int8_t *q, int32_t kq, float *scales, int32_t num_threads);
int baton_scale_int32(const int32_t *acc, int32_t m, int32_t n, const float *xs,
                      const float *ws, const float *bias, void *y, int64_t y_stride,
                      int32_t j0, int32_t y_bf16, int32_t num_threads);

/* g = act(x gate^T + gate_bias), u = mul(x up^T + up_bias, g): the two calls of
 * baton_linear_rows in one parallel region (linear.c). */
int baton_gated_rows(const void *x, int64_t x_stride, int32_t m, int32_t k, const void *gate,
                     const void *gate_bias, int32_t act, void *g, const void *up,
                     const void *up_bias, int32_t mul, void *u, int32_t n, int32_t act_bf16,
                     int32_t w_format, int32_t num_threads);

/* layer.c's decoder layer. Matrices are packed in linear.c's panels, all in one format
 * (w_format: W_F32, W_BF16, W_INT8), their biases fp32 or bf16 (BIAS_AT); norm weights in
 * the activations' dtype. */
typedef struct { /* field for field baton/kernels/layer_abi.py ``LayerArgs`` */
    const void *input_norm, *post_norm; /* [hidden] */
    const void *qkv, *qkv_bias;         /* [(heads + 2 kv_heads) * head_dim, hidden] */
    const void *qk_norm;                /* [heads + kv_heads, head_dim]: q heads, then k */
    const void *o, *o_bias;             /* [hidden, heads * head_dim] */
    const void *gate, *gate_bias, *up, *up_bias, *down, *down_bias;
    int32_t hidden, intermediate, heads, kv_heads, head_dim, act; /* act: EPI_SILU / GELU */
    float eps, norm_offset, qk_eps;
    int32_t w_format, round_once; /* round_once: EPI_ROUND_ONCE, as oneDNN's packed matmuls */
} Layer;

typedef struct { /* field for field baton/kernels/layer_abi.py ``StepArgs`` */
    void *x;               /* [tokens, hidden] in: the layer's input; out: its output */
    const void *cos, *sin; /* [tokens, head_dim] rotary tables of the tokens' positions */
    void *k_pool, *v_pool; /* this layer's keys and values in the pool (Args' k and v) */
    const Args *attn;      /* the forward's index lists for the pool */
    int32_t tokens, batch; /* the step's tokens; segments in attn */
    int32_t act_bf16, lanes, num_threads;
} Step;

/* layer.c: one decoder layer of a small step; 0, or nonzero without scratch memory. */
int baton_decoder_layer(const Layer *L, const Step *s);

/* logits.c: the head (linear.c's panels) on m rows, then each row's argmax and its
 * log-probability; scores: [m, vocab] scratch, or NULL (allocated here). 0, or 1 without
 * scratch memory. */
int baton_head_greedy(const void *x, int64_t x_stride, int32_t m, int32_t k, const void *w,
                      int32_t vocab, const void *bias, int32_t op, void *scores,
                      int32_t act_bf16, int32_t w_format, int64_t *best, float *logprob,
                      int32_t num_threads);

/* logits.c: per row its first maximum's index and value. */
void baton_argmax_rows(const void *x, int64_t rows, int64_t vocab, int64_t row_stride,
                       int is_bf16, int64_t *best, float *best_value, int num_threads);
void baton_argmax_rows_on(const void *x, int64_t rows, int64_t vocab, int64_t row_stride,
                          int is_bf16, int64_t *best, float *best_value, int num_threads,
                          int pooled);

/* dst[r] = table[ids[r]] for n rows of row_bytes (an embedding lookup). */
static inline void baton_gather_rows(void *dst, const void *table, const int64_t *ids, int64_t n,
                                     size_t row_bytes) {
    for (int64_t r = 0; r < n; r++)
        memcpy((char *)dst + r * row_bytes, (const char *)table + ids[r] * row_bytes, row_bytes);
}

/* The rotary cos and sin rows of n positions from tables of table_rows rows by position (the
 * activations' dtype, row_bytes each): 0, or 2 with nothing written when a position is past
 * them. */
static inline int baton_rotary_rows(void *cos, void *sin, const void *cos_table,
                                    const void *sin_table, int64_t table_rows,
                                    const int64_t *positions, int64_t n, size_t row_bytes) {
    for (int64_t r = 0; r < n; r++)
        if (positions[r] < 0 || positions[r] >= table_rows) return 2;
    baton_gather_rows(cos, cos_table, positions, n, row_bytes);
    baton_gather_rows(sin, sin_table, positions, n, row_bytes);
    return 0;
}

/* The lowest position a query at `start` reads: start - window + 1 (window 0: none), not
 * below 0 or `floor`, never above `start` itself. */
static inline int baton_first_visible(int start, int window, int floor) {
    int lo = window > 0 && start - window + 1 > 0 ? start - window + 1 : 0;
    lo = lo > floor ? lo : floor;
    return lo < start ? lo : start;
}

/* for (int64_t i = 0; i < n; i++) { body } -- in an OpenMP parallel region over the
 * caller's `num_threads` threads where `wide` holds and `num_threads` > 1, else as a
 * plain loop: a `#pragma omp parallel for ... if (wide)` with `wide` false still calls
 * GOMP_parallel (~0.3 us; a batch-1 MTP decode step made 57 such calls). */
#define PARALLEL_FOR(i, n, wide, ...)                                                         \
    do {                                                                                      \
        if (num_threads > 1 && (wide)) {                                                      \
            _Pragma("omp parallel for num_threads(num_threads) schedule(static)")             \
            for (int64_t i = 0; i < (n); i++) { __VA_ARGS__; }                                \
        } else {                                                                              \
            for (int64_t i = 0; i < (n); i++) { __VA_ARGS__; }                                \
        }                                                                                     \
    } while (0)

/* pool.c: fn(ctx, task, worker) for every task in [0, tasks), on up to `threads` threads;
 * worker in [0, threads) tells a task's thread (scratch memory). */
typedef void (*baton_task)(void *ctx, int task, int worker);
void baton_parallel(baton_task fn, void *ctx, int tasks, int threads);
/* The same on OpenMP's threads, the runtime torch loaded (pool.c: a large call among torch's
 * ops, whose spinning worker would share a core with this pool's helper). */
void baton_parallel_openmp(baton_task fn, void *ctx, int tasks, int threads);
/* Threads a parallel region of `work` units gets: one per `per_thread` units of it, at least
 * 1, at most `threads` -- a small region is not spread over every core (its threads would
 * cost more in wake-ups than they save), a large one takes them all. */
int baton_threads_for(int64_t work, int64_t per_thread, int threads);

/* A packed weight's format (linear.c's panels; baton/kernels/linear.py ``WEIGHT_FORMATS``):
 * fp32, bf16, int8 (symmetric per output column: each panel's 16 columns x k int8 values in
 * quads of inputs, k padded to whole quads, then its 16 columns' fp32 scales, then their
 * int32 sums of the values, which the VNNI tiles' unsigned rows need) or int4
 * (symmetric per column and group of INT4_GROUP inputs, k padded to whole groups: per group
 * its 16 x 32 values in 256 bytes, two per byte, then the group's 16 column scales). The bias
 * of an int8 or int4 weight is fp32. */
enum { W_F32 = 0, W_BF16 = 1, W_INT8 = 2, W_INT4 = 3 };
enum { INT4_GROUP = 32, INT4_GROUP_BYTES = 16 * INT4_GROUP / 2 + 16 * 4 };

/* k rounded up to whole quads of inputs (an int8 panel's and its rows' length). */
static inline int64_t baton_int8_quads(int64_t k) { return (k + 3) / 4; }

/* k in whole int4 groups. */
static inline int64_t baton_int4_groups(int64_t k) { return (k + INT4_GROUP - 1) / INT4_GROUP; }

/* The bytes of one panel of `k` inputs in format `w_format`. */
static inline int64_t baton_panel_bytes(int64_t k, int w_format) {
    if (w_format == W_INT8) /* values, then 16 fp32 scales and 16 int32 column sums */
        return 64 * baton_int8_quads(k) + 16 * (int64_t)(sizeof(float) + sizeof(int32_t));
    if (w_format == W_INT4) return INT4_GROUP_BYTES * baton_int4_groups(k);
    return 16 * k * (w_format ? 2 : 4);
}

/* Element i of a bias of a weight in format `w_format`, as fp32. */
#define BIAS_AT(bias, i, w_format) to_f32((bias), (i), (w_format) == W_BF16)

enum { EPI_NONE = 0, EPI_ADD = 1, EPI_MUL = 2, EPI_SILU = 3, EPI_GELU = 4 };
/* Or'ed into linear.c's op: the epilogue runs on the fp32 result and rounds once, as
 * oneDNN's packed matmul with a post-op does (the path it replaces on AVX-512-BF16 CPUs). */
enum { EPI_ROUND_ONCE = 16 };

#endif
