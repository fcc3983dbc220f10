/* What the native kernels share: 16-float vectors (GCC vector extensions; AVX-512 registers with -march=native where
 * the CPU has them, pairs or quads of narrower ones elsewhere) and the softmax's exponential. */
#ifndef TXL_VEC_H
#define TXL_VEC_H
#include <math.h>
#include <stdint.h>

#define VL 16
typedef float vf __attribute__((vector_size(VL * sizeof(float))));
typedef float vfu __attribute__((vector_size(VL * sizeof(float)), aligned(4), may_alias)); /* unaligned access */

static inline vf vload(const float *p) { return *(const vfu *)p; }
static inline void vstore(float *p, vf x) { *(vfu *)p = x; }
static inline vf vzero(void) { return (vf){0}; }

static inline float hsum(vf a) {
    float s[VL];
    vstore(s, a);
    for (int w = VL / 2; w > 0; w /= 2) /* pairwise: s[i] += s[i + w] */
        for (int i = 0; i < w; i++) s[i] += s[i + w];
    return s[0];
}

typedef int32_t vi __attribute__((vector_size(VL * sizeof(int32_t))));

/* e^r for |r| <= ln2/2: Cephes' degree-7 polynomial. */
static inline vf exp_poly(vf r) {
    vf p = 1.9875691500e-4f + vzero();
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    return p * r * r + r + 1.0f;
}

/* exp(x) for x <= 0 (the softmax's shifted scores), 16 at a time: 2^n e^r with n = round(x / ln2), |r| <= ln2/2,
 * and Cephes' degree-7 polynomial (relative error ~2e-7, as libm's expf); 0 for -inf and below -104 (where exp
 * rounds to 0 in fp32; the portable version: below -87.3, no subnormal results); NaN for NaN. */
#if defined(__AVX512F__)
#include <immintrin.h>
/* AVX-512: the rounding and the scaling by 2^n (vscalefps: exact, subnormal results included) in one instruction
 * each. x is clamped at -104 first (so that r stays finite for -inf); max(c, x) returns x where x is NaN. */
static inline vf vexp(vf x) {
    const __m512 xc = _mm512_max_ps(_mm512_set1_ps(-104.0f), (__m512)x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const vf fn = (vf)n;
    const vf r = (vf)xc - fn * 0.693359375f - fn * -2.12194440e-4f;
    const vf p = exp_poly(r);
    return (vf)_mm512_scalef_ps((__m512)p, n);
}
#else
static inline vf vexp(vf x) {
    const vi under = x < -87.3f; /* (below: 0; the subnormal results are not computed) */
    x = (vf)(((vi)x & ~under) | ((vi)(vzero() - 87.3f) & under)); /* (-inf lanes too: `under` zeroes them below) */
    const vf y = x * 1.44269504088896341f + 0.5f;
    vi n = __builtin_convertvector(y, vi);
    n += (vi)(__builtin_convertvector(n, vf) > y); /* floor (truncation rounds negative values up) */
    const vf fn = __builtin_convertvector(n, vf);
    const vf r = x - fn * 0.693359375f - fn * -2.12194440e-4f;
    const vf p = exp_poly(r);
    const vi scaled = (vi)p + (n << 23); /* p * 2^n (n >= -126: x >= -87.3) */
    const vi nan = x != x;               /* NaN stays NaN (a NaN score makes its row NaN, as in torch) */
    return (vf)((scaled & ~under) | (nan & (vi)(vzero() + NAN)));
}
#endif

#endif
