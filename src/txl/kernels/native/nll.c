/* The softmax's negative log-likelihood of one target per row, and its gradient, straight from the logits: what
 * the adaptive softmax computes as -log_softmax(x).gather(target), without the [N, V] log-probabilities.
 *
 * Why: PyTorch writes the whole log-softmax (N x V floats) to read one entry per row, and its backward fills an
 * [N, V] zero gradient, scatters the targets' entries into it and runs the log-softmax's backward over both (two
 * more [N, V] tensors). On the bench-word model (a 4,008-column head and tails of 12,000 and 16,000 columns) this
 * kernel takes 4-6% off the fp32 training step. Here the forward reads each row twice (its maximum, then the sum of
 * exponentials, from L1/L2) and writes one float per row; the backward writes the gradient once.
 *
 *   forward:  m = max_j x_j,  s = sum_j exp(x_j - m),  nll = log(s) - (x_t - m)   (0 where t < 0: ignored)
 *             lse = m + log(s) is kept for the backward
 *   backward: dx_j = g * exp(x_j - lse) - g [j = t]                         (a row with t < 0 gets zeros)
 *
 * The same values as PyTorch's log_softmax + gather and their backward up to fp32 rounding (the sum is grouped
 * differently). A NaN in a row makes its nll NaN (the maximum skips it, its exponential does not); +inf gives NaN
 * (inf - inf), -inf entries (the head's padding columns) take no probability. Rows are split among threads, each
 * computed by one thread in a fixed order: the same results at any thread count.
 */
#include <stdint.h>

#include "vec.h"

/* max_j x_j over a row of v floats (NaN skipped). */
static float row_max(const float *x, long v) {
    vf m = vzero() - INFINITY;
    long j = 0;
    for (; j + VL <= v; j += VL) {
        const vf a = vload(x + j);
        const vi greater = a > m;
        m = (vf)(((vi)a & greater) | ((vi)m & ~greater));
    }
    float best = -INFINITY;
    for (int l = 0; l < VL; l++) best = m[l] > best ? m[l] : best;
    for (; j < v; j++) best = x[j] > best ? x[j] : best;
    return best;
}

/* The last (v mod VL) floats of a row as one vector, the rest of it `fill`. */
static inline vf tail(const float *x, long v, float fill) {
    vf t = vzero() + fill;
    for (long j = v / VL * VL, l = 0; j < v; j++, l++) t[l] = x[j];
    return t;
}

/* sum_j exp(x_j - m) (four accumulators, then pairwise). */
static float row_sum_exp(const float *x, long v, float m) {
    vf s[4] = {vzero(), vzero(), vzero(), vzero()};
    long j = 0;
    for (; j + 4 * VL <= v; j += 4 * VL)
        for (int a = 0; a < 4; a++) s[a] += vexp(vload(x + j + a * VL) - m);
    for (; j + VL <= v; j += VL) s[0] += vexp(vload(x + j) - m);
    if (j < v) s[1] += vexp(tail(x, v, -INFINITY) - m);
    return hsum((s[0] + s[1]) + (s[2] + s[3]));
}

/* nll [n] and lse [n] of the n rows of x (row i at x + i * ldx, v floats); target [n] (< 0: ignored). */
void txl_nll_forward(const float *x, long n, long v, long ldx, const int64_t *target, float *nll, float *lse,
                     int n_threads) {
    const int nt = n * v >= (1L << 15) && n_threads > 1 ? n_threads : 1;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (long i = 0; i < n; i++) {
        const float *row = x + i * ldx;
        const float m = row_max(row, v);
        const float log_s = logf(row_sum_exp(row, v, m));
        const int64_t t = target[i];
        nll[i] = t < 0 ? 0.0f : log_s - (row[t] - m);
        lse[i] = m + log_s;
    }
}

/* dx (row i at dx + i * lddx) = g_i * (softmax(x_i) - onehot(t_i)); zeros where t_i < 0. */
void txl_nll_backward(const float *x, long n, long v, long ldx, const int64_t *target, const float *lse,
                      const float *g, float *dx, long lddx, int n_threads) {
    const int nt = n * v >= (1L << 15) && n_threads > 1 ? n_threads : 1;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (long i = 0; i < n; i++) {
        const float *row = x + i * ldx;
        float *out = dx + i * lddx;
        const int64_t t = target[i];
        const float gi = g[i], c = lse[i];
        long j = 0;
        if (t < 0) {
            for (; j < v; j++) out[j] = 0.0f;
            continue;
        }
        for (; j + VL <= v; j += VL) vstore(out + j, vexp(vload(row + j) - c) * gi);
        if (j < v) {
            const vf r = vexp(tail(row, v, -INFINITY) - c) * gi;
            for (int l = 0; j < v; j++, l++) out[j] = r[l];
        }
        out[t] -= gi;
    }
}

/* The same NLL for logits that are never stored: x = h W^T + b computed 8 rows x 32 columns at a time into a scratch
 * that stays in L1, with a running maximum and sum per row (the sum rescaled once per chunk when the maximum grows).
 * For the adaptive softmax's clusters in evaluation (inputs of at most NL_MAX_D): bench-word's tails (16 or 64 inputs,
 * 12,000-16,000 columns) run through BLAS at a third to half of its peak and their [N, V] logits are written and read
 * again; its head (256 inputs, 4,008 columns) also takes less time here than its product alone through BLAS.
 *   h [n][d] (rows ldh apart), wt = W^T [d][vp] (vp, a multiple of 32 columns, the extra ones zero), bias [vp] (-inf
 *   past the v real columns), target [n] (< v; < 0: ignored), nll [n].
 * The same values as the products and txl_nll_forward up to fp32 rounding. */
#define NL_ROWS 8
#define NL_CHUNK 512 /* columns per chunk (a multiple of 32): 8 x 512 floats of scratch */
#define NL_MAX_D 256 /* inputs per row (the caller checks) */
#define NL_KBLOCK 64 /* inputs summed per block */

static void nll_linear_block(const float *hb, int d, const float *wt, long vp, const float *bias, const int64_t *t,
                             int rows, float *out) {
    float scratch[NL_ROWS * NL_CHUNK] __attribute__((aligned(64)));
    float m[NL_ROWS], s[NL_ROWS], xt[NL_ROWS];
    for (int r = 0; r < NL_ROWS; r++) m[r] = -INFINITY, s[r] = 0.0f, xt[r] = 0.0f;
    for (long c0 = 0; c0 < vp; c0 += NL_CHUNK) {
        const int width = vp - c0 < NL_CHUNK ? (int)(vp - c0) : NL_CHUNK;
        vf cmax[NL_ROWS];
        for (int r = 0; r < NL_ROWS; r++) cmax[r] = vzero() - INFINITY;
        for (int j = 0; j < width; j += 2 * VL)
            for (int k0 = 0; k0 < d; k0 += NL_KBLOCK) { /* (sums over blocks of inputs, added: BLAS's accuracy) */
                const int k1 = d - k0 < NL_KBLOCK ? d : k0 + NL_KBLOCK;
                vf a0[NL_ROWS], a1[NL_ROWS];
                for (int r = 0; r < NL_ROWS; r++) a0[r] = a1[r] = vzero();
                for (int k = k0; k < k1; k++) {
                    const vf w0 = vload(wt + k * vp + c0 + j), w1 = vload(wt + k * vp + c0 + j + VL);
                    for (int r = 0; r < NL_ROWS; r++) {
                        const float x = hb[r * d + k];
                        a0[r] += x * w0;
                        a1[r] += x * w1;
                    }
                }
                for (int r = 0; r < NL_ROWS; r++) {
                    float *at = scratch + r * NL_CHUNK + j;
                    if (k0 == 0) {
                        a0[r] += vload(bias + c0 + j), a1[r] += vload(bias + c0 + j + VL);
                    } else {
                        a0[r] += vload(at), a1[r] += vload(at + VL);
                    }
                    vstore(at, a0[r]);
                    vstore(at + VL, a1[r]);
                    if (k1 == d) {
                        const vi g0 = a0[r] > cmax[r];
                        cmax[r] = (vf)(((vi)a0[r] & g0) | ((vi)cmax[r] & ~g0));
                        const vi g1 = a1[r] > cmax[r];
                        cmax[r] = (vf)(((vi)a1[r] & g1) | ((vi)cmax[r] & ~g1));
                    }
                }
            }
        for (int r = 0; r < rows; r++) {
            float cm = -INFINITY;
            for (int l = 0; l < VL; l++) cm = cmax[r][l] > cm ? cmax[r][l] : cm;
            if (cm > m[r]) { /* (the sum so far, relative to the new maximum) */
                s[r] *= expf(m[r] - cm);
                m[r] = cm;
            }
            const float *row = scratch + r * NL_CHUNK;
            vf acc = vzero();
            for (int j = 0; j < width; j += VL) acc += vexp(vload(row + j) - m[r]);
            s[r] += hsum(acc);
            if (t[r] >= c0 && t[r] < c0 + width) xt[r] = row[t[r] - c0];
        }
    }
    for (int r = 0; r < rows; r++) out[r] = t[r] < 0 ? 0.0f : logf(s[r]) - (xt[r] - m[r]);
}

/* nll [n] of the rows of h (see above); d <= NL_MAX_D. */
void txl_nll_linear(const float *h, long n, int d, long ldh, const float *wt, long vp, const float *bias,
                    const int64_t *target, float *nll, int n_threads) {
    const long blocks = (n + NL_ROWS - 1) / NL_ROWS;
    const int nt = n * vp * d >= (1L << 18) && n_threads > 1 ? n_threads : 1;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (long blk = 0; blk < blocks; blk++) {
        const long i0 = blk * NL_ROWS;
        const int rows = n - i0 < NL_ROWS ? (int)(n - i0) : NL_ROWS;
        float hb[NL_ROWS * NL_MAX_D];
        int64_t t[NL_ROWS];
        for (int r = 0; r < NL_ROWS; r++) {
            t[r] = r < rows ? target[i0 + r] : -1;
            for (int k = 0; k < d; k++) hb[r * d + k] = r < rows ? h[(i0 + r) * ldh + k] : 0.0f;
        }
        nll_linear_block(hb, d, wt, vp, bias, t, rows, nll + i0);
    }
}
