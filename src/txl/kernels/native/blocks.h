/* The small products the attention kernels are made of (attention.c, attention_grad.c), each on a block of ROWS
 * query rows, for any Dh (chunks of 16 floats in registers, a scalar tail for the rest):
 *   block_scores   s[r][j]  = a_r . m[:, j]             a [ROWS][Dh], m [Dh][n] (keys or W_kR R columns)
 *   block_product  o[r][:]  = sum_j p[r][j] v_j          p [ROWS][n], v [n][Dh] (values, keys, W_kR R rows)
 *   block_outer    o[j][:] += sum_r a[r][j] x_r          a [ROWS][n], x [ROWS][Dh] (the keys', values' and
 *                                                        positions' gradients, summed over query blocks)
 * Rows past the block's real ones must be zero in the operands that have them. */
#ifndef TXL_BLOCKS_H
#define TXL_BLOCKS_H
#include <string.h>

#include "vec.h"

#define ROWS 8 /* queries per block */

/* The dropout of the probabilities (training with dropatt): the stream of dropout.c keyed by seed, element e of the
 * [B, H, T, K] probabilities kept iff its word >= threshold and then multiplied by scale; NULL: no dropout. */
typedef struct {
    uint64_t seed;
    uint32_t threshold;
    float scale;
} dropout_spec;

void txl_dropout_factors(uint64_t seed, long first, long n, uint32_t threshold, float scale, float *f);

/* The relative attention's query terms from the raw queries: qu = (q + u) * scale and qv = (q + v) * scale, with u and
 * v per head ([H][Dh], rows us and vs apart), as the PyTorch path rounds them (the sum, then the product); NULL:
 * the queries come with them added and scaled. */
typedef struct {
    const float *u, *v;
    long us, vs;
    float scale;
} query_bias;

/* Head h's u and v rows (NULL without qb) into *u and *v; returns the scale (1 without qb). */
static inline float head_bias(const query_bias *qb, int h, const float **u, const float **v) {
    *u = qb ? qb->u + h * qb->us : NULL;
    *v = qb ? qb->v + h * qb->vs : NULL;
    return qb ? qb->scale : 1.0f;
}

/* dst [Dh] = (src + add) * scale, or src itself without add: a query row as the block takes it. */
static inline void query_row(float *dst, const float *src, const float *add, float scale, int Dh) {
    if (!add) {
        memcpy(dst, src, sizeof(float) * Dh);
        return;
    }
    for (int d = 0; d < Dh; d++) dst[d] = (src[d] + add[d]) * scale;
}

/* t [Dh][np] = m^T for the rows m [n][Dh] (rows ms apart), the columns from n to np zero: 16 rows at a time, each
 * of t's rows written 16 floats at a time. */
static void transpose(const float *m, long ms, int n, int Dh, float *t, int np) {
    int j0 = 0;
    for (; j0 + VL <= n; j0 += VL)
        for (int d = 0; d < Dh; d++) {
            vf col;
            for (int j = 0; j < VL; j++) col[j] = m[(j0 + j) * ms + d];
            vstore(t + (long)d * np + j0, col);
        }
    for (int d = 0; d < Dh; d++)
        for (int j = j0; j < np; j++) t[(long)d * np + j] = j < n ? m[j * ms + d] : 0.0f;
}

/* s[r][j] = qb_r . m[:, j] for the block's ROWS rows qb [ROWS][Dh] and columns j < n of m [Dh][n] (rows ms apart),
 * into s [ROWS][ss]. */
static void block_scores(const float *qb, int Dh, const float *m, long ms, int n, float *s, long ss) {
    int j0 = 0;
    for (; j0 + VL <= n; j0 += VL) {
        vf acc[ROWS];
        for (int r = 0; r < ROWS; r++) acc[r] = vzero();
        for (int d = 0; d < Dh; d++) {
            const vf k = vload(m + d * ms + j0);
            for (int r = 0; r < ROWS; r++) acc[r] += qb[r * Dh + d] * k;
        }
        for (int r = 0; r < ROWS; r++) vstore(s + r * ss + j0, acc[r]);
    }
    for (; j0 < n; j0++) /* (the last columns of a width that is not a multiple of 16) */
        for (int r = 0; r < ROWS; r++) {
            float a = 0.0f;
            for (int d = 0; d < Dh; d++) a += qb[r * Dh + d] * m[d * ms + j0];
            s[r * ss + j0] = a;
        }
}

/* acc[r][c] = sum_{j < n} p[r][j] v_j[16c : 16c + 16] for NC (constant) chunks starting at chunk c0. */
static inline __attribute__((always_inline)) void block_values(const float *p, long ps, int n, const float *v, long vs,
                                                               int c0, int NC, float *out, int Dh) {
    vf acc[ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = vzero();
    for (int j = 0; j < n; j++) {
        vf val[4];
        for (int c = 0; c < NC; c++) val[c] = vload(v + j * vs + (c0 + c) * VL);
        for (int r = 0; r < ROWS; r++) {
            const float w = p[(long)r * ps + j];
            for (int c = 0; c < NC; c++) acc[r][c] += w * val[c];
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < NC; c++) vstore(out + r * Dh + (c0 + c) * VL, acc[r][c]);
}

/* out [ROWS][Dh] = p [ROWS][n] (rows ps apart) times v [n][Dh] (rows vs apart). */
static void block_product(const float *p, long ps, int n, const float *v, long vs, int Dh, float *out) {
    const int chunks = Dh / VL;
    for (int c0 = 0; c0 + 4 <= chunks; c0 += 4) block_values(p, ps, n, v, vs, c0, 4, out, Dh);
    switch (chunks % 4) { /* (constant chunk counts: the accumulators stay in registers) */
    case 1: block_values(p, ps, n, v, vs, chunks - 1, 1, out, Dh); break;
    case 2: block_values(p, ps, n, v, vs, chunks - 2, 2, out, Dh); break;
    case 3: block_values(p, ps, n, v, vs, chunks - 3, 3, out, Dh); break;
    }
    for (int d = chunks * VL; d < Dh; d++) /* the scalar tail of Dh */
        for (int r = 0; r < ROWS; r++) {
            float a = 0.0f;
            for (int j = 0; j < n; j++) a += p[(long)r * ps + j] * v[j * vs + d];
            out[r * Dh + d] = a;
        }
}

/* out[j][16c : 16c + 16] += sum_r a[r][j] x_r[16c : ...] for j < n and NC (constant, <= 2) chunks from chunk c0: the
 * block's rows of x stay in registers; two keys at a time (four independent sums). */
static inline __attribute__((always_inline)) void outer_chunks(const float *a, long as, int n, const float *x, int Dh,
                                                               int c0, int NC, float *out) {
    vf xr[ROWS][2];
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < NC; c++) xr[r][c] = vload(x + r * Dh + (c0 + c) * VL);
    int j = 0;
    for (; j + 2 <= n; j += 2) {
        vf acc0[2], acc1[2];
        float *o0 = out + (long)j * Dh + c0 * VL, *o1 = o0 + Dh;
        for (int c = 0; c < NC; c++) acc0[c] = vload(o0 + c * VL), acc1[c] = vload(o1 + c * VL);
        for (int r = 0; r < ROWS; r++) {
            const float w0 = a[r * as + j], w1 = a[r * as + j + 1];
            for (int c = 0; c < NC; c++) acc0[c] += w0 * xr[r][c], acc1[c] += w1 * xr[r][c];
        }
        for (int c = 0; c < NC; c++) vstore(o0 + c * VL, acc0[c]), vstore(o1 + c * VL, acc1[c]);
    }
    for (; j < n; j++) {
        vf acc[2];
        float *o = out + (long)j * Dh + c0 * VL;
        for (int c = 0; c < NC; c++) acc[c] = vload(o + c * VL);
        for (int r = 0; r < ROWS; r++)
            for (int c = 0; c < NC; c++) acc[c] += a[r * as + j] * xr[r][c];
        for (int c = 0; c < NC; c++) vstore(o + c * VL, acc[c]);
    }
}

/* out [n][Dh] += a^T x: a [ROWS][n] (rows as apart), x [ROWS][Dh]. */
static void block_outer(const float *a, long as, int n, const float *x, int Dh, float *out) {
    const int chunks = Dh / VL;
    int c0 = 0;
    for (; c0 + 2 <= chunks; c0 += 2) outer_chunks(a, as, n, x, Dh, c0, 2, out);
    if (c0 < chunks) outer_chunks(a, as, n, x, Dh, c0, 1, out);
    for (int d = chunks * VL; d < Dh; d++) /* the scalar tail of Dh */
        for (int j = 0; j < n; j++) {
            float acc = out[(long)j * Dh + d];
            for (int r = 0; r < ROWS; r++) acc += a[r * as + j] * x[r * Dh + d];
            out[(long)j * Dh + d] = acc;
        }
}

#endif
