/* One cached decoding step of Transformer-XL (attn_type 0), every layer, for B rows of one new token each: what
 * TransformerXL._decode computes with PyTorch kernels, as one call. Built on first use by txl/kernels/native/__init__.py
 * (cc -O3 -march=native -fopenmp; plain C with GCC vector extensions, no dependency), called through ctypes.
 *
 * Why: one token is ~15 MFLOP for the bench-char model, but ~30 MB of weights, cached keys/values and projected
 * positions are read per token. PyTorch runs it as ~20 kernels per layer, each with its dispatch, its threads and
 * a pass over memory; here each layer is one pass over its weights, cache and positions.
 *
 * Per layer (the paper's Sec. 3.3, inference: no dropout), for each row b:
 *   x = LN1(h) if pre_lnorm else h
 *   q, k, v = W_qkv x                                  (k, v written to the cache at position `pos`)
 *   s_j = (q + u).k_j / sqrt(Dh)            (a)+(c)     for the window's keys j = 0 .. K-1 (time order)
 *       + (q + v).W_kR R_{K-1-j} / sqrt(Dh) (b)+(d)     the newest query's row needs no shift
 *       (-inf where masked)
 *   a = sum_j softmax(s)_j v_j, per head;  h = h + W_o a (then LN1 unless pre_lnorm)
 *   h = h + W_2 relu(W_1 LN2?(h) + b_1) + b_2 (then LN2 unless pre_lnorm)
 * The same values as the PyTorch path up to fp32 rounding (sums are grouped differently).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "row.h"
#include "vec.h"

/* GTrXL's GRU gate g(x, y) joining a sub-module's output y to the residual stream x (txl.model.gating.GRUGate):
 * r = sig(W_r y + U_r x), z = sig(W_z y + U_z x - b_g), c = tanh(W_g y + U_g (r * x)), g = (1 - z) * x + z * c. */
typedef struct {
    const float *w;  /* [3D, D]: rows W_r; W_z; W_g (NULL: no gate) */
    const float *u;  /* [2D, D]: rows U_r; U_z */
    const float *ug; /* [D, D] */
    const float *bg; /* [D] */
} txl_gate;

/* The layer's tensors (fp32, contiguous, PyTorch layouts). */
typedef struct {
    const float *qkv;        /* [3*H*Dh, D]: rows W_q; W_k; W_v */
    const float *o;          /* [D, H*Dh] */
    const float *ln1_w, *ln1_b; /* [D] (the attention's layer norm; NULL: no affine) */
    const float *w1, *b1;    /* [Di, D], [Di] (b1 may be NULL) */
    const float *w2, *b2;    /* [D, Di], [D] */
    const float *ln2_w, *ln2_b; /* [D] (the feed-forward's layer norm) */
    const float *u, *v;      /* r_w_bias, r_r_bias of this layer, [H, Dh] */
    float eps1, eps2;
    float scale;             /* the attention's scale (its own attn.scale, read per layer: a user may change one) */
    int pre_lnorm;           /* this layer's pre_lnorm (the attention's and the feed-forward's, the same) */
    int identity_map;        /* GTrXL's reordering (pre-LN only): a ReLU on each sub-module's output */
    txl_gate gate1, gate2;   /* the attention's and the feed-forward's GRU gates (w NULL: the residual sum) */
} txl_layer;

/* gemv for many rows (B >= GEMV_ROWS): 16 weight rows at a time, kept in cache for every row b, whose 16 dot
 * products are summed across lanes together (sums16) instead of one horizontal sum each: with d_model 64 a dot is 4
 * vector products, and its own horizontal sum cost more than them (an agent's step, hundreds of environments). */
#define GEMV_ROWS 4
static void gemv_block(const float *W, const float *bias, int n_out, int n_in, const float *x, long xs, float *y,
                       long ys, int B) {
    const int n1 = n_in / VL * VL;
    for (int o = 0; o + VL <= n_out; o += VL) {
        const float *w = W + (long)o * n_in;
        for (int b = 0; b < B; b++) {
            const float *xb = x + b * xs;
            vf p[VL]; /* (16 independent sums: one chain each would wait on its own additions) */
            for (int m = 0; m < VL; m++) p[m] = vzero();
            for (int i = 0; i < n1; i += VL) {
                const vf xv = vload(xb + i);
                for (int m = 0; m < VL; m++) p[m] += vload(w + (long)m * n_in + i) * xv;
            }
            float out[VL];
            vstore(out, sums16(p));
            for (int m = 0; m < VL; m++) {
                const float *wm = w + (long)m * n_in;
                for (int i = n1; i < n_in; i++) out[m] += wm[i] * xb[i];
                y[b * ys + o + m] = out[m] + (bias ? bias[o + m] : 0.0f);
            }
        }
    }
}

/* y[b, :] = W x[b, :] + bias for rows b < B: W [n_out, n_in]; x rows `xs` apart, y rows `ys` apart. For a few rows,
 * one weight row at a time, read front to back: the hardware prefetcher follows one stream well (here ~35 GB/s from
 * L3), several interleaved rows poorly (~15 GB/s); the row stays in L1 for the B dot products. For many, gemv_block
 * (its last n_out % 16 outputs here). */
static void gemv(const float *W, const float *bias, int n_out, int n_in, const float *x, long xs, float *y, long ys,
                 int B) {
    int first = 0;
    if (B >= GEMV_ROWS) {
        first = n_out / VL * VL;
        gemv_block(W, bias, first, n_in, x, xs, y, ys, B);
    }
    for (int o = first; o < n_out; o++) {
        const float *w = W + (long)o * n_in;
        const float c = bias ? bias[o] : 0.0f;
        for (int b = 0; b < B; b++) y[b * ys + o] = dot(w, x + b * xs, n_in) + c;
    }
}

/* y = LayerNorm(x) over n values (biased variance, as torch), in double for the moments. */
static void layer_norm(const float *x, float *y, int n, const float *w, const float *b, float eps) {
    double mean = 0, var = 0;
    for (int i = 0; i < n; i++) mean += x[i];
    mean /= n;
    for (int i = 0; i < n; i++) var += ((double)x[i] - mean) * ((double)x[i] - mean);
    var /= n;
    const float m = (float)mean, rstd = (float)(1.0 / sqrt(var + eps));
    for (int i = 0; i < n; i++) {
        float t = (x[i] - m) * rstd;
        y[i] = w ? t * w[i] + (b ? b[i] : 0.0f) : t;
    }
}

/* y = exp(x) for n values x <= 0, as the softmax computes it (exported for the tests). */
void txl_exp(const float *x, float *y, long n) {
    long i = 0;
    for (; i + VL <= n; i += VL) vstore(y + i, vexp(vload(x + i)));
    for (; i < n; i++) y[i] = expf(x[i]);
}

#ifdef _OPENMP
#include <omp.h>
#define BARRIER _Pragma("omp barrier")
#else
#define BARRIER
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#endif

/* Thread t's share [*lo, *hi) of n items. */
static inline void share(int n, int *lo, int *hi) {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    *lo = (int)((long)n * t / nt);
    *hi = (int)((long)n * (t + 1) / nt);
}

/* Thread t's share [*lo, *hi) of n outputs of a gemv of B rows: for B >= GEMV_ROWS in whole blocks of 16 (the
 * remainder to the last thread), so that each output is computed as gemv_block or as a dot product whatever the
 * number of threads (the two sum in different orders). */
static inline void share_outputs(int n, int B, int *lo, int *hi) {
    if (B < GEMV_ROWS) {
        share(n, lo, hi);
        return;
    }
    const int t = omp_get_thread_num(), nt = omp_get_num_threads(), blocks = n / VL;
    *lo = VL * (int)((long)blocks * t / nt);
    *hi = t == nt - 1 ? n : VL * (int)((long)blocks * (t + 1) / nt);
}

/* h[b] = LN(h[b] + t[b]) (post-LN) or h[b] + t[b] (pre-LN; with identity_map h[b] + ReLU(t[b])), for this thread's
 * rows b. */
static void residual(float *h, float *t, int B, int D, int pre_lnorm, int relu, const float *w, const float *bias,
                     float eps) {
    int lo, hi;
    share(B, &lo, &hi);
    for (int b = lo; b < hi; b++) {
        float *hb = h + (long)b * D, *tb = t + (long)b * D;
        if (relu)
            for (int i = 0; i < D; i++) tb[i] = hb[i] + (tb[i] < 0.0f ? 0.0f : tb[i]); /* (NaN stays NaN) */
        else
            for (int i = 0; i < D; i++) tb[i] = hb[i] + tb[i];
        if (pre_lnorm)
            memcpy(hb, tb, sizeof(float) * D);
        else
            layer_norm(tb, hb, D, w, bias, eps);
    }
}

static inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* 16 at a time, from vexp of a non-positive argument: sigmoid(x) = 1 / (1 + e^-x) for x >= 0, e^x / (1 + e^x) below;
 * tanh|x| = (1 - e^-2|x|) / (1 + e^-2|x|) with x's sign (absolute error ~1e-7 near 0, where torch's is relative).
 * NaN stays NaN. */
static inline vi vsign_bit(void) { return (vi){0} + INT32_MIN; }
static inline vf vneg_abs(vf x) { return (vf)((vi)x | vsign_bit()); }
static inline vf vsigmoid(vf x) {
    const vf e = vexp(vneg_abs(x)), s = 1.0f / (1.0f + e);
    const vi pos = x >= 0.0f;
    return (vf)(((vi)s & pos) | ((vi)(e * s) & ~pos));
}
static inline vf vtanh(vf x) {
    const vf e = vexp(vneg_abs(x) * 2.0f), t = (1.0f - e) / (1.0f + e);
    return (vf)((vi)t | ((vi)x & vsign_bit())); /* (t >= 0: x's sign bit) */
}

/* h[b] = g(h[b], y[b]) for the GRU gate g (above), y = ReLU(t) with identity_map, every row (its phases shared by the
 * threads, with barriers between them). gy [B, 3D], gx [B, 2D], rx [B, D]: scratch. */
static void gru_gate(const txl_gate *g, float *h, float *t, int B, int D, int relu, float *gy, float *gx, float *rx) {
    int lo, hi;
    if (relu) {
        share(B, &lo, &hi);
        for (long i = (long)lo * D; i < (long)hi * D; i++) t[i] = t[i] < 0.0f ? 0.0f : t[i];
        BARRIER
    }
    share_outputs(3 * D, B, &lo, &hi); /* W y, and U x: the weights' rows shared */
    gemv(g->w + (long)lo * D, NULL, hi - lo, D, t, D, gy + lo, 3 * D, B);
    share_outputs(2 * D, B, &lo, &hi);
    gemv(g->u + (long)lo * D, NULL, hi - lo, D, h, D, gx + lo, 2 * D, B);
    BARRIER
    share(B, &lo, &hi); /* r, z (z into gx's U_z part), r * x */
    for (int b = lo; b < hi; b++) {
        const float *wy = gy + (long)b * 3 * D, *hb = h + (long)b * D;
        float *ux = gx + (long)b * 2 * D, *rb = rx + (long)b * D;
        int i = 0;
        for (; i + VL <= D; i += VL) {
            vstore(rb + i, vsigmoid(vload(wy + i) + vload(ux + i)) * vload(hb + i));
            vstore(ux + D + i, vsigmoid(vload(wy + D + i) + vload(ux + D + i) - vload(g->bg + i)));
        }
        for (; i < D; i++) {
            rb[i] = sigmoid(wy[i] + ux[i]) * hb[i];
            ux[D + i] = sigmoid(wy[D + i] + ux[D + i] - g->bg[i]);
        }
    }
    BARRIER
    share_outputs(D, B, &lo, &hi); /* U_g (r * x), into t (y is no longer needed) */
    gemv(g->ug + (long)lo * D, NULL, hi - lo, D, rx, D, t + lo, D, B);
    BARRIER
    share(B, &lo, &hi);
    for (int b = lo; b < hi; b++) {
        const float *wy = gy + (long)b * 3 * D, *z = gx + (long)b * 2 * D + D, *ug = t + (long)b * D;
        float *hb = h + (long)b * D;
        int i = 0;
        for (; i + VL <= D; i += VL) {
            const vf c = vtanh(vload(wy + 2 * D + i) + vload(ug + i)), zi = vload(z + i);
            vstore(hb + i, (1.0f - zi) * vload(hb + i) + zi * c);
        }
        for (; i < D; i++) {
            const float c = tanhf(wy[2 * D + i] + ug[i]);
            hb[i] = (1.0f - z[i]) * hb[i] + z[i] * c;
        }
    }
}

/* h = join(h, t): the residual sum (and norm), or the gate. */
static void join(const txl_layer *L, const txl_gate *g, float *h, float *t, int B, int D, int pre_lnorm,
                 const float *w, const float *bias, float eps, float *gy, float *gx, float *rx) {
    if (g->w)
        gru_gate(g, h, t, B, D, L->identity_map, gy, gx, rx);
    else
        residual(h, t, B, D, pre_lnorm, L->identity_map, w, bias, eps);
}

/* x[b] = LN(h[b]) (pre-LN; returns x) or h (post-LN; returns h), for this thread's rows b. */
static const float *layer_input(const float *h, float *x, int B, int D, int pre_lnorm, const float *w,
                                const float *bias, float eps) {
    if (!pre_lnorm) return h;
    int lo, hi;
    share(B, &lo, &hi);
    for (int b = lo; b < hi; b++) layer_norm(h + (long)b * D, x + (long)b * D, D, w, bias, eps);
    return x;
}

/* Every layer for one new position per row. h [B, D] (in: the embedded tokens; out: the last layer's output); hids
 * (NULL: not kept) [n_layer, B, D] receives each layer's input.
 * kc, vc: the cache's keys/values [n_layer, B, H, cap, Dh]; the window is positions [start, pos] (the new token's
 * key/value is written at pos). r[l]: W_kR R of layer l for the distances K-1 .. 0 (K = pos - start + 1), element
 * (h, d, j) at r[l][h * rs_h + d * rs_d + j]. mask: [B, K] bytes, rows mask_sb apart (0: one row for all), or NULL.
 * n_threads threads share each phase (OpenMP: PyTorch's own pool, when its libgomp is the one loaded); every
 * value is computed by one thread with the same code, so the result does not depend on n_threads.
 * Returns 0, or 1 when scratch memory could not be allocated (nothing was written then). */
int txl_decode_step(const txl_layer *layers, int n_layer, const float *const *r, long rs_h, long rs_d, float *kc,
                    float *vc, long cap, long start, long pos, const uint8_t *mask, long mask_sb, int B, int D, int H,
                    int Dh, int Di, float *h, float *hids, int n_threads) {
    const int K = (int)(pos - start + 1), HD = H * Dh;
    const int nt = n_threads > 0 ? n_threads : 1;
    const long per_thread = K + 2L * Dh;
    int gated = 0;
    for (int l = 0; l < n_layer; l++) gated |= layers[l].gate1.w || layers[l].gate2.w;
    const long n_gate = gated ? 6L * B * D : 0; /* the gates' W y [B, 3D], U x [B, 2D], r * x [B, D] */
    const long n_scratch = (long)B * (3L * HD + HD + D + D + Di) + n_gate + nt * per_thread;
    float *buf = malloc(sizeof(float) * n_scratch);
    if (!buf) return 1;
    float *qkv = buf, *att = qkv + (long)B * 3 * HD, *x = att + (long)B * HD, *t = x + (long)B * D,
          *ff = t + (long)B * D, *gy = ff + (long)B * Di, *gx = gy + (gated ? 3L * B * D : 0),
          *rx = gx + (gated ? 2L * B * D : 0), *thread_buf = gy + n_gate;
    const long layer_stride = (long)B * H * cap * Dh;

#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
#endif
    {
        float *s = thread_buf + omp_get_thread_num() * per_thread, *qu = s + K, *qv = qu + Dh;
        int lo, hi;
        for (int l = 0; l < n_layer; l++) {
            const txl_layer *L = &layers[l];
            const int pre_lnorm = L->pre_lnorm;
            const float scale = L->scale;
            float *kl = kc + l * layer_stride, *vl = vc + l * layer_stride;
            if (hids) { /* (h is whole: the last phase ended with a barrier) */
                share(B, &lo, &hi);
                memcpy(hids + ((long)l * B + lo) * D, h + (long)lo * D, sizeof(float) * D * (hi - lo));
            }
            const float *in = layer_input(h, x, B, D, pre_lnorm, L->ln1_w, L->ln1_b, L->eps1);
            if (pre_lnorm) { BARRIER } /* (post-LN reads h, complete since the last barrier) */
            /* per head: its rows of q, k, v (k, v into the cache), then its attention, for every row b */
            share(H, &lo, &hi);
            for (int hh = lo; hh < hi; hh++) {
                for (int part = 0; part < 3; part++) /* q, k, v of this head: Dh rows of W_qkv each */
                    gemv(L->qkv + ((long)part * HD + hh * Dh) * D, NULL, Dh, D, in, D, qkv + part * HD + hh * Dh,
                         3 * HD, B);
                for (int b = 0; b < B; b++) {
                    const float *q = qkv + (long)b * 3 * HD + hh * Dh, *kn = q + HD, *vn = kn + HD;
                    const long base = (((long)b * H + hh) * cap) * Dh;
                    memcpy(kl + base + pos * Dh, kn, sizeof(float) * Dh);
                    memcpy(vl + base + pos * Dh, vn, sizeof(float) * Dh);
                    for (int d = 0; d < Dh; d++) {
                        qu[d] = (q[d] + L->u[hh * Dh + d]) * scale;
                        qv[d] = (q[d] + L->v[hh * Dh + d]) * scale;
                    }
                    attend_row(qu, qv, kl + base + start * Dh, Dh, vl + base + start * Dh, Dh, r[l] + hh * rs_h, rs_d,
                               mask ? mask + b * mask_sb : NULL, K, Dh, s, att + (long)b * HD + hh * Dh);
                }
            }
            BARRIER
            /* h = h + W_o a, then LN1 (post-LN) */
            share_outputs(D, B, &lo, &hi);
            gemv(L->o + (long)lo * HD, NULL, hi - lo, HD, att, HD, t + lo, D, B);
            BARRIER
            join(L, &L->gate1, h, t, B, D, pre_lnorm, L->ln1_w, L->ln1_b, L->eps1, gy, gx, rx);
            BARRIER
            /* feed-forward: h = h + W2 relu(W1 x + b1) + b2, then LN2 (post-LN) */
            in = layer_input(h, x, B, D, pre_lnorm, L->ln2_w, L->ln2_b, L->eps2);
            if (pre_lnorm) { BARRIER }
            share_outputs(Di, B, &lo, &hi);
            gemv(L->w1 + (long)lo * D, L->b1 ? L->b1 + lo : NULL, hi - lo, D, in, D, ff + lo, Di, B);
            for (int b = 0; b < B; b++)
                for (int i = lo; i < hi; i++) {
                    float *f = ff + (long)b * Di + i;
                    *f = *f < 0.0f ? 0.0f : *f; /* (NaN stays NaN) */
                }
            BARRIER
            share_outputs(D, B, &lo, &hi);
            gemv(L->w2 + (long)lo * Di, L->b2 ? L->b2 + lo : NULL, hi - lo, Di, ff, Di, t + lo, D, B);
            BARRIER
            join(L, &L->gate2, h, t, B, D, pre_lnorm, L->ln2_w, L->ln2_b, L->eps2, gy, gx, rx);
            BARRIER
        }
    }
    free(buf);
    return 0;
}
