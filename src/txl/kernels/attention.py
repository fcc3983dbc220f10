"""The native backend of the relative attention (attn_type 0), inference and training: the reference is
``txl.model.attention`` (scores() + attend()); tests/test_backends_exact.py holds this to it."""

from __future__ import annotations

from collections.abc import Callable

import torch
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
    scale: float,
    mask: Tensor | None, grad: bool, dropatt: float,
) -> Tensor | None:  # fmt: skip
    """The native backend of attn_type 0's attention (``Backends.native_attention``): softmax((q + u) k + shift((q +
    v) W_kR R)) v as one call, [B, T, H*Dh], with the (b)+(d) rows read at their shift inside the kernel; with
    ``grad``, the autograd function above (its dropout of the probabilities, ``dropatt``, draws its seed where the
    reference's :class:`~txl.kernels.dropout.Dropout` would, and is the same mask). ``q`` [B, T, H, Dh] raw queries
    (the kernel forms (q + u) * scale and (q + v) * scale), ``kv`` the keys and values [B, H, K, Dh] (one [2, ...]
    tensor, or a cache's pair), ``positions(K)`` W_kR R [H, Dh, >= K]. None where it does not apply (or
    ``Backends.native_attention`` is off): the caller runs the reference."""
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
