"""The adaptive softmax's loss as named operations with native backends (``Backends.native_nll``): the loss of a
batch (each cluster's NLL straight from its logits, or the reference's log-softmax and gather), and a cluster's NLL
in evaluation (from the hidden states and a packed copy of the output layer, no logits stored). The references are
in ``txl.model.adaptive``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from txl.kernels import native
from txl.kernels.linear import stamp, weight_copies
from txl.kernels.native import ops
from txl.kernels.registry import Backend, _cpu_switch, dispatch, register


def softmax_nll(x: Tensor, target: Tensor) -> Tensor:
    """-log_softmax(x)[i, t_i] per row of ``x`` [N, V] (0 where t_i < 0), with its gradient: by the native kernel
    where it runs for ``x`` (fp32 on the CPU), else by log_softmax and gather (the reference)."""
    if native.nll_applies(x):
        return ops.nll(x, target)[0]
    valid = target >= 0
    return -x.log_softmax(-1).gather(1, target.clamp(min=0)[:, None]).squeeze(1) * valid


register(
    Backend(
        "native_nll",
        "adaptive_nll",
        "the adaptive softmax's log_softmax + gather per cluster",
        _cpu_switch("native_nll"),
        lambda h: None if native.nll_applies(h) else "not fp32 on the CPU",
        deep=True,
    )
)


def adaptive_nll(
    module: nn.Module, h: Tensor, reference: Callable[[], Tensor], per_cluster: Callable[[], Tensor]
) -> Tensor:
    """The adaptive softmax's per-token NLL of the rows ``h`` [N, d_model] (fp32): ``per_cluster()`` (each cluster's
    NLL from its logits by the native kernel, no log-softmax tensor) where the registry chooses ``native_nll`` for
    ``module`` (the adaptive softmax, stock), else ``reference()`` (log-softmax and gather)."""
    if not native.nll_applies(h):  # (the common case off the CPU: nothing more looked at)
        return reference()
    # (the cost grows with the vocabulary; in inference the native path reads packed weights, in training logits)
    grad = 2 if torch.is_grad_enabled() else 1  # (1, 2: apart after the kind's rounding to powers of two)
    shapes = [h.shape, (getattr(module, "n_token", 0), getattr(module, "n_clusters", 0), grad)]
    return dispatch("native_nll", module, per_cluster, reference, operands=(h,), shapes=shapes, where="crit")


def cluster_nll(
    hp: Tensor,
    target: Tensor,
    logits: Callable[[], Tensor],
    params: Callable[[], tuple[Tensor, Tensor]],
    key: Any,
    sources: list[Tensor],
) -> Tensor:
    """One cluster's NLL of ``target`` [n] for its projected rows ``hp`` [n, d_i]: ``softmax_nll(logits())``; in
    inference inside :func:`~txl.kernels.linear.transposed_weights` (fixed weights), :func:`native.nll_linear` from
    the cluster's output layer ``params()`` (weight, bias) packed once for the scope (under ``key``, remade when one of
    ``sources``, the parameters it is made from, changes), with no logits stored."""
    copies = weight_copies()
    if copies is not None and not torch.is_grad_enabled() and hp.shape[1] <= native.LINEAR_MAX_DIM:
        packed = copies.get(sources[0], key, stamp(*sources), lambda: native.pack_linear(*params()))
        return native.nll_linear(hp, packed, target)  # (hp is fp32 on the CPU here)
    return softmax_nll(logits(), target)
