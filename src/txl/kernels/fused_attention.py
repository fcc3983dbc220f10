"""attn_type 0's relative attention as one fused Triton kernel, FlashAttention-style, forward and backward: a
backend of :func:`txl.kernels.attention.rel_attention` (``Backends.fused_attention``, a list of devices).
Design notes: docs/internals.md#txlkernelsfused_attention."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
SUPPORTED = hasattr(tl, "gather")  # (the shift as an index needs tl.gather: triton 3.2 or later)
BLOCK = 64  # queries and keys per tile on a GPU (16 under the interpreter: fewer padded rows to simulate)


@triton.jit
def _scores(qu, qv, K_ptr, R_ptr, b, h, i0, j0, T, Kn, W, sk_b, sk_h, sk_k, sr_h, sr_d, sr_c, Dh,
            BLOCK: tl.constexpr, DHP: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr):  # fmt: skip
    """One tile's scores (a)+(c) + (b)+(d), [BLOCK, BLOCK] fp32, its keys [BLOCK, DHP] and R's band [DHP, 2*BLOCK]
    (``qu``, ``qv``: the tile's (q+u)/sqrt(Dh), (q+v)/sqrt(Dh) in the dot dtype)."""
    j = j0 + tl.arange(0, BLOCK)
    d = tl.arange(0, DHP)
    kt = tl.load(
        K_ptr + b * sk_b + h * sk_h + j[:, None] * sk_k + d[None, :],
        mask=(j[:, None] < Kn) & (d[None, :] < Dh),
        other=0.0,
    )  # fmt: skip  [BLOCK, DHP]
    c = T - i0 - BLOCK + j0 + tl.arange(0, 2 * BLOCK)  # the band's columns of R
    rw = tl.load(R_ptr + h * sr_h + d[:, None] * sr_d + c[None, :] * sr_c,
                 mask=(d[:, None] < Dh) & (c[None, :] >= 0) & (c[None, :] < W), other=0.0)  # fmt: skip
    if DOT_F32:
        ac = tl.dot(qu.to(tl.float32), tl.trans(kt).to(tl.float32), input_precision=PREC)
        band = tl.dot(qv.to(tl.float32), rw.to(tl.float32), input_precision=PREC)  # [BLOCK, 2*BLOCK]
    else:
        ac = tl.dot(qu, tl.trans(kt), input_precision=PREC)  # [BLOCK, BLOCK]
        band = tl.dot(qv, rw, input_precision=PREC)
    il = tl.arange(0, BLOCK)[:, None]
    jl = tl.arange(0, BLOCK)[None, :]
    bd = tl.gather(band, jl - il + (BLOCK - 1), 1)  # (i, j) reads column T-1-i+j: the shift as an index
    return ac + bd, kt, rw


@triton.jit
def _visible(Mask_ptr, b, i, j, T, Kn, sm_b, sm_t, sm_k, HAS_MASK: tl.constexpr):
    """[BLOCK, BLOCK] True where query i may attend key j."""
    ok = (i[:, None] < T) & (j[None, :] < Kn)
    if HAS_MASK:
        masked = tl.load(Mask_ptr + b * sm_b + i[:, None] * sm_t + j[None, :] * sm_k, mask=ok, other=1)
        ok = ok & (masked == 0)
    return ok


@triton.jit
def _keep(seed, b, h, H, i, j, T, Kn, p):
    """Attention dropout's mask of a tile: Philox of (seed; i*K + j, b*H + h), kept where its uniform is >= p."""
    c0 = (i[:, None] * Kn + j[None, :]).to(tl.uint32)
    c1 = (tl.zeros_like(c0) + (b * H + h)).to(tl.uint32)
    r, _, _, _ = tl.random.philox(seed, c0, c1, tl.zeros_like(c0), tl.zeros_like(c0))
    return tl.random.uint_to_uniform_float(r) >= p


@triton.jit
def _load_queries(Q_ptr, U_ptr, V_ptr, b, h, i, T, sq_b, sq_t, sq_h, su_h, Dh, scale, dt, DHP: tl.constexpr):
    d = tl.arange(0, DHP)
    ok = (i[:, None] < T) & (d[None, :] < Dh)
    q = tl.load(Q_ptr + b * sq_b + i[:, None] * sq_t + h * sq_h + d[None, :], mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U_ptr + h * su_h + d, mask=d < Dh, other=0.0).to(tl.float32)
    v = tl.load(V_ptr + h * su_h + d, mask=d < Dh, other=0.0).to(tl.float32)
    return ((q + u[None, :]) * scale).to(dt), ((q + v[None, :]) * scale).to(dt), ok


@triton.jit
def _program(H, Seed_ptr, BLOCK: tl.constexpr, DROPOUT: tl.constexpr):
    """This program's first row (of queries or keys), batch row and head, and dropatt's key (a device tensor: drawn
    inside a graph or a compiled step, never read by the host)."""
    if DROPOUT:
        seed = tl.load(Seed_ptr)
    else:
        seed = 0
    return tl.program_id(0) * BLOCK, tl.program_id(1) // H, tl.program_id(1) % H, seed


@triton.jit
def _forward(Q_ptr, U_ptr, V_ptr, K_ptr, Vv_ptr, R_ptr, Mask_ptr, Out_ptr, Lse_ptr,
             sq_b, sq_t, sq_h, su_h, sk_b, sk_h, sk_k, sv_b, sv_h, sv_k, sr_h, sr_d, sr_c, sm_b, sm_t, sm_k,
             so_b, so_t, so_h, H, T, Kn, W, Dh, scale, p, Seed_ptr,
             HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr, BLOCK: tl.constexpr, DHP: tl.constexpr,
             PREC: tl.constexpr, DOT_F32: tl.constexpr):  # fmt: skip
    i0, b, h, seed = _program(H, Seed_ptr, BLOCK, DROPOUT)
    dt = Vv_ptr.dtype.element_ty
    i = i0 + tl.arange(0, BLOCK)
    d = tl.arange(0, DHP)
    qu, qv, q_ok = _load_queries(Q_ptr, U_ptr, V_ptr, b, h, i, T, sq_b, sq_t, sq_h, su_h, Dh, scale, dt, DHP)
    m = tl.full([BLOCK], float("-inf"), tl.float32)  # running max
    l = tl.zeros([BLOCK], tl.float32)  # running sum of exp  # noqa: E741
    acc = tl.zeros([BLOCK, DHP], tl.float32)
    for j0 in range(0, Kn, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        ok = _visible(Mask_ptr, b, i, j, T, Kn, sm_b, sm_t, sm_k, HAS_MASK)
        if tl.max(ok.to(tl.int32)) > 0:  # (a tile every query of which is masked: skipped)
            s, kt, rw = _scores(qu, qv, K_ptr, R_ptr, b, h, i0, j0, T, Kn, W, sk_b, sk_h, sk_k, sr_h, sr_d, sr_c, Dh,
                                BLOCK, DHP, PREC, DOT_F32)  # fmt: skip
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            e = tl.exp(s - m_safe[:, None])  # [BLOCK, BLOCK]
            l = l * alpha + tl.sum(e, 1)  # noqa: E741
            if DROPOUT:
                e = tl.where(_keep(seed, b, h, H, i, j, T, Kn, p), e / (1.0 - p), 0.0)
            vt = tl.load(Vv_ptr + b * sv_b + h * sv_h + j[:, None] * sv_k + d[None, :],
                         mask=(j[:, None] < Kn) & (d[None, :] < Dh), other=0.0)  # fmt: skip
            if DOT_F32:
                pv = tl.dot(e.to(dt).to(tl.float32), vt.to(tl.float32), input_precision=PREC)
            else:
                pv = tl.dot(e.to(dt), vt, input_precision=PREC)
            acc = acc * alpha[:, None] + pv
            m = m_new
    out = acc / tl.where(i < T, l, 1.0)[:, None]  # (a row with no visible key: 0/0, NaN, as the reference's)
    tl.store(Out_ptr + b * so_b + i[:, None] * so_t + h * so_h + d[None, :], out.to(dt), mask=q_ok)
    lse = tl.where(m == float("-inf"), float("-inf"), m + tl.log(tl.where(l > 0, l, 1.0)))
    tl.store(Lse_ptr + (b * H + h) * T + i, lse, mask=i < T)


@triton.jit
def _probabilities(s, ok, lse, Do, vt, Di, seed, b, h, H, i, j, T, Kn, p, dt,
                   DROPOUT: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr):  # fmt: skip
    """A tile's probabilities P (dropped out: Pd) and the scores' gradient dS = P * (dP - D)."""
    prob = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
    if DOT_F32:
        dpd = tl.dot(Do.to(tl.float32), tl.trans(vt).to(tl.float32), input_precision=PREC)
    else:
        dpd = tl.dot(Do, tl.trans(vt), input_precision=PREC)  # dL/dPd [BLOCK, BLOCK]
    if DROPOUT:
        keep = _keep(seed, b, h, H, i, j, T, Kn, p)
        pd = tl.where(keep, prob / (1.0 - p), 0.0)
        dp = tl.where(keep, dpd / (1.0 - p), 0.0)
    else:
        pd = prob
        dp = dpd
    return pd, prob * (dp - Di[:, None])


@triton.jit
def _backward_keys(Q_ptr, U_ptr, V_ptr, K_ptr, Vv_ptr, R_ptr, Mask_ptr, Do_ptr, Lse_ptr, Di_ptr, Dk_ptr, Dv_ptr,
                   sq_b, sq_t, sq_h, su_h, sk_b, sk_h, sk_k, sv_b, sv_h, sv_k, sr_h, sr_d, sr_c, sm_b, sm_t, sm_k,
                   sg_b, sg_t, sg_h, H, T, Kn, W, Dh, scale, p, Seed_ptr,
                   HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr, BLOCK: tl.constexpr, DHP: tl.constexpr,
                   PREC: tl.constexpr, DOT_F32: tl.constexpr):  # fmt: skip
    """dK and dV of one block of keys, over every block of queries."""
    j0, b, h, seed = _program(H, Seed_ptr, BLOCK, DROPOUT)
    dt = Vv_ptr.dtype.element_ty
    j = j0 + tl.arange(0, BLOCK)
    d = tl.arange(0, DHP)
    k_ok = (j[:, None] < Kn) & (d[None, :] < Dh)
    vt = tl.load(Vv_ptr + b * sv_b + h * sv_h + j[:, None] * sv_k + d[None, :], mask=k_ok, other=0.0)
    dk = tl.zeros([BLOCK, DHP], tl.float32)
    dv = tl.zeros([BLOCK, DHP], tl.float32)
    for i0 in range(0, T, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        ok = _visible(Mask_ptr, b, i, j, T, Kn, sm_b, sm_t, sm_k, HAS_MASK)
        if tl.max(ok.to(tl.int32)) > 0:
            qu, qv, q_ok = _load_queries(Q_ptr, U_ptr, V_ptr, b, h, i, T, sq_b, sq_t, sq_h, su_h, Dh, scale, dt, DHP)
            s, kt, rw = _scores(qu, qv, K_ptr, R_ptr, b, h, i0, j0, T, Kn, W, sk_b, sk_h, sk_k, sr_h, sr_d, sr_c, Dh,
                                BLOCK, DHP, PREC, DOT_F32)  # fmt: skip
            lse = tl.load(Lse_ptr + (b * H + h) * T + i, mask=i < T, other=0.0)
            Di = tl.load(Di_ptr + (b * H + h) * T + i, mask=i < T, other=0.0)
            Do = tl.load(Do_ptr + b * sg_b + i[:, None] * sg_t + h * sg_h + d[None, :], mask=q_ok, other=0.0)
            pd, ds = _probabilities(s, ok, lse, Do, vt, Di, seed, b, h, H, i, j, T, Kn, p, dt,
                                    DROPOUT, PREC, DOT_F32)  # fmt: skip
            if DOT_F32:
                dv += tl.dot(tl.trans(pd.to(dt).to(tl.float32)), Do.to(tl.float32), input_precision=PREC)
                dk += tl.dot(tl.trans(ds.to(dt).to(tl.float32)), qu.to(tl.float32), input_precision=PREC)
            else:
                dv += tl.dot(tl.trans(pd.to(dt)), Do, input_precision=PREC)  # [BLOCK, DHP]
                dk += tl.dot(tl.trans(ds.to(dt)), qu, input_precision=PREC)
    tl.store(Dk_ptr + ((b * H + h) * Kn + j[:, None]) * Dh + d[None, :], dk, mask=k_ok)
    tl.store(Dv_ptr + ((b * H + h) * Kn + j[:, None]) * Dh + d[None, :], dv, mask=k_ok)


@triton.jit
def _backward_queries(Q_ptr, U_ptr, V_ptr, K_ptr, Vv_ptr, R_ptr, Mask_ptr, Do_ptr, Lse_ptr, Di_ptr, Gu_ptr, Gv_ptr,
                      Dr_ptr,
                      sq_b, sq_t, sq_h, su_h, sk_b, sk_h, sk_k, sv_b, sv_h, sv_k, sr_h, sr_d, sr_c, sm_b, sm_t, sm_k,
                      sg_b, sg_t, sg_h, H, T, Kn, W, Dh, scale, p, Seed_ptr,
                      HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr, BLOCK: tl.constexpr, DHP: tl.constexpr,
                      PREC: tl.constexpr, DOT_F32: tl.constexpr):  # fmt: skip
    """The gradients of (q+u)/sqrt(Dh) and (q+v)/sqrt(Dh) of one block of queries, over every block of keys, and
    their part of W_kR R's gradient (the scores' gradient scattered back into R's band, added atomically)."""
    i0, b, h, seed = _program(H, Seed_ptr, BLOCK, DROPOUT)
    dt = Vv_ptr.dtype.element_ty
    i = i0 + tl.arange(0, BLOCK)
    d = tl.arange(0, DHP)
    qu, qv, q_ok = _load_queries(Q_ptr, U_ptr, V_ptr, b, h, i, T, sq_b, sq_t, sq_h, su_h, Dh, scale, dt, DHP)
    lse = tl.load(Lse_ptr + (b * H + h) * T + i, mask=i < T, other=0.0)
    Di = tl.load(Di_ptr + (b * H + h) * T + i, mask=i < T, other=0.0)
    Do = tl.load(Do_ptr + b * sg_b + i[:, None] * sg_t + h * sg_h + d[None, :], mask=q_ok, other=0.0)
    gu = tl.zeros([BLOCK, DHP], tl.float32)
    gv = tl.zeros([BLOCK, DHP], tl.float32)
    il = tl.arange(0, BLOCK)[:, None]
    w = tl.arange(0, 2 * BLOCK)[None, :]
    src = w + il - (BLOCK - 1)  # band column w of query row il holds key jl = w + il - (BLOCK - 1)
    in_band = (src >= 0) & (src < BLOCK)
    src = tl.minimum(tl.maximum(src, 0), BLOCK - 1)
    for j0 in range(0, Kn, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        ok = _visible(Mask_ptr, b, i, j, T, Kn, sm_b, sm_t, sm_k, HAS_MASK)
        if tl.max(ok.to(tl.int32)) > 0:
            s, kt, rw = _scores(qu, qv, K_ptr, R_ptr, b, h, i0, j0, T, Kn, W, sk_b, sk_h, sk_k, sr_h, sr_d, sr_c, Dh,
                                BLOCK, DHP, PREC, DOT_F32)  # fmt: skip
            vt = tl.load(Vv_ptr + b * sv_b + h * sv_h + j[:, None] * sv_k + d[None, :],
                         mask=(j[:, None] < Kn) & (d[None, :] < Dh), other=0.0)  # fmt: skip
            _, ds = _probabilities(s, ok, lse, Do, vt, Di, seed, b, h, H, i, j, T, Kn, p, dt,
                                   DROPOUT, PREC, DOT_F32)  # fmt: skip
            dband = tl.where(in_band, tl.gather(ds, src, 1), 0.0)  # [BLOCK, 2*BLOCK]
            if DOT_F32:
                gu += tl.dot(ds.to(dt).to(tl.float32), kt.to(tl.float32), input_precision=PREC)
                gv += tl.dot(dband.to(dt).to(tl.float32), tl.trans(rw).to(tl.float32), input_precision=PREC)
                dr = tl.dot(tl.trans(dband.to(dt).to(tl.float32)), qv.to(tl.float32), input_precision=PREC)
            else:
                gu += tl.dot(ds.to(dt), kt, input_precision=PREC)  # [BLOCK, DHP]
                gv += tl.dot(dband.to(dt), tl.trans(rw), input_precision=PREC)
                dr = tl.dot(tl.trans(dband.to(dt)), qv, input_precision=PREC)  # [2*BLOCK, DHP]
            c = T - i0 - BLOCK + j0 + tl.arange(0, 2 * BLOCK)
            tl.atomic_add(Dr_ptr + h * Dh * W + d[None, :] * W + c[:, None], dr,
                          mask=(c[:, None] >= 0) & (c[:, None] < W) & (d[None, :] < Dh))  # fmt: skip
    out = b * (T * H * Dh) + i[:, None] * (H * Dh) + h * Dh + d[None, :]
    tl.store(Gu_ptr + out, gu * scale, mask=q_ok)
    tl.store(Gv_ptr + out, gv * scale, mask=q_ok)


def _settings(q: Tensor, v: Tensor) -> dict:
    """The compile-time constants of one call."""
    Dh = q.shape[-1]
    tf32 = torch.backends.cuda.matmul.allow_tf32 and q.device.type == "cuda"
    return dict(
        BLOCK=16 if INTERPRETED else BLOCK,
        DHP=max(16, triton.next_power_of_2(Dh)),
        PREC="tf32" if tf32 or v.dtype != torch.float32 else "ieee",
        DOT_F32=INTERPRETED and v.dtype == torch.bfloat16,
    )


def _mask_strides(mask: Tensor | None, q: Tensor) -> tuple[Tensor, tuple[int, int, int]]:
    """The mask as bytes, and its strides for (b, i, j) ([T, K]: b's stride 0)."""
    if mask is None:
        return q, (0, 0, 0)
    m = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    if m.dim() == 2:
        return m, (0, m.stride(0), m.stride(1))
    return m, (m.stride(0), m.stride(-2), m.stride(-1))  # [B, 1, T, K]


def _common(q, u, v, k, vv, r, mask) -> tuple:
    B, T, H, Dh = q.shape
    if not applies(q, u, v, k, vv, r, mask):
        raise ValueError(
            "txl::rel_attention: these operands are not the kernel's (see txl.kernels.fused_attention.applies): "
            f"q {tuple(q.shape)} {q.dtype} on {q.device}, k {tuple(k.shape)}, r {tuple(r.shape)}, mask "
            f"{None if mask is None else (tuple(mask.shape), mask.dtype)}"
        )
    m, (sm_b, sm_t, sm_k) = _mask_strides(mask, q)
    strides = (
        q.stride(0), q.stride(1), q.stride(2), u.stride(0),
        k.stride(0), k.stride(1), k.stride(2), vv.stride(0), vv.stride(1), vv.stride(2),
        r.stride(0), r.stride(1), r.stride(2), sm_b, sm_t, sm_k,
    )  # fmt: skip
    return B, T, H, Dh, m, strides


@torch.library.custom_op("txl::rel_attention", mutates_args=())
def rel_attention_op(
    q: Tensor, u: Tensor, v: Tensor, k: Tensor, vv: Tensor, r: Tensor, mask: Tensor | None, scale: float, p: float,
    seed: Tensor | None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """softmax((q+u)k/sqrt(Dh) + shift((q+v)W_kR R)/sqrt(Dh), masked) v: [B, T, H*Dh] in the values' dtype, and each
    row's log-sum-exp [B, H, T] (fp32) for the backward. ``q`` [B, T, H, Dh], ``u``/``v`` [H, Dh], ``k``/``vv`` [B,
    H, K, Dh], ``r`` [H, Dh, W >= K] (column c: distance K-1-c), ``mask`` [T, K] / [B, 1, T, K] (True = masked),
    ``scale`` 1/sqrt(Dh); ``p`` > 0: attention dropout keyed by ``seed`` (int64 [1] on q's device; None without)."""
    B, T, H, Dh, m, strides = _common(q, u, v, k, vv, r, mask)
    if p > 0 and seed is None:
        raise ValueError("txl::rel_attention: attention dropout (p > 0) needs its seed, an int64 tensor [1]")
    Kn, W = k.shape[2], r.shape[2]
    out = torch.empty(B, T, H, Dh, dtype=vv.dtype, device=q.device)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    cfg = _settings(q, vv)
    grid = (triton.cdiv(T, cfg["BLOCK"]), B * H)
    _forward[grid](q, u, v, k, vv, r, m, out, lse, *strides, out.stride(0), out.stride(1), out.stride(2),
                   H, T, Kn, W, Dh, scale, p, lse if seed is None else seed, HAS_MASK=mask is not None,
                   DROPOUT=p > 0, **cfg)  # fmt: skip
    return out.view(B, T, H * Dh), lse


@rel_attention_op.register_fake
def _(q, u, v, k, vv, r, mask, scale, p, seed):  # noqa: ANN001, ANN202 (torch.library's signature)
    B, T, H, Dh = q.shape
    return q.new_empty(B, T, H * Dh, dtype=vv.dtype), q.new_empty(B, H, T, dtype=torch.float32)


@torch.library.custom_op("txl::rel_attention_backward", mutates_args=())
def rel_attention_backward_op(
    grad: Tensor, out: Tensor, lse: Tensor, q: Tensor, u: Tensor, v: Tensor, k: Tensor, vv: Tensor, r: Tensor,
    mask: Tensor | None, scale: float, p: float, seed: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """The gradients of :func:`rel_attention_op`'s output ``out`` [B, T, H*Dh] given ``grad`` (its gradient):
    (dq, du, dv, dk, dvv, dr), each in its input's dtype and shape."""
    B, T, H, Dh, m, strides = _common(q, u, v, k, vv, r, mask)
    Kn, W = k.shape[2], r.shape[2]
    g = grad.view(B, T, H, Dh)
    if g.stride(-1) != 1:
        g = g.contiguous()
    Di = (g.float() * out.view(B, T, H, Dh).float()).sum(-1).permute(0, 2, 1).contiguous()  # [B, H, T]
    dk = torch.empty(B, H, Kn, Dh, dtype=torch.float32, device=q.device)
    dvv = torch.empty_like(dk)
    gu = torch.empty(B, T, H, Dh, dtype=torch.float32, device=q.device)
    gv = torch.empty_like(gu)
    dr = torch.zeros(H, Dh, W, dtype=torch.float32, device=q.device)
    cfg = _settings(q, vv)
    flags = dict(HAS_MASK=mask is not None, DROPOUT=p > 0, **cfg)
    tail = (g.stride(0), g.stride(1), g.stride(2), H, T, Kn, W, Dh, scale, p, lse if seed is None else seed)
    _backward_keys[(triton.cdiv(Kn, cfg["BLOCK"]), B * H)](
        q, u, v, k, vv, r, m, g, lse, Di, dk, dvv, *strides, *tail, **flags
    )
    _backward_queries[(triton.cdiv(T, cfg["BLOCK"]), B * H)](
        q, u, v, k, vv, r, m, g, lse, Di, gu, gv, dr, *strides, *tail, **flags
    )
    dq = (gu + gv).to(q.dtype)
    return dq, gu.sum((0, 1)).to(u.dtype), gv.sum((0, 1)).to(v.dtype), dk.to(k.dtype), dvv.to(vv.dtype), dr.to(r.dtype)


@rel_attention_backward_op.register_fake
def _(grad, out, lse, q, u, v, k, vv, r, mask, scale, p, seed):  # noqa: ANN001, ANN202
    return tuple(t.new_empty(t.shape) for t in (q, u, v, k, vv, r))  # (contiguous, as the kernels write them)


def _setup(ctx, inputs, output) -> None:  # noqa: ANN001 (torch.library's signature)
    q, u, v, k, vv, r, mask, scale, p, seed = inputs
    out, lse = output
    ctx.save_for_backward(q, u, v, k, vv, r, mask, out, lse, seed)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)
    ctx.scale, ctx.p = scale, p


def _backward(ctx, grad: Tensor, _grad_lse: Tensor | None) -> tuple:  # noqa: ANN001
    q, u, v, k, vv, r, mask, out, lse, seed = ctx.saved_tensors
    dq, du, dv, dk, dvv, dr = torch.ops.txl.rel_attention_backward(
        grad, out, lse, q, u, v, k, vv, r, mask, ctx.scale, ctx.p, seed
    )
    return dq, du, dv, dk, dvv, dr, None, None, None, None


rel_attention_op.register_autograd(_backward, setup_context=_setup)


def fused_rel_attention(
    q: Tensor, u: Tensor, v: Tensor, k: Tensor, vv: Tensor, r: Tensor, mask: Tensor | None, scale: float,
    p: float = 0.0, seed: Tensor | int | None = None,
) -> Tensor:  # fmt: skip
    """The fused attention's output [B, T, H*Dh] (see :func:`rel_attention_op`; differentiable). ``seed``: an int64
    tensor [1] on q's device (e.g. drawn by ``torch.randint`` inside a compiled step), or an int."""
    if not isinstance(seed, Tensor):
        seed = torch.tensor([seed or 0], dtype=torch.int64, device=q.device) if p > 0 else None
    return torch.ops.txl.rel_attention(q, u, v, k, vv, r, mask, scale, p, seed)[0]


MAX_HEAD_DIM = 128
"""The largest d_head the kernels take (their tiles hold BLOCK x d_head operands in shared memory)."""


def applies(q: Tensor, u: Tensor, v: Tensor, k: Tensor, vv: Tensor, r: Tensor, mask: Tensor | None) -> bool:
    """Whether the kernels compute this call: float operands on one device (a CUDA GPU of compute capability 8.0 or
    later: compiled ahead of time for sm_80/86/89/90 their shared memory fits, run on sm_90; or any device under the
    interpreter), the head dimension contiguous in q, k, vv (and u, v contiguous), d_head <= :data:`MAX_HEAD_DIM`,
    K >= T with R covering every visible distance, a boolean mask wherever T > 1 (the unmasked future keys would
    read columns the reference's shift fills from the next row)."""
    T, Kn = q.shape[1], k.shape[2]
    return (
        (INTERPRETED or (q.is_cuda and torch.cuda.get_device_properties(q.device).major >= 8))  # (Dynamo folds it)
        and len({t.device for t in (q, u, v, k, vv, r)}) == 1
        and q.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and all(t.stride(-1) == 1 for t in (q, k, vv))
        and u.is_contiguous()
        and v.is_contiguous()
        and q.shape[-1] <= MAX_HEAD_DIM
        and Kn >= T
        and r.shape[-1] >= Kn
        and (mask is not None or T == 1)
        and (mask is None or mask.dtype == torch.bool)
    )


@triton.jit
def _keep_mask(Out_ptr, H, T, Kn, p, Seed_ptr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    b = tl.program_id(1) // H
    h = tl.program_id(1) % H
    seed = tl.load(Seed_ptr)
    for j0 in range(0, Kn, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        keep = _keep(seed, b, h, H, i, j, T, Kn, p)
        tl.store(Out_ptr + ((b * H + h) * T + i[:, None]) * Kn + j[None, :], keep.to(tl.int8),
                 mask=(i[:, None] < T) & (j[None, :] < Kn))  # fmt: skip


def dropout_keep(B: int, H: int, T: int, K: int, p: float, seed: int | Tensor, device: torch.device | str) -> Tensor:
    """The fused kernel's attention dropout mask [B, H, T, K] (True = kept) for ``seed``: the reference with this
    mask computes what the kernel computes."""
    out = torch.empty(B, H, T, K, dtype=torch.int8, device=device)
    if not isinstance(seed, Tensor):
        seed = torch.tensor([seed], dtype=torch.int64, device=device)
    block = 16
    _keep_mask[(triton.cdiv(T, block), B * H)](out, H, T, K, p, seed, BLOCK=block)
    return out.bool()
