"""The attention's named operations and their backends: the whole relative attention of attn_type 0 (the fused
Triton kernel, the native CPU kernel; inference and training), the attend step (one SDPA call, or the model's explicit
reference) and the sum of the scores (half precision under autocast, or the reference's fp32). The references are the
model's own code (``txl.model.attention``: scores() + attend()); tests/test_backends_exact.py holds every backend to
them."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from txl.kernels import native
from txl.kernels.backends import backends
from txl.kernels.dropout import dropout_seed


class _NativeRelAttention(torch.autograd.Function):
    """attn_type 0's attention with gradients, natively (fp32 on the CPU): the forward is the inference kernel that
    also keeps the probabilities [B, H, T, K], the backward (:func:`txl.kernels.native.attention_backward`) the
    softmax's and
    the five products' gradients with the shift undone in place, computing only the keys each block of queries sees
    (no [B, H, T, K] scores, shifted copies or zero-filled buffers). ``drop`` (p, seed): dropatt, the mask that
    :class:`Dropout` draws for that seed (regenerated in the backward). The same values as scores() + attend() up to
    fp32 rounding; ``use_backends(native_attention=False)`` gives the PyTorch kernels."""

    @staticmethod
    def forward(
        ctx, q: Tensor, u: Tensor, v: Tensor, kv: Tensor, r_k: Tensor, mask: Tensor | None, drop: tuple | None, scale
    ):
        qt = q.transpose(1, 2)  # [B, H, T, Dh], raw: the kernel forms (q + u) * scale and (q + v) * scale
        out, prob = native.attention_train(qt, kv[0], kv[1], qt, r_k, mask, drop, (u, v, scale))  # [B, T, H*Dh]
        ctx.save_for_backward(q, u, v, kv, r_k, prob)  # (prob [B, H, T, K])
        ctx.drop, ctx.scale = drop, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> tuple:
        q, u, v, kv, r_k, prob = ctx.saved_tensors
        qt = q.transpose(1, 2)
        g_u, g_v, dkv, dr = native.attention_backward(
            qt, kv[0], kv[1], qt, r_k, prob, grad, ctx.drop, (u, v, ctx.scale)
        )
        # g_u, g_v [B, T, H, Dh]: the gradients of q + u and q + v, as autograd's of the two sums
        du = g_u.sum((0, 1)) if ctx.needs_input_grad[1] else None  # [H, Dh]
        dv = g_v.sum((0, 1)) if ctx.needs_input_grad[2] else None
        return g_u + g_v, du, dv, dkv, dr, None, None, None


def rel_attention(
    q: Tensor, u: Tensor, v: Tensor, kv: Tensor | tuple[Tensor, Tensor], positions: Callable[[int], Tensor],
    scale: float, mask: Tensor | None, dropatt: float, reference: Callable[[], Tensor],
) -> Tensor:  # fmt: skip
    """attn_type 0's attention, softmax((q + u) k + shift((q + v) W_kR R)) v, [B, T, H*Dh]: the named operation. The
    ``reference()`` is the model's (its scores() + attend()); the backends compute the same as one call, with the
    (b)+(d) rows read at their shift inside the kernel, in this order where they apply:

    * ``Backends.fused_attention`` (devices): the fused Triton kernel (:mod:`txl.kernels.fused_attention`), forward
      and backward, any float dtype, dropatt by its own Philox stream.
    * ``Backends.native_attention``: the native CPU kernel (fp32), inference, and training through the autograd
      function above (its dropout of the probabilities, ``dropatt``, draws its seed where the reference's
      :class:`~txl.kernels.dropout.Dropout` would, and is the same mask).

    ``q`` [B, T, H, Dh] raw queries (the kernels form (q + u) * scale and (q + v) * scale), ``kv`` the keys and values
    [B, H, K, Dh] (one [2, ...] tensor, or a cache's pair), ``positions(K)`` W_kR R [H, Dh, >= K]."""
    grad = torch.is_grad_enabled()
    out = _fused(q, u, v, kv, positions, scale, mask, grad, dropatt)
    if out is None:
        out = _native(q, u, v, kv, positions, scale, mask, grad, dropatt)
    return reference() if out is None else out


def _fused(q, u, v, kv, positions, scale, mask, grad, dropatt) -> Tensor | None:  # noqa: ANN001
    """The fused Triton kernel where ``Backends.fused_attention`` lists q's device and it applies (triton installed,
    the operands' layout; with gradients only for keys and values of this step, not a cache's)."""
    if q.device.type not in backends().fused_attention or (grad and not isinstance(kv, Tensor)):
        return None
    fused = _fused_module()
    if fused is None:
        return None
    k, v_ = kv
    r_k = positions(k.shape[2])
    if not fused.applies(q, k, r_k, mask):
        return None
    dev = q.device.type  # the products' dtype: autocast's, as the reference's matmuls take it, else the values'
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else v_.dtype
    k, v_, r_k = (t if t.dtype == dt else t.to(dt) for t in (k, v_, r_k))
    seed = dropout_seed() if dropatt else 0
    return fused.fused_rel_attention(q, u, v, k, v_, r_k, mask, scale, dropatt, seed)


_FUSED: list = []  # [the module, or None without triton], once imported


def _fused_module():  # noqa: ANN202
    """:mod:`txl.kernels.fused_attention`, imported on first use (None without triton)."""
    if not _FUSED:
        try:
            from txl.kernels import fused_attention
        except ImportError:
            fused_attention = None
        _FUSED.append(fused_attention)
    return _FUSED[0]


def _native(q, u, v, kv, positions, scale, mask, grad, dropatt) -> Tensor | None:  # noqa: ANN001
    """The native CPU kernel where ``Backends.native_attention`` is on and it applies."""
    policy = backends()
    if not (policy.native_attention and native.usable(q)) or (dropatt and not (grad and policy.native_dropout)):
        return None
    k, v_ = kv
    r_k = positions(k.shape[2])
    qt, biases = q.transpose(1, 2), (u, v, scale)  # [B, H, T, Dh]
    if not native.attention_applies(qt, k, v_, qt, r_k, query_bias=biases):
        return None
    if not grad:
        return native.attention(qt, k, v_, qv=qt, r=r_k, mask=mask, query_bias=biases)
    if not isinstance(kv, Tensor):  # (a cache's keys and values, with gradients: the PyTorch kernels)
        return None
    drop = (dropatt, dropout_seed()) if dropatt else None
    return _NativeRelAttention.apply(q, u, v, kv, r_k, mask, drop, scale)


def score_sum(ac: Tensor, bd: Tensor | None) -> Tensor:
    """The attention scores (a)+(c) + (b)+(d), [B, H, T, K], summed into ``ac`` in place (``bd`` None: the content
    term alone). The reference sums in at least fp32 (half-precision products are upcast first); under autocast, with
    ``Backends.half_precision_scores``, the sum stays in the products' half precision (the softmax computes in fp32
    either way)."""
    if not backends().half_precision_scores and ac.dtype in (torch.float16, torch.bfloat16):
        ac = ac.float()
    return ac if bd is None else ac.add_(bd)


def attend(
    q_w: Tensor,
    k: Tensor,
    v: Tensor,
    explicit: Callable[[], tuple[Tensor, Tensor]],
    bias: Callable[[bool], Tensor | None],
    probabilities: bool,
) -> tuple[Tensor, Tensor | None]:
    """softmax(q_w k^T + (b)+(d), masked) v, [B, H, T, Dh], and the probabilities [B, H, T, K] where they are
    computed. The reference is ``explicit()`` (the model's scores, mask, softmax, dropout of the probabilities and
    value sum); it runs where the probabilities are needed (``probabilities``: asked for, or dropped out) and in
    training except as below. Elsewhere one ``scaled_dot_product_attention`` call with ``bias(grad)`` (the (b)+(d)
    term with the mask as -inf, additive) as its bias: in inference, and in training on the devices of
    ``Backends.sdpa_training_devices`` without autocast (its gradient flows through the bias)."""
    grad = torch.is_grad_enabled() and q_w.requires_grad
    dev = q_w.device.type
    fused = grad and dev in backends().sdpa_training_devices and not torch.is_autocast_enabled(dev)
    if probabilities or (grad and not fused):
        return explicit()
    b = bias(grad)
    return F.scaled_dot_product_attention(q_w, k, v, attn_mask=None if b is None else b.to(q_w.dtype), scale=1.0), None
