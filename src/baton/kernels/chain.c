/* A draft's proposal chain in one call: a top-1 chain of `steps` guesses is the draft's first
 * step on each request's pending pairs (baton/speculative/proposer.py), then per guess the
 * target's head and an argmax and -- but for the last -- one more draft step on (draft state,
 * guess): ~40 torch ops and a dozen native calls per step, on a few tokens. Here they are the
 * C calls of the kernels beside this file, with the same arithmetic in the same order (so the
 * same guesses and the same stored bytes as the proposer's per-step path):
 *
 *   d_i = argmax(h head^T)                                            linear.c, logits.c
 *   x   = [rms_norm(embed[d_i], enorm), rms_norm(h, hnorm)] eh^T      norm.c, linear.c
 *   x   = decoder_layer(x) at slot L + i - 1 (stores its k, v)        layer.c
 *   h   = rms_norm(x, norm)                                           the target's final norm
 *
 * Step i's query attends the pool's rows before its slot, the earlier steps' scratch slots
 * included (stored by then). So the plan (`attn`) is built once, for segments of steps - 1
 * tokens starting at each request's first scratch slot L, its units covering all of them;
 * each step's query, visible range and store are derived from it here:
 *
 *   slot:      L-W+1 ....... L-1 | L    L+1  ...  L+steps-2
 *   step 1:    [  visible  ]       q
 *   step 2:       [  visible  ]    k    q                     (k: stored by step 1)
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

typedef struct { /* field for field baton/kernels/chain.py ``_Chain`` */
    const Layer *layer;               /* the draft's decoder layer */
    const void *embed;                /* [vocab, hidden] the target's, activations' dtype */
    const void *enorm, *hnorm, *norm; /* [hidden]: the draft's input norms, the target's final */
    const void *eh, *eh_bias;         /* panels of [hidden, 2 hidden] (bias may be NULL) */
    const void *head, *head_bias;     /* panels of [vocab, hidden] */
    int32_t vocab, hidden, eh_w_format, head_w_format, eh_op, head_op;
    float eps, offset, norm_eps, norm_offset; /* enorm's and hnorm's; the final norm's */
} Chain;

typedef struct { /* field for field baton/kernels/chain.py ``_ChainStep`` */
    void *hidden; /* [batch, hidden] the first step's states (out: the last step's); NULL with
                   * first_attn: scratch */
    const void *cos, *sin; /* [table_rows, head_dim] the rotary tables by position */
    void *k_pool, *v_pool; /* the draft layer's keys and values in its pool */
    const Args *attn;      /* the plan (see above) */
    const int32_t *floor;  /* [batch] no position below it is read (the ablation switch) */
    int64_t *tokens;       /* [batch, steps] out: the guesses */
    /* The first step too, when first_attn is not NULL: the pending pairs (target states, the
     * tokens after them, their positions), a plan of their segments, each request's last
     * pair's row. */
    const void *first_hidden;                          /* [pairs, hidden] */
    const int64_t *first_ids, *first_positions;        /* [pairs] */
    const Args *first_attn;
    const int32_t *last_rows; /* [batch] */
    int32_t pairs, batch, steps, act_bf16, lanes, num_threads, table_rows;
} ChainStep;

/* x = decoder_layer(eh(cat(enorm(embed[ids]), hnorm(hidden)))) for n tokens of `segments`
 * segments; scratch: 4 n rows of hidden. */
static int draft_step(const Chain *c, const ChainStep *s, const void *hidden, const int64_t *ids,
                      int64_t n, const void *cos, const void *sin, const Args *attn,
                      int32_t segments, char *scratch, char *x) {
    const int64_t hid = c->hidden;
    const int bf = s->act_bf16, nt = s->num_threads;
    const size_t row = (size_t)hid * (bf ? 2 : 4);
    char *e = scratch, *en = e + n * row, *eh = en + n * row;
    baton_gather_rows(e, c->embed, ids, n, row);
    baton_rms_norm_on(e, n, hid, 1, 0, c->enorm, 0, en, (int)hid, c->eps, c->offset, bf,
                      s->lanes, nt, 1);
    baton_rms_norm_on(hidden, n, hid, 1, 0, c->hnorm, 0, e, (int)hid, c->eps, c->offset, bf,
                      s->lanes, nt, 1);
    for (int r = 0; r < n; r++) { /* cat(enorm(embed), hnorm(h)) */
        memcpy(eh + 2 * r * row, en + r * row, row);
        memcpy(eh + (2 * r + 1) * row, e + r * row, row);
    }
    int status = baton_linear_rows(eh, 2 * hid, (int)n, (int)(2 * hid), c->eh, (int)hid,
                                   c->eh_bias, NULL, 0, c->eh_op, x, hid, bf, c->eh_w_format, nt);
    const Step step = {x, cos, sin, s->k_pool, s->v_pool, attn, (int32_t)n, segments, bf,
                       s->lanes, nt};
    return status | baton_decoder_layer(c->layer, &step);
}

/* Step `i`'s (1-based) query, visible range and store, per segment, from the plan. */
static void step_plan(const Args *plan, const int32_t *floor, int i, int32_t batch,
                      int32_t *lists, Args *a) {
    int32_t *q_offset = lists, *q_start = lists + batch, *q_count = lists + 2 * batch;
    int32_t *first = lists + 3 * batch, *store_token = lists + 4 * batch;
    int32_t *store_unit = lists + 5 * batch, *store_row = lists + 6 * batch;
    for (int b = 0; b < batch; b++) {
        const int pos = plan->q_start[b] + i - 1;
        q_offset[b] = b, q_start[b] = pos, q_count[b] = 1;
        first[b] = baton_first_visible(pos, plan->window, floor[b]);
        store_token[b] = b;
        const int32_t *units = plan->units + (int64_t)b * plan->max_units;
        if (plan->is_ring) {
            store_unit[b] = units[0], store_row[b] = pos % plan->rows;
        } else {
            const int at = pos - plan->key_base[b];
            store_unit[b] = units[at / plan->rows], store_row[b] = at % plan->rows;
        }
    }
    *a = *plan;
    a->q_offset = q_offset, a->q_start = q_start, a->q_count = q_count, a->first = first;
    a->store_token = store_token, a->store_unit = store_unit, a->store_row = store_row;
    a->num_stores = batch;
}

/* 0; 1 when a kernel found no scratch memory; 2 (before anything is computed or stored) when
 * a position is past the rotary tables. A guess's step of request r is at position (as its
 * slot) its plan's first slot + the step: the rotary position one more (the pair's token). */
static int draft_chain(const Chain *c, const ChainStep *s);

/* As draft_chain; with s->hidden NULL (a chain whose first step runs here: the states are
 * scratch) the states are allocated here. */
int baton_draft_chain(const Chain *c, const ChainStep *s) {
    if (s->hidden != NULL) return draft_chain(c, s);
    ChainStep own = *s;
    own.hidden = malloc((size_t)s->batch * c->hidden * (s->act_bf16 ? 2 : 4));
    if (own.hidden == NULL) return 1;
    const int status = draft_chain(c, &own);
    free(own.hidden);
    return status;
}

static int draft_chain(const Chain *c, const ChainStep *s) {
    const int64_t b = s->batch, hid = c->hidden, vocab = c->vocab, d = c->layer->head_dim;
    const int64_t n = s->first_attn != NULL && s->pairs > b ? s->pairs : b; /* most rows */
    for (int64_t r = 0; r < b; r++) /* the guesses' steps: checked before anything is stored */
        if (s->attn->q_start[r] + s->steps - 1 >= s->table_rows) return 2;
    const int bf = s->act_bf16, nt = s->num_threads;
    const size_t elem = bf ? 2 : 4, row = (size_t)hid * elem, rot = (size_t)d * elem;
    char *scratch = malloc((size_t)b * vocab * elem + 5 * n * row + 2 * n * rot);
    int64_t *best = malloc(sizeof(int64_t) * 2 * b), *at = best + b;
    float *value = malloc(sizeof(float) * b);
    int32_t *lists = malloc(sizeof(int32_t) * 7 * b);
    int status = scratch == NULL || best == NULL || value == NULL || lists == NULL;
    char *scores = scratch, *x = scores + b * vocab * elem, *rest = x + n * row;
    char *cos = rest + 4 * n * row, *sin = cos + n * rot;
    if (status == 0 && s->first_attn != NULL) /* 2: a pair's position past the tables */
        status = baton_rotary_rows(cos, sin, s->cos, s->sin, s->table_rows, s->first_positions,
                                   s->pairs, rot);
    if (status == 0 && s->first_attn != NULL) { /* the pending pairs; each request's last */
        status |= draft_step(c, s, s->first_hidden, s->first_ids, s->pairs, cos, sin,
                             s->first_attn, (int32_t)b, rest, x);
        for (int r = 0; r < b; r++) memmove(x + r * row, x + s->last_rows[r] * row, row);
        baton_rms_norm_on(x, b, hid, 1, 0, c->norm, 0, s->hidden, (int)hid, c->norm_eps,
                          c->norm_offset, bf, s->lanes, nt, 1);
    }
    for (int i = 0; status == 0; i++) {
        status |= baton_linear_rows(s->hidden, hid, (int)b, (int)hid, c->head, (int)vocab,
                                    c->head_bias, NULL, 0, c->head_op, scores, vocab, bf,
                                    c->head_w_format, nt);
        baton_argmax_rows_on(scores, b, vocab, vocab, bf, best, value, nt, 1);
        for (int r = 0; r < b; r++) s->tokens[r * s->steps + i] = best[r];
        if (i == s->steps - 1) break;
        Args a;
        step_plan(s->attn, s->floor, i + 1, (int32_t)b, lists, &a);
        for (int r = 0; r < b; r++) at[r] = s->attn->q_start[r] + i + 1;
        baton_rotary_rows(cos, sin, s->cos, s->sin, s->table_rows, at, b, rot); /* checked */
        status |= draft_step(c, s, s->hidden, best, b, cos, sin, &a, (int32_t)b, rest, x);
        baton_rms_norm_on(x, b, hid, 1, 0, c->norm, 0, s->hidden, (int)hid, c->norm_eps,
                          c->norm_offset, bf, s->lanes, nt, 1);
    }
    free(scratch);
    free(best);
    free(value);
    free(lists);
    return status;
}
