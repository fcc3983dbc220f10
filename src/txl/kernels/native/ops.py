"""The native CPU kernels as ``torch.library`` operators (``torch.ops.txl.native_*``): each with a fake
implementation (shapes, dtypes and strides without running it) and, where it has a gradient, its backward as another
operator, registered as its autograd formula. So torch.compile, export and ``torch.library.opcheck`` see one operator
each, not a ctypes call. The backends of ``txl.kernels.attention``, ``.dropout`` and ``.nll`` call them where
``Backends`` lets the native kernels run; in a graph being compiled or exported those backends decline (the compiled
path is Inductor's own code; an exported or ONNX graph must not need txl's library), so these operators run in eager
code. The one-token decode step (``decode.c``) is not one: it reads a plan of the model's weights and updates the
K/V cache in place, state that an operator's schema does not describe."""

from __future__ import annotations

import torch
from torch import Tensor

from txl.kernels import native


def _library_missing(what: str) -> RuntimeError:
    return RuntimeError(f"txl::{what}: the native kernel cannot run here ({native.status()})")


# --- the relative attention (attn_type 0): inference ---------------------------------------------------------


@torch.library.custom_op("txl::native_rel_attention", mutates_args=())
def rel_attention(
    q: Tensor, u: Tensor, v: Tensor, k: Tensor, vv: Tensor, r: Tensor, mask: Tensor | None, scale: float
) -> Tensor:
    """softmax((q+u)k*scale + shift((q+v)r)*scale, masked) vv as [B, T, H*Dh] (attention.c); ``q`` [B, T, H, Dh]
    raw queries, ``k``/``vv`` [B, H, K, Dh], ``r`` W_kR R [H, Dh, >= K], ``mask`` [T, K] / [B, 1, T, K]."""
    qt = q.transpose(1, 2)  # [B, H, T, Dh]
    out = native.attention(qt, k, vv, qv=qt, r=r, mask=mask, query_bias=(u, v, scale))
    if out is None:
        raise _library_missing("native_rel_attention")
    return out


@rel_attention.register_fake
def _(q, u, v, k, vv, r, mask, scale):  # noqa: ANN001, ANN202 (torch.library's signature)
    B, T, H, Dh = q.shape
    return q.new_empty(B, T, H * Dh)


# --- the relative attention: training (the probabilities kept for the backward) ----------------------------------


@torch.library.custom_op("txl::native_rel_attention_train", mutates_args=())
def rel_attention_train(
    q: Tensor, u: Tensor, v: Tensor, kv: Tensor, r: Tensor, mask: Tensor | None, scale: float, p: float, seed: int
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """:func:`rel_attention` of the keys and values ``kv`` [2, B, H, K, Dh] keeping the probabilities [B, H, T, K]
    (before dropout); ``p`` > 0: the probabilities dropped out as :func:`txl.kernels.native.dropout` (``p``,
    ``seed``) drops out a [B, H, T, K] tensor."""
    qt = q.transpose(1, 2)
    drop = (p, seed) if p > 0 else None
    if not native.attention_applies(qt, kv[0], kv[1], qt, r, query_bias=(u, v, scale)):
        raise _library_missing("native_rel_attention_train")
    return native.attention_train(qt, kv[0], kv[1], qt, r, mask, drop, (u, v, scale))


@rel_attention_train.register_fake
def _(q, u, v, kv, r, mask, scale, p, seed):  # noqa: ANN001, ANN202
    B, T, H, Dh = q.shape
    return q.new_empty(B, T, H * Dh), q.new_empty(B, H, T, kv.shape[3])


@torch.library.custom_op("txl::native_rel_attention_backward", mutates_args=())
def rel_attention_backward(
    grad: Tensor, q: Tensor, u: Tensor, v: Tensor, kv: Tensor, r: Tensor, prob: Tensor, scale: float, p: float,
    seed: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """The gradients of :func:`rel_attention_train`'s output (attention_grad.c): (dq, du, dv, dkv, dr)."""
    qt = q.transpose(1, 2)
    drop = (p, seed) if p > 0 else None
    g_u, g_v, dkv, dr = native.attention_backward(qt, kv[0], kv[1], qt, r, prob, grad, drop, (u, v, scale))
    # g_u, g_v [B, T, H, Dh]: the gradients of q + u and q + v, as autograd's of the two sums
    return g_u + g_v, g_u.sum((0, 1)), g_v.sum((0, 1)), dkv, dr


@rel_attention_backward.register_fake
def _(grad, q, u, v, kv, r, prob, scale, p, seed):  # noqa: ANN001, ANN202
    _, B, H, K, Dh = kv.shape
    dkv = q.new_empty(B, K, 2, H, Dh).permute(2, 0, 3, 1, 4)  # (the layout the kernel writes)
    return q.new_empty(q.shape), u.new_empty(u.shape), v.new_empty(v.shape), dkv, r.new_empty(r.shape)


def _attention_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    q, u, v, kv, r, mask, scale, p, seed = inputs
    ctx.save_for_backward(q, u, v, kv, r, output[1])
    ctx.mark_non_differentiable(output[1])  # (the probabilities: kept for the backward only)
    ctx.set_materialize_grads(False)  # (no zero-filled gradient for them)
    ctx.scale, ctx.p, ctx.seed = scale, p, seed


def _attention_backward(ctx, grad: Tensor, _grad_prob: Tensor | None) -> tuple:  # noqa: ANN001
    q, u, v, kv, r, prob = ctx.saved_tensors
    dq, du, dv, dkv, dr = torch.ops.txl.native_rel_attention_backward(
        grad, q, u, v, kv, r, prob, ctx.scale, ctx.p, ctx.seed
    )
    return dq, du, dv, dkv, dr, None, None, None, None


rel_attention_train.register_autograd(_attention_backward, setup_context=_attention_setup)


# --- dropout, and relu + dropout ---------------------------------------------------------------------------------


@torch.library.custom_op("txl::native_dropout", mutates_args=())
def dropout(x: Tensor, p: float, seed: int, relu: bool) -> Tensor:
    """``x`` (with ``relu``: relu(x)) dropped out with probability ``p``, the mask Philox4x32-10 of ``seed``
    (dropout.c; the backward regenerates it)."""
    out = native.dropout(x, p, seed, relu)
    if out is None:
        raise _library_missing("native_dropout")
    return out


@dropout.register_fake
def _(x, p, seed, relu):  # noqa: ANN001, ANN202
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("txl::native_relu_dropout_backward", mutates_args=())
def relu_dropout_backward(grad: Tensor, y: Tensor, p: float) -> Tensor:
    """The gradient of ``native_dropout(x, p, seed, relu=True)`` from its output ``y``."""
    return native.relu_dropout_backward(grad, y, p)


@relu_dropout_backward.register_fake
def _(grad, y, p):  # noqa: ANN001, ANN202
    return torch.empty_like(y, memory_format=torch.contiguous_format)


def _dropout_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    x, p, seed, relu = inputs
    ctx.p, ctx.seed, ctx.relu = p, seed, relu
    if relu:  # (relu's backward reads the output, which the next layer keeps anyway)
        ctx.save_for_backward(output)


def _dropout_backward(ctx, grad: Tensor) -> tuple:  # noqa: ANN001
    if ctx.relu:
        return torch.ops.txl.native_relu_dropout_backward(grad, ctx.saved_tensors[0], ctx.p), None, None, None
    return torch.ops.txl.native_dropout(grad, ctx.p, ctx.seed, False), None, None, None


dropout.register_autograd(_dropout_backward, setup_context=_dropout_setup)


# --- the softmax's negative log-likelihood ---------------------------------------------------------------------


@torch.library.custom_op("txl::native_nll", mutates_args=())
def nll(x: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """-log_softmax(x)[i, target[i]] of each row of ``x`` [N, V] (0 where target < 0) and each row's log-sum-exp
    (nll.c), without the [N, V] log-probabilities."""
    out = native.nll(x, target)
    if out is None:
        raise _library_missing("native_nll")
    return out


@nll.register_fake
def _(x, target):  # noqa: ANN001, ANN202
    return x.new_empty(x.shape[0]), x.new_empty(x.shape[0])


@torch.library.custom_op("txl::native_nll_backward", mutates_args=())
def nll_backward(x: Tensor, target: Tensor, lse: Tensor, grad: Tensor) -> Tensor:
    """grad[i] * (softmax(x_i) - onehot(target[i])), zero rows where target < 0."""
    return native.nll_backward(x, target, lse, grad)


@nll_backward.register_fake
def _(x, target, lse, grad):  # noqa: ANN001, ANN202
    return x.new_empty(x.shape)


def _nll_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    x, target = inputs
    ctx.save_for_backward(x, target, output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _nll_backward(ctx, grad: Tensor, _grad_lse: Tensor | None) -> tuple:  # noqa: ANN001
    x, target, lse = ctx.saved_tensors
    return torch.ops.txl.native_nll_backward(x, target, lse, grad), None


nll.register_autograd(_nll_backward, setup_context=_nll_setup)
