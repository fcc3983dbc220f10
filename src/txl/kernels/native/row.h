/* One query row's attention (decode.c's one-token step, attention.c's single-query calls: an agent's acting step):
 * per head, the (b)+(d) row vectorised over the keys, the (a)+(c) products 16 keys at a time, the softmax and the
 * value sum, reading the keys and values where they are (no transposed copy: one query would use 1/ROWS of a block).
 */
#ifndef TXL_ROW_H
#define TXL_ROW_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

static inline float dot(const float *a, const float *b, int n) {
    const int n2 = n / (2 * VL) * (2 * VL), n1 = n / VL * VL;
    vf a0 = vzero(), a1 = vzero();
    int i = 0;
    for (; i < n2; i += 2 * VL) {
        a0 += vload(a + i) * vload(b + i);
        a1 += vload(a + i + VL) * vload(b + i + VL);
    }
    for (; i < n1; i += VL) a0 += vload(a + i) * vload(b + i);
    float s = hsum(a0 + a1);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* The lane sums of 16 vectors, as one vector (lane m: the sum of p[m]): a transpose by halves. */
static inline vf sums16(const vf *p) {
    vf u[8], w[4], x[2];
    for (int i = 0; i < 8; i++) /* lanes 0-7: 8 partial sums of p[2i]; 8-15: of p[2i+1] */
        u[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                       30, 31);
    for (int i = 0; i < 4; i++) /* 4-lane groups: p[4i] .. p[4i+3] */
        w[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(u[2 * i], u[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                       31);
    for (int i = 0; i < 2; i++) /* 2-lane groups: p[8i] .. p[8i+7] */
        x[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(w[2 * i], w[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                       31);
    return __builtin_shufflevector(x[0], x[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(x[0], x[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* One head of one query row: out[Dh] = softmax(s) V over K keys. qu, qv: the query's (q + u) / sqrt(Dh) and
 * (q + v) / sqrt(Dh); k, v: the first key/value, rows ks and vs floats apart ([K][Dh]); r: W_kR R of this head for
 * the distances K-1 .. 0 (the newest query's row needs no shift), r[d * rs + j]; mask: K bytes (nonzero: masked) or
 * NULL; s: K floats of scratch. */
static void attend_row(const float *qu, const float *qv, const float *k, long ks, const float *v, long vs,
                       const float *r, long rs, const uint8_t *mask, int K, int Dh, float *s, float *out) {
    /* (b)+(d): s_j = sum_d qv_d r[d, j], vectorised over j */
    memset(s, 0, sizeof(float) * K);
    const int kv = K / VL * VL;
    for (int d = 0; d < Dh; d++) {
        const float c = qv[d];
        const float *rd = r + d * rs;
        const vf cv = vzero() + c;
        int j = 0;
        for (; j < kv; j += VL) vstore(s + j, vload(s + j) + cv * vload(rd + j));
        for (; j < K; j++) s[j] += c * rd[j];
    }
    /* + (a)+(c): 16 keys at a time (their products summed across lanes together) */
    int j = 0;
    if (Dh % VL == 0)
        for (; j < kv; j += VL) {
            vf p[VL];
            for (int m = 0; m < VL; m++) {
                const float *kj = k + (long)(j + m) * ks;
                vf a = vzero();
                for (int d = 0; d < Dh; d += VL) a += vload(qu + d) * vload(kj + d);
                p[m] = a;
            }
            vstore(s + j, vload(s + j) + sums16(p));
        }
    for (; j < K; j++) s[j] += dot(qu, k + (long)j * ks, Dh);
    /* the mask, the maximum */
    float mx = -INFINITY;
    for (j = 0; j < K; j++) {
        if (mask && mask[j]) s[j] = -INFINITY;
        mx = s[j] > mx ? s[j] : mx;
    }
    /* p_j = exp(s_j - max), their sum, and sum_j p_j v_j */
    vf tot = vzero();
    for (j = 0; j < kv; j += VL) {
        const vf e = vexp(vload(s + j) - mx);
        vstore(s + j, e);
        tot += e;
    }
    float total = hsum(tot);
    for (; j < K; j++) {
        s[j] = s[j] == -INFINITY ? 0.0f : expf(s[j] - mx);
        total += s[j];
    }
    float acc[Dh];
    memset(acc, 0, sizeof(float) * Dh);
    const int dv = Dh / VL * VL;
    for (j = 0; j < K; j++) {
        const float p = s[j];
        const float *vj = v + (long)j * vs;
        const vf pv = vzero() + p;
        int d = 0;
        for (; d < dv; d += VL) vstore(acc + d, vload(acc + d) + pv * vload(vj + d));
        for (; d < Dh; d++) acc[d] += p * vj[d];
    }
    const float inv = 1.0f / total;
    for (int d = 0; d < Dh; d++) out[d] = acc[d] * inv;
}

#endif
