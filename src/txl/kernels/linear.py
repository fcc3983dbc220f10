"""The linear layers' product, a named operation: :func:`project` calls the model's ``nn.Linear`` module (the
reference: hooks fire, a LoRA adapter, a quantised or replaced layer is used); for a plain ``nn.Linear`` (exactly
that class, no hooks) its backends may read the weight instead: ``F.linear``, and for the few rows of CPU inference
inside :func:`transposed_weights` a product from transposed copies of the weights (``Backends.transposed_weights``);
and training's projections of [memory; segment] with one backward (``Backends.segment_projection``). The copies
belong to the scope that made them (:class:`WeightCopies`), never to the module."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.kernels.admission import global_hooks, is_stock
from txl.kernels.backends import backends
from txl.kernels.registry import Backend, dispatch, register

# ---------------------------------------------------------------------------------------------------------
# 4a. A linear layer is called as a module; its weight is read directly only where the module is plain.
# ---------------------------------------------------------------------------------------------------------


def plain_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a plain ``nn.Linear``: exactly that class (not a LoRA wrapper, a quantised or
    parametrized layer, or a subclass), its methods as torch wrote them, none shadowed on the instance, no hooks
    (``txl.kernels.admission``): one whose call is ``F.linear(x, module.weight, module.bias)``, so that a backend
    may read its weight instead of calling it."""
    return type(module) is nn.Linear and is_stock(module) and not global_hooks()


def project(module: nn.Module, x: Tensor, out: slice | None = None) -> Tensor:
    """``module(x)[..., out]``: the model's linear layers are called through this. A plain ``nn.Linear``
    (:func:`plain_linear`) takes :func:`linear` (its backends, computing only the ``out`` columns); any other module
    is called (its hooks fire, an adapter or a quantised layer computes), and its output sliced."""
    if plain_linear(module):
        return linear(x, module.weight, module.bias, out)
    y = module(x)
    return y if out is None else y[..., out]


# ---------------------------------------------------------------------------------------------------------
# 4b. The linear layers' product, with a form for the few rows of generation (one token per step).
# ---------------------------------------------------------------------------------------------------------

SMALL_ROWS = 16
"""Products with at most this many rows take :func:`linear`'s transposed-weight form in CPU inference."""
SPLIT = 4
"""The input blocks of a product with one or two rows (bmm batch entries that the cores share)."""


class WeightCopies:
    """Copies made from weights that do not change while a :func:`transposed_weights` scope is open (transposed
    weights, the adaptive softmax's packed output layers), keyed by (id of the weight, what was made), each with
    the weight (weakly) and the stamp it was made from. They belong to the scope: dropped when it closes."""

    def __init__(self) -> None:
        self._copies: dict[tuple, tuple[weakref.ref, tuple, Any]] = {}
        self.open = True

    def get(self, weight: Tensor, what: Any, stamp: tuple, make: Callable[[], Any]) -> Any:
        """``make()``, made once for (``weight``, ``what``) and remade when ``stamp`` (the versions and addresses
        of what it is made from) changes."""
        entry = self._copies.get((id(weight), what))
        if entry is None or entry[0]() is not weight or entry[1] != stamp:
            entry = self._copies[(id(weight), what)] = (weakref.ref(weight), stamp, make())
        return entry[2]

    def close(self) -> None:
        self.open = False
        self._copies.clear()

    def __contains__(self, key: tuple) -> bool:
        return key in self._copies

    def __len__(self) -> int:
        return len(self._copies)


_SCOPE: ContextVar[WeightCopies | None] = ContextVar("txl_weight_copies", default=None)


def weight_copies() -> WeightCopies | None:
    """The copies of the innermost open :func:`transposed_weights` scope of this thread (or task); None outside."""
    if torch.compiler.is_compiling():  # (a graph cannot read a context variable; compiled code keeps no copies)
        return None
    copies = _SCOPE.get()
    return copies if copies is not None and copies.open else None


@contextlib.contextmanager
def transposed_weights() -> Iterator[None]:
    """Let :func:`linear` keep transposed copies of the weights, and the adaptive softmax packed copies of its output
    layers, while this is open (generation, serving and ``txl.infer.evaluate`` open it: their weights do not
    change). The scope is this thread's (a context variable: the serving engine's thread opens its own); a nested
    scope shares the outer one's copies. They are dropped when the scope closes, so training, whose weights change
    every step (also through ``.data``, which no version counter sees), never reads a stale one."""
    if weight_copies() is not None:
        yield
        return
    copies, before = WeightCopies(), _SCOPE.get()
    _SCOPE.set(copies)
    try:
        yield
    finally:
        copies.close()  # (also for a context that still holds it: a generator finished elsewhere)
        _SCOPE.set(before)


def stamp(*tensors: Tensor) -> tuple:
    """What a copy is made from: each tensor's version, address and dtype."""
    return tuple((t._version, t.data_ptr(), t.dtype) for t in tensors)


def _transposed(copies: WeightCopies, weight: Tensor) -> Tensor:
    """A contiguous [in, out] copy of ``weight``, made once per scope and remade when the weight changes in place or
    moves."""
    return copies.get(weight, "t", stamp(weight), lambda: weight.detach().t().contiguous())


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, out: slice | None = None) -> Tensor:
    """``F.linear(x, weight[out], bias[out])``, with a faster product for the few rows of CPU inference (generation
    projects one token per step), inside :func:`transposed_weights`.

    With a handful of rows the product is a matrix-vector product, bound by reading the weight. The [out, in]
    layout makes it a dot product per output over a row of ``in`` values, which BLAS runs on one core and, for
    short rows, at a fraction of the memory bandwidth; from a transposed copy ([in, out], made once and kept
    until the weight changes) the same product is a sum of scaled rows of ``out`` values, and one row is split
    over the input dimension into ``SPLIT`` blocks that the cores share (2-3x per product on a 2-core EPYC,
    see docs/benchmarks.md). Weights with fewer outputs than inputs keep ``F.linear`` (long dot products, and no
    copy). The same value up to fp32 rounding (the additions are grouped differently). Training, autograd,
    autocast, other devices and more rows take ``F.linear``.
    """
    copies = weight_copies()
    if not (copies is not None and _few_rows(x) and weight.shape[0] >= weight.shape[1] and x.dtype == weight.dtype):
        if out is not None:
            weight, bias = weight[out], None if bias is None else bias[out]
        return F.linear(x, weight, bias)
    wt = _transposed(copies, weight)  # [in, out]
    if out is not None:
        wt, bias = wt[:, out], None if bias is None else bias[out]
    return _rows_product(x, wt, bias)


def _few_rows(x: Tensor) -> bool:
    """Whether products of ``x`` may take :func:`linear`'s transposed-weight form (CPU inference, few rows, inside
    :func:`transposed_weights`); the weight decides the rest (at least as many outputs as inputs, same dtype)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return bool(
        backends().transposed_weights
        and 0 < rows <= SMALL_ROWS
        and x.device.type == "cpu"
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
        and not torch.compiler.is_exporting()
        and not torch.jit.is_tracing()
    )


def _rows_product(x: Tensor, wt: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ wt + bias`` for the few rows of ``x`` [..., in] from a transposed weight ``wt`` [in, out]."""
    k, n = wt.shape
    rows = x.numel() // k
    if rows <= 2 and k % SPLIT == 0:  # partial products over SPLIT blocks of the input, one per bmm batch entry
        blocks = x.reshape(SPLIT, 1, k // SPLIT) if rows == 1 else x.reshape(2, SPLIT, k // SPLIT).transpose(0, 1)
        y = torch.bmm(blocks, wt.view(SPLIT, k // SPLIT, n)).sum(0)  # [SPLIT, rows, n] -> [rows, n]
    else:
        y = torch.mm(x.reshape(rows, k), wt)  # [rows, n]
    if bias is not None:
        y = y.add_(bias)
    return y.view(*x.shape[:-1], n)


def rows_linear(x: Tensor, dtype: torch.dtype) -> Callable[..., Tensor]:
    """:func:`linear` for the products of one step whose rows are like ``x`` (and weights of ``dtype``), with its
    checks made once for the step (the one-token decoding loop)."""
    copies = weight_copies()
    few = copies is not None and _few_rows(x) and x.dtype == dtype

    def product(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        if few and weight.shape[0] >= weight.shape[1]:
            return _rows_product(x, _transposed(copies, weight), bias)
        return F.linear(x, weight, bias)

    return product


class _SegmentMemoryProjection(torch.autograd.Function):
    """Training's projections of one layer, ``q = x W_q^T`` for the segment and ``[k; v] = [mem; x] W_kv^T`` for
    [memory; segment], with one backward: the memory carries no gradient (it is detached), so the input gradient
    is computed for the segment's rows only (autograd would compute it for all K rows of the concatenation and drop
    M of them), as one product ``[g_q, g_kv of the segment] W``; the weight gradient is written straight into one
    [3HD, D] tensor (no zero-filled slice gradients to add). The same values up to fp32 rounding. Under autocast the
    products run in its dtype, as ``F.linear`` there."""

    @staticmethod
    def forward(ctx, mem: Tensor, x: Tensor, weight: Tensor, n_q: int) -> tuple[Tensor, Tensor]:
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        w, xs = weight.to(dtype), x.to(dtype)  # [3HD, D], [B, T, D]
        xc = torch.cat([mem.to(dtype), xs], dim=1)  # [B, K, D]
        with torch.autocast(x.device.type, enabled=False):
            q = F.linear(xs, w[:n_q])  # [B, T, HD]
            kv = F.linear(xc, w[n_q:])  # [B, K, 2HD]
        ctx.save_for_backward(xs, xc, w)
        ctx.n_q, ctx.dtypes = n_q, (x.dtype, weight.dtype)
        return q, kv

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_q: Tensor, g_kv: Tensor) -> tuple[None, Tensor, Tensor, None]:
        xs, xc, w = ctx.saved_tensors
        n_q, (x_dtype, w_dtype) = ctx.n_q, ctx.dtypes
        (B, T, D), K = xs.shape, xc.shape[1]
        g_q, g_kv = g_q.to(w.dtype), g_kv.to(w.dtype)
        g_x = g_w = None
        if ctx.needs_input_grad[2]:
            g_w = w.new_empty(w.shape)  # [3HD, D]
            torch.mm(g_q.reshape(B * T, n_q).t(), xs.reshape(B * T, D), out=g_w[:n_q])
            torch.mm(g_kv.reshape(B * K, -1).t(), xc.reshape(B * K, D), out=g_w[n_q:])
            g_w = g_w.to(w_dtype)
        if ctx.needs_input_grad[1]:
            g_seg = torch.cat([g_q, g_kv[:, K - T :]], dim=-1)  # [B, T, 3HD]
            g_x = torch.mm(g_seg.view(B * T, -1), w).view(B, T, D).to(x_dtype)  # [B, T, D]
        return None, g_x, g_w, None


register(
    Backend(
        "segment_projection",
        "segment_memory_projection",
        "the layer's Linear called on [memory; segment]",
        lambda p, dev: p.segment_projection,
    )
)


def segment_memory_projection(module: nn.Module, mem: Tensor, x: Tensor, n_q: int) -> tuple[Tensor, Tensor]:
    """One layer's projections where the keys and values cover [``mem``; ``x``] and the queries only the segment
    ``x`` [B, T, D]: (queries [B, T, n_q], keys/values [B, M+T, out - n_q]). The reference calls ``module`` once on
    [memory; segment] (hooks and adapters see one call) and slices. For a plain ``nn.Linear`` (:func:`plain_linear`)
    the queries' and keys/values' columns are computed apart (:func:`project`), and in training, where the memory
    carries no gradient (``Backends.segment_projection``), as one product with one backward that computes no input
    gradient for the memory's rows."""
    T = x.shape[1]
    if not plain_linear(module):
        qkv = module(torch.cat([mem, x], dim=1))  # [B, M+T, out]
        return qkv[:, -T:, :n_q], qkv[..., n_q:]
    grad = torch.is_grad_enabled() and x.requires_grad and not mem.requires_grad

    def apart() -> tuple[Tensor, Tensor]:
        q = project(module, x, out=slice(0, n_q))  # queries of the segment only, [B, T, n_q]
        return q, project(module, torch.cat([mem, x], dim=1), out=slice(n_q, None))  # [B, M+T, out - n_q]

    if not grad or module.bias is not None:
        return apart()
    call = lambda: _SegmentMemoryProjection.apply(mem, x, module.weight, n_q)  # noqa: E731
    shapes = [mem.shape, x.shape, module.weight.shape]
    return dispatch("segment_projection", module, call, apart, operands=(x, module.weight), shapes=shapes)


def logits_linear(h: Tensor, weight: Tensor, bias: Tensor | None, autocast: torch.dtype | None = None) -> Tensor:
    """The output layer's product ``F.linear(h, weight, bias)`` in fp32 (the adaptive softmax's logits), a named
    operation with two backends. The reference: fp32 operands. Where the caller runs under ``autocast`` (its dtype)
    on a device of ``Backends.half_precision_logits``: the product of ``h`` and ``weight`` in that dtype (tensor
    cores, fp32 accumulation), its result upcast and the bias added in fp32, so that the log-softmax, its sum and the
    loss stay fp32 as in the reference (the rounding of bf16 operands, as every other product under autocast)."""
    if autocast is None or h.device.type not in backends().half_precision_logits:
        return F.linear(h, weight, bias)
    return _half_product(h.to(autocast), weight.to(autocast), bias)


def output_logits(
    h: Tensor,
    params: Callable[[], tuple[Tensor, Tensor | None]],
    autocast: torch.dtype | None,
    key: Any,
    sources: list[Tensor],
) -> Tensor:
    """:func:`logits_linear` of the output layer ``params()`` (weight, bias; made from ``sources``, the parameters):
    in inference inside :func:`transposed_weights` (fixed weights), with the half-precision operands of
    ``Backends.half_precision_logits``, the weight's cast copy is made once for the scope (under ``key``, remade when
    one of ``sources`` changes) instead of at every call (a WikiText-103 output layer is 137 M values)."""
    copies = weight_copies()
    half = autocast is not None and h.device.type in backends().half_precision_logits
    if not (half and copies is not None and not torch.is_grad_enabled()):
        return logits_linear(h, *params(), autocast)

    def make() -> tuple[Tensor, Tensor | None]:
        w, b = params()
        return w.detach().to(autocast), None if b is None else b.detach().float()

    w, b = copies.get(sources[0], ("half", key, autocast), stamp(*sources), make)
    return _half_product(h.to(autocast), w, b)


def _half_product(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``h @ weight.T + bias`` from half-precision ``h`` and ``weight`` (fp32 accumulation), fp32 [N, n]. In CUDA
    inference the product writes fp32 itself and adds the bias (``addmm``'s ``out_dtype``: one pass, and no rounding
    of the product to half precision); elsewhere it is rounded to the operands' dtype, upcast, and the bias added."""
    if h.is_cuda and not torch.is_grad_enabled() and h.dim() == 2 and _out_dtype_products(h.device):
        if bias is None:
            return torch.mm(h, weight.t(), out_dtype=torch.float32)
        return torch.addmm(bias, h, weight.t(), out_dtype=torch.float32)
    y = F.linear(h, weight).float()  # [N, n]
    return y if bias is None else y.add_(bias)


@functools.cache
def _out_dtype_products(device: torch.device) -> bool:
    """Whether this device's torch has ``mm`` / ``addmm`` with an fp32 ``out_dtype`` for bf16 operands (CUDA, torch
    >= 2.8)."""
    try:
        a = torch.ones(2, 8, dtype=torch.bfloat16, device=device)
        out = torch.addmm(torch.zeros(3, device=device), a, a.new_ones(3, 8).t(), out_dtype=torch.float32)
        return out.dtype == torch.float32 and bool((out == 8).all())
    except (RuntimeError, TypeError):
        return False


def projection(h: Tensor, proj: Tensor, autocast: torch.dtype | None = None) -> Tensor:
    """``h @ proj`` (the adaptive softmax's input projection, fp32), by :func:`logits_linear`'s rule for its dtype."""
    if autocast is None or h.device.type not in backends().half_precision_logits:
        return h @ proj
    return (h.to(autocast) @ proj.to(autocast)).float()
