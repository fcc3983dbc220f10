"""The softmax NLL of a row of logits, natively (``Backends.native_nll``): the reference is
``log_softmax`` + gather in ``txl.model.adaptive``."""

from __future__ import annotations

import torch
from torch import Tensor

from txl.kernels import native


class _SoftmaxNLL(torch.autograd.Function):
    """-log_softmax(x)[i, t_i] per row by :func:`txl.kernels.native.nll` (0 where t_i < 0); the backward is
    g_i (softmax(x_i) - onehot(t_i)), from the logits and each row's log-sum-exp."""

    @staticmethod
    def forward(ctx, x: Tensor, target: Tensor) -> Tensor:  # [N, V], [N] -> [N]
        nll, lse = native.nll(x, target)
        ctx.save_for_backward(x, target, lse)
        return nll

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        x, target, lse = ctx.saved_tensors
        return native.nll_backward(x, target, lse, grad), None


def softmax_nll(x: Tensor, target: Tensor) -> Tensor:
    """-log_softmax(x)[i, t_i] per row of ``x`` [N, V] (0 where t_i < 0), with its gradient."""
    return _SoftmaxNLL.apply(x, target)
