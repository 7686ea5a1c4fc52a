/* Attention of a step's segments (decode, speculative verification, draft steps, prefill
 * chunks) read in place: context from the pool's pages or ring, the segment's own keys and
 * values from the step's tensors. No gathered copy, no padded batch, no write before read
 * (so a chunk longer than a ring is fine); then the kept rows of the step's K/V (store_*:
 * token, unit, row) are copied into the pool.
 *
 * One task per (tile of a segment's queries, kv head): the tile's queries of the heads that
 * share the kv head are scored against the positions they can see in one pass (each key
 * row converted to fp32 once), soft-maxed per query in fp32, the value rows accumulated the
 * same way. A short tile (decode, verification) may give a task several kv heads, taken
 * block by block: each block of positions scored (then weighed) for every head before the
 * next, its whole pool rows requested ahead -- not one head's piece of each (which memory
 * streams at a fraction of its rate: a head's 256 bytes of each 2 KiB row), and not every
 * head's rows again per head; each query's arithmetic is the same either way.
 * The query at position p of segment b sees positions
 *     max(first[b], p - W + 1) .. p          (W: the window; none: no lower bound but first)
 * Position kp of the segment lives at
 *     kp >= q_start[b]:  fresh token q_offset[b] + kp - q_start[b]      (this step's K/V)
 *     pages:             unit units[b][(kp - key_base[b]) / rows], row (kp - key_base[b]) % rows
 *     ring:              unit units[b][0], row kp % rows
 * Layout, in elements: pool row (unit u, row r, kv head g) at k + u * unit_stride +
 * r * row_stride + g * head_stride (v alike); fresh token t, kv head g at fresh_k +
 * t * fk_token_stride + g * fk_head_stride (fresh_v with its own strides); query token t,
 * head h at q + t * q_token_stride + h * q_head_stride, output alike. A segment's tokens are
 * consecutive in the step. Activations are bf16 (is_bf16) or fp32; arithmetic is fp32,
 * except on the AVX-512 BF16 path: bf16 q.k pairs summed in fp32, and the softmax numerators
 * (computed and summed in fp32) rounded to bf16 to weigh the value rows, pairs of products
 * summed in fp32 -- what torch's CPU flash attention does in bf16 (transformers' SDPA), and
 * a quarter off the kernel's time.
 * An int8 pool (kv_int8; baton/memory/kv_format.py): a row of head_dim int8 values q and its
 * fp32 scale s in the 4 bytes after them (strides in bytes), standing for q * s. The step's
 * own K/V rows are quantized once per call (quantize_step: baton_quantize_rows, round(x *
 * 127 / max |x|), s = max |x| / 127) and attended as such too -- every query sees every key
 * as the pool holds it, so a result does not depend on how a prompt was cut into chunks --
 * and the stored rows are those bytes. A task reads each block's rows once, as q * s
 * rounded to bf16 where the AVX-512 BF16 path takes them (rounded once, to nearest even),
 * else to fp32, and attends them as such a pool's.
 * A bf16 pool under fp32 activations (kv_bf16 without is_bf16): the step's own K/V rows are
 * rounded to bf16 once per call (to nearest even, as torch's .to(bfloat16)) and attended and
 * stored as such, the same way; queries, arithmetic and outputs stay fp32.
 * Built and loaded by baton/kernels/__init__.py; the reference is the torch path of
 * baton/model/paged_attention.py, which tests compare it with.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fastmath.h"
#include "kernels.h"
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#define MAX_QUERIES 64 /* queries of one task: tile tokens x heads per kv head */
#define TASKS_PER_THREAD 4 /* a task per tile and kv head, or per tile and several: at least these */
#define SHORT_TILE 8       /* a tile of at most these tokens may take several kv heads */
#define AHEAD 2 /* blocks: a block's rows are requested while the one this far before it is computed */

/* Whether a task may take several kv heads (1), or one (0; tests compare the two bit for bit). */
int32_t baton_attention_heads_together = 1;

static inline void store(void *base, int64_t i, float f, int is_bf16) {
    if (is_bf16) { /* round to nearest even, as torch does; NaN stays NaN */
        uint32_t bits;
        memcpy(&bits, &f, sizeof bits);
        if ((bits & 0x7fffffffu) > 0x7f800000u) {
            ((uint16_t *)base)[i] = (uint16_t)((bits >> 16) | 0x40u);
            return;
        }
        bits += 0x7fffu + ((bits >> 16) & 1u);
        ((uint16_t *)base)[i] = (uint16_t)(bits >> 16);
        return;
    }
    ((float *)base)[i] = f;
}

/* Row of `n` elements to fp32; separate loops per dtype so that each vectorises. */
static inline void load_row(float *restrict dst, const void *src, int64_t offset, int n,
                            int is_bf16) {
    if (is_bf16) {
        const uint16_t *restrict s = (const uint16_t *)src + offset;
#pragma omp simd
        for (int i = 0; i < n; i++) {
            uint32_t bits = (uint32_t)s[i] << 16;
            float f;
            memcpy(&f, &bits, sizeof f);
            dst[i] = f;
        }
    } else {
        memcpy(dst, (const float *)src + offset, (size_t)n * sizeof(float));
    }
}

/* An int8 row (d values, then their fp32 scale s) as q * s at dst: bf16 (to nearest even,
 * as `store`; a finite scale: no NaN to keep) or fp32; loops that vectorise. */
static inline void dequantize_row(void *dst, const int8_t *restrict row, int d, int to_bf16) {
    float s;
    memcpy(&s, row + d, sizeof s);
    if (to_bf16) {
        uint16_t *restrict out = dst;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        if (d % 32 == 0) { /* vcvtne2ps2bf16 rounds to nearest even, as below */
            const __m512 vs = _mm512_set1_ps(s);
            for (int e = 0; e < d; e += 32) {
                const __m512 lo = _mm512_mul_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + e)))), vs);
                const __m512 hi = _mm512_mul_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + e + 16)))), vs);
                _mm512_storeu_si512(out + e, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            }
            return;
        }
#endif
#pragma omp simd
        for (int e = 0; e < d; e++) {
            const float f = (float)row[e] * s;
            uint32_t bits;
            memcpy(&bits, &f, sizeof bits);
            out[e] = (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
        }
        return;
    }
    float *restrict out = dst;
#pragma omp simd
    for (int e = 0; e < d; e++) out[e] = (float)row[e] * s;
}

/* Bytes of one element of a pool row (int8 rows: their values). */
static inline int row_element(const Args *a) {
    return a->kv_int8 ? 1 : a->is_bf16 || a->kv_bf16 ? 2 : 4;
}

#define BLOCK 16 /* keys scored and accumulated together (one AVX-512 register of scores) */

typedef struct { /* one block of key positions of one task */
    const void *k[BLOCK], *v[BLOCK]; /* each row's first element (padding repeats row 0) */
    int32_t pos[BLOCK];              /* position, -1: padding */
} Block;

static inline int visible(const Args *a, int b, int kp, int p) {
    return kp >= 0 && kp >= a->first[b] && kp <= p && !(a->window > 0 && kp <= p - a->window);
}

/* scores[kk] = scale * q . k_kk for the block, -INFINITY where not visible (portable C); the
 * rows bf16 (row_bf16) or fp32. */
static inline void score_block(const Args *a, int b, const Block *blk, const float *q, int p,
                               float *row, float *scores, int d, int row_bf16) {
    for (int kk = 0; kk < BLOCK; kk++) {
        if (!visible(a, b, blk->pos[kk], p)) {
            scores[kk] = -INFINITY;
            continue;
        }
        load_row(row, blk->k[kk], 0, d, row_bf16);
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int e = 0; e < d; e++) dot += q[e] * row[e];
        scores[kk] = dot * a->scale;
    }
}

/* acc[e] += sum_kk probs[kk] * v_kk[e] (portable C); rows: the block's values in fp32. */
static inline void accumulate_block(const float *probs, const float *rows, float *acc, int d) {
    for (int kk = 0; kk < BLOCK; kk++) {
        if (probs[kk] == 0.0f) continue;
#pragma omp simd
        for (int e = 0; e < d; e++) acc[e] += probs[kk] * rows[(int64_t)kk * d + e];
    }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAS_BF16_PATH 1

/* r[k] = sum of the lanes of v[k], k < 16: 45 shuffles and adds instead of 16 reductions. */
static inline __m512 reduce16(const __m512 v[16]) {
    __m512 w[8], x[4];
    for (int k = 0; k < 8; k++) /* per 128-bit lane: (a0+a2, b0+b2, a1+a3, b1+b3) */
        w[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                             _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++) /* per 128-bit lane: the lane sums of v[4k .. 4k+3] */
        x[k] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* score_block for bf16 with d % 32 == 0: bf16 pair products summed in fp32 (vdpbf16ps). */
static inline void score_block_bf16(const Args *a, int b, const Block *blk, const uint16_t *q,
                                    int p, float *scores, int d) {
    __m512 part[BLOCK];
    for (int kk = 0; kk < BLOCK; kk++) {
        const uint16_t *k = (const uint16_t *)blk->k[kk];
        __m512 acc = _mm512_setzero_ps();
        for (int e = 0; e < d; e += 32)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + e),
                                   (__m512bh)_mm512_loadu_si512(k + e));
        part[kk] = acc;
    }
    __m512 s = _mm512_mul_ps(reduce16(part), _mm512_set1_ps(a->scale));
    __m512i pos = _mm512_loadu_si512(blk->pos);
    int lo = a->first[b] > 0 ? a->first[b] : 0;
    __mmask16 keep = _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(lo)) &
                     _mm512_cmple_epi32_mask(pos, _mm512_set1_epi32(p));
    if (a->window > 0) keep &= _mm512_cmpgt_epi32_mask(pos, _mm512_set1_epi32(p - a->window));
    _mm512_storeu_ps(scores, _mm512_mask_blend_ps(keep, _mm512_set1_ps(-INFINITY), s));
}

/* accumulate_block with d % 16 == 0, d <= 256: the accumulator stays in registers. */
static inline void accumulate_block_avx512(const float *probs, const float *rows, float *acc,
                                           int d) {
    __m512 r[16];
    for (int c = 0; c < d / 16; c++) r[c] = _mm512_loadu_ps(acc + 16 * c);
    for (int kk = 0; kk < BLOCK; kk++) {
        if (probs[kk] == 0.0f) continue;
        __m512 pk = _mm512_set1_ps(probs[kk]);
        for (int c = 0; c < d / 16; c++)
            r[c] = _mm512_fmadd_ps(pk, _mm512_loadu_ps(rows + (int64_t)kk * d + 16 * c), r[c]);
    }
    for (int c = 0; c < d / 16; c++) _mm512_storeu_ps(acc + 16 * c, r[c]);
}

/* A query's softmax numerators to bf16 in place (RNE): as uint32 the row then holds pairs
 * (p[2j], p[2j+1]) -- the layout vdpbf16ps multiplies value pairs by. n % 16 == 0; each store
 * lands on floats already read. */
static inline void probs_to_bf16_pairs(float *s, int n) {
    int j = 0;
    for (; j + 32 <= n; j += 32) {
        const __m512 lo = _mm512_loadu_ps(s + j), hi = _mm512_loadu_ps(s + j + 16);
        _mm512_storeu_si512((uint16_t *)s + j, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    if (j < n) /* the last 16 */
        _mm256_storeu_si256((__m256i *)((uint16_t *)s + j),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + j)));
}

/* The block's values as pairs of rows: pairs[(j * d / 16 + c) * 16 + e] holds (v_2j[16c + e],
 * v_2j+1[16c + e]) as the low and high half of a uint32. */
static inline void pair_values_bf16(const Block *blk, uint32_t *pairs, int d) {
    for (int j = 0; j < BLOCK / 2; j++) {
        const uint16_t *v0 = (const uint16_t *)blk->v[2 * j], *v1 = (const uint16_t *)blk->v[2 * j + 1];
        for (int c = 0; c < d / 16; c++) {
            const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v0 + 16 * c)));
            const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v1 + 16 * c)));
            _mm512_storeu_si512(pairs + ((int64_t)j * (d / 16) + c) * 16,
                                _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

/* pair_values_bf16 of int8 rows: each value q * s rounded to bf16 as dequantize_row rounds
 * it, straight into the pairs. */
static inline void pair_values_int8(const Block *blk, uint32_t *pairs, int d) {
    for (int j = 0; j < BLOCK / 2; j++) {
        const int8_t *v0 = blk->v[2 * j], *v1 = blk->v[2 * j + 1];
        float s0, s1;
        memcpy(&s0, v0 + d, sizeof s0);
        memcpy(&s1, v1 + d, sizeof s1);
        for (int c = 0; c < d / 16; c++) {
            const __m512 f0 = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(v0 + 16 * c)))),
                _mm512_set1_ps(s0));
            const __m512 f1 = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(v1 + 16 * c)))),
                _mm512_set1_ps(s1));
            const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(f0));
            const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(f1));
            _mm512_storeu_si512(pairs + ((int64_t)j * (d / 16) + c) * 16,
                                _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

/* acc[e] += sum_kk probs[kk] * v_kk[e] with bf16 probabilities (`probs`: the query's pairs for
 * this block) and values, each pair of products summed in fp32 (vdpbf16ps); d % 16 == 0. */
static inline void accumulate_block_bf16(const uint32_t *probs, const uint32_t *pairs,
                                         float *acc, int d) {
    __m512 r[16];
    for (int c = 0; c < d / 16; c++) r[c] = _mm512_loadu_ps(acc + 16 * c);
    for (int j = 0; j < BLOCK / 2; j++) {
        if (probs[j] == 0) continue; /* both keys invisible (or weightless) */
        const __m512bh pj = (__m512bh)_mm512_set1_epi32((int)probs[j]);
        for (int c = 0; c < d / 16; c++)
            r[c] = _mm512_dpbf16_ps(
                r[c], (__m512bh)_mm512_loadu_si512(pairs + ((int64_t)j * (d / 16) + c) * 16), pj);
    }
    for (int c = 0; c < d / 16; c++) _mm512_storeu_ps(acc + 16 * c, r[c]);
}
#else
#define HAS_BF16_PATH 0
#endif

#if !HAS_BF16_PATH && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAS_AVX2_PATH 1

/* r[k] = sum of the lanes of v[k], k < 8. */
static inline __m256 reduce8(const __m256 v[8]) {
    const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* score_block with AVX2 (d % 16 == 0): each key row read from the pool as it is, no copy;
 * the same scores as the portable loop up to the order of each dot product's sum. */
static inline __attribute__((always_inline)) void score_block_avx2(
    const Args *a, int b, const Block *blk, const float *q, int p, float *scores, const int d,
    const int is_bf16) {
    int lo = a->first[b] > 0 ? a->first[b] : 0;
    if (a->window > 0 && p - a->window + 1 > lo) lo = p - a->window + 1;
    for (int h = 0; h < BLOCK; h += 8) {
        __m256 part[8];
        _Pragma("GCC unroll 8") for (int kk = 0; kk < 8; kk++) {
            const void *k = blk->k[h + kk];
            __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
            for (int e = 0; e < d; e += 16) {
                s0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + e), load8_f32(k, e, is_bf16), s0);
                s1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + e + 8), load8_f32(k, e + 8, is_bf16), s1);
            }
            part[kk] = _mm256_add_ps(s0, s1);
        }
        const __m256 sc = _mm256_mul_ps(reduce8(part), _mm256_set1_ps(a->scale));
        const __m256i pos = _mm256_loadu_si256((const __m256i *)(blk->pos + h));
        const __m256i keep = _mm256_andnot_si256(
            _mm256_cmpgt_epi32(_mm256_set1_epi32(lo), pos), /* pos >= lo (padding is -1) */
            _mm256_cmpgt_epi32(_mm256_set1_epi32(p + 1), pos)); /* pos <= p */
        _mm256_storeu_ps(scores + h, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sc,
                                                      _mm256_castsi256_ps(keep)));
    }
}

/* accumulate_block with AVX2 (d % 8 == 0, d <= 128): the accumulator in registers, the
 * value rows read from the pool as they are; the same sums in the same order. */
static inline __attribute__((always_inline)) void accumulate_block_avx2(
    const float *probs, const Block *blk, float *acc, const int d, const int is_bf16) {
    __m256 r[16];
    _Pragma("GCC unroll 16") for (int c = 0; c < d / 8; c++) r[c] = _mm256_loadu_ps(acc + 8 * c);
    for (int kk = 0; kk < BLOCK; kk++) {
        if (probs[kk] == 0.0f) continue;
        const __m256 pk = _mm256_set1_ps(probs[kk]);
        _Pragma("GCC unroll 16") for (int c = 0; c < d / 8; c++)
            r[c] = _mm256_fmadd_ps(pk, load8_f32(blk->v[kk], 8 * c, is_bf16), r[c]);
    }
    _Pragma("GCC unroll 16") for (int c = 0; c < d / 8; c++) _mm256_storeu_ps(acc + 8 * c, r[c]);
}
#else
#define HAS_AVX2_PATH 0
#endif

/* The block of positions p0 .. p0+BLOCK-1 of segment b (see the top of the file for where
 * a position lives); those before `p_lo` or past `p_end` are padding (they repeat the row of
 * the block's first other position). Walks the pool row by row: one division per block,
 * not two per position. */
static inline void fill_block(const Args *a, int b, int g, int p0, int p_lo, int p_end,
                              Block *blk) {
    /* element bytes, pool and step rows alike (int8: the step's rows quantize_step made) */
    const int size = row_element(a), start = a->q_start[b];
    const int32_t *units = a->units + (int64_t)b * a->max_units;
    const int k0 = p_lo > p0 ? p_lo - p0 : 0; /* the first row that is not padding */
    const int j = a->is_ring ? (p0 + k0) % a->rows : p0 + k0 - a->key_base[b];
    int unit = a->is_ring ? 0 : j / a->rows, row = j % a->rows;
    for (int kk = k0; kk < BLOCK; kk++) {
        const int kp = p0 + kk;
        const int is_pad = kp > p_end;
        blk->pos[kk] = is_pad ? -1 : kp;
        if (is_pad) {
            blk->k[kk] = blk->k[k0];
            blk->v[kk] = blk->v[k0];
        } else if (kp >= start) { /* the step's own token */
            const int64_t t = a->q_offset[b] + kp - start;
            blk->k[kk] = (const char *)a->fresh_k + (t * a->fk_token_stride +
                                                      (int64_t)g * a->fk_head_stride) * size;
            blk->v[kk] = (const char *)a->fresh_v + (t * a->fv_token_stride +
                                                      (int64_t)g * a->fv_head_stride) * size;
        } else {
            const int64_t at = (int64_t)units[unit] * a->unit_stride +
                               (int64_t)row * a->row_stride + (int64_t)g * a->head_stride;
            blk->k[kk] = (const char *)a->k + at * size;
            blk->v[kk] = (const char *)a->v + at * size;
        }
        if (++row == a->rows) { /* next page; a ring wraps to its row 0 */
            row = 0;
            unit += !a->is_ring;
        }
    }
    for (int kk = 0; kk < k0; kk++) {
        blk->pos[kk] = -1;
        blk->k[kk] = blk->k[k0];
        blk->v[kk] = blk->v[k0];
    }
}

/* A block's int8 rows of `which` (0: keys, 1: values; padding too) dequantized into `deq`
 * (BLOCK rows, bf16 or fp32), where the block then points (both pointers of a row). */
static inline void dequantize_block(Block *blk, int which, int d, float *deq, int to_bf16) {
    for (int kk = 0; kk < BLOCK; kk++) {
        float *row = deq + (int64_t)kk * d; /* room for fp32 */
        dequantize_row(row, which ? blk->v[kk] : blk->k[kk], d, to_bf16);
        blk->k[kk] = blk->v[kk] = row;
    }
}

/* A block's bf16 rows of `which` (0: keys, 1: values; padding too) widened to fp32 into
 * `deq` (exact), where the block then points: once per block, not once per query. */
static inline void widen_block(Block *blk, int which, int d, float *deq) {
    for (int kk = 0; kk < BLOCK; kk++) {
        float *row = deq + (int64_t)kk * d;
        load_row(row, which ? blk->v[kk] : blk->k[kk], 0, d, 1);
        blk->k[kk] = blk->v[kk] = row;
    }
}

/* Bytes [from, to) of each row of a block requested into L2 (prefetcht1), not loaded: the
 * core goes on computing while they come. */
static inline void prefetch_slice(const void *const rows[BLOCK], int from, int to) {
    for (int kk = 0; kk < BLOCK; kk++)
        for (int at = from; at < to; at += 64) __builtin_prefetch((const char *)rows[kk] + at, 0, 2);
}

/* Queries of tokens [t0, t1) of segment b, heads of kv heads [g0, g0 + ng) (query i: kv head
 * g0 + i / per_head, token t0 + i % per_head / rep, head (g0 + i / per_head) * rep + i % rep,
 * per_head = (t1 - t0) * rep), block by block: each block of positions is scored (then
 * weighed) for every kv head of the task before the next block, so a block's whole pool
 * rows are read once, while in the cache; span: the bytes of each row, from the first head's
 * on, that the task reads, requested ahead. Each query's sums are its own and in the same
 * order whatever ng is. */
static inline __attribute__((always_inline)) void one_task(const Args *a, int b, int g0, int ng,
                                                          int t0, int t1, float *scratch,
                                                          int stride, int span, const int d) {
    const int rep = a->heads / a->kv_heads;
    const int per_head = (t1 - t0) * rep, nq = ng * per_head;
    /* Positions the tile can see: from its first query's lowest to its last query. */
    const int p_first = a->q_start[b] + t0, p_last = a->q_start[b] + t1 - 1;
    int lo = a->first[b] > 0 ? a->first[b] : 0;
    if (a->window > 0 && p_first - a->window + 1 > lo) lo = p_first - a->window + 1;
    /* Blocks start at multiples of BLOCK, whatever the tile: a query's scores then sit in
     * the same lanes and its sums run in the same order however the step's tokens are
     * tiled -- a prefix-cache hit's suffix gives the bytes a cold run's longer chunk does. */
    const int base = lo / BLOCK * BLOCK;
    const int padded = (p_last - base + 1 + BLOCK - 1) / BLOCK * BLOCK;
    float *qf = scratch, *acc = qf + (size_t)MAX_QUERIES * d, *rows = acc + (size_t)MAX_QUERIES * d;
    float *scores = rows + (size_t)BLOCK * d;
    float *deq = scores + (size_t)MAX_QUERIES * stride; /* a block's int8 or bf16 rows, converted */
    int64_t q_at[MAX_QUERIES];
    for (int i = 0; i < nq; i++) {
        const int g = g0 + i / per_head, j = i % per_head;
        q_at[i] = (int64_t)(a->q_offset[b] + t0 + j / rep) * a->q_token_stride +
                  (int64_t)(g * rep + j % rep) * a->q_head_stride;
        load_row(qf + (int64_t)i * d, a->q, q_at[i], d, a->is_bf16);
    }
    /* int8 rows are read as bf16 where the AVX-512 BF16 path takes them, else as fp32 */
    const int fast = HAS_BF16_PATH && a->is_bf16 && d % 32 == 0 && d <= 256;
    const int stored_bf16 = (a->is_bf16 || a->kv_bf16) && (!a->kv_int8 || fast);
    /* bf16 rows off the AVX-512 BF16 path: widened once per block, then read as fp32, where
     * a head's row is read by more than 2 queries; by 1-2 (decode), widened as read -- the
     * same fp32 values (widening is exact), a pass over the block's rows less. */
    const int widen = stored_bf16 && !fast && !a->kv_int8 && per_head > 2;
    const int row_bf16 = stored_bf16 && !widen;
    const int avx2 = HAS_AVX2_PATH && d % 16 == 0 && d <= 128; /* unused without AVX2 */
    (void)avx2;
    Block blk, ahead;
    /* The rows' bytes requested AHEAD blocks ahead: a slice before each head's turn, so that
     * the requests spread over the block's arithmetic. */
    const int slice = (span / ng + 63) / 64 * 64;
    fill_block(a, b, g0, base, lo, p_last, &ahead);
    prefetch_slice(ahead.k, 0, span);
    for (int j = BLOCK; j < AHEAD * BLOCK && j < padded; j += BLOCK) {
        fill_block(a, b, g0, base + j, lo, p_last, &ahead);
        prefetch_slice(ahead.k, 0, span);
    }
    for (int j0 = 0; j0 < padded; j0 += BLOCK) {
        const int next = j0 + AHEAD * BLOCK;
        if (next < padded) fill_block(a, b, g0, base + next, lo, p_last, &ahead);
        for (int h = 0; h < ng; h++) {
            if (next < padded) prefetch_slice(ahead.k, h * slice, h + 1 < ng ? (h + 1) * slice : span);
            fill_block(a, b, g0 + h, base + j0, lo, p_last, &blk);
            if (a->kv_int8) dequantize_block(&blk, 0, d, deq, fast);
            if (widen) widen_block(&blk, 0, d, deq);
            for (int i = h * per_head; i < (h + 1) * per_head; i++) {
                const int p = a->q_start[b] + t0 + i % per_head / rep;
                float *s = scores + (int64_t)i * stride + j0;
#if HAS_BF16_PATH
                if (fast) {
                    score_block_bf16(a, b, &blk, (const uint16_t *)a->q + q_at[i], p, s, d);
                    continue;
                }
#endif
#if HAS_AVX2_PATH
                if (avx2) {
                    if (row_bf16)
                        score_block_avx2(a, b, &blk, qf + (int64_t)i * d, p, s, d, 1);
                    else
                        score_block_avx2(a, b, &blk, qf + (int64_t)i * d, p, s, d, 0);
                    continue;
                }
#endif
                score_block(a, b, &blk, qf + (int64_t)i * d, p, rows, s, d, row_bf16);
            }
        }
    }
    /* Softmax numerators in place (soft-capped first where the model says so). */
    float sums[MAX_QUERIES];
    for (int i = 0; i < nq; i++) {
        float *s = scores + (int64_t)i * stride;
        if (a->softcap > 0.0f)
            for (int j = 0; j < padded; j++)
                if (s[j] != -INFINITY) s[j] = tanhf(s[j] / a->softcap) * a->softcap;
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int j = 0; j < padded; j++) m = s[j] > m ? s[j] : m;
        float total = 0.0f;
#if defined(__AVX2__) && defined(__FMA__) /* 8 lanes (padded: whole blocks); GCC left it scalar */
        __m256 lanes = _mm256_setzero_ps();
        const __m256 top = _mm256_set1_ps(m), none = _mm256_set1_ps(-INFINITY);
        for (int j = 0; j < padded; j += 8) {
            const __m256 x = _mm256_loadu_ps(s + j);
            const __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(x, none, _CMP_EQ_OQ),
                                              exp8_nonpositive(_mm256_sub_ps(x, top)));
            _mm256_storeu_ps(s + j, e);
            lanes = _mm256_add_ps(lanes, e);
        }
        float lane[8];
        _mm256_storeu_ps(lane, lanes);
        total = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
#else
#pragma omp simd reduction(+ : total)
        for (int j = 0; j < padded; j++) {
            float e = s[j] == -INFINITY ? 0.0f : exp_nonpositive(s[j] - m);
            s[j] = e;
            total += e;
        }
#endif
        sums[i] = total;
#if HAS_BF16_PATH
        if (fast) probs_to_bf16_pairs(s, padded);
#endif
    }
    memset(acc, 0, (size_t)nq * d * sizeof(float));
    fill_block(a, b, g0, base, lo, p_last, &ahead);
    prefetch_slice(ahead.v, 0, span);
    for (int j = BLOCK; j < AHEAD * BLOCK && j < padded; j += BLOCK) {
        fill_block(a, b, g0, base + j, lo, p_last, &ahead);
        prefetch_slice(ahead.v, 0, span);
    }
    for (int j0 = 0; j0 < padded; j0 += BLOCK) {
        const int next = j0 + AHEAD * BLOCK;
        if (next < padded) fill_block(a, b, g0, base + next, lo, p_last, &ahead);
        for (int h = 0; h < ng; h++) {
            const int i0 = h * per_head, i1 = i0 + per_head;
            if (next < padded) prefetch_slice(ahead.v, h * slice, h + 1 < ng ? (h + 1) * slice : span);
            fill_block(a, b, g0 + h, base + j0, lo, p_last, &blk);
            if (a->kv_int8 && !fast) dequantize_block(&blk, 1, d, deq, 0); /* else paired below */
            if (widen) widen_block(&blk, 1, d, deq);
#if HAS_BF16_PATH
            if (fast) { /* padding rows are read, never weighed */
                if (a->kv_int8)
                    pair_values_int8(&blk, (uint32_t *)rows, d);
                else
                    pair_values_bf16(&blk, (uint32_t *)rows, d);
                for (int i = i0; i < i1; i++)
                    accumulate_block_bf16((const uint32_t *)(scores + (int64_t)i * stride) + j0 / 2,
                                          (const uint32_t *)rows, acc + (int64_t)i * d, d);
                continue;
            }
#endif
#if HAS_AVX2_PATH
            if (avx2) { /* padding rows weigh 0: never read */
                for (int i = i0; i < i1; i++) {
                    const float *probs = scores + (int64_t)i * stride + j0;
                    if (row_bf16)
                        accumulate_block_avx2(probs, &blk, acc + (int64_t)i * d, d, 1);
                    else
                        accumulate_block_avx2(probs, &blk, acc + (int64_t)i * d, d, 0);
                }
                continue;
            }
#endif
            for (int kk = 0; kk < BLOCK; kk++) /* padding rows are read, never weighed */
                load_row(rows + (int64_t)kk * d, blk.v[kk], 0, d, row_bf16);
            for (int i = i0; i < i1; i++) {
                const float *probs = scores + (int64_t)i * stride + j0;
#if HAS_BF16_PATH
                if (d % 16 == 0 && d <= 256) {
                    accumulate_block_avx512(probs, rows, acc + (int64_t)i * d, d);
                    continue;
                }
#endif
                accumulate_block(probs, rows, acc + (int64_t)i * d, d);
            }
        }
    }
    for (int i = 0; i < nq; i++) {
        const float inv = 1.0f / sums[i];
        const int j = i % per_head;
        int64_t at = (int64_t)(a->q_offset[b] + t0 + j / rep) * a->out_token_stride +
                     (int64_t)((g0 + i / per_head) * rep + j % rep) * a->out_head_stride;
        for (int e = 0; e < d; e++) store(a->out, at + e, acc[(int64_t)i * d + e] * inv, a->is_bf16);
    }
}

typedef struct {
    const Args *a;
    const int32_t *tasks; /* (segment, first token of its tile, first kv head, kv heads) */
    float *buffers;       /* per_thread floats for each worker */
    size_t per_thread;
    int tile, stride;
    int head_bytes, width; /* bytes from one kv head's row to the next's; of one's row */
} Job;

/* One task: one tile of a segment's queries, one kv head or several -- in groups whose queries
 * fit MAX_QUERIES, each group block by block (one_task). */
static void one_tile(void *ctx, int t, int worker) {
    const Job *J = ctx;
    const Args *a = J->a;
    float *scratch = J->buffers + J->per_thread * worker;
    const int32_t *task = J->tasks + 4 * (int64_t)t;
    const int b = task[0], t0 = task[1], first = task[2], heads = task[3];
    const int t1 = t0 + J->tile < a->q_count[b] ? t0 + J->tile : a->q_count[b];
    const int per_head = (t1 - t0) * (a->heads / a->kv_heads);
    const int group = MAX_QUERIES / per_head > 0 ? MAX_QUERIES / per_head : 1;
    for (int g = first; g < first + heads; g += group) {
        const int ng = first + heads - g < group ? first + heads - g : group;
        /* the group's heads' pieces of each row: whole rows where it is every kv head (a pool
         * row holds the kv heads side by side) */
        const int span = (ng - 1) * J->head_bytes + J->width;
        if (a->head_dim == 64) /* constant sizes: unrolled inner loops */
            one_task(a, b, g, ng, t0, t1, scratch, J->stride, span, 64);
        else if (a->head_dim == 128)
            one_task(a, b, g, ng, t0, t1, scratch, J->stride, span, 128);
        else
            one_task(a, b, g, ng, t0, t1, scratch, J->stride, span, a->head_dim);
    }
}

/* An int8 pool's view of the step's K/V rows: tokens [0, n) x kv heads, keys then values,
 * each as the pool holds a row (head_dim int8 values, then the scale) at rows + ((w * n + t)
 * * kv_heads + g) * (head_dim + 4): what the call attends and stores. */
typedef struct {
    int8_t *rows;
    float *scales; /* scratch: baton_quantize_rows writes them apart */
    int64_t n;
} Quantized;

/* Store the step's K/V row `n` (every kv head) in the pool: as it is, or (int8 pool) the
 * call's quantized rows `qz`. */
static inline void store_token(const Args *a, int n, const Quantized *qz) {
    const size_t size = row_element(a), row_bytes = (size_t)a->head_dim * size;
    const int64_t t = a->store_token[n];
    for (int g = 0; g < a->kv_heads; g++) {
        const int64_t at = (int64_t)a->store_unit[n] * a->unit_stride +
                           (int64_t)a->store_row[n] * a->row_stride + (int64_t)g * a->head_stride;
        if (qz != NULL) {
            const int64_t width = a->head_dim + 4;
            for (int w = 0; w < 2; w++)
                memcpy((int8_t *)(w ? a->v : a->k) + at,
                       qz->rows + ((w * qz->n + t) * a->kv_heads + g) * width, (size_t)width);
            continue;
        }
        memcpy((char *)a->k + at * size,
               (const char *)a->fresh_k + (t * a->fk_token_stride + g * a->fk_head_stride) * size,
               row_bytes);
        memcpy((char *)a->v + at * size,
               (const char *)a->fresh_v + (t * a->fv_token_stride + g * a->fv_head_stride) * size,
               row_bytes);
    }
}

/* The step's K/V rows [0, qz->n) quantized into qz->rows for an int8 pool. */
static void quantize_step(const Args *a, const Quantized *qz, int num_threads, int pooled) {
    const int d = a->head_dim, kv = a->kv_heads, size = a->is_bf16 ? 2 : 4, width = d + 4;
    const int64_t n = qz->n;
    if (pooled) num_threads = 1; /* a small step: no OpenMP region on pool.c's cores */
    PARALLEL_FOR(t, n, n * kv * d > 65536, {
        for (int w = 0; w < 2; w++) {
            const char *src = (const char *)(w ? a->fresh_v : a->fresh_k) +
                              t * (w ? a->fv_token_stride : a->fk_token_stride) * size;
            const int64_t r = (w * n + t) * kv;
            /* d values zero-padded to d + 4 (the scale's bytes, written next) per row */
            baton_quantize_rows(src, w ? a->fv_head_stride : a->fk_head_stride, kv, d, width,
                                a->is_bf16, qz->rows + r * width, qz->scales + r, 1);
            for (int g = 0; g < kv; g++)
                memcpy(qz->rows + (r + g) * width + d, qz->scales + r + g, sizeof(float));
        }
    });
}

/* The step's K/V rows [0, n) rounded to bf16 into rows (keys, then values; token t, kv head
 * g at (w * n + t) * kv_heads + g rows of head_dim) for a bf16 pool under fp32 activations. */
static void round_step(const Args *a, uint16_t *rows, int64_t n, int num_threads, int pooled) {
    const int d = a->head_dim, kv = a->kv_heads;
    if (pooled) num_threads = 1; /* a small step: no OpenMP region on pool.c's cores */
    PARALLEL_FOR(t, n, n * kv * d > 65536, {
        for (int w = 0; w < 2; w++) {
            const float *src = (const float *)(w ? a->fresh_v : a->fresh_k) +
                               t * (w ? a->fv_token_stride : a->fk_token_stride);
            const int64_t head = w ? a->fv_head_stride : a->fk_head_stride;
            uint16_t *dst = rows + (w * n + t) * kv * d;
            for (int g = 0; g < kv; g++)
                for (int e = 0; e < d; e++) store(dst, (int64_t)g * d + e, src[g * head + e], 1);
        }
    });
}

static int attend(const Args *a, int32_t batch, int32_t num_threads, int pooled,
                  const Quantized *qz);

/* The step's tokens a call reads or stores. */
static int64_t step_tokens(const Args *a, int32_t batch) {
    int64_t n = 0;
    for (int b = 0; b < batch; b++)
        n = a->q_offset[b] + a->q_count[b] > n ? a->q_offset[b] + a->q_count[b] : n;
    for (int i = 0; i < a->num_stores; i++) n = a->store_token[i] + 1 > n ? a->store_token[i] + 1 : n;
    return n;
}

/* Returns 0, or -1 when a size is beyond this kernel or memory is short (the caller then
 * takes the torch path). pooled: the tasks run on pool.c's threads (a small step's call from
 * layer.c), else on OpenMP's (torch's). */
int baton_paged_attention_on(const Args *a, int32_t batch, int32_t num_threads, int pooled) {
    if (a->kv_bf16 && !a->is_bf16) { /* attends and stores the step's rows rounded */
        const int64_t n = step_tokens(a, batch), width = (int64_t)a->kv_heads * a->head_dim;
        uint16_t *rows = malloc((size_t)(2 * n * width > 0 ? 2 * n * width : 1) * 2);
        if (rows == NULL) return -1;
        round_step(a, rows, n, num_threads, pooled);
        Args r = *a;
        r.fresh_k = rows, r.fresh_v = rows + n * width;
        r.fk_token_stride = r.fv_token_stride = width;
        r.fk_head_stride = r.fv_head_stride = a->head_dim;
        const int status = attend(&r, batch, num_threads, pooled, NULL);
        free(rows);
        return status;
    }
    if (!a->kv_int8) return attend(a, batch, num_threads, pooled, NULL);
    const int64_t n = step_tokens(a, batch);
    const size_t rows = (size_t)(2 * n * a->kv_heads > 0 ? 2 * n * a->kv_heads : 1);
    const int64_t width = a->head_dim + 4;
    Quantized qz = {malloc(rows * width), malloc(rows * sizeof(float)), n};
    int status = -1;
    if (qz.rows != NULL && qz.scales != NULL) {
        quantize_step(a, &qz, num_threads, pooled);
        Args r = *a; /* attends the quantized rows (fill_block reads them as the pool's) */
        r.fresh_k = qz.rows, r.fresh_v = qz.rows + n * a->kv_heads * width;
        r.fk_token_stride = r.fv_token_stride = a->kv_heads * width;
        r.fk_head_stride = r.fv_head_stride = width;
        status = attend(&r, batch, num_threads, pooled, &qz);
    }
    free(qz.rows);
    free(qz.scales);
    return status;
}

static int attend(const Args *a, int32_t batch, int32_t num_threads, int pooled,
                  const Quantized *qz) {
    const int rep = a->heads / a->kv_heads;
    if (rep > MAX_QUERIES || num_threads < 1) return -1;
    const int tile = MAX_QUERIES / rep; /* tokens per task */
    int span = 1; /* most positions one tile sees */
    for (int b = 0; b < batch; b++) {
        int n = a->q_start[b] + a->q_count[b] - a->first[b];
        if (a->window > 0 && n > a->window + tile - 1) n = a->window + tile - 1;
        span = n > span ? n : span;
    }
    /* Scores per query: the span and a block's start before it (one_task's base). */
    const int stride = (span + 2 * (BLOCK - 1)) / BLOCK * BLOCK;
    const size_t per_thread = (size_t)MAX_QUERIES * a->head_dim * 2 +
                              (size_t)BLOCK * a->head_dim + (size_t)MAX_QUERIES * stride +
                              (size_t)BLOCK * a->head_dim; /* a block's rows, widened */
    /* Tasks: (segment, first token of its tile) x kv heads, long segments split in tiles; a
     * short tile (decode, verification: at most SHORT_TILE tokens) takes `heads` kv heads a
     * task -- all of them (whole rows read), unless that leaves fewer than TASKS_PER_THREAD
     * tasks per thread (batch-1 decode: one per kv head). A long tile (a prompt chunk's) is
     * work enough per head, and its tasks balance the threads better one head each. */
    const int kv = a->kv_heads;
    int num_short = 0, num_long = 0;
    for (int b = 0; b < batch; b++)
        for (int t0 = 0; t0 < a->q_count[b]; t0 += tile)
            *(a->q_count[b] - t0 <= SHORT_TILE ? &num_short : &num_long) += 1;
    int heads = baton_attention_heads_together ? kv : 1;
    while (heads > 1 && num_short * (kv / heads) + num_long * kv < TASKS_PER_THREAD * num_threads) {
        do heads--;
        while (kv % heads);
    }
    const int tasks = num_short * (kv / heads) + num_long * kv;
    int32_t *list = malloc(sizeof(int32_t) * 4 * (tasks > 0 ? tasks : 1));
    float *buffers = malloc(per_thread * num_threads * sizeof(float));
    if (list == NULL || buffers == NULL) {
        free(list);
        free(buffers);
        return -1;
    }
    for (int b = 0, n = 0; b < batch; b++)
        for (int t0 = 0; t0 < a->q_count[b]; t0 += tile) {
            const int per_task = a->q_count[b] - t0 <= SHORT_TILE ? heads : 1;
            for (int g = 0; g < kv; g += per_task, n++) {
                int32_t *task = list + 4 * (int64_t)n;
                task[0] = b, task[1] = t0, task[2] = g, task[3] = per_task;
            }
        }
    const int size = row_element(a), width = a->kv_int8 ? a->head_dim + 4 : a->head_dim * size;
    const int head_bytes = (int)(a->head_stride * (a->kv_int8 ? 1 : size));
    const Job job = {a, list, buffers, per_thread, tile, stride, head_bytes, width};
    if (pooled) {
        baton_parallel(one_tile, (void *)&job, tasks, num_threads);
    } else if (num_threads > 1 && tasks > 1) {
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
        for (int t = 0; t < tasks; t++) one_tile((void *)&job, t, omp_get_thread_num());
    } else {
        for (int t = 0; t < tasks; t++) one_tile((void *)&job, t, 0);
    }
    free(list);
    free(buffers);
    /* Then the step's K/V go into the pool (after every read: a ring row may be both). */
    PARALLEL_FOR(n, a->num_stores, a->num_stores > 256, store_token(a, (int)n, qz));
    return 0;
}

int baton_paged_attention(const Args *a, int32_t batch, int32_t num_threads) {
    return baton_paged_attention_on(a, batch, num_threads, 0);
}

typedef struct { /* a plan's segment: its lowest visible position, the pages read, stores */
    int first, first_page, num_pages, store_from, end;
} Span;

static inline Span plan_span(const Args *a, const int32_t *seg, int keep, int covers_own) {
    const int start = seg[1], end = start + seg[2], read_end = covers_own ? end : start;
    const int first = baton_first_visible(start, a->window, seg[3]);
    const int pages = first < read_end ? (read_end - 1) / a->rows - first / a->rows + 1 : 0;
    const Span span = {first, first / a->rows, pages,
                       keep >= 0 && end - keep > start ? end - keep : start, end};
    return span;
}

/* The index lists of a batch plan (paged_attention.py ``PagedAttentionCall``) from each
 * segment's unit table: tables[b] -> the request's units by logical index (-1: none held),
 * table_lens[b] of them; segs [batch, 4]: per segment the step token of its first query,
 * that query's position, its queries, its floor (no lower position is read). The context
 * read is [first, start) -- [first, start + count) with covers_own -- first = max(floor,
 * start - window + 1, 0) capped at start: on pages the units covering it and key_base the
 * position of the first one's row 0; a ring's one unit (key_base 0). Stored: the segment's
 * positions from max(start, end - keep) (keep < 0: all) at (unit, row) of position p: pages
 * table[p / rows], p % rows; a ring table[0], p % rows. Uses a's rows, window and is_ring;
 * sets its list pointers (into `buffer`, `capacity` int32s, in the layout those fields
 * describe), max_units and num_stores. 0; -1: the buffer is too small; -2: a unit the plan
 * needs is not in the table. */
int baton_paged_plan(Args *a, int32_t batch, const int64_t *tables, const int32_t *table_lens,
                     const int32_t *segs, int32_t keep, int32_t covers_own, int32_t *buffer,
                     int64_t capacity) {
    const int rows = a->rows;
    int max_units = 0;
    int64_t num_stores = 0;
    for (int b = 0; b < batch; b++) {
        const Span sp = plan_span(a, segs + 4 * b, keep, covers_own);
        const int units = a->is_ring ? 1 : sp.num_pages;
        max_units = units > max_units ? units : max_units;
        num_stores += sp.end - sp.store_from;
    }
    if ((int64_t)batch * (max_units + 6) + 3 * num_stores > capacity) return -1;
    int32_t *units = buffer, *num_units = units + (int64_t)batch * max_units;
    int32_t *key_base = num_units + batch, *q_offset = key_base + batch;
    int32_t *q_start = q_offset + batch, *q_count = q_start + batch, *firsts = q_count + batch;
    int32_t *store_token = firsts + batch, *store_unit = store_token + num_stores;
    int32_t *store_row = store_unit + num_stores;
    for (int b = 0, n = 0; b < batch; b++) {
        const int32_t *table = (const int32_t *)(intptr_t)tables[b], *seg = segs + 4 * b;
        const int len = table_lens[b];
        const Span sp = plan_span(a, seg, keep, covers_own);
        int32_t *row_units = units + (int64_t)b * max_units;
        int held = 0;
        if (a->is_ring) {
            if (len < 1 || table[0] < 0) return -2;
            row_units[held++] = table[0];
            key_base[b] = 0;
        } else {
            key_base[b] = sp.first_page * rows;
            for (int p = sp.first_page; p < sp.first_page + sp.num_pages; p++) {
                if (p >= len || table[p] < 0) return -2;
                row_units[held++] = table[p];
            }
        }
        for (int u = held; u < max_units; u++) row_units[u] = 0;
        num_units[b] = held, q_offset[b] = seg[0], q_start[b] = seg[1], q_count[b] = seg[2];
        firsts[b] = sp.first;
        for (int p = sp.store_from; p < sp.end; p++, n++) {
            const int logical = a->is_ring ? 0 : p / rows;
            if (logical >= len || table[logical] < 0) return -2;
            store_token[n] = seg[0] + p - seg[1];
            store_unit[n] = table[logical], store_row[n] = p % rows;
        }
    }
    a->units = units, a->num_units = num_units, a->key_base = key_base, a->q_offset = q_offset;
    a->q_start = q_start, a->q_count = q_count, a->first = firsts;
    a->store_token = store_token, a->store_unit = store_unit, a->store_row = store_row;
    a->max_units = max_units, a->num_stores = (int32_t)num_stores;
    return 0;
}
