/* A gated delta net's sequence core token by token (Qwen3.5's linear attention), one
 * sequence: what baton/model/linear_attention.py's GatedDeltaNet computes between its input
 * and output projections, without a torch call per token and layer. Per token t:
 *
 *   x     = silu(conv over the last K inputs of q|k|v, per channel)    (rounded to bf16
 *           where the model computes in bf16, as the torch path does)
 *   q, k  = L2-normed per key head (q times dk^-0.5);  v
 *   beta  = sigmoid(b_t);  g = -exp(A_log) softplus(a_t + dt_bias)      per value head
 *   S     = exp(g) S;  d = beta (v - S^T k);  S = S + k d^T;  o_t = S^T q   (S: [dk, dv])
 *
 * Every operation on a token reads that token's inputs and the state only, in the same
 * order whatever T: a prompt cut into chunks of any size, restored from a prefix-cache
 * snapshot or handed off gives the same bits as one long step (torch's elementwise
 * kernels do not promise that: an element in a vector's tail takes other code). The
 * exponentials are fastmath.h's polynomial (vectorisable) and libm's expf / log1pf for the
 * per-head gates; results stay within ~1e-6 of the torch path (tests).
 *
 * x: [T, C] q|k|v projections (C = 2 Hk dk + Hv dv), fp32; a, b: [T, Hv] fp32; conv_w:
 * [C, K]; a_log, dt_bias: [Hv]; conv_state: [C, K-1], state: [Hv, dk, dv], both updated in
 * place; out: [T, Hv, dv]; keep[t] != 0: the states after token t are copied to
 * saved_conv / saved_state (one after the other, in t's order). Returns -1 where a buffer
 * would overflow (the caller then takes the torch path).
 * Built and loaded by baton/kernels/__init__.py; Python side: baton/kernels/delta_rule.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fastmath.h"
#include "kernels.h"

enum { MAX_CHANNELS = 32768, MAX_DV = 1024, MAX_KERNEL = 8 };

/* u * sigmoid(u), the sigmoid from e = exp(-|u|) <= 1 (no overflow). */
static inline float silu_of(float u) {
    const float e = exp_nonpositive(-fabsf(u));
    return u * (u >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e));
}

static inline float sigmoid_of(float u) {
    const float e = exp_nonpositive(-fabsf(u));
    return u >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

/* torch's softplus (beta 1, threshold 20). */
static inline float softplus_of(float u) { return u > 20.0f ? u : log1pf(expf(u)); }

/* The L2 norm's inverse of n values (FLA's and transformers' x * rsqrt(sum x^2 + 1e-6)). */
static inline float inverse_norm(const float *x, int n) {
    float sum = 0.0f;
    for (int i = 0; i < n; i++) sum += x[i] * x[i];
    return 1.0f / sqrtf(sum + 1e-6f);
}

int baton_gated_delta_steps(const float *x, const float *a, const float *b,
                            const float *conv_w, const float *a_log, const float *dt_bias,
                            float *conv_state, float *state, float *out, int32_t T, int32_t C,
                            int32_t K, int32_t hk, int32_t hv, int32_t dk, int32_t dv,
                            int32_t is_bf16, const uint8_t *keep, float *saved_conv,
                            float *saved_state) {
    if (C > MAX_CHANNELS || dv > MAX_DV || K > MAX_KERNEL || K < 2 || hv % hk) return -1;
    static __thread float mixed[MAX_CHANNELS];
    float pred[MAX_DV], delta[MAX_DV];
    const int64_t per_head = (int64_t)dk * dv, state_size = hv * per_head;
    const int64_t conv_size = (int64_t)C * (K - 1);
    const int group = hv / hk, key_dim = hk * dk;
    const float scale = 1.0f / sqrtf((float)dk);
    for (int32_t t = 0; t < T; t++) {
        const float *xt = x + (int64_t)t * C;
        /* the conv over the window (the state's K-1 inputs, then x_t), one tap after the
         * other; then the window moves by one */
        for (int32_t c = 0; c < C; c++) {
            float *window = conv_state + (int64_t)c * (K - 1);
            const float *w = conv_w + (int64_t)c * K;
            float acc = window[0] * w[0];
            for (int j = 1; j < K - 1; j++) acc = acc + window[j] * w[j];
            acc = acc + xt[c] * w[K - 1];
            mixed[c] = round_to(silu_of(acc), is_bf16);
            for (int j = 0; j < K - 2; j++) window[j] = window[j + 1];
            window[K - 2] = xt[c];
        }
        float *q = mixed, *k = mixed + key_dim;
        const float *v = mixed + 2 * key_dim;
        for (int h = 0; h < hk; h++) {
            float *qh = q + h * dk, *kh = k + h * dk;
            const float iq = inverse_norm(qh, dk), ik = inverse_norm(kh, dk);
            for (int i = 0; i < dk; i++) {
                qh[i] = (qh[i] * iq) * scale;
                kh[i] = kh[i] * ik;
            }
        }
        for (int32_t h = 0; h < hv; h++) {
            float *S = state + h * per_head;
            const float *kt = k + (h / group) * dk, *qt = q + (h / group) * dk;
            const float *vt = v + (int64_t)h * dv;
            float *ot = out + ((int64_t)t * hv + h) * dv;
            const float beta = sigmoid_of(b[(int64_t)t * hv + h]);
            const float g = -expf(a_log[h]) * softplus_of(a[(int64_t)t * hv + h] + dt_bias[h]);
            const float decay = expf(g);
            for (int32_t j = 0; j < dv; j++) pred[j] = 0.0f;
            for (int32_t i = 0; i < dk; i++) {
                float *row = S + (int64_t)i * dv;
                const float ki = kt[i];
                for (int32_t j = 0; j < dv; j++) {
                    row[j] *= decay;
                    pred[j] += row[j] * ki;
                }
            }
            for (int32_t j = 0; j < dv; j++) {
                delta[j] = (vt[j] - pred[j]) * beta;
                ot[j] = 0.0f;
            }
            for (int32_t i = 0; i < dk; i++) {
                float *row = S + (int64_t)i * dv;
                const float ki = kt[i], qi = qt[i];
                for (int32_t j = 0; j < dv; j++) {
                    row[j] += ki * delta[j];
                    ot[j] += row[j] * qi;
                }
            }
        }
        if (keep != NULL && keep[t]) {
            memcpy(saved_conv, conv_state, sizeof(float) * conv_size);
            memcpy(saved_state, state, sizeof(float) * state_size);
            saved_conv += conv_size;
            saved_state += state_size;
        }
    }
    return 0;
}
