/* The attention of Transformer-XL (attn_type 0) in one pass per head, what the evaluation path computes with torch's
 * kernels: the (b)+(d) product, the shift, the mask, scaled_dot_product_attention; in training it also keeps the
 * probabilities for the backward (attention_grad.c). For query i (absolute
 * position M+i) and key j of [memory; segment] (K = M+T keys):
 *   s_ij = (q_i + u).k_j / sqrt(Dh)                          (a)+(c)
 *        + (q_i + v).W_kR R_{M+i-j} / sqrt(Dh)               (b)+(d): raw column c = j + T-1-i of W_kR R, whose
 *                                                             columns hold the distances K-1 .. 0 (Appendix B)
 *        (-inf where j > M+i, or where the mask says)
 *   out_i = sum_j softmax_j(s_ij) v_j
 * The queries come scaled, with u and v added, or raw with u, v and the scale given (query_bias, blocks.h): then the
 * kernel forms (q + u) / sqrt(Dh) and (q + v) / sqrt(Dh) as it copies each block's rows, rounded as torch's two
 * operations round them. Optionally an additive bias [B, H, T, K] instead of the positional
 * term (the other attention variants). Built with the other kernels by txl/kernels/native/__init__.py, called through ctypes
 * by txl.modeling.
 *
 * Why: on a 2-core EPYC torch's CPU flash attention runs these shapes (d_head 32, 128 queries over 768 keys) at
 * ~60 GFLOP/s, a third of the GEMM peak (its products are small blocks with a 32-long inner dimension), and the
 * shifted (b)+(d) scores go through memory twice as a [B, H, T, K] tensor (25 MB per layer of the bench model). Here
 * one head's keys are transposed once ([Dh, K], zero-padded to a multiple of 16) and W_kR R is copied once per call
 * (zero-padded past K: a block's raw columns start anywhere, and their last partial vector would otherwise be
 * computed one column at a time, ~8% of the kernel); a block of 8 queries takes 16 keys (and 16 raw positional
 * columns) at a time, 8 accumulators per key vector load; the copies' rows are not 4 KB multiples apart (cache sets);
 * the block's raw (b)+(d) rows are added to its scores at each row's shift; the softmax runs over whole rows; the
 * value sum takes 8 rows x Dh outputs per key. Nothing of size T x K leaves the core's caches (in training, the
 * probabilities are written once).
 *
 * The same values as the PyTorch path up to fp32 rounding (sums are grouped differently); each row is computed by
 * one thread with the same code at any thread count. A NaN makes its row NaN, as in torch.
 */
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "row.h"

/* The positional input of a block: W_kR R of its head [Dh, >= Kp + VL] (rows rs apart; zero past column K, so that
 * the block's raw columns are computed in whole vectors), and the scaled q + v rows. */
typedef struct {
    const float *r;
    long rs;
    const float *qv; /* [ROWS][Dh] */
} positional;

/* One block of queries t0 .. t0+rows-1: scores (plus the shifted (b)+(d) rows, or the bias; -inf where masked and past
 * K), softmax over each row, the value sum into ob [ROWS][Dh]. Keys past the block's last causal one (j > M + t0 +
 * rows - 1 with the positional term) are never computed. raw: scratch [ROWS][K + VL]. p (NULL: not kept): the
 * block's rows of the probabilities [rows][K], written normalized (0 where masked), and the value sum reads them;
 * with drop (NULL: none), dropped out, the row at index e0 + r K of the [B, H, T, K] stream (p keeps them whole). */
static void attend_block(const float *qb, int rows, int t0, int T, int Dh, const float *kt, long kts, int Kp, int K,
                         const float *v, long vs, const positional *pos, float *raw, const float *bias, long bias_rs,
                         const unsigned char *mask, long mask_rs, float *s, float *ob, float *p,
                         const dropout_spec *drop, long e0) {
    const int lim_block = pos ? K - (T - 1 - (t0 + rows - 1)) : K; /* keys j < lim_block: any row sees them */
    const int width = (lim_block + VL - 1) / VL * VL;             /* <= Kp: the columns computed */
    block_scores(qb, Dh, kt, kts, width, s, Kp);
    int c_lo = 0; /* the block's first raw column: T-1-i for its last row i */
    if (pos) {
        c_lo = T - 1 - (t0 + ROWS - 1);
        c_lo = c_lo < 0 ? 0 : c_lo;
        const int n = (K - c_lo + VL - 1) / VL * VL; /* (whole vectors: r's copy is zero past K) */
        block_scores(pos->qv, Dh, pos->r + c_lo, pos->rs, n, raw, K + VL);
    }
    float inv[ROWS];
    for (int r = 0; r < rows; r++) {
        float *row = s + (long)r * Kp;
        const int i = t0 + r;
        const int lim = pos ? K - (T - 1 - i) : K; /* keys j < lim are scored (j > M+i: causally masked) */
        const float *b = pos ? raw + (long)r * (K + VL) + (T - 1 - i - c_lo) /* b[j]: raw column j + T-1-i */
                             : bias ? bias + r * bias_rs : NULL;
        vf mv = vzero() - INFINITY;
        int j = 0;
        for (; j + VL <= lim; j += VL) {
            const vf x = b ? vload(row + j) + vload(b + j) : vload(row + j);
            vstore(row + j, x);
            const vi gt = x > mv;
            mv = (vf)(((vi)x & gt) | ((vi)mv & ~gt));
        }
        float m = -INFINITY; /* (NaN scores are passed over here; their exp is NaN, so their row becomes NaN) */
        for (; j < lim; j++) {
            row[j] += b ? b[j] : 0.0f;
            m = row[j] > m ? row[j] : m;
        }
        for (; j < width; j++) row[j] = -INFINITY;
        if (mask) { /* (8 mask bytes at a time while they are all 0, as the causal part is: the kernel masks it) */
            const unsigned char *mr = mask + r * mask_rs;
            int masked = 0;
            for (j = 0; j + 8 <= lim; j += 8) {
                uint64_t w;
                memcpy(&w, mr + j, 8);
                if (w) break;
            }
            for (; j < lim; j++)
                if (mr[j]) row[j] = -INFINITY, masked = 1;
            if (masked) { /* (the maximum again, over what the mask left) */
                mv = vzero() - INFINITY, m = -INFINITY;
                for (j = 0; j < width; j += VL) {
                    const vf x = vload(row + j);
                    const vi gt = x > mv;
                    mv = (vf)(((vi)x & gt) | ((vi)mv & ~gt));
                }
            }
        }
        for (int l = 0; l < VL; l++) m = mv[l] > m ? mv[l] : m;
        vf sum = vzero();
        for (j = 0; j < width; j += VL) {
            const vf e = vexp(vload(row + j) - m);
            vstore(row + j, e);
            sum += e;
        }
        inv[r] = 1.0f / hsum(sum); /* (applied to the value sums: the same as normalizing the probabilities) */
    }
    for (int r = rows; r < ROWS; r++) memset(s + (long)r * Kp, 0, sizeof(float) * width); /* (padding rows) */
    if (p) { /* (training: the probabilities are kept, normalized, and the value sum reads them) */
        const int kept = width < K ? width : K;
        for (int r = 0; r < rows; r++) {
            float *row = s + (long)r * Kp, *pr = p + (long)r * K;
            for (int j = 0; j < width; j++) row[j] *= inv[r];
            memcpy(pr, row, sizeof(float) * kept);
            memset(pr + kept, 0, sizeof(float) * (K - kept));
            inv[r] = 1.0f;
            if (drop) { /* (raw is free by now: the factors) */
                txl_dropout_factors(drop->seed, e0 + (long)r * K, kept, drop->threshold, drop->scale, raw);
                for (int j = 0; j < kept; j++) row[j] *= raw[j];
            }
        }
    }
    block_product(s, Kp, lim_block, v, vs, Dh, ob);
    for (int r = 0; r < rows; r++)
        for (int d = 0; d < Dh; d++) ob[r * Dh + d] *= inv[r];
}

#ifdef _OPENMP
#include <omp.h>
#endif

/* The calling thread's number in the parallel region (its scratch memory), 0 without OpenMP. */
static inline int thread_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* txl_attention for one query per head (T = 1, the positional term, inference): attend_row per head, reading the
 * keys, values and W_kR R where they are. */
static int attention_rows(const float *q, long qsb, long qsh, const float *qv, long vqsb, long vqsh, const float *k,
                          long ksb, long ksh, long ksj, const float *v, long vsb, long vsh, long vsj, const float *r,
                          long rsh, long rsd, const unsigned char *mask, long msb, float *out, const query_bias *qbias,
                          int B, int H, int K, int Dh, int n_threads) {
    const long per_thread = ((long)K + 2L * Dh + VL) / VL * VL; /* scores, the two query rows */
    const int nt = n_threads > 1 && B * H > 1 ? n_threads : 1;
    float *scratch = aligned_alloc(64, (sizeof(float) * (size_t)(per_thread * nt) + 63) / 64 * 64);
    if (!scratch) return 1;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int u = 0; u < B * H; u++) {
        float *s = scratch + thread_id() * per_thread, *qu = s + K, *qr = qu + Dh;
        const int b = u / H, h = u % H;
        const float *uh, *vh;
        const float scale = head_bias(qbias, h, &uh, &vh);
        query_row(qu, q + b * qsb + h * qsh, uh, scale, Dh);
        query_row(qr, qv + b * vqsb + h * vqsh, vh, scale, Dh);
        attend_row(qu, qr, k + b * ksb + h * ksh, ksj, v + b * vsb + h * vsh, vsj, r + h * rsh, rsd,
                   mask ? mask + b * msb : NULL, K, Dh, s, out + ((long)b * H + h) * Dh);
    }
    free(scratch);
    return 0;
}

/* out[b, t, h, :] for B x H heads of T queries over K keys of Dh values (see the top). Strides in floats, the last
 * dimension contiguous: q, the scaled q + u, and qv, the scaled q + v (b, h, t); k and v (b, h, j); r, W_kR R of each
 * head (h, d; its columns: the distances K-1 .. 0; NULL: no positional term); bias (b, h, t; 0 for a broadcast
 * dimension; NULL: none; used only without r); mask, bytes, nonzero = masked (b, t; NULL: none). out is
 * [B, T, H, Dh], contiguous; p (training; NULL: none) [B, H, T, K], contiguous, receives the probabilities that
 * attention_grad.c's backward reads, and drop (with p; NULL: none) is the dropout of the probabilities. With qb
 * (NULL: none), q and qv are the raw queries and the kernel adds u and v and scales them (see query_bias). Returns
 * nonzero if scratch memory could not be allocated. */
int txl_attention(const float *q, long qsb, long qsh, long qst, const float *qv, long vqsb, long vqsh, long vqst,
                  const float *k, long ksb, long ksh, long ksj, const float *v, long vsb, long vsh, long vsj,
                  const float *r, long rsh, long rsd, const float *bias, long bsb, long bsh, long bst,
                  const unsigned char *mask, long msb, long mst, float *out, float *p, const dropout_spec *drop,
                  const query_bias *qbias, int B, int H, int T, int K, int Dh, int n_threads) {
    if (T == 1 && r && qv && !p) /* (one query: an agent's acting step; a block would compute ROWS - 1 zero rows) */
        return attention_rows(q, qsb, qsh, qv, vqsb, vqsh, k, ksb, ksh, ksj, v, vsb, vsh, vsj, r, rsh, rsd, mask, msb,
                              out, qbias, B, H, K, Dh, n_threads);
    const int Kp = (K + VL - 1) / VL * VL;
    const int ks = Kp + VL; /* the copies' row stride (keys and W_kR R): not a multiple of 4 KB (cache sets) */
    const long per_thread = ((long)Dh * ks + (long)ROWS * Kp + (long)ROWS * (K + VL) + 3L * ROWS * Dh + VL) / VL * VL;
    const int nt = n_threads > 1 && B * H > 1 ? n_threads : 1;
    const long shared = r ? (long)H * Dh * ks : 0; /* r's copy, every head's */
    float *scratch = aligned_alloc(64, (sizeof(float) * (size_t)(shared + per_thread * nt) + 63) / 64 * 64);
    if (!scratch) return 1;
    float *rts = scratch + per_thread * nt; /* [H][Dh][ks]: W_kR R, zero past column K */
    if (r) {
#pragma omp parallel for num_threads(nt < H ? nt : H) schedule(static)
        for (int h = 0; h < H; h++)
            for (int d = 0; d < Dh; d++) {
                float *row = rts + ((long)h * Dh + d) * ks;
                memcpy(row, r + h * rsh + d * rsd, sizeof(float) * K);
                memset(row + K, 0, sizeof(float) * (ks - K));
            }
    }
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int u = 0; u < B * H; u++) {
        float *kt = scratch + thread_id() * per_thread, *s = kt + (long)Dh * ks, *raw = s + (long)ROWS * Kp;
        float *qb = raw + (long)ROWS * (K + VL), *qvb = qb + ROWS * Dh, *ob = qvb + ROWS * Dh;
        const int b = u / H, h = u % H;
        const float *kh = k + b * ksb + h * ksh, *vh = v + b * vsb + h * vsh, *qh = q + b * qsb + h * qsh;
        const float *qvh = qv ? qv + b * vqsb + h * vqsh : NULL;
        const float *uh, *vbh;
        const float scale = head_bias(qbias, h, &uh, &vbh);
        transpose(kh, ksj, K, Dh, kt, ks);
        const positional pos = {rts + (long)h * Dh * ks, ks, qvb};
        for (int t0 = 0; t0 < T; t0 += ROWS) {
            const int rows = T - t0 < ROWS ? T - t0 : ROWS;
            for (int i = 0; i < ROWS; i++) {
                if (i < rows) query_row(qb + i * Dh, qh + (t0 + i) * qst, uh, scale, Dh);
                else memset(qb + i * Dh, 0, sizeof(float) * Dh);
                if (i < rows && qvh) query_row(qvb + i * Dh, qvh + (t0 + i) * vqst, vbh, scale, Dh);
                else memset(qvb + i * Dh, 0, sizeof(float) * Dh);
            }
            const float *bb = bias && !r ? bias + b * bsb + h * bsh + t0 * bst : NULL;
            const unsigned char *mb = mask ? mask + b * msb + t0 * mst : NULL;
            const long e0 = ((long)u * T + t0) * K;
            attend_block(qb, rows, t0, T, Dh, kt, ks, Kp, K, vh, vsj, r ? &pos : NULL, raw, bb, bst, mb, mst, s, ob,
                         p ? p + e0 : NULL, p ? drop : NULL, e0);
            for (int i = 0; i < rows; i++)
                memcpy(out + (((long)b * T + t0 + i) * H + h) * Dh, ob + i * Dh, sizeof(float) * Dh);
        }
    }
    free(scratch);
    return 0;
}
