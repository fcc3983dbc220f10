/* Dropout in one pass, with a counter-based random stream: y = x * (keep ? 1/(1-p) : 0). Built with decode.c by
 * txl/kernels/native/__init__.py (cc -O3 -march=native -fopenmp; plain C with GCC vector extensions), called through
 * ctypes by txl.kernels.dropout.Dropout.
 *
 * Why: PyTorch's CPU generator draws its random words one at a time on one core (~5.7 ns per 64-bit word here),
 * and the mask then takes three more passes (the bits, the comparison, the products); dropout was ~12% of the
 * fp32 and ~22% of the bf16 training step of the bench-char model.
 *
 * The stream: Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011; the
 * generator of cuRAND and of PyTorch's CUDA dropout), keyed by a 64-bit seed that the caller draws from torch's
 * generator (so torch.manual_seed and a saved RNG state fix it). Element i = 64c + 16j + l takes 32-bit word j of
 * the block with counter 16c + l; it is kept iff that word >= threshold = round(p * 2^32). Each element's
 * decision depends only on (seed, i): the result does not depend on the number of threads, and the backward
 * (the same call on the gradient, with the same seed) regenerates the mask instead of storing it.
 *
 * The product is the one PyTorch computes for x.mul(keep).mul_(1/(1-p)): x * scale in fp32 (bf16: the value
 * widened to fp32, multiplied, rounded to nearest even once), and x * 0 for a dropped element (a NaN or an
 * infinity gives NaN, as there).
 *
 * The feed-forward's relu and its dropout run as one pass too (relu = 1: the same result as relu, then dropout), with
 * one backward from the output (the gradient passes where the output is positive: kept and positive).
 */
#include <stdint.h>
#include <string.h>

typedef uint32_t u32v __attribute__((vector_size(64)));
typedef uint64_t u64v __attribute__((vector_size(64)));
typedef float f32v __attribute__((vector_size(64)));
typedef float f32vu __attribute__((vector_size(64), aligned(4), may_alias));
typedef uint16_t u16v __attribute__((vector_size(32)));
typedef uint16_t u16vu __attribute__((vector_size(32), aligned(2), may_alias));

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u
#define LO32 0xFFFFFFFFull

/* The low and high 32 bits of a * m, per 32-bit lane (even and odd lanes as 64-bit products). */
static inline void mulhilo(u32v a, uint64_t m, u32v *lo, u32v *hi) {
    const u64v w = (u64v)a;
    const u64v even = (w & LO32) * m, odd = (w >> 32) * m;
    *lo = (u32v)((even & LO32) | (odd << 32));
    *hi = (u32v)((even >> 32) | (odd & ~LO32));
}

/* Philox4x32-10 of the 16 counters (c, c_hi, 0, 0), lanes l = 0..15: the four words of each, w[j][l]. */
static void philox16(uint64_t first, uint32_t k0, uint32_t k1, u32v w[4]) {
    u32v c0, c1, c2 = {0}, c3 = {0};
    for (int l = 0; l < 16; l++) {
        c0[l] = (uint32_t)(first + l);
        c1[l] = (uint32_t)((first + l) >> 32);
    }
    for (int round = 0; round < 10; round++) {
        u32v lo0, hi0, lo1, hi1;
        mulhilo(c0, PHILOX_M0, &lo0, &hi0);
        mulhilo(c2, PHILOX_M1, &lo1, &hi1);
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += PHILOX_W0;
        k1 += PHILOX_W1;
    }
    w[0] = c0, w[1] = c1, w[2] = c2, w[3] = c3;
}

static inline u32v keep_mask(u32v w, uint32_t threshold) { return (u32v)(w >= threshold); }

static inline f32v factors(u32v keep, float scale) {
    uint32_t s;
    memcpy(&s, &scale, 4);
    return (f32v)(keep & s); /* scale where kept, +0.0 where dropped */
}

static inline f32v bf16_widen(u16v h) {
    u32v u = __builtin_convertvector(h, u32v) << 16;
    return (f32v)u;
}

/* fp32 -> bf16, rounded to nearest even; a NaN becomes 0x7FC0, as c10::BFloat16. */
static inline u16v bf16_round(f32v f) {
    u32v u = (u32v)f;
    u32v r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    u32v nan = (u32v)((u & 0x7FFFFFFFu) > 0x7F800000u);
    r = (r & ~nan) | (0x7FC0u & nan);
    return __builtin_convertvector(r, u16v);
}

#define BF16 1 /* kind bits: the values are bf16 (else fp32) */
#define RELU 2 /* relu(x) is dropped out */

/* relu(x), NaN kept (as torch's relu). */
static inline f32v relu(f32v x) { return (f32v)((u32v)x & ((u32v)(x > 0.0f) | (u32v)(x != x))); }

/* 16 values from element `at` of p (fp32 or bf16; the first len of them, the rest 0), as fp32. */
static inline f32v load16(const void *p, long at, int len, int bf16) {
    if (len < 16) {
        uint16_t tail[32] = {0};
        memcpy(tail, (const char *)p + at * (bf16 ? 2 : 4), len * (bf16 ? 2 : 4));
        return bf16 ? bf16_widen(*(const u16vu *)tail) : (f32v) * (const f32vu *)tail;
    }
    return bf16 ? bf16_widen(*(const u16vu *)((const uint16_t *)p + at)) :
                  (f32v) * (const f32vu *)((const float *)p + at);
}

/* The 64 elements of chunk c, from x to y (whole chunks; the last one goes through a zero-padded copy). */
static void chunk64(const void *x, void *y, long c, int kind, uint32_t k0, uint32_t k1, uint32_t threshold,
                    float scale) {
    u32v w[4];
    philox16((uint64_t)c * 16, k0, k1, w);
    for (int j = 0; j < 4; j++) {
        const f32v m = factors(keep_mask(w[j], threshold), scale);
        f32v v = load16(x, 16 * j, 16, kind & BF16);
        v = kind & RELU ? relu(v) : v;
        if (kind & BF16)
            *(u16vu *)((uint16_t *)y + 16 * j) = bf16_round(v * m);
        else
            *(f32vu *)((float *)y + 16 * j) = v * m;
    }
}

/* Chunk c (elements 64c .. 64c + 63, the first `len` of them). */
static void chunk(const void *x, void *y, long c, int len, int kind, uint32_t k0, uint32_t k1, uint32_t threshold,
                  float scale) {
    const size_t size = kind & BF16 ? 2 : 4, at = (size_t)c * 64 * size;
    if (len == 64) {
        chunk64((const char *)x + at, (char *)y + at, c, kind, k0, k1, threshold, scale);
        return;
    }
    float in[64] = {0}, out[64]; /* (the tail: the same code on a copy, bytes of either dtype) */
    memcpy(in, (const char *)x + at, len * size);
    chunk64(in, out, c, kind, k0, k1, threshold, scale);
    memcpy((char *)y + at, out, len * size);
}

/* y[i] = x[i] * (kept ? scale : 0) for i < n, fp32 (bf16 = 0) or bf16 (bf16 = 1) values; x == y is allowed. With
 * relu = 1, relu(x[i]) instead of x[i] (the feed-forward's inner activation, in the same pass). */
void txl_dropout(const void *x, void *y, long n, int bf16, int relu, uint64_t seed, uint32_t threshold, float scale,
                 int n_threads) {
    const int kind = (bf16 ? BF16 : 0) | (relu ? RELU : 0);
    const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    const long chunks = (n + 63) / 64;
    const int nt = n >= (1L << 15) && n_threads > 1 ? n_threads : 1;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (long c = 0; c < chunks; c++) {
        const long left = n - c * 64;
        chunk(x, y, c, left < 64 ? (int)left : 64, kind, k0, k1, threshold, scale);
    }
}

/* The backward of relu + dropout from the forward's output y: dx[i] = g[i] * scale where y[i] > 0 (the element was
 * positive and kept), else 0; fp32 or bf16 (the product rounded once, as the dropout's). */
void txl_relu_dropout_backward(const void *g, const void *y, void *dx, long n, int bf16, float scale,
                               int n_threads) {
    const long chunks = (n + 15) / 16;
    const int nt = n >= (1L << 15) && n_threads > 1 ? n_threads : 1;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (long c = 0; c < chunks; c++) {
        const long at = c * 16;
        const int len = n - at < 16 ? (int)(n - at) : 16;
        const f32v d = (f32v)((u32v)(load16(g, at, len, bf16) * scale) & (u32v)(load16(y, at, len, bf16) > 0.0f));
        uint16_t out[32];
        if (bf16)
            *(u16vu *)out = bf16_round(d);
        else
            *(f32vu *)out = d;
        memcpy((char *)dx + at * (bf16 ? 2 : 4), out, len * (bf16 ? 2 : 4));
    }
}

/* The 32-bit words of elements 0 .. n-1 (for the tests: the stream itself). */
void txl_dropout_words(uint64_t seed, uint32_t *out, long n) {
    for (long c = 0; c * 64 < n; c++) {
        u32v w[4];
        philox16((uint64_t)c * 16, (uint32_t)seed, (uint32_t)(seed >> 32), w);
        for (int e = 0; e < 64 && c * 64 + e < n; e++) out[c * 64 + e] = w[e / 16][e % 16];
    }
}

/* f[i] = scale where element first + i of the stream for seed is kept, else 0, for i < n: the factors txl_dropout
 * multiplies by (the attention kernels use them for the dropout of their probabilities). */
void txl_dropout_factors(uint64_t seed, long first, long n, uint32_t threshold, float scale, float *f) {
    const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (long c = first / 64; c * 64 < first + n; c++) {
        u32v w[4];
        philox16((uint64_t)c * 16, k0, k1, w);
        const long lo = c * 64 < first ? first : c * 64, hi = c * 64 + 64 < first + n ? c * 64 + 64 : first + n;
        for (long e = lo; e < hi; e++) f[e - first] = w[(e % 64) / 16][e % 16] >= threshold ? scale : 0.0f;
    }
}
