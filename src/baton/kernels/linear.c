/* A matmul for a few rows -- decode, speculative verification, draft steps -- that reads
 * the weight once for all of them:
 *
 *   y[m, n] = epilogue(sum_k x[m, k] * w[n, k] + bias[n], other[m, n])
 *
 * epilogue: none, add (a residual), mul (the gated MLP's up times act(gate)), silu, gelu
 * (tanh approximation). The weight is packed once (baton/kernels/linear.py ``PackedRows``)
 * in panels of PANEL = 16 output columns: panel b holds w[16 b + c, i] at [b][i][c], so a
 * panel is one contiguous stream and 16 outputs of a row are two 8-lane accumulators fed by
 * a broadcast of x[r, i] -- no horizontal sums, and every weight load serves all the rows
 * of a group (up to GROUP): a 4-row verification step costs little more than one row (the
 * BLAS sgemm it replaces takes 2-4x a row's time for 2-8 rows here, and ~20-30 us per call
 * of fixed cost for any). In bf16 a panel's 16 values of one i are interleaved (columns
 * 0..7 at even positions, 8..15 at odd ones) so that a shift and a mask widen them to two
 * fp32 vectors; where the CPU multiplies bf16 pairs (AVX-512 BF16) bf16 rows times bf16
 * panels take the pair tiles instead (two panel rows, paired by a permute, per vdpbf16ps:
 * twice the multiply-adds per instruction, other sums; for 2 rows or more two panels at
 * once, each broadcast feeding both). Panels are split over pool.c's
 * threads, a few panels per task (a small step's calls: see there why not OpenMP's); a call
 * below ~64 K multiply-adds runs on one thread. Columns past n in the last panel are zeros and never
 * stored.
 *
 * x (m rows, row stride x_stride, k contiguous), other (row stride other_stride) and y
 * (row stride y_stride) are bf16 (act_bf16) or fp32; the packed weight is fp32, bf16 or
 * int8 (w_format: kernels.h's W_*), its bias bf16 for a bf16 weight, else fp32. An int8
 * weight (weight-only quantization, baton/model/quantize.py) is symmetric per output
 * column: a panel's 16 x k integers, widened to fp32 as they are loaded (a quarter of fp32's
 * bytes, half of bf16's: a decode step streams its weights), then its 16 columns' fp32
 * scales, applied once to each sum. Arithmetic is fp32. Rounding follows the torch path this replaces
 * (baton/model/layers.py FrozenLinear): unpacked, the matmul's result is rounded to the
 * activation dtype, then each epilogue op rounds again; with EPI_ROUND_ONCE in op (oneDNN's
 * packed bf16 matmul, whose post-op works on the fp32 result) the epilogue rounds once.
 * The sum over k runs in order, in up to 4 interleaved partial sums for 1-3 rows (one
 * chain of multiply-adds would wait on their latency), so fp32 results differ from BLAS's
 * in the last bits (tests compare within tolerance, and greedy tokens); which thread
 * computes a panel changes nothing.
 * Built and loaded by baton/kernels/__init__.py; Python side: baton/kernels/linear.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fastmath.h"
#include "kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif

/* MACS_PER_THREAD: a matmul gets a thread per 32768 multiply-adds (``baton_threads_for``):
 * two threads from 65536 on, as before that rule; a 256-wide one-row matmul 2, not 16. */
enum { GROUP = 6, PANEL = 16, MACS_PER_THREAD = 32768, TASKS_PER_THREAD = 4 };

/* A tile of 2 rows or more asks for its panel's bytes AHEAD_BYTES ahead of the ones it
 * multiplies (into the next panel at its end): it multiplies each weight into every row,
 * slower than memory streams it, and the hardware's own prefetch alone left it waiting on
 * the panel (AVX2 8-row decode steps ~1.4x faster with it; docs/measurements/
 * 2026-12-06-zen4-5.md). One row streams at memory's rate without it: not asked there. */
enum { AHEAD_BYTES = 2048 };
#define AHEAD(rows, base, offset)                                                              \
    do {                                                                                       \
        if (rows > 1) __builtin_prefetch((const char *)(base) + (offset) + AHEAD_BYTES);       \
    } while (0)

/* The column a bf16 panel holds at position p of one i (see the layout above). */
static inline int bf16_column(int p) { return (p & 1) * 8 + p / 2; }

/* tile_R: tile_R_of with the weight format (fp32 or bf16) a constant in each copy. */
#define DISPATCH_TILE(R)                                                                      \
    static void tile_##R(const float *x, int k, const void *p, int w_format, float *out) {    \
        if (w_format == W_BF16)                                                               \
            tile_##R##_of(x, k, p, W_BF16, out);                                              \
        else                                                                                  \
            tile_##R##_of(x, k, p, W_F32, out);                                               \
    }

#if defined(HAVE_AVX512)
/* w[16 b + c, i] for the panel's 16 columns c (already at panel b); in bf16 in the panel's
 * order (lane 2 c + h holds column 8 h + c), which the tile puts right when it stores. */
static inline __m512 load16(const void *p, int64_t i, const int w_format) {
    if (w_format == W_BF16) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + 16 * i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
    }
    return _mm512_loadu_ps((const float *)p + 16 * i);
}

/* The AVX2 tile below with one 16-lane accumulator per row and partial sum: the same
 * multiply-adds in the same order per column, so the same bits, at half the instructions. */
#define DEFINE_TILE(R, U)                                                                     \
    static inline __attribute__((always_inline)) void tile_##R##_of(                          \
        const float *x, int k, const void *p, const int w_format, float *out) {               \
        __m512 acc[U][R];                                                                     \
        _Pragma("GCC unroll 8") for (int u = 0; u < U; u++)                                   \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[u][r] = _mm512_setzero_ps(); \
        int i = 0;                                                                            \
        for (; i + U <= k; i += U)                                                            \
            _Pragma("GCC unroll 8") for (int u = 0; u < U; u++) {                             \
                AHEAD(R, p, (w_format == W_BF16 ? 32 : 64) * (int64_t)(i + u));               \
                const __m512 w = load16(p, i + u, w_format);                                  \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[u][r] = _mm512_fmadd_ps( \
                    w, _mm512_set1_ps(x[(int64_t)r * k + i + u]), acc[u][r]);                 \
            }                                                                                 \
        for (; i < k; i++) {                                                                  \
            const __m512 w = load16(p, i, w_format);                                          \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[0][r] =                   \
                _mm512_fmadd_ps(w, _mm512_set1_ps(x[(int64_t)r * k + i]), acc[0][r]);         \
        }                                                                                     \
        const __m512i column_at = /* bf16: column c sits in lane 2 (c % 8) + c / 8 */         \
            _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);          \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                 \
            __m512 sum = acc[0][r];                                                           \
            _Pragma("GCC unroll 8") for (int u = 1; u < U; u++)                               \
                sum = _mm512_add_ps(sum, acc[u][r]);                                          \
            if (w_format == W_BF16) sum = _mm512_permutexvar_ps(column_at, sum);              \
            _mm512_storeu_ps(out + r * 16, sum);                                              \
        }                                                                                     \
    }                                                                                         \
    DISPATCH_TILE(R)
#elif defined(HAVE_AVX2)
/* w[16 b + c, i] for c < 8 (lo) and c >= 8 (hi) of panel `p` (already at panel b). */
static inline void load16(const void *p, int64_t i, const int w_format, __m256 *lo, __m256 *hi) {
    if (w_format == W_BF16) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + 16 * i));
        *lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        *hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
    } else {
        *lo = _mm256_loadu_ps((const float *)p + 16 * i);
        *hi = _mm256_loadu_ps((const float *)p + 16 * i + 8);
    }
}

/* out[r * 16 + c] = sum_i x[r, i] w[16 b + c, i] for R rows of fp32 x (k apart) and the
 * panel at p; U interleaved partial sums (R x 2 x U accumulators within 12 registers),
 * added in order at the end. R, U and the weight dtype are constants in each copy. */
#define DEFINE_TILE(R, U)                                                                     \
    static inline __attribute__((always_inline)) void tile_##R##_of(                          \
        const float *x, int k, const void *p, const int w_format, float *out) {               \
        __m256 acc[U][R][2];                                                                  \
        _Pragma("GCC unroll 8") for (int u = 0; u < U; u++)                                                           \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[u][r][0] = acc[u][r][1] = _mm256_setzero_ps();   \
        int i = 0;                                                                            \
        for (; i + U <= k; i += U)                                                            \
            _Pragma("GCC unroll 8") for (int u = 0; u < U; u++) {                                                     \
                __m256 lo, hi;                                                                \
                AHEAD(R, p, (w_format == W_BF16 ? 32 : 64) * (int64_t)(i + u));               \
                load16(p, i + u, w_format, &lo, &hi);                                         \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                                 \
                    const __m256 b = _mm256_broadcast_ss(x + (int64_t)r * k + i + u);         \
                    acc[u][r][0] = _mm256_fmadd_ps(lo, b, acc[u][r][0]);                      \
                    acc[u][r][1] = _mm256_fmadd_ps(hi, b, acc[u][r][1]);                      \
                }                                                                             \
            }                                                                                 \
        for (; i < k; i++) {                                                                  \
            __m256 lo, hi;                                                                    \
            load16(p, i, w_format, &lo, &hi);                                                 \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                                     \
                const __m256 b = _mm256_broadcast_ss(x + (int64_t)r * k + i);                 \
                acc[0][r][0] = _mm256_fmadd_ps(lo, b, acc[0][r][0]);                          \
                acc[0][r][1] = _mm256_fmadd_ps(hi, b, acc[0][r][1]);                          \
            }                                                                                 \
        }                                                                                     \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                                         \
            __m256 s0 = acc[0][r][0], s1 = acc[0][r][1];                                      \
            _Pragma("GCC unroll 8") for (int u = 1; u < U; u++)                                                       \
                s0 = _mm256_add_ps(s0, acc[u][r][0]), s1 = _mm256_add_ps(s1, acc[u][r][1]);   \
            _mm256_storeu_ps(out + r * 16, s0);                                               \
            _mm256_storeu_ps(out + r * 16 + 8, s1);                                           \
        }                                                                                     \
    }                                                                                         \
    DISPATCH_TILE(R)
#else
/* Portable C, the same sums in the same order. */
#define DEFINE_TILE(R, U)                                                                     \
    static void tile_##R(const float *x, int k, const void *p, int w_format, float *out) {    \
        float acc[U][R][16];                                                                  \
        memset(acc, 0, sizeof acc);                                                           \
        int i = 0;                                                                            \
        for (; i + U <= k; i += U)                                                            \
            for (int u = 0; u < U; u++)                                                       \
                for (int q = 0; q < 16; q++) {                                                \
                    const int c = w_format == W_BF16 ? bf16_column(q) : q;                    \
                    const float w = to_f32(p, 16 * (int64_t)(i + u) + q, w_format);        \
                    for (int r = 0; r < R; r++)                                               \
                        acc[u][r][c] = fmaf(w, x[(int64_t)r * k + i + u], acc[u][r][c]);      \
                }                                                                             \
        for (; i < k; i++)                                                                    \
            for (int q = 0; q < 16; q++) {                                                    \
                const int c = w_format == W_BF16 ? bf16_column(q) : q;                        \
                const float w = to_f32(p, 16 * (int64_t)i + q, w_format);                  \
                for (int r = 0; r < R; r++)                                                   \
                    acc[0][r][c] = fmaf(w, x[(int64_t)r * k + i], acc[0][r][c]);              \
            }                                                                                 \
        for (int r = 0; r < R; r++)                                                           \
            for (int c = 0; c < 16; c++) {                                                    \
                float s = acc[0][r][c];                                                       \
                for (int u = 1; u < U; u++) s += acc[u][r][c];                                \
                out[r * 16 + c] = s;                                                          \
            }                                                                                 \
    }
#endif

DEFINE_TILE(1, 4)
DEFINE_TILE(2, 2)
DEFINE_TILE(3, 2)
DEFINE_TILE(4, 1)
DEFINE_TILE(5, 1)
DEFINE_TILE(6, 1)

typedef void (*tile_fn)(const float *, int, const void *, int, float *);
static const tile_fn TILES[GROUP + 1] = {NULL, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};

#if defined(HAVE_AVX512) && defined(__AVX512BF16__)
#define HAVE_PAIRS 1
/* bf16 activations and weights where the CPU multiplies bf16 pairs (vdpbf16ps, as oneDNN's
 * bf16 matmuls do): out[r * 16 + c] = sum over pairs j of x[r, 2j] w[c, 2j] + x[r, 2j+1]
 * w[c, 2j+1], twice the multiply-adds per instruction of the widened fp32 tiles. xb: the rows
 * in bf16, kp (k rounded up to even) apart, zero-padded. Two panel rows i, i+1 (adjacent)
 * are one 64-byte load, their columns paired by one permute; an odd k's last row pairs with
 * zeros. NOTE: other bits than the fp32 tiles (pairs summed in the instruction's order).
 * P (1 or 2) adjacent panels at once (the second at p + second, its outputs at out2): each
 * broadcast of a row's pair then feeds P multiply-adds (one broadcast and one panel load per
 * multiply-add held the one-panel tile of 4-6 rows to ~1.4 vdpbf16ps per cycle on a Zen 5);
 * every output's sum is the one-panel tile's, in its order. */
#define DEFINE_PAIR_TILE(NAME, R, U, P)                                                       \
    static void NAME(const uint16_t *xb, int k, int kp, const void *p, int64_t second,        \
                     float *out, float *out2) {                                               \
        const __m512i pair_at = _mm512_loadu_si512(PAIR_AT);                                  \
        const uint16_t *w[2] = {p, (const uint16_t *)p + second};                             \
        float *outs[2] = {out, out2};                                                         \
        __m512 acc[P][U][R], v[P];                                                            \
        _Pragma("GCC unroll 2") for (int q = 0; q < P; q++)                                   \
            _Pragma("GCC unroll 8") for (int u = 0; u < U; u++)                               \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                           \
                    acc[q][u][r] = _mm512_setzero_ps();                                       \
        const int pairs = k / 2;                                                              \
        int j = 0;                                                                            \
        for (; j + U <= pairs; j += U)                                                        \
            _Pragma("GCC unroll 8") for (int u = 0; u < U; u++) {                             \
                _Pragma("GCC unroll 2") for (int q = 0; q < P; q++)                           \
                    AHEAD(R, w[q], 64 * (int64_t)(j + u));                                    \
                _Pragma("GCC unroll 2") for (int q = 0; q < P; q++) v[q] = (__m512)           \
                    _mm512_permutexvar_epi16(pair_at,                                         \
                                             _mm512_loadu_si512(w[q] + 32 * (int64_t)(j + u))); \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                         \
                    const __m512bh xr = (__m512bh)_mm512_set1_epi32(                          \
                        *(const int32_t *)(xb + (int64_t)r * kp + 2 * (j + u)));              \
                    _Pragma("GCC unroll 2") for (int q = 0; q < P; q++) acc[q][u][r] =        \
                        _mm512_dpbf16_ps(acc[q][u][r], xr, (__m512bh)v[q]);                   \
                }                                                                             \
            }                                                                                 \
        for (; j < (k + 1) / 2; j++) {                                                        \
            _Pragma("GCC unroll 2") for (int q = 0; q < P; q++) v[q] = (__m512)               \
                _mm512_permutexvar_epi16(pair_at,                                             \
                    2 * j + 1 < k ? _mm512_loadu_si512(w[q] + 32 * (int64_t)j)                \
                                  : _mm512_zextsi256_si512(_mm256_loadu_si256(                \
                                        (const __m256i *)(w[q] + 32 * (int64_t)j))));         \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                             \
                const __m512bh xr = (__m512bh)_mm512_set1_epi32(                              \
                    *(const int32_t *)(xb + (int64_t)r * kp + 2 * j));                        \
                _Pragma("GCC unroll 2") for (int q = 0; q < P; q++) acc[q][0][r] =            \
                    _mm512_dpbf16_ps(acc[q][0][r], xr, (__m512bh)v[q]);                       \
            }                                                                                 \
        }                                                                                     \
        _Pragma("GCC unroll 2") for (int q = 0; q < P; q++)                                   \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                             \
                __m512 sum = acc[q][0][r];                                                    \
                _Pragma("GCC unroll 8") for (int u = 1; u < U; u++)                           \
                    sum = _mm512_add_ps(sum, acc[q][u][r]);                                   \
                _mm512_storeu_ps(outs[q] + r * 16, sum);                                      \
            }                                                                                 \
    }
/* Element 2c of a permuted pair of panel rows: column c of row i (position 2 (c % 8) +
 * c / 8), element 2c + 1: of row i + 1 (16 further): the lanes then hold the columns in
 * order. */
static const uint16_t PAIR_AT[32] = {0, 16, 2, 18, 4,  20, 6,  22, 8,  24, 10,
                                     26, 12, 28, 14, 30, 1, 17, 3,  19, 5,  21,
                                     7,  23, 9,  25, 11, 27, 13, 29, 15, 31};
/* 8 to 12 independent sums in flight: a vdpbf16ps waits on its accumulator's last. */
DEFINE_PAIR_TILE(pair_tile_1, 1, 8, 1)
DEFINE_PAIR_TILE(pair_tile_2, 2, 4, 1)
DEFINE_PAIR_TILE(pair_tile_3, 3, 4, 1)
DEFINE_PAIR_TILE(pair_tile_4, 4, 2, 1)
DEFINE_PAIR_TILE(pair_tile_5, 5, 2, 1)
DEFINE_PAIR_TILE(pair_tile_6, 6, 2, 1)
DEFINE_PAIR_TILE(pair_tile2_1, 1, 8, 2) /* a group's last row */
DEFINE_PAIR_TILE(pair_tile2_2, 2, 4, 2)
DEFINE_PAIR_TILE(pair_tile2_3, 3, 4, 2)
DEFINE_PAIR_TILE(pair_tile2_4, 4, 2, 2)
DEFINE_PAIR_TILE(pair_tile2_5, 5, 2, 2)
DEFINE_PAIR_TILE(pair_tile2_6, 6, 2, 2)
typedef void (*pair_tile_fn)(const uint16_t *, int, int, const void *, int64_t, float *, float *);
static const pair_tile_fn PAIR_TILES[2][GROUP + 1] = { /* [panels at once - 1][rows] */
    {NULL, pair_tile_1, pair_tile_2, pair_tile_3, pair_tile_4, pair_tile_5, pair_tile_6},
    {NULL, pair_tile2_1, pair_tile2_2, pair_tile2_3, pair_tile2_4, pair_tile2_5, pair_tile2_6}};
#else
#define HAVE_PAIRS 0
#endif

/* int8 weights times int8 rows (W8A8): each row quantized to int8 for the call (symmetric,
 * its own scale: max |x| / 127, round to nearest even), then exact integer sums -- where
 * the CPU's int8 multiply-adds are 2-4x denser than fp32 FMAs and a weight is a byte. A
 * panel holds, per quad j of inputs (k padded with zeros to whole quads), 16 columns x 4
 * bytes: w[16 b + c, 4 j + t] at [j][c][t], so one 32-byte load is 8 columns' quads. On
 * AVX2 (and the AVX-512 builds, which run the same 256-bit code) vpmaddubsw multiplies |w|
 * (unsigned, taken once per load: -128, which a checkpoint may hold, is 128) by x with w's
 * sign (vpsignb; x is -127..127, so its negation exists) and adds pairs into 16 bits -- at
 * most 2 x 128 x 127, no saturation -- and vpmaddwd adds the pairs into 32 bits: a quad of
 * inputs for 8 columns in 4 instructions per row, its broadcast shared by the two halves.
 * out[r * 16 + c] = the sum over k of xq[r, i] w[c, i], exact (int32). */
#define DEFINE_INT8_TILE(R)                                                                   \
    static void int8_tile_##R(const int8_t *xq, int64_t stride, int quads, const int8_t *p,   \
                              int32_t *out) {                                                 \
        INT8_TILE_BODY(R)                                                                     \
    }
#if defined(HAVE_AVX512) && defined(__AVX512VNNI__)
/* AVX-512 VNNI (Cascade Lake and later, Zen 4): a panel's quad j is one 64-byte register,
 * 16 columns x 4 inputs, and vpdpbusd adds each column's 4 products of an unsigned byte and
 * a signed one into its 32-bit sum in one instruction -- exact, no 16-bit stage. The
 * weights are the signed operand as they are (-128 included); the row's bytes are made
 * unsigned, x + 128 (x is -127..127: run() flips their sign bits once per call), so a
 * column's sum is sum (x + 128) w = sum x w + 128 sum w, sum w stored in the panel (after
 * the scales): per row and quad a broadcast and the vpdpbusd, nothing per load but the
 * load (|w| as the unsigned side and x with w's sign as the signed one took two more per
 * load and one more per row; 6-row tiles ~1.5x faster without). Each row's sums are kept
 * in INT8_CHAINS(R) independent chains of quads, added at the end -- integer sums, the same
 * in any order -- since a vpdpbusd waits for the last one into its register (~5 cycles on a
 * Zen 4): one chain held one row to a fifth of the instruction's rate (a 1024 x 3072
 * matmul of one row 1.4x faster with 4). INT8_VNNI: run() hands these tiles x + 128, and
 * some_panels gives them rows in groups of even sizes (tiles of 1-2 rows cost more a row
 * than 3-6). */
#define INT8_VNNI 1
#define INT8_CHAINS(R) ((R) == 1 ? 4 : (R) <= 4 ? 2 : 1)
#define INT8_QUAD(R, c, jj)                                                                   \
    do {                                                                                      \
        __m512i w = _mm512_loadu_si512((const void *)(p + 64 * (int64_t)(jj)));              \
        __asm__("" : "+v"(w)); /* one load for the R rows: not folded into each vpdpbusd */    \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                 \
            int32_t sq;                                                                       \
            memcpy(&sq, xq + r * stride + 4 * (int64_t)(jj), 4);                              \
            acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], _mm512_set1_epi32(sq), w);             \
        }                                                                                     \
    } while (0)
#define INT8_TILE_BODY(R)                                                                     \
    enum { C = INT8_CHAINS(R) };                                                              \
    const __m512i zero = _mm512_setzero_si512();                                              \
    __m512i acc[R][C];                                                                        \
    _Pragma("GCC unroll 4") for (int c = 0; c < C; c++)                                       \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[r][c] = zero;                 \
    int j = 0;                                                                                \
    for (; j + C <= quads; j += C) {                                                          \
        _Pragma("GCC unroll 4") for (int c = 0; c < C; c++) {                                 \
            AHEAD(R, p, 64 * (int64_t)(j + c));                                               \
            INT8_QUAD(R, c, j + c);                                                           \
        }                                                                                     \
    }                                                                                         \
    for (; j < quads; j++) INT8_QUAD(R, 0, j);                                                \
    const __m512i bias = _mm512_slli_epi32(                                                   \
        _mm512_loadu_si512((const void *)(p + 64 * (int64_t)quads + 16 * 4)), 7);            \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                     \
        __m512i sum = acc[r][0];                                                              \
        _Pragma("GCC unroll 4") for (int c = 1; c < C; c++)                                   \
            sum = _mm512_add_epi32(sum, acc[r][c]);                                           \
        _mm512_storeu_si512((void *)(out + r * 16), _mm512_sub_epi32(sum, bias));             \
    }
#elif defined(HAVE_AVX512) || defined(HAVE_AVX2)
#define INT8_TILE_BODY(R)                                                                     \
    __m256i acc[R][2];                                                                        \
    const __m256i ones = _mm256_set1_epi16(1);                                                \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] =               \
        _mm256_setzero_si256();                                                               \
    for (int j = 0; j < quads; j++) {                                                         \
        AHEAD(R, p, 64 * (int64_t)j);                                                         \
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(p + 64 * (int64_t)j));        \
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(p + 64 * (int64_t)j + 32));   \
        const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);                     \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                 \
            int32_t sq;                                                                       \
            memcpy(&sq, xq + r * stride + 4 * (int64_t)j, 4);                                 \
            const __m256i xs = _mm256_set1_epi32(sq);                                         \
            acc[r][0] = _mm256_add_epi32(                                                     \
                acc[r][0],                                                                    \
                _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(xs, w0)), ones)); \
            acc[r][1] = _mm256_add_epi32(                                                     \
                acc[r][1],                                                                    \
                _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(xs, w1)), ones)); \
        }                                                                                     \
    }                                                                                         \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                     \
        _mm256_storeu_si256((__m256i *)(out + r * 16), acc[r][0]);                            \
        _mm256_storeu_si256((__m256i *)(out + r * 16 + 8), acc[r][1]);                        \
    }
#else
#define INT8_TILE_BODY(R)                                                                     \
    for (int r = 0; r < R; r++)                                                               \
        for (int c = 0; c < 16; c++) {                                                        \
            int32_t sum = 0;                                                                  \
            for (int j = 0; j < quads; j++)                                                   \
                for (int t = 0; t < 4; t++)                                                   \
                    sum += (int32_t)xq[r * stride + 4 * (int64_t)j + t] *                     \
                           p[64 * (int64_t)j + 4 * c + t];                                    \
            out[r * 16 + c] = sum;                                                            \
        }
#endif
#ifndef INT8_VNNI
#define INT8_VNNI 0
#endif
DEFINE_INT8_TILE(1)
DEFINE_INT8_TILE(2)
DEFINE_INT8_TILE(3)
DEFINE_INT8_TILE(4)
DEFINE_INT8_TILE(5)
DEFINE_INT8_TILE(6)
typedef void (*int8_tile_fn)(const int8_t *, int64_t, int, const int8_t *, int32_t *);
static const int8_tile_fn INT8_TILES[GROUP + 1] = {
    NULL, int8_tile_1, int8_tile_2, int8_tile_3, int8_tile_4, int8_tile_5, int8_tile_6};

/* int4 weights times int8 rows (W4A8, as llama.cpp's q4_0 x q8_0): per group of 32 inputs
 * the exact integer sums, then each column's sum times its group scale, added in fp32 over
 * the groups (fmaf, in order). A group of a panel is 4 pairs of quads (2 h, 2 h + 1), each
 * pair 2 x 32 bytes (columns 0-7, then 8-15; byte 4 c + t: w[c, 4 (2 h) + t] + 8 in its low
 * nibble, w[c, 4 (2 h + 1) + t] + 8 in its high one), then the group's 16 fp32 scales.
 * out[r * 16 + c] = the sum over groups of (integer sum) * scale[c, group]. xg[r, g]: row r's
 * sum of its int8 values over group g. */
#define DEFINE_INT4_TILE(R)                                                                   \
    static void int4_tile_##R(const int8_t *xq, const int32_t *xg, int64_t stride, int groups, \
                              const uint8_t *p, float *out) {                                 \
        INT4_TILE_BODY(R)                                                                     \
    }
#if defined(HAVE_AVX512) && defined(__AVX512VNNI__)
/* AVX-512 VNNI: a quad pair of a group is one 64-byte register (lane c: column c's 4
 * bytes), its low and high nibbles the two quads' u = w + 8; vpdpbusd adds u x (u unsigned,
 * x signed) into each column's 32-bit sum directly, then (sum - 8 xg) x scale as on AVX2:
 * the same integers, the same fmaf order over the groups. */
#define INT4_TILE_BODY(R)                                                                     \
    const __m512i low = _mm512_set1_epi8(0x0f);                                               \
    __m512 total[R];                                                                          \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) total[r] = _mm512_setzero_ps();       \
    for (int g = 0; g < groups; g++) {                                                        \
        const uint8_t *gp = p + (int64_t)g * INT4_GROUP_BYTES;                                \
        __m512i acc[R];                                                                       \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_si512();  \
        _Pragma("GCC unroll 4") for (int h = 0; h < 4; h++) {                                 \
            AHEAD(R, gp, 64 * h);                                                             \
            const __m512i v = _mm512_loadu_si512((const void *)(gp + 64 * h));                \
            const __m512i u0 = _mm512_and_si512(v, low);                                      \
            const __m512i u1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);                \
            const int64_t at = 4 * ((int64_t)g * 8 + 2 * h);                                  \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                             \
                int32_t s0, s1;                                                               \
                memcpy(&s0, xq + r * stride + at, 4);                                         \
                memcpy(&s1, xq + r * stride + at + 4, 4);                                     \
                acc[r] = _mm512_dpbusd_epi32(acc[r], u0, _mm512_set1_epi32(s0));              \
                acc[r] = _mm512_dpbusd_epi32(acc[r], u1, _mm512_set1_epi32(s1));              \
            }                                                                                 \
        }                                                                                     \
        const __m512 sc = _mm512_loadu_ps((const float *)(gp + 16 * INT4_GROUP / 2));         \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                 \
            const __m512i offset = _mm512_set1_epi32(8 * xg[(int64_t)r * groups + g]);        \
            const __m512 i = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r], offset));            \
            total[r] = _mm512_fmadd_ps(i, sc, total[r]);                                      \
        }                                                                                     \
    }                                                                                         \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * 16, total[r]);
#elif defined(HAVE_AVX512) || defined(HAVE_AVX2)
/* The nibble u = w + 8 (0..15) is vpmaddubsw's unsigned operand as it is: sum u x = sum w x
 * + 8 sum x, so a group's sum is (sum u x) - 8 xg -- no sign or absolute value per row, and
 * a pair's products are at most 2 x 15 x 127, so a group's 8 quads add in 16 bits (at most
 * 30,480) before one vpmaddwd. The fp32 totals live in `out` (updated once per group); with
 * 16 ymm registers (AVX2) 4 rows fit. */
#define INT4_TILE_BODY(R)                                                                     \
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0f);                  \
    memset(out, 0, sizeof(float) * 16 * R);                                                   \
    for (int g = 0; g < groups; g++) {                                                        \
        const uint8_t *gp = p + (int64_t)g * INT4_GROUP_BYTES;                                \
        __m256i acc[R][2];                                                                    \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] =           \
            _mm256_setzero_si256();                                                           \
        for (int h = 0; h < 4; h++) {                                                         \
            AHEAD(R, gp, 64 * h);                                                             \
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)(gp + 64 * h));            \
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(gp + 64 * h + 32));       \
            _Pragma("GCC unroll 2") for (int s = 0; s < 2; s++) {                             \
                const __m256i u0 = _mm256_and_si256(s ? _mm256_srli_epi16(v0, 4) : v0, low);  \
                const __m256i u1 = _mm256_and_si256(s ? _mm256_srli_epi16(v1, 4) : v1, low);  \
                const int64_t at = 4 * ((int64_t)g * 8 + 2 * h + s);                          \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                         \
                    int32_t sq;                                                               \
                    memcpy(&sq, xq + r * stride + at, 4);                                     \
                    const __m256i xs = _mm256_set1_epi32(sq);                                 \
                    acc[r][0] = _mm256_add_epi16(acc[r][0], _mm256_maddubs_epi16(u0, xs));    \
                    acc[r][1] = _mm256_add_epi16(acc[r][1], _mm256_maddubs_epi16(u1, xs));    \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        const float *sc = (const float *)(gp + 16 * INT4_GROUP / 2);                          \
        const __m256 s0 = _mm256_loadu_ps(sc), s1 = _mm256_loadu_ps(sc + 8);                  \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                 \
            const __m256i offset = _mm256_set1_epi32(8 * xg[(int64_t)r * groups + g]);        \
            const __m256i i0 = _mm256_sub_epi32(_mm256_madd_epi16(acc[r][0], ones), offset);  \
            const __m256i i1 = _mm256_sub_epi32(_mm256_madd_epi16(acc[r][1], ones), offset);  \
            float *o = out + r * 16;                                                          \
            _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), s0, _mm256_loadu_ps(o))); \
            _mm256_storeu_ps(o + 8,                                                           \
                             _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), s1, _mm256_loadu_ps(o + 8))); \
        }                                                                                     \
    }
#else
#define INT4_TILE_BODY(R)                                                                     \
    (void)xg;                                                                                 \
    for (int r = 0; r < R; r++)                                                               \
        for (int c = 0; c < 16; c++) {                                                        \
            float total = 0.0f;                                                               \
            for (int g = 0; g < groups; g++) {                                                \
                const uint8_t *gp = p + (int64_t)g * INT4_GROUP_BYTES;                        \
                int32_t sum = 0;                                                              \
                for (int h = 0; h < 4; h++)                                                   \
                    for (int s = 0; s < 2; s++)                                               \
                        for (int t = 0; t < 4; t++) {                                         \
                            const uint8_t byte = gp[64 * h + 32 * (c / 8) + 4 * (c % 8) + t]; \
                            const int w = (s ? byte >> 4 : byte & 15) - 8;                    \
                            sum += w * xq[r * stride + 4 * ((int64_t)g * 8 + 2 * h + s) + t]; \
                        }                                                                     \
                const float *sc = (const float *)(gp + 16 * INT4_GROUP / 2);                  \
                total = fmaf((float)sum, sc[c], total);                                       \
            }                                                                                 \
            out[r * 16 + c] = total;                                                          \
        }
#endif
DEFINE_INT4_TILE(1)
DEFINE_INT4_TILE(2)
DEFINE_INT4_TILE(3)
DEFINE_INT4_TILE(4)
DEFINE_INT4_TILE(5)
DEFINE_INT4_TILE(6)
typedef void (*int4_tile_fn)(const int8_t *, const int32_t *, int64_t, int, const uint8_t *,
                             float *);

/* Rows per call of the int8 / int4 tiles: their accumulators stay in registers (AVX2 has
 * 16: 4 rows; AVX-512's 32 hold GROUP). */
#if defined(HAVE_AVX2)
enum { INT8_ROWS = 4, INT4_ROWS = 4 };
#else
enum { INT8_ROWS = GROUP, INT4_ROWS = GROUP };
#endif
static const int4_tile_fn INT4_TILES[GROUP + 1] = {
    NULL, int4_tile_1, int4_tile_2, int4_tile_3, int4_tile_4, int4_tile_5, int4_tile_6};

#if defined(HAVE_AVX512)
enum { QUANT_LANES = 16 };
/* Lanes of x from element i (bf16 or fp32) as fp32. */
static inline __m512 load_lanes(const void *x, int64_t i, int bf) {
    if (bf)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i))), 16));
    return _mm512_loadu_ps((const float *)x + i);
}
#elif defined(HAVE_AVX2)
enum { QUANT_LANES = 8 };
static inline __m256 load_lanes(const void *x, int64_t i, int bf) { return load8_f32(x, i, bf); }
#endif

/* Row r of x (k values, bf16 or fp32) as int8: xq = round(x * 127 / max |x|) (ties to even),
 * zero-padded to kq; returns its scale, max |x| / 127 (0 for a zero row). Vector lanes where
 * they exist: max is exact and the product and rounding (cvtps: the current mode, nearest
 * even, as nearbyintf) the same per element. */
static float quantize_row(const void *x, int64_t at, int k, int kq, int bf, int8_t *xq) {
    float amax = 0.0f;
    int i = 0;
#if defined(HAVE_AVX512)
    __m512 top = _mm512_setzero_ps();
    for (; i + QUANT_LANES <= k; i += QUANT_LANES)
        top = _mm512_max_ps(top, _mm512_abs_ps(load_lanes(x, at + i, bf)));
    amax = _mm512_reduce_max_ps(top);
#elif defined(HAVE_AVX2)
    __m256 top = _mm256_setzero_ps();
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (; i + QUANT_LANES <= k; i += QUANT_LANES)
        top = _mm256_max_ps(top, _mm256_and_ps(load_lanes(x, at + i, bf), magnitude));
    float lanes[QUANT_LANES];
    _mm256_storeu_ps(lanes, top);
    for (int t = 0; t < QUANT_LANES; t++) amax = fmaxf(amax, lanes[t]);
#endif
    for (; i < k; i++) amax = fmaxf(amax, fabsf(to_f32(x, at + i, bf)));
    const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    i = 0;
#if defined(HAVE_AVX512)
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    for (; i + QUANT_LANES <= k; i += QUANT_LANES) {
        __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load_lanes(x, at + i, bf), vinv));
        v = _mm512_min_epi32(_mm512_max_epi32(v, lo), hi);
        _mm_storeu_si128((__m128i *)(xq + i), _mm512_cvtepi32_epi8(v));
    }
#elif defined(HAVE_AVX2)
    const __m256 vinv = _mm256_set1_ps(inv);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    for (; i + QUANT_LANES <= k; i += QUANT_LANES) {
        __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(load_lanes(x, at + i, bf), vinv));
        v = _mm256_min_epi32(_mm256_max_epi32(v, lo), hi);
        const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        _mm_storel_epi64((__m128i *)(xq + i), _mm_packs_epi16(words, words));
    }
#endif
    for (; i < kq; i++) {
        const int v = i < k ? (int)nearbyintf(to_f32(x, at + i, bf) * inv) : 0;
        xq[i] = (int8_t)(v > 127 ? 127 : v < -127 ? -127 : v);
    }
    return scale;
}

/* silu(u) = u sigmoid(u), the sigmoid from e = exp(-|u|) <= 1 (fastmath.h's polynomial: no
 * overflow, and plain arithmetic, so that finish's loop vectorises -- libm's expf, one call
 * per element, took longer than the pair tiles' multiply-adds of a few rows: a 5-row gate
 * matmul 768 x 256 with silu 18-22 us, 10 without): 1 / (1 + e) for u >= 0, e / (1 + e)
 * below. Within ~3e-7 of torch's silu (and the same bf16 values nearly everywhere). */
static inline float silu(float u) {
    const float e = exp_nonpositive(-fabsf(u));
    return u * ((u >= 0.0f ? 1.0f : e) / (1.0f + e));
}

/* tanh(z) from t = exp(-2|z|) <= 1 as silu's sigmoid: (1 - t) / (1 + t), z's sign. Its
 * absolute error is ~3e-7 (the relative one grows near 0, where gelu adds it to 1). */
static inline float tanh_of(float z) {
    const float t = exp_nonpositive(-2.0f * fabsf(z));
    const float a = (1.0f - t) / (1.0f + t);
    return z < 0.0f ? -a : a;
}

#if defined(HAVE_AVX512) || defined(HAVE_AVX2)
/* finish() of a whole panel, 8 lanes at a time (AVX2; the AVX-512 builds run it too): the
 * same steps as its scalar loops, which GCC leaves scalar (at k = 256 they took as long as
 * the tile's multiply-adds: docs/measurements/2026-12-07-zen4.md): exp_nonpositive, silu,
 * tanh_of and round_to lane for lane, within an ulp or two of them (fused multiply-adds where
 * GCC may or may not fuse the scalar ones; exp8_nonpositive, load8_f32: fastmath.h). */
#define VECTOR_FINISH 1
static inline __m256 round8(__m256 f) { /* round_to(f, 1): nearest even, NaN kept */
    const __m256i b = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_and_si256(
        _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))),
        _mm256_set1_epi32((int)0xffff0000u));
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), f, _mm256_cmp_ps(f, f, _CMP_UNORD_Q));
}
static inline __m256 round8_to(__m256 f, int bf) { return bf ? round8(f) : f; }
static inline __m256 abs8(__m256 u) {
    return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), u);
}
static inline __m256 silu8(__m256 u) { /* silu, 8 lanes */
    const __m256 e = exp8_nonpositive(_mm256_sub_ps(_mm256_setzero_ps(), abs8(u)));
    const __m256 top = _mm256_blendv_ps(e, _mm256_set1_ps(1.0f),
                                        _mm256_cmp_ps(u, _mm256_setzero_ps(), _CMP_GE_OQ));
    return _mm256_mul_ps(u, _mm256_div_ps(top, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
}
static inline __m256 gelu8(__m256 u) { /* finish's tanh gelu, 8 lanes */
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 u3 = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), u), _mm256_mul_ps(u, u));
    const __m256 z = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f), _mm256_add_ps(u, u3));
    const __m256 t = exp8_nonpositive(_mm256_mul_ps(_mm256_set1_ps(-2.0f), abs8(z)));
    __m256 a = _mm256_div_ps(_mm256_sub_ps(one, t), _mm256_add_ps(one, t));
    a = _mm256_or_ps(a, _mm256_and_ps(z, _mm256_set1_ps(-0.0f))); /* z's sign (a >= 0) */
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), u), _mm256_add_ps(one, a));
}
static inline void store8(void *y, int64_t at, __m256 v, int bf) { /* put, 8 lanes (rounded) */
    if (!bf) {
        _mm256_storeu_ps((float *)y + at, v);
        return;
    }
    const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
    _mm_storeu_si128((__m128i *)((uint16_t *)y + at), words);
}

/* finish() of count == PANEL outputs. */
static void finish16(const float *d, const float *scale, int j0, const void *bias, int w_format,
                     int op, const void *other, int64_t other_at, void *y, int64_t y_at, int bf) {
    const int first = op & EPI_ROUND_ONCE ? 0 : bf;
    op &= ~EPI_ROUND_ONCE;
    for (int h = 0; h < PANEL; h += 8) {
        __m256 v = _mm256_loadu_ps(d + h);
        if (scale != NULL) v = _mm256_mul_ps(v, _mm256_loadu_ps(scale + h));
        if (bias != NULL) v = _mm256_add_ps(v, load8_f32(bias, j0 + h, w_format == W_BF16));
        v = round8_to(v, first);
        switch (op) {
        case EPI_ADD: v = round8_to(_mm256_add_ps(v, load8_f32(other, other_at + h, bf)), bf); break;
        case EPI_MUL: v = round8_to(_mm256_mul_ps(v, load8_f32(other, other_at + h, bf)), bf); break;
        case EPI_SILU: v = round8_to(silu8(v), bf); break;
        case EPI_GELU: v = round8_to(gelu8(v), bf); break;
        default: v = first != bf ? round8(v) : v; break; /* none, rounding once: here */
        }
        store8(y, y_at + h, v, bf);
    }
}
#else
#define VECTOR_FINISH 0
#endif

/* y[row, j0 + i] = epilogue(round(d[i] scale[i] + bias[j0 + i]), other[row, j0 + i]) for
 * i < count: one output row's stretch of a block, the epilogue chosen once for the stretch;
 * scale: an int8 panel's column scales, or NULL. A whole panel: finish16 where it exists. */
static void finish(const float *d, const float *scale, int j0, int count, const void *bias,
                   int w_format, int op, const void *other, int64_t other_at, void *y,
                   int64_t y_at, int bf) {
#if VECTOR_FINISH
    if (count == PANEL) {
        finish16(d, scale, j0, bias, w_format, op, other, other_at, y, y_at, bf);
        return;
    }
#endif
    float v[PANEL];
    const int first = op & EPI_ROUND_ONCE ? 0 : bf; /* the matmul's own rounding */
    op &= ~EPI_ROUND_ONCE;
    for (int i = 0; i < count; i++)
        v[i] = round_to((scale != NULL ? d[i] * scale[i] : d[i]) +
                            (bias != NULL ? BIAS_AT(bias, j0 + i, w_format) : 0.0f),
                        first);
    switch (op) {
    case EPI_ADD:
        for (int i = 0; i < count; i++) v[i] = round_to(v[i] + to_f32(other, other_at + i, bf), bf);
        break;
    case EPI_MUL:
        for (int i = 0; i < count; i++) v[i] = round_to(v[i] * to_f32(other, other_at + i, bf), bf);
        break;
    case EPI_SILU:
        for (int i = 0; i < count; i++) v[i] = round_to(silu(v[i]), bf);
        break;
    case EPI_GELU: {
        const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
        for (int i = 0; i < count; i++) {
            const float u = v[i];
            v[i] = round_to(0.5f * u * (1.0f + tanh_of(c * (u + 0.044715f * u * u * u))), bf);
        }
        break;
    }
    default:
        if (first != bf) /* none, rounding once: here */
            for (int i = 0; i < count; i++) v[i] = round_to(v[i], bf);
        break;
    }
    if (bf)
        for (int i = 0; i < count; i++) put(y, y_at + i, v[i], 1);
    else
        memcpy((float *)y + y_at, v, (size_t)count * sizeof(float));
}

typedef struct Job {
    const float *xf;    /* the rows in fp32, contiguous (or NULL: xb) */
    const uint16_t *xb; /* the pair tiles' rows: bf16, kp apart */
    const int8_t *xq;   /* int8 / int4 weights: the rows as int8 (kp apart: whole quads) */
    const float *xs;    /* each row's scale */
    const int32_t *xg;  /* int4: each row's sums of xq per group of INT4_GROUP */
    int32_t m, k, kp, n, op, act_bf16, w_format;
    const void *w, *bias, *other;
    int64_t other_stride, y_stride;
    void *y;
    int32_t per_task; /* panels per task */
    struct Job *then; /* or NULL: a second matmul of the same rows and n, run panel by panel
                         after this one (its epilogue may read this one's y) */
} Job;

/* Output columns [blk * PANEL, +count * PANEL) of every row, from panels blk.. (count: 1,
 * or 2 with the pair tiles, both panels full). */
static void some_panels(const Job *J, int blk, int count) {
    const int m = J->m, k = J->k, n = J->n;
    float block[2][GROUP * PANEL]; /* the group's rows' outputs, per panel */
    const int64_t panel_elems = (int64_t)PANEL * k; /* the pair tiles' second panel */
    const void *panel = (const char *)J->w + blk * baton_panel_bytes(k, J->w_format);
    (void)panel_elems;
    /* int8: the panel's column scales follow its values (one panel: count is 1) */
    const int int8 = J->w_format == W_INT8, int4 = J->w_format == W_INT4;
    const float *scale = int8 ? (const float *)((const char *)panel + 16 * (int64_t)J->kp) : NULL;
    const int group = int8 ? INT8_ROWS : int4 ? INT4_ROWS : GROUP;
    /* VNNI int8: the rows in groups of even sizes (8 rows: 4 + 4, not 6 + 2; INT8_CHAINS) --
     * the sums are exact, a row's bits do not depend on its group. Elsewhere full groups
     * (AVX2's int tiles ran 0.93-1.0x evened; the float tiles' order depends on R). */
    const int even = int8 && INT8_VNNI, tiles = (m + group - 1) / group;
    for (int g = 0, tile = 0, rows; g < m; g += rows, tile++) {
        rows = even ? (m - g) / (tiles - tile) : m - g < group ? m - g : group;
        if (int8) {
            int32_t sums[GROUP * PANEL];
            INT8_TILES[rows](J->xq + (int64_t)g * J->kp, J->kp, J->kp / 4, panel, sums);
            for (int r = 0; r < rows; r++)
                for (int c = 0; c < PANEL; c++)
                    block[0][r * PANEL + c] = (float)sums[r * PANEL + c] * J->xs[g + r];
        } else if (int4) { /* the group scales are inside the panel */
            const int groups = J->kp / INT4_GROUP;
            INT4_TILES[rows](J->xq + (int64_t)g * J->kp, J->xg + (int64_t)g * groups, J->kp,
                             groups, panel, block[0]);
            for (int r = 0; r < rows; r++)
                for (int c = 0; c < PANEL; c++) block[0][r * PANEL + c] *= J->xs[g + r];
        } else
#if HAVE_PAIRS
        if (J->xb != NULL)
            PAIR_TILES[count - 1][rows](J->xb + (int64_t)g * J->kp, k, J->kp, panel,
                                        panel_elems, block[0], block[1]);
        else
#endif
            TILES[rows](J->xf + (int64_t)g * k, k, panel, J->w_format, block[0]);
        for (int q = 0; q < count; q++) {
            const int begin = (blk + q) * PANEL, stop = begin + PANEL < n ? begin + PANEL : n;
            for (int r = 0; r < rows; r++) {
                const int64_t row = g + r;
                finish(block[q] + r * PANEL, scale, begin, stop - begin, J->bias, J->w_format,
                       J->op, J->other, row * J->other_stride + begin, J->y,
                       row * J->y_stride + begin, J->act_bf16);
            }
        }
    }
}

/* Panels a task's pair tiles take at once: 2, or 1 (tests compare the two bit for bit). */
int32_t baton_linear_panels_at_once = 2;

/* One task: panels [task * per_task, +per_task). A task per panel made the threads take
 * turns at pool.c's shared word 16-48 times per call (each a cache line moving between the
 * cores) in calls of a few microseconds: ~4 tasks per thread still balance a helper that
 * joins late, and a 5-row 768 x 256 matmul took 5.8-6.4 instead of 6.6-7.5 us. */
static void some_blocks(void *ctx, int task, int worker) {
    const Job *J = ctx;
    const int panels = (J->n + PANEL - 1) / PANEL, first = task * J->per_task;
    const int stop = first + J->per_task < panels ? first + J->per_task : panels;
    (void)worker;
    /* Two panels at once for the pair tiles of 2 rows or more (one row: no gain). */
    const int pairs = HAVE_PAIRS && J->xb != NULL && J->m >= 2 && baton_linear_panels_at_once == 2;
    for (int b = first; b < stop;) {
        const int count = pairs && b + 1 < stop && (b + 2) * PANEL <= J->n ? 2 : 1;
        some_panels(J, b, count);
        if (J->then != NULL) some_panels(J->then, b, count);
        b += count;
    }
}

/* `job` (and its `then`) over the rows x: 0, or 1 when no scratch memory could be had.
 * num_threads < 0: at most -num_threads, on the OpenMP runtime's threads (a prompt step's
 * call among torch's ops: pool.c's baton_parallel_openmp). */
static int run(Job *job, const void *x, int64_t x_stride, int num_threads) {
    const int openmp = num_threads < 0;
    if (openmp) num_threads = -num_threads;
    const int m = job->m, k = job->k, n = job->n;
    /* The rows every weight row is multiplied into, contiguous: in bf16 for the pair tiles
     * (zero-padded to an even kp), as int8 for int8 weights (kp: whole quads, each row's
     * scale after the m rows), else in fp32. */
    const int pairs = HAVE_PAIRS && job->act_bf16 && job->w_format == W_BF16;
    const int int8 = job->w_format == W_INT8 || job->w_format == W_INT4; /* rows as int8 */
    const int kp = job->w_format == W_INT4 ? INT4_GROUP * (int)baton_int4_groups(k)
                   : int8                  ? 4 * (int)baton_int8_quads(k)
                                           : k + (k & 1);
    float *xf = pairs || int8 ? NULL : malloc((size_t)m * (size_t)k * sizeof(float));
    uint16_t *xb = pairs ? calloc((size_t)m * (size_t)kp, sizeof(uint16_t)) : NULL;
    const int groups = job->w_format == W_INT4 ? kp / INT4_GROUP : 0;
    float *xs = int8 ? malloc((size_t)m * (sizeof(float) + groups * sizeof(int32_t) + kp)) : NULL;
    if (xf == NULL && xb == NULL && xs == NULL) return 1;
    int32_t *xg = int8 ? (int32_t *)(xs + m) : NULL;
    int8_t *xq = int8 ? (int8_t *)(xg + (int64_t)m * groups) : NULL;
    for (int r = 0; r < m; r++) {
        if (int8) {
            xs[r] = quantize_row(x, (int64_t)r * x_stride, k, kp, job->act_bf16,
                                 xq + (int64_t)r * kp);
            if (INT8_VNNI && job->w_format == W_INT8) /* x + 128 (padding too) */
                for (int i = 0; i < kp; i++) xq[(int64_t)r * kp + i] ^= (int8_t)0x80;
            for (int q = 0; q < groups; q++) {
                int32_t sum = 0;
                for (int i = 0; i < INT4_GROUP; i++) sum += xq[(int64_t)r * kp + q * INT4_GROUP + i];
                xg[(int64_t)r * groups + q] = sum;
            }
        }
        else if (pairs)
            memcpy(xb + (int64_t)r * kp, (const uint16_t *)x + (int64_t)r * x_stride,
                   (size_t)k * sizeof(uint16_t));
        else
            for (int i = 0; i < k; i++)
                xf[(int64_t)r * k + i] = to_f32(x, (int64_t)r * x_stride + i, job->act_bf16);
    }
    const int64_t macs = (int64_t)m * n * k * (job->then != NULL ? 2 : 1);
    const int threads = baton_threads_for(macs, MACS_PER_THREAD, num_threads);
    const int panels = (n + PANEL - 1) / PANEL;
    int per_task = panels / (TASKS_PER_THREAD * threads);
    if (per_task < 1) per_task = 1;
    for (Job *j = job; j != NULL; j = j->then) /* the same rows, the same tasks */
        j->xf = xf, j->xb = xb, j->xq = xq, j->xs = xs, j->xg = xg, j->kp = kp,
        j->per_task = per_task;
    (openmp ? baton_parallel_openmp : baton_parallel)(some_blocks, (void *)job,
                                                      (panels + per_task - 1) / per_task, threads);
    free(xf);
    free(xb);
    free(xs);
    return 0;
}

int baton_linear_rows(const void *x, int64_t x_stride, int32_t m, int32_t k, const void *w,
                      int32_t n, const void *bias, const void *other, int64_t other_stride,
                      int32_t op, void *y, int64_t y_stride, int32_t act_bf16, int32_t w_format,
                      int32_t num_threads) {
    Job job = {NULL, NULL, NULL, NULL, NULL, m, k, 0, n, op, act_bf16, w_format, w, bias,
               other, other_stride, y_stride, y, 0, NULL};
    return run(&job, x, x_stride, num_threads);
}

/* A gated MLP's two matmuls of the same rows in one parallel region (one wait for the other
 * thread instead of two): per panel, g = act(x gate^T + gate_bias), then
 * u = (x up^T + up_bias) * g -- the same values as two baton_linear_rows calls (gate with
 * `act`, up with EPI_MUL over g), panel by panel. g and u: [m, n] contiguous. */
int baton_gated_rows(const void *x, int64_t x_stride, int32_t m, int32_t k, const void *gate,
                     const void *gate_bias, int32_t act, void *g, const void *up,
                     const void *up_bias, int32_t mul, void *u, int32_t n, int32_t act_bf16,
                     int32_t w_format, int32_t num_threads) {
    Job second = {NULL, NULL, NULL, NULL, NULL, m, k, 0, n, mul, act_bf16, w_format, up,
                  up_bias, g, n, n, u, 0, NULL};
    Job first = {NULL, NULL, NULL, NULL, NULL, m, k, 0, n, act, act_bf16, w_format, gate,
                 gate_bias, NULL, 0, n, g, 0, &second};
    return run(&first, x, x_stride, num_threads);
}

/* An int4 panel's group (at gp): its 16 column scales, after the group's values. */
static inline const float *int4_scales(const uint8_t *gp) {
    return (const float *)(gp + 16 * INT4_GROUP / 2);
}

/* n values (at most 8) times their scale, in fp32, rounded once into out (fp32, or bf16
 * where out_bf16) at [i, i + n). */
static inline void put_scaled(void *out, int64_t i, const int32_t *v, float scale, int n,
                              int out_bf16) {
    for (int t = 0; t < n; t++) put(out, i + t, round_to((float)v[t] * scale, out_bf16), out_bf16);
}

#if defined(HAVE_AVX512) || defined(HAVE_AVX2)
static inline int32_t load_u32(const void *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* One column's 4 bytes of 4 consecutive 64-byte blocks of its panel (int8: 4 quads; int4: a
 * group's 4 quad pairs), in order, as one 16-byte vector. */
static inline __m128i column_bytes(const uint8_t *b) {
    return _mm_set_epi32(load_u32(b + 192), load_u32(b + 128), load_u32(b + 64), load_u32(b));
}

/* Sixteen int8 values (bytes) times scale, in fp32, rounded once (to nearest even, as
 * round_to) into out at [i, i + 16). */
static inline void put16(void *out, int64_t i, __m128i bytes, float scale, int out_bf16) {
#if defined(HAVE_AVX512)
    const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)),
                                   _mm512_set1_ps(scale));
    if (!out_bf16) {
        _mm512_storeu_ps((float *)out + i, f);
        return;
    }
    __m512i b = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    b = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), _mm512_cvtepi32_epi16(b));
#else
    const __m256 s = _mm256_set1_ps(scale);
    const __m256 f0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), s);
    const __m256 f1 =
        _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8))), s);
    if (!out_bf16) {
        _mm256_storeu_ps((float *)out + i, f0);
        _mm256_storeu_ps((float *)out + i + 8, f1);
        return;
    }
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff);
    __m256i b0 = _mm256_castps_si256(f0), b1 = _mm256_castps_si256(f1);
    b0 = _mm256_add_epi32(b0, _mm256_add_epi32(half, _mm256_and_si256(_mm256_srli_epi32(b0, 16), one)));
    b1 = _mm256_add_epi32(b1, _mm256_add_epi32(half, _mm256_and_si256(_mm256_srli_epi32(b1, 16), one)));
    const __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(b0, 16), _mm256_srli_epi32(b1, 16));
    _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), _mm256_permute4x64_epi64(packed, 0xD8));
#endif
}
#define HAVE_PUT16 1
#endif

/* Column c of a panel of an int8 / int4 weight (k values) dequantized into out's row
 * starting at element base, reading the column's bytes in the panel's order, writing the
 * row in order (no scratch: a row is written once); 16 values at a time where the vector
 * code exists, the same products and roundings. */
static void dequantize_column(const uint8_t *p, int k, int w_format, int c, void *out,
                              int64_t base, int out_bf16) {
    int32_t v[8];
    if (w_format == W_INT8) {
        const float scale = ((const float *)(p + 64 * baton_int8_quads(k)))[c];
        int j = 0; /* quads 4 j .. 4 j + 3: inputs 16 j .. */
#if defined(HAVE_PUT16)
        for (; 16 * j + 16 <= k; j++)
            put16(out, base + 16 * j, column_bytes(p + 256 * j + 4 * c), scale, out_bf16);
#endif
        for (int i = 16 * j; i < k; i += 8) { /* quads i / 4 and i / 4 + 1 */
            const int8_t *q0 = (const int8_t *)p + 16 * i + 4 * c, *q1 = q0 + 64;
            for (int t = 0; t < 4; t++) v[t] = q0[t];
            if (i + 4 < k)
                for (int t = 0; t < 4; t++) v[4 + t] = q1[t];
            put_scaled(out, base + i, v, scale, k - i < 8 ? k - i : 8, out_bf16);
        }
        return;
    }
    for (int g = 0; g * INT4_GROUP < k; g++) {
        const uint8_t *gp = p + (int64_t)g * INT4_GROUP_BYTES;
        const float scale = int4_scales(gp)[c];
        const uint8_t *b0 = gp + 32 * (c / 8) + 4 * (c % 8); /* quad pair h at b0 + 64 h */
#if defined(HAVE_PUT16)
        if ((g + 1) * INT4_GROUP <= k) {
            const __m128i bytes = column_bytes(b0);
            const __m128i nibble = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
            const __m128i low = _mm_sub_epi8(_mm_and_si128(bytes, nibble), eight);
            const __m128i high = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble), eight);
            /* dwords: pair h's low quad (inputs 8 h ..), then its high one (8 h + 4 ..) */
            put16(out, base + g * INT4_GROUP, _mm_unpacklo_epi32(low, high), scale, out_bf16);
            put16(out, base + g * INT4_GROUP + 16, _mm_unpackhi_epi32(low, high), scale, out_bf16);
            continue;
        }
#endif
        for (int h = 0; h < 4; h++) { /* quad 2 h in the low nibbles, quad 2 h + 1 high */
            const int first = g * INT4_GROUP + 8 * h;
            if (first >= k) break;
            const uint8_t *b = b0 + 64 * h;
            for (int t = 0; t < 4; t++) {
                v[t] = (b[t] & 15) - 8;
                v[4 + t] = (b[t] >> 4) - 8;
            }
            put_scaled(out, base + first, v, scale, k - first < 8 ? k - first : 8, out_bf16);
        }
    }
}

/* Rows [row0, row0 + rows) of an int8 or int4 weight in its panels, dequantized (value times
 * its column's, or group's, scale, in fp32, rounded once to bf16 where out_bf16) into out
 * ([rows, k], contiguous): the prompt path's weight, read from the panels the small steps
 * read, so the integers are kept once. Rows in parallel over OpenMP's threads. Returns 0. */
int baton_dequantize_rows(const void *w, int32_t k, int32_t w_format, int32_t row0,
                          int32_t rows, void *out, int32_t out_bf16, int32_t num_threads) {
    const int64_t panel_bytes = baton_panel_bytes(k, w_format);
    PARALLEL_FOR(r, rows, (int64_t)rows * k > 65536, {
        const int64_t row = row0 + r;
        dequantize_column((const uint8_t *)w + row / PANEL * panel_bytes, k, w_format,
                          (int)(row % PANEL), out, r * k, out_bf16);
    });
    return 0;
}

/* ---- The prompt path's W8A8 matmul around oneDNN's int8 one (quantize.int8_linear):
 * the rows quantized, the weight's integers taken out of the panels, the int32 sums
 * scaled. Each a pass over its data, rows in parallel over OpenMP's threads. */

/* Rows x [m, k] (bf16 or fp32, row r at r * x_stride) as int8 into xq [m, kq] (zero-padded)
 * with each row's scale into xs: quantize_row's values, the small steps' own. Returns 0. */
int baton_quantize_rows(const void *x, int64_t x_stride, int32_t m, int32_t k, int32_t kq,
                        int32_t x_bf16, int8_t *xq, float *xs, int32_t num_threads) {
    PARALLEL_FOR(r, m, (int64_t)m * k > 65536,
                 { xs[r] = quantize_row(x, r * x_stride, k, kq, x_bf16, xq + r * kq); });
    return 0;
}

/* Column c of a panel as int8 into q (kq values: the k values, zeros after) and its scale:
 * an int8 weight's integers and scale as they are; an int4 weight's requantized to one
 * scale per row, s = 8 max_g s_g / 127 (|value| <= 8: |q| <= 127), value v of group g
 * becoming nearbyint(v (s_g / s)) -- per group a table of its 16 values. */
static float int8_column(const uint8_t *p, int k, int w_format, int c, int8_t *q, int kq) {
    if (w_format == W_INT8) {
        for (int j = 0; 4 * j < kq; j++) memcpy(q + 4 * j, p + 64 * j + 4 * c, 4);
        return ((const float *)(p + 64 * baton_int8_quads(k)))[c];
    }
    const int groups = (int)baton_int4_groups(k);
    float top = 0.0f;
    for (int g = 0; g < groups; g++)
        top = fmaxf(top, int4_scales(p + (int64_t)g * INT4_GROUP_BYTES)[c]);
    const float scale = top > 0.0f ? 8.0f * top / 127.0f : 1.0f;
    for (int g = 0; g < groups; g++) {
        const uint8_t *gp = p + (int64_t)g * INT4_GROUP_BYTES;
        const float ratio = int4_scales(gp)[c] / scale;
        const uint8_t *b0 = gp + 32 * (c / 8) + 4 * (c % 8);
        int8_t *out = q + g * INT4_GROUP; /* kq >= groups * INT4_GROUP: whole groups */
#if defined(HAVE_PUT16)
        /* the table: lane u = round((u - 8) ratio), cvtps rounding to nearest even */
#if defined(HAVE_AVX512)
        const __m512 values = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
        const __m128i lut = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(values, _mm512_set1_ps(ratio))));
#else
        const __m256 below = _mm256_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1);
        const __m256 above = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256 r8 = _mm256_set1_ps(ratio);
        const __m256i lo8 = _mm256_cvtps_epi32(_mm256_mul_ps(below, r8));
        const __m256i hi8 = _mm256_cvtps_epi32(_mm256_mul_ps(above, r8));
        const __m128i lut = _mm_packs_epi16(
            _mm_packs_epi32(_mm256_castsi256_si128(lo8), _mm256_extracti128_si256(lo8, 1)),
            _mm_packs_epi32(_mm256_castsi256_si128(hi8), _mm256_extracti128_si256(hi8, 1)));
#endif
        const __m128i nibble = _mm_set1_epi8(15);
        const __m128i bytes = column_bytes(b0);
        const __m128i low = _mm_shuffle_epi8(lut, _mm_and_si128(bytes, nibble));
        const __m128i high = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble));
        _mm_storeu_si128((__m128i *)out, _mm_unpacklo_epi32(low, high));
        _mm_storeu_si128((__m128i *)(out + 16), _mm_unpackhi_epi32(low, high));
#else
        int8_t table[16];
        for (int u = 0; u < 16; u++) table[u] = (int8_t)nearbyintf((float)(u - 8) * ratio);
        for (int h = 0; h < 4; h++)
            for (int t = 0; t < 4; t++) {
                out[8 * h + t] = table[b0[64 * h + t] & 15];
                out[8 * h + 4 + t] = table[b0[64 * h + t] >> 4];
            }
#endif
    }
    return scale;
}

/* Rows [row0, row0 + rows) of an int8 / int4 weight as int8 rows q [rows, kq] (kq: whole
 * groups for int4, whole quads for int8) and their scales. Returns 0. */
int baton_int8_rows(const void *w, int32_t k, int32_t w_format, int32_t row0, int32_t rows,
                    int8_t *q, int32_t kq, float *scales, int32_t num_threads) {
    const int64_t panel_bytes = baton_panel_bytes(k, w_format);
    PARALLEL_FOR(r, rows, (int64_t)rows * k > 65536, {
        const int64_t row = row0 + r;
        scales[r] = int8_column((const uint8_t *)w + row / PANEL * panel_bytes, k, w_format,
                                (int)(row % PANEL), q + r * kq, kq);
    });
    return 0;
}

/* The exact int32 sums out [m, n] of int8 rows xq [m, kq] (baton_quantize_rows' rows: kq =
 * 4 x the weight's quads, zero-padded) times an int8 weight's panels (W_INT8), by the small
 * steps' tiles -- the same integers as oneDNN's int8 matmul of baton_int8_rows' rows, without
 * taking the weight's integers out of the panels first (a pass over every weight per call:
 * a third of a Zen 4's 8-token int8 prefill). Panels in tasks on OpenMP's threads (a prompt
 * step's call). Returns 0, or 1 without scratch memory. */
typedef struct {
    const int8_t *xq;
    const uint8_t *w;
    int32_t *out;
    int64_t panel_bytes;
    int32_t m, kq, n, per_task;
} Sums;

static void sums_task(void *ctx, int task, int worker) {
    const Sums *S = ctx;
    const int panels = (S->n + PANEL - 1) / PANEL, first = task * S->per_task;
    const int stop = first + S->per_task < panels ? first + S->per_task : panels;
    int32_t sums[GROUP * PANEL];
    (void)worker;
    for (int blk = first; blk < stop; blk++) {
        const int8_t *panel = (const int8_t *)(S->w + blk * S->panel_bytes);
        const int c0 = blk * PANEL, cols = S->n - c0 < PANEL ? S->n - c0 : PANEL;
        for (int g = 0, rows; g < S->m; g += rows) {
            rows = S->m - g < INT8_ROWS ? S->m - g : INT8_ROWS;
            INT8_TILES[rows](S->xq + (int64_t)g * S->kq, S->kq, S->kq / 4, panel, sums);
            for (int r = 0; r < rows; r++)
                memcpy(S->out + (int64_t)(g + r) * S->n + c0, sums + r * PANEL,
                       (size_t)cols * sizeof(int32_t));
        }
    }
}

int baton_int8_sums(const int8_t *xq, int32_t m, int32_t kq, const void *w, int32_t k,
                    int32_t n, int32_t *out, int32_t num_threads) {
    int8_t *flipped = NULL;
    if (INT8_VNNI) { /* the VNNI tiles take x + 128 (see run()) */
        flipped = malloc((size_t)m * kq > 0 ? (size_t)m * kq : 1);
        if (flipped == NULL) return 1;
        for (int64_t i = 0; i < (int64_t)m * kq; i++) flipped[i] = (int8_t)(xq[i] ^ 0x80);
    }
    const int panels = (n + PANEL - 1) / PANEL;
    const int threads = baton_threads_for((int64_t)m * n * k, MACS_PER_THREAD, num_threads);
    int per_task = panels / (TASKS_PER_THREAD * threads);
    if (per_task < 1) per_task = 1;
    const Sums S = {flipped != NULL ? flipped : xq, w, out, baton_panel_bytes(k, W_INT8), m, kq, n,
                    per_task};
    baton_parallel_openmp(sums_task, (void *)&S, (panels + per_task - 1) / per_task, threads);
    free(flipped);
    return 0;
}

/* y[r, j0 + j] = round(acc[r, j] xs[r] ws[j] + bias[j]) for an int32 block acc [m, n]:
 * (acc xs) ws, then + bias (fp32, or NULL), each product and sum rounded in fp32 as torch's
 * elementwise ops round them (no fused multiply-add), once to y's dtype; y's rows y_stride
 * apart. Returns 0. */
__attribute__((optimize("fp-contract=off"))) int baton_scale_int32(
    const int32_t *acc, int32_t m, int32_t n, const float *xs, const float *ws,
    const float *bias, void *y, int64_t y_stride, int32_t j0, int32_t y_bf16,
    int32_t num_threads) {
    PARALLEL_FOR(r, m, (int64_t)m * n > 65536, {
        const int32_t *a = acc + r * n;
        const float s = xs[r];
        const int64_t at = r * y_stride + j0;
        if (y_bf16) {
            for (int j = 0; j < n; j++) {
                float v = (float)a[j] * s;
                v = v * ws[j];
                if (bias != NULL) v = v + bias[j];
                put(y, at + j, round_to(v, 1), 1);
            }
        } else {
            float *o = (float *)y + at;
            for (int j = 0; j < n; j++) {
                float v = (float)a[j] * s;
                v = v * ws[j];
                o[j] = bias != NULL ? v + bias[j] : v;
            }
        }
    });
    return 0;
}
