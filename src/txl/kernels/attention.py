"""The attention's named operations and their backends: the whole relative attention of attn_type 0 (the fused
Triton kernel, the native CPU kernel; inference and training), the attend step (one SDPA call, or the model's explicit
reference) and the sum of the scores (half precision under autocast, or the reference's fp32). The references are the
model's own code (``txl.model.attention``: scores() + attend()); tests/test_backends_exact.py holds every backend to
them."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.kernels import measured, native
from txl.kernels.admission import admits, verified
from txl.kernels.backends import backends, fused_pays
from txl.kernels.dropout import dropout_seed
from txl.kernels.native import ops


def rel_attention(
    module: nn.Module, q: Tensor, u: Tensor, v: Tensor, kv: Tensor | tuple[Tensor, Tensor],
    positions: Callable[[int], Tensor], scale: float, mask: Tensor | None, dropatt: float,
    reference: Callable[[], Tensor],
) -> Tensor:  # fmt: skip
    """attn_type 0's attention, softmax((q + u) k + shift((q + v) W_kR R)) v, [B, T, H*Dh]: the named operation. The
    ``reference()`` is the model's (its scores() + attend()); the backends compute the same as one call, with the
    (b)+(d) rows read at their shift inside the kernel, in this order where they apply:

    * ``Backends.fused_attention`` (devices; in training ``fused_attention_training``): the fused Triton kernel
      (:mod:`txl.kernels.fused_attention`), forward and backward, dropatt by its own Philox stream; on a GPU for
      half-precision segments of several positions.
    * ``Backends.native_attention``: the native CPU kernel (fp32; ``torch.ops.txl.native_rel_attention``, and in
      training ``native_rel_attention_train`` with its backward: :mod:`txl.kernels.native.ops`); its dropout of the
      probabilities, ``dropatt``, draws its seed where the reference's :class:`~txl.kernels.dropout.Dropout` would,
      and is the same mask.

    ``q`` [B, T, H, Dh] raw queries (the kernels form (q + u) * scale and (q + v) * scale), ``kv`` the keys and values
    [B, H, K, Dh] (one [2, ...] tensor, or a cache's pair), ``positions(K)`` W_kR R [H, Dh, >= K].

    The kernels stand in for ``module``'s scores() and attend(): only where it is stock (``txl.kernels.admission``:
    the attention class as txl wrote it, its dropout too, no hook), and checked against ``reference()`` the first
    time in the process (without dropatt: with it the two draw different masks). The native kernel runs only where
    it was measured faster here (``txl.kernels.measured``)."""
    grad = torch.is_grad_enabled()
    name = "fused_attention" if _fused_wanted(q, grad) else "native_attention"
    if not _wanted(q, grad) or not admits(name, module) or not admits(name, module.dropatt):
        return reference()
    fast = _fused(q, u, v, kv, positions, scale, mask, grad, dropatt)
    if fast is None:
        fast = _native(q, u, v, kv, positions, scale, mask, grad, dropatt, reference)
    if fast is None:
        return reference()
    if dropatt or verified(name, (type(module), grad, q.dtype, q.device.type, mask is None), fast, reference):
        return fast()
    return reference()


def _fused_wanted(q: Tensor, grad: bool) -> bool:
    policy = backends()
    return q.device.type in (policy.fused_attention_training if grad else policy.fused_attention)


def _wanted(q: Tensor, grad: bool) -> bool:
    """Whether a kernel might run (before the module is looked at: the common no-kernel case costs nothing more)."""
    policy = backends()
    return _fused_wanted(q, grad) or (policy.native_attention and native.usable(q))


def _fused(q, u, v, kv, positions, scale, mask, grad, dropatt) -> Callable[[], Tensor] | None:  # noqa: ANN001
    """The fused Triton kernel (a call of it) where the policy lists q's device (``Backends.fused_attention``, with
    gradients ``fused_attention_training``) and it applies (triton installed, the operands' layout; with gradients
    only for keys and values of this step, not a cache's). On a GPU only where it was measured faster: products in half
    precision, and segments of several positions (one-token steps are the decode paths')."""
    if not _fused_wanted(q, grad):
        return None
    if torch.compiler.is_exporting():  # (an exported graph, ONNX's too, must not need txl's library)
        return None
    if grad and not isinstance(kv, Tensor):
        return None
    k, v_ = kv
    dev = q.device.type  # the products' dtype: autocast's, as the reference's matmuls take it, else the values'
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else v_.dtype
    if not fused_pays(dev, dt, q.shape[1]):
        return None
    fused = _fused_module()
    if fused is None:
        return None
    r_k = positions(k.shape[2])
    k, v_, r_k = (t if t.dtype == dt else t.to(dt) for t in (k, v_, r_k))
    if not fused.applies(q, u, v, k, v_, r_k, mask):
        return None

    def call() -> Tensor:
        seed = torch.randint(0, 2**62, (1,), device=q.device) if dropatt else None  # (on the device: no host read)
        return fused.fused_rel_attention(q, u, v, k, v_, r_k, mask, scale, dropatt, seed)

    return call


_FUSED: list = []  # [the module, or None without triton], once imported


def _fused_module():  # noqa: ANN202
    """:mod:`txl.kernels.fused_attention`, imported on first use (None without triton, or with one too old for it)."""
    if not _FUSED:
        try:
            from txl.kernels import fused_attention
        except ImportError:
            fused_attention = None
        _FUSED.append(fused_attention if fused_attention is not None and fused_attention.SUPPORTED else None)
    return _FUSED[0]


def _native(q, u, v, kv, positions, scale, mask, grad, dropatt, reference) -> Callable[[], Tensor] | None:  # noqa: ANN001
    """The native CPU kernel (a call of it) where ``Backends.native_attention`` is on, it applies, and it was measured
    faster than ``reference`` here."""
    policy = backends()
    if not (policy.native_attention and native.usable(q)) or (dropatt and not (grad and policy.native_dropout)):
        return None
    if grad and not isinstance(kv, Tensor):  # (a cache's keys and values, with gradients: the PyTorch kernels)
        return None
    k, v_ = kv
    name, shapes = ("native_attention_train" if grad else "native_attention"), (q.shape, k.shape)
    known = measured.decided(name, shapes, q.dtype)
    if known is False:  # (measured slower here: W_kR R is not even projected for it)
        return None
    r_k = positions(k.shape[2])
    qt, biases = q.transpose(1, 2), (u, v, scale)  # [B, H, T, Dh]
    if not native.attention_applies(qt, k, v_, qt, r_k, query_bias=biases):
        return None
    if not grad:
        call = lambda: ops.rel_attention(q, u, v, k, v_, r_k, mask, scale)  # noqa: E731
    else:
        seed = dropout_seed if dropatt else lambda: 0
        call = lambda: ops.rel_attention_train(q, u, v, kv, r_k, mask, scale, dropatt, seed())[0]  # noqa: E731
    if known is None and not measured.faster(name, shapes, q.dtype, call, reference, (q, kv) if grad else ()):
        return None
    return call


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
