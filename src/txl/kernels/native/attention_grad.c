/* The backward of training's relative attention (attn_type 0), from the probabilities that attention.c's forward
 * kept. With s_ij = qu_i . k_j + qv_i . r[:, c] (c = j + T-1-i, Appendix B's shift; the queries qu = (q + u) /
 * sqrt(Dh) and qv = (q + v) / sqrt(Dh), formed by the caller or, with query_bias, here), P = softmax(s) and
 * out_i = sum_j P_ij v_j, for the gradient g_i of out_i:
 *   dP_ij = g_i . v_j                      dS_ij = P_ij (dP_ij - sum_l P_il dP_il)     (softmax backward)
 *   dqu_i = sum_j dS_ij k_j                dk_j  = sum_i dS_ij qu_i
 *   dv_j  = sum_i P_ij g_i
 *   dqv_i = sum_c dS_i,c-(T-1-i) r[:, c]   dr[:, c] = sum_{b,i} dS_i,c-(T-1-i) qv_i   (the shift, backwards)
 * With dropout of the probabilities (dropatt), the output reads P f (f_ij: 0 or 1/(1-p), regenerated from the
 * forward's seed, as dropout.c draws it), dv_j = sum_i P_ij f_ij g_i, and dP_ij = (g_i . v_j) f_ij.
 * Keys past a query's causal limit (j > M+i) have P = 0 and so dS = 0: each block of 8 queries computes only the
 * keys its last row sees and the raw columns its first row reads, a quarter less work on the T x T block than the
 * PyTorch path's [B, H, T, K] products, and nothing of size T x K is written.
 *
 * Why: PyTorch runs the backward as six batched products with d_head 32 as the inner or outer dimension (90-135
 * GFLOP/s here), a softmax backward, the shift's zero-filled [B, H, T, K + T] buffer and copy, and the gradient's
 * transposes: ~11 ms per layer of the bench-char training step.
 *
 * The work is split into units of one head and a fixed group of batch rows (at least UNITS units where the batch
 * allows), each computed by one thread; dr is summed per unit and the units' sums added in a fixed order, so the
 * results do not depend on the number of threads. The same values as the PyTorch path up to fp32 rounding. */
#include <stdlib.h>
#include <string.h>

#include "blocks.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#define UNITS 16 /* the work units to aim for (threads that can share the backward) */

/* dst [Dh] = src times the queries' scale (1 where the caller formed the queries: a copy). */
static inline void scaled_row(float *dst, const float *src, float scale, int Dh) {
    if (scale == 1.0f) {
        memcpy(dst, src, sizeof(float) * Dh);
        return;
    }
    for (int d = 0; d < Dh; d++) dst[d] = src[d] * scale;
}

/* Strides in floats, the last dimension contiguous. qu, qv (b, h, t); k, v (b, h, j); r [H, Dh, >= K] (h, d); p
 * [B, H, T, K] contiguous (the forward's probabilities, before dropout); g, the output's gradient (b, h, t); drop:
 * the forward's dropout of the probabilities (NULL: none). Written: dqu, dqv [B, T, H, Dh] contiguous; dk, dv
 * (b, h, j); dr (h, d; its first K columns). With qb (NULL: none), qu and qv are the raw queries, to which the
 * kernel adds u and v and which it scales as the forward did, and dqu, dqv are the gradients of q + u and q + v
 * (times the scale). Returns nonzero if scratch memory could not be allocated. */
int txl_attention_backward(const float *qu, long qsb, long qsh, long qst, const float *qv, long vqsb, long vqsh,
                           long vqst, const float *k, long ksb, long ksh, long ksj, const float *v, long vsb, long vsh,
                           long vsj, const float *r, long rsh, long rsd, const float *p, const float *g, long gsb,
                           long gsh, long gst, float *dqu, float *dqv, float *dk, long dksb, long dksh, long dksj,
                           float *dv, long dvsb, long dvsh, long dvsj, float *dr, long drsh, long drsd,
                           const dropout_spec *drop, const query_bias *qbias, int B, int H, int T, int K, int Dh,
                           int n_threads) {
    const int Kp = (K + VL - 1) / VL * VL;
    /* Work units: each head's batch rows in G groups (G from H and B only, not the thread count: each unit sums its
     * part of dr, and the parts are added in order after), at least UNITS units where the batch allows. */
    const int G = H >= UNITS ? 1 : (B < (UNITS + H - 1) / H ? B : (UNITS + H - 1) / H), per_group = (B + G - 1) / G;
    const int units = H * G;
    const long per_thread =
        ((long)Dh * Kp + 3L * ROWS * Kp + (long)ROWS * (K + VL) + 4L * ROWS * Dh + 3L * K * Dh + VL) / VL * VL;
    const int nt = n_threads < units ? (n_threads > 1 ? n_threads : 1) : units;
    const size_t bytes = sizeof(float) * (size_t)(per_thread * nt + (long)units * K * Dh);
    float *scratch = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!scratch) return 1;
    float *parts = scratch + per_thread * nt; /* [units][K][Dh]: each unit's dr, transposed */
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int unit = 0; unit < units; unit++) {
        int t_id = 0;
#ifdef _OPENMP
        t_id = omp_get_thread_num();
#endif
        const int h = unit / G, b_lo = unit % G * per_group, b_hi = b_lo + per_group < B ? b_lo + per_group : B;
        const float *uh, *vbh;
        const float scale = head_bias(qbias, h, &uh, &vbh);
        float *vt = scratch + t_id * per_thread;  /* [Dh][Kp]: the values, transposed */
        float *s = vt + (long)Dh * Kp;            /* [ROWS][Kp]: dP, then dS */
        float *pb = s + (long)ROWS * Kp;          /* [ROWS][Kp]: the block's P */
        float *pd = pb + (long)ROWS * Kp;         /* [ROWS][Kp]: with dropout, the factors, then P dropped out */
        float *raw = pd + (long)ROWS * Kp;        /* [ROWS][K + VL]: dS at the raw columns */
        float *qb = raw + (long)ROWS * (K + VL);  /* [ROWS][Dh] x 4: qu, qv, g, and a product's rows */
        float *qvb = qb + ROWS * Dh, *gb = qvb + ROWS * Dh, *ob = gb + ROWS * Dh;
        float *dka = ob + ROWS * Dh, *dva = dka + (long)K * Dh; /* [K][Dh]: dk, dv of one (b, h) */
        float *rt = dva + (long)K * Dh, *drt = parts + (long)unit * K * Dh; /* [K][Dh]: r, dr, transposed */
        for (int c = 0; c < K; c++)
            for (int d = 0; d < Dh; d++) rt[(long)c * Dh + d] = r[h * rsh + d * rsd + c];
        memset(drt, 0, sizeof(float) * K * Dh);
        for (int b = b_lo; b < b_hi; b++) {
            const float *kh = k + b * ksb + h * ksh, *vh = v + b * vsb + h * vsh;
            const float *quh = qu + b * qsb + h * qsh, *qvh = qv + b * vqsb + h * vqsh, *gh = g + b * gsb + h * gsh;
            const float *ph = p + ((long)b * H + h) * T * K;
            transpose(vh, vsj, K, Dh, vt, Kp);
            memset(dka, 0, sizeof(float) * 2 * K * Dh);
            for (int t0 = 0; t0 < T; t0 += ROWS) {
                const int rows = T - t0 < ROWS ? T - t0 : ROWS;
                const int lim_block = K - (T - 1 - (t0 + rows - 1)); /* keys j < lim_block: some row sees them */
                const int width = (lim_block + VL - 1) / VL * VL;
                int c_lo = T - 1 - (t0 + ROWS - 1); /* the block's first raw column (its last row's) */
                c_lo = c_lo < 0 ? 0 : c_lo;
                const int n_c = K - c_lo;
                for (int i = 0; i < ROWS; i++) {
                    const int real = i < rows;
                    if (real) {
                        query_row(qb + i * Dh, quh + (t0 + i) * qst, uh, scale, Dh);
                        query_row(qvb + i * Dh, qvh + (t0 + i) * vqst, vbh, scale, Dh);
                        memcpy(gb + i * Dh, gh + (t0 + i) * gst, sizeof(float) * Dh);
                    } else {
                        memset(qb + i * Dh, 0, sizeof(float) * Dh);
                        memset(qvb + i * Dh, 0, sizeof(float) * Dh);
                        memset(gb + i * Dh, 0, sizeof(float) * Dh);
                    }
                    float *pr = pb + (long)i * Kp;
                    const int kept = real ? lim_block : 0; /* (P is 0 past each row's own limit) */
                    if (kept) memcpy(pr, ph + (long)(t0 + i) * K, sizeof(float) * kept);
                    memset(pr + kept, 0, sizeof(float) * (width - kept));
                }
                block_scores(gb, Dh, vt, Kp, width, s, Kp); /* dP (of the dropped-out P, with dropout) */
                if (drop) /* dP = dP_dropped * factor; the value gradient reads P * factor */
                    for (int i = 0; i < ROWS; i++) {
                        float *f = pd + (long)i * Kp, *sr = s + (long)i * Kp;
                        const float *pr = pb + (long)i * Kp;
                        memset(f, 0, sizeof(float) * width);
                        if (i < rows)
                            txl_dropout_factors(drop->seed, ((long)(b * H + h) * T + t0 + i) * K, lim_block,
                                                drop->threshold, drop->scale, f);
                        for (int j = 0; j < width; j++) sr[j] *= f[j], f[j] *= pr[j];
                    }
                for (int i = 0; i < ROWS; i++) {            /* dS = P (dP - sum P dP) */
                    float *sr = s + (long)i * Kp;
                    const float *pr = pb + (long)i * Kp;
                    vf acc = vzero();
                    for (int j = 0; j < width; j += VL) acc += vload(pr + j) * vload(sr + j);
                    const float dot = hsum(acc);
                    for (int j = 0; j < width; j += VL) vstore(sr + j, vload(pr + j) * (vload(sr + j) - dot));
                }
                block_product(s, Kp, lim_block, kh, ksj, Dh, ob); /* dqu */
                for (int i = 0; i < rows; i++)
                    scaled_row(dqu + (((long)b * T + t0 + i) * H + h) * Dh, ob + i * Dh, scale, Dh);
                block_outer(s, Kp, lim_block, qb, Dh, dka);  /* dk */
                block_outer(drop ? pd : pb, Kp, lim_block, gb, Dh, dva); /* dv */
                for (int i = 0; i < ROWS; i++) {             /* dS at the raw columns c_lo .. K-1 */
                    float *rr = raw + (long)i * (K + VL);
                    if (i >= rows) {
                        memset(rr, 0, sizeof(float) * n_c);
                        continue;
                    }
                    const int off = T - 1 - (t0 + i) - c_lo; /* row i reads raw columns from T-1-i on */
                    memset(rr, 0, sizeof(float) * off);
                    memcpy(rr + off, s + (long)i * Kp, sizeof(float) * (n_c - off));
                }
                block_product(raw, K + VL, n_c, rt + (long)c_lo * Dh, Dh, Dh, ob); /* dqv */
                for (int i = 0; i < rows; i++)
                    scaled_row(dqv + (((long)b * T + t0 + i) * H + h) * Dh, ob + i * Dh, scale, Dh);
                block_outer(raw, K + VL, n_c, qvb, Dh, drt + (long)c_lo * Dh); /* dr */
            }
            float *dkh = dk + b * dksb + h * dksh, *dvh = dv + b * dvsb + h * dvsh;
            for (int j = 0; j < K; j++) {
                memcpy(dkh + j * dksj, dka + (long)j * Dh, sizeof(float) * Dh);
                memcpy(dvh + j * dvsj, dva + (long)j * Dh, sizeof(float) * Dh);
            }
        }
    }
#pragma omp parallel for num_threads(nt < H ? nt : H) schedule(static)
    for (int h = 0; h < H; h++) { /* dr of each head: its units' parts, in order */
        const float *part = parts + (long)h * G * K * Dh;
        for (int d = 0; d < Dh; d++)
            for (int c = 0; c < K; c++) {
                float acc = part[(long)c * Dh + d];
                for (int grp = 1; grp < G; grp++) acc += part[((long)grp * K + c) * Dh + d];
                dr[h * drsh + d * drsd + c] = acc;
            }
    }
    free(scratch);
    return 0;
}
