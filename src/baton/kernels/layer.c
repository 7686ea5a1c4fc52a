/* One decoder layer of a small step (decode, speculative verification, draft steps) in one
 * call: the ~10 torch ops of baton/model/decoder.py's DecoderLayer.forward -- each a Python
 * dispatch of 3-30 us on a step whose arithmetic is a few hundred -- become C calls of the
 * kernels beside this file, with the same arithmetic in the same order:
 *
 *   h   = rms_norm(x, input_norm)                              norm.c
 *   qkv = h qkv^T (+ bias)                                     linear.c
 *   q,k = rms_norm_rotary(qkv's q and k heads, qk_norm)        norm.c (Qwen3's q/k norm)
 *   a   = paged_attention(q, k, qkv's v) (stores k, v)         paged_attention.c
 *   x   = x + a o^T                                            linear.c, ADD epilogue
 *   h   = rms_norm(x, post_norm)
 *   g   = act(h gate^T);  u = (h up^T) * g;  x = x + u down^T  linear.c (g, u: one region)
 *
 * Intermediates are rounded to the activation dtype where torch rounds them (every op's
 * output), so the one difference from the torch path is linear.c's order of summation.
 * Models this does not cover (sandwich norms, no q/k norm, packed bf16 weights) keep the
 * torch path: baton/kernels/layer.py decides, and its torch path stays the reference.
 */
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

/* 0, or nonzero when a kernel found no scratch memory. */
int baton_decoder_layer(const Layer *L, const Step *s) {
    const int64_t t = s->tokens, hid = L->hidden, d = L->head_dim;
    const int64_t heads = L->heads, kv = L->kv_heads, inter = L->intermediate;
    const int64_t qkv_dim = (heads + 2 * kv) * d, qk_dim = (heads + kv) * d;
    const int bf = s->act_bf16, nt = s->num_threads, once = L->round_once ? EPI_ROUND_ONCE : 0;
    const size_t elem = bf ? 2 : 4;
    char *scratch = malloc((size_t)t * (hid + qkv_dim + qk_dim + heads * d + 2 * inter) * elem);
    if (scratch == NULL) return 1;
    char *h = scratch, *qkv = h + t * hid * elem, *qk = qkv + t * qkv_dim * elem;
    char *att = qk + t * qk_dim * elem, *g = att + t * heads * d * elem, *u = g + t * inter * elem;
    int status = 0;

    baton_rms_norm_on(s->x, t, hid, 1, 0, L->input_norm, 0, h, (int)hid, L->eps,
                      L->norm_offset, bf, s->lanes, nt, 1);
    status |= baton_linear_rows(h, hid, (int)t, (int)hid, L->qkv, (int)qkv_dim, L->qkv_bias,
                                NULL, 0, EPI_NONE | once, qkv, qkv_dim, bf, L->w_format, nt);
    baton_rms_norm_rotary_on(qkv, t, qkv_dim, heads + kv, d, L->qk_norm, d, s->cos, s->sin, d,
                             qk, (int)d, L->qk_eps, bf, s->lanes, nt, 1);

    Args a = *s->attn;
    a.q = qk, a.q_token_stride = qk_dim, a.q_head_stride = d;
    a.fresh_k = qk + heads * d * elem, a.fk_token_stride = qk_dim, a.fk_head_stride = d;
    a.fresh_v = qkv + qk_dim * elem, a.fv_token_stride = qkv_dim, a.fv_head_stride = d;
    a.out = att, a.out_token_stride = heads * d, a.out_head_stride = d;
    a.k = s->k_pool, a.v = s->v_pool;
    a.is_bf16 = bf;
    status |= baton_paged_attention_on(&a, s->batch, nt, 1) != 0;

    /* The residual adds write x in place: each element is read, then written, by one thread. */
    status |= baton_linear_rows(att, heads * d, (int)t, (int)(heads * d), L->o, (int)hid,
                                L->o_bias, s->x, hid, EPI_ADD | once, s->x, hid, bf, L->w_format, nt);
    baton_rms_norm_on(s->x, t, hid, 1, 0, L->post_norm, 0, h, (int)hid, L->eps, L->norm_offset,
                      bf, s->lanes, nt, 1);
    status |= baton_gated_rows(h, hid, (int)t, (int)hid, L->gate, L->gate_bias, L->act | once, g,
                               L->up, L->up_bias, EPI_MUL | once, u, (int)inter, bf, L->w_format, nt);
    status |= baton_linear_rows(u, inter, (int)t, (int)inter, L->down, (int)hid, L->down_bias,
                                s->x, hid, EPI_ADD | once, s->x, hid, bf, L->w_format, nt);
    free(scratch);
    return status;
}

typedef struct { /* field for field baton/kernels/layer_abi.py ``StackLayerArgs`` */
    const Layer *layer;
    const Args *attn; /* the step's index lists for this layer's pool */
    void *k_pool, *v_pool;
    int32_t batch; /* segments in attn */
} StackLayer;

typedef struct { /* field for field baton/kernels/layer_abi.py ``StackPlanArgs`` */
    Args *args;                         /* the pool's plan (rows, window, is_ring set) */
    const int64_t *tables;              /* [batch] each segment's unit table (int32 *) */
    const int32_t *table_lens;          /* [batch] */
    int32_t *buffer;                    /* the plan's lists */
    int64_t capacity;                   /* int32s in buffer */
    int32_t keep, covers_own;
} StackPlan;

typedef struct { /* field for field baton/kernels/layer_abi.py ``StackArgs`` */
    const int64_t *ids;             /* [tokens] */
    const void *embed, *norm;       /* [vocab, hidden], [hidden]: the activations' dtype */
    void *out;                      /* [tokens, hidden] the final-normed states */
    const void *cos, *sin;          /* [table_rows, head_dim] rotary tables by position */
    const int64_t *positions;       /* [tokens] */
    const StackLayer *layers;
    float eps, offset;              /* the final norm's */
    int32_t num_layers, tokens, hidden, act_bf16, lanes, num_threads, table_rows;
    /* Optionally (head not NULL) the head's greedy epilogue on every row, as
     * baton_head_greedy: each row's argmax (best) and its log-probability (logprob). */
    const void *head, *head_bias; /* panels of [vocab, hidden] */
    int64_t *best;                /* [tokens] */
    float *logprob;               /* [tokens] */
    int32_t vocab, head_op, head_w_format;
    /* Optionally (num_plans > 0) the pools' attention plans, built here first
     * (baton_paged_plan) from the step's segments [batch, 4]: the layers' attn point at
     * their args. */
    const StackPlan *plans;
    const int32_t *segs;
    int32_t num_plans, batch;
    int32_t failed_plan; /* out: the plan whose buffer was too small (status 3) */
} Stack;

/* A small step's whole model but the head: the pools' plans where given, embedding rows, the
 * positions' rotary rows, every layer (as baton_decoder_layer), the final norm -- what
 * CausalLM.forward runs layer by layer -- and, where asked, the head's greedy epilogue
 * (baton_head_greedy) on every row. 0; 1 when a kernel found no scratch memory; before
 * anything is computed or stored: 2 when a position is past the tables, 3 when a plan's
 * buffer is too small (failed_plan says which), 4 when a plan needs a unit its request does
 * not hold. */
int baton_decoder_stack(Stack *s) {
    for (int64_t r = 0; r < s->tokens; r++)
        if (s->positions[r] < 0 || s->positions[r] >= s->table_rows) return 2;
    for (int i = 0; i < s->num_plans; i++) {
        const StackPlan *p = &s->plans[i];
        const int st = baton_paged_plan(p->args, s->batch, p->tables, p->table_lens, s->segs,
                                        p->keep, p->covers_own, p->buffer, p->capacity);
        if (st == -1) {
            s->failed_plan = i;
            return 3;
        }
        if (st != 0) return 4;
    }
    const int64_t t = s->tokens, hid = s->hidden;
    const size_t elem = s->act_bf16 ? 2 : 4, row = (size_t)hid * elem;
    const size_t rot = (size_t)s->layers[0].layer->head_dim * elem;
    char *x = malloc((size_t)t * (row + 2 * rot));
    if (x == NULL) return 1;
    char *cos = x + t * row, *sin = cos + t * rot;
    int status = baton_rotary_rows(cos, sin, s->cos, s->sin, s->table_rows, s->positions, t, rot);
    if (status != 0) {
        free(x);
        return status;
    }
    baton_gather_rows(x, s->embed, s->ids, t, row);
    for (int i = 0; i < s->num_layers && status == 0; i++) {
        const StackLayer *l = &s->layers[i];
        const Step step = {x, cos, sin, l->k_pool, l->v_pool, l->attn, s->tokens, l->batch,
                           s->act_bf16, s->lanes, s->num_threads};
        status |= baton_decoder_layer(l->layer, &step);
    }
    baton_rms_norm_on(x, t, hid, 1, 0, s->norm, 0, s->out, (int)hid, s->eps, s->offset,
                      s->act_bf16, s->lanes, s->num_threads, 1);
    free(x);
    if (status == 0 && s->head != NULL)
        status = baton_head_greedy(s->out, hid, (int32_t)t, (int32_t)hid, s->head, s->vocab,
                                   s->head_bias, s->head_op, NULL, s->act_bf16, s->head_w_format,
                                   s->best, s->logprob, s->num_threads);
    return status;
}
