/* The softmax's negative log-likelihood of one target per row, and its gradient, straight from the logits: what
 * the adaptive softmax computes as -log_softmax(x).gather(target), without the [N, V] log-probabilities.
 *
 * Why: PyTorch writes the whole log-softmax (N x V floats) to read one entry per row, and its backward fills an
 * [N, V] zero gradient, scatters the targets' entries into it and runs the log-softmax's backward over both (two
 * more [N, V] tensors). On the bench-word model (a 4,008-column head and tails of 12,000 and 16,000 columns) that
 * was ~25% of the fp32 training step. Here the forward reads each row twice (its maximum, then the sum of
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
