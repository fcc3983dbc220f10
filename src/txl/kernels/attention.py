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

from txl.kernels import native
from txl.kernels.backends import backends, fused_pays
from txl.kernels.dropout import dropout_seed, masks
from txl.kernels.native import ops
from txl.kernels.registry import Backend, _cpu_switch, dispatch, register, settled_off

register(
    Backend(
        "fused_attention",
        "rel_attention",
        "the attention's scores() + attend()",
        lambda p, dev: dev in p.fused_attention,
        measured=False,
    )
)
register(
    Backend(
        "fused_attention_training",
        "rel_attention",
        "the attention's scores() + attend(), with gradients",
        lambda p, dev: dev in p.fused_attention_training,
        measured=False,
    )
)
register(
    Backend(
        "native_attention",
        "rel_attention",
        "the attention's scores() + attend()",
        _cpu_switch("native_attention"),
        lambda q, *_: None if native.usable(q) else _NOT_FP32,
    )
)
register(
    Backend(
        "native_attention_train",
        "rel_attention",
        "the attention's scores() + attend(), with gradients",
        _cpu_switch("native_attention"),
        lambda q, *_: None if native.usable(q) else _NOT_FP32,
    )
)


def rel_attention(
    module: nn.Module, q: Tensor, u: Tensor, v: Tensor, kv: Tensor | tuple[Tensor, Tensor],
    positions: Callable[[int], Tensor], scale: float, mask: Tensor | None, dropatt: float,
    reference: Callable[[], Tensor],
) -> Tensor:  # fmt: skip
    """attn_type 0's attention, softmax((q + u) k + shift((q + v) W_kR R)) v, [B, T, H*Dh]: the named operation. The
    ``reference()`` is the model's (its scores() + attend()); the backends compute the same as one call, with the
    (b)+(d) rows read at their shift inside the kernel:

    * ``fused_attention`` / ``fused_attention_training`` (``Backends.fused_attention``, devices): the fused Triton
      kernel (:mod:`txl.kernels.fused_attention`), forward and backward, dropatt by its own Philox stream; on a GPU for
      half-precision segments of several positions.
    * ``native_attention`` / ``native_attention_train`` (``Backends.native_attention``): the native CPU kernel (fp32;
      ``torch.ops.txl.native_rel_attention``, and in training ``native_rel_attention_train`` with its backward); its
      dropout of the probabilities, ``dropatt``, draws its seed where the reference's
      :class:`~txl.kernels.dropout.Dropout` would, and is the same mask (the Philox stream; with torch's, not run).

    ``q`` [B, T, H, Dh] raw queries (the kernels form (q + u) * scale and (q + v) * scale), ``kv`` the keys and values
    [B, H, K, Dh] (one [2, ...] tensor, or a cache's pair), ``positions(K)`` W_kR R [H, Dh, >= K]. Chosen by
    :func:`txl.kernels.registry.dispatch` for ``module`` and its ``dropatt`` (both stock)."""
    grad = torch.is_grad_enabled()
    modules = (module, module.dropatt)
    kind = (grad, mask is None, dropatt > 0)
    if q.device.type in (backends().fused_attention_training if grad else backends().fused_attention):
        name = "fused_attention_training" if grad else "fused_attention"
        fast = _fused(q, u, v, kv, positions, scale, mask, grad, dropatt)
        if fast is not None:  # (its dropatt is its own stream: checked against the reference without it)
            return dispatch(name, modules, fast, reference, operands=(q,), kind=kind, verify=not dropatt)
    name = "native_attention_train" if grad else "native_attention"
    fast = _native(q, u, v, kv, positions, scale, mask, grad, dropatt, name)
    if fast is None:
        return reference()
    k = kv[0]
    shapes = (q.shape, k.shape)
    operands = (q, kv) if grad and isinstance(kv, Tensor) else (q,)
    return dispatch(name, modules, fast, reference, operands=operands, kind=kind, shapes=shapes)


_NOT_FP32 = "not fp32 on the CPU without autocast, or no native library"


def _fused(q, u, v, kv, positions, scale, mask, grad, dropatt) -> Callable[[], Tensor] | None:  # noqa: ANN001
    """The fused Triton kernel (a call of it) where it applies (triton installed, the operands' layout; with
    gradients only for keys and values of this step, not a cache's). On a GPU only in half precision and for segments
    of several positions (one-token steps are the decode paths')."""
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


def _native(q, u, v, kv, positions, scale, mask, grad, dropatt, name) -> Callable[[], Tensor] | None:  # noqa: ANN001
    """The native CPU kernel (a call of it) where its switch is on and it applies to these operands; its dropatt only
    where the run's masks are Philox's (the kernel's stream)."""
    policy = backends()
    if not (policy.native_kernels and policy.native_attention and native.usable(q)):
        return None
    if dropatt and not (grad and masks() == "philox"):
        return None
    if grad and not isinstance(kv, Tensor):  # (a cache's keys and values, with gradients: the PyTorch kernels)
        return None
    k, v_ = kv
    if settled_off(name, (q.shape, k.shape), q.dtype):  # (measured slower here: W_kR R is not even projected)
        return None
    r_k = positions(k.shape[2])
    qt, biases = q.transpose(1, 2), (u, v, scale)  # [B, H, T, Dh]
    if not native.attention_applies(qt, k, v_, qt, r_k, query_bias=biases):
        return None
    if not grad:
        return lambda: ops.rel_attention(q, u, v, k, v_, r_k, mask, scale)
    seed = dropout_seed if dropatt else lambda: 0
    return lambda: ops.rel_attention_train(q, u, v, kv, r_k, mask, scale, dropatt, seed())[0]


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
