/* Math shared by the kernels, in plain arithmetic so loops over it vectorise. */
#ifndef BATON_FASTMATH_H
#define BATON_FASTMATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* Element i of a bf16 or fp32 array, as fp32. */
static inline float to_f32(const void *base, int64_t i, int is_bf16) {
    if (is_bf16) {
        uint32_t bits = (uint32_t)((const uint16_t *)base)[i] << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    return ((const float *)base)[i];
}

/* f rounded to the nearest bf16 value, ties to even (as torch rounds), when is_bf16; NaN
 * stays NaN. */
static inline float round_to(float f, int is_bf16) {
    if (!is_bf16) return f;
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return f; /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    bits &= 0xffff0000u;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Store element i of a bf16 or fp32 array; f is already rounded (round_to). */
static inline void put(void *base, int64_t i, float f, int is_bf16) {
    if (is_bf16) {
        uint32_t bits;
        memcpy(&bits, &f, sizeof bits);
        ((uint16_t *)base)[i] = (uint16_t)(bits >> 16);
    } else {
        ((float *)base)[i] = f;
    }
}

/* exp(x) for x <= 0 (scores minus their maximum) in plain arithmetic so loops over it
 * vectorise: 2^n * p(r), r in [-ln2/2, ln2/2], degree-6 polynomial, relative error ~2e-7.
 * Below -87 it returns 0. */
static inline float exp_nonpositive(float x) {
    if (x < -87.0f) return 0.0f;
    float n = nearbyintf(x * 1.44269504088896341f);
    float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (0.16666667f + r * (0.041666668f +
                  r * (0.0083333333f + r * 0.0013888889f)))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* to_f32 of elements i .. i + 7 (bf16 or fp32), 8 lanes. */
static inline __m256 load8_f32(const void *p, int64_t i, int is_bf16) {
    if (is_bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))), 16));
    return _mm256_loadu_ps((const float *)p + i);
}

/* exp_nonpositive, 8 lanes: the same steps (its reductions and polynomial as fused
 * multiply-adds), for the loops GCC leaves scalar. */
static inline __m256 exp8_nonpositive(__m256 x) {
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_fmadd_ps(r, _mm256_set1_ps(0.0013888889f), _mm256_set1_ps(0.0083333333f));
    p = _mm256_fmadd_ps(r, p, _mm256_set1_ps(0.041666668f));
    p = _mm256_fmadd_ps(r, p, _mm256_set1_ps(0.16666667f));
    p = _mm256_fmadd_ps(r, p, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(r, p, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(r, p, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
    return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ), e);
}
#endif

#endif
