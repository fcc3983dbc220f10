"""Dropout, the named operation, and where its masks come from. Design notes: docs/internals.md#txlkernelsdropout."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.kernels import measured, native, philox
from txl.kernels.admission import stock
from txl.kernels.backends import backends
from txl.kernels.native import ops
from txl.kernels.registry import Backend, _cpu_switch, dispatch, register

MASKS = ("philox", "torch")
_NOT_NATIVE = "not fp32 or bf16 on the CPU, or no native library"
register(
    Backend(
        "native_dropout",
        "dropout",
        "the Philox mask in PyTorch operations (txl.kernels.philox)",
        _cpu_switch("native_dropout"),
        lambda x: None if native.dropout_applies(x) else _NOT_NATIVE,
    )
)
register(
    Backend(
        "native_relu_dropout",
        "relu_dropout",
        "relu, then the Dropout module",
        lambda p, dev: _cpu_switch("native_dropout")(p, dev) and p.native_relu_dropout,
        lambda x: None if native.dropout_applies(x) else _NOT_NATIVE,
    )
)
_pinned: ContextVar[str | None] = ContextVar("txl_masks", default=None)


def default_masks() -> str:
    """The stream of a process that pinned none: Philox's where the native dropout can run here and was measured
    faster than torch's own mask (on an AVX2-only CPU it can be slower), else torch's. A run pins the stream it
    began with (:func:`use_masks`), so this choice is made once per run."""
    policy = backends()
    if not (policy.native_kernels and policy.native_dropout and native.dropout_ready()):
        return "torch"
    threads = torch.get_num_threads()
    fast = _STREAM_FASTER.get(threads)
    if fast is None:  # (once per process: a stream that changed mid-process would make its runs irreproducible)
        x = torch.rand(1 << 20, generator=torch.Generator().manual_seed(0))  # (torch's own stream left as it was)
        drop = Dropout(0.1)
        fast = _STREAM_FASTER[threads] = measured.faster(
            "dropout_stream", [x.shape], x.dtype, lambda: ops.dropout(x, 0.1, 1, False), lambda: drop._mask(x)
        )
    return "philox" if fast else "torch"


_STREAM_FASTER: dict[int, bool] = {}  # threads -> whether Philox's native mask was measured faster (this process)


def masks() -> str:
    """The stream of dropout masks in force: the pinned one (:func:`use_masks`), else :func:`default_masks`."""
    return _pinned.get() or default_masks()


@contextlib.contextmanager
def use_masks(stream: str | None) -> Iterator[str]:
    """Draw the CPU dropout masks of this block from ``stream`` (one of :data:`MASKS`; None: the default)."""
    if stream is not None and stream not in MASKS:
        raise ValueError(f"dropout masks come from one of {', '.join(MASKS)} (got {stream!r})")
    token = _pinned.set(stream)
    try:
        yield masks()
    finally:
        _pinned.reset(token)


def dropout_seed() -> int:
    """The key of one Philox mask: 63 random bits of torch's generator."""
    return int(torch.empty((), dtype=torch.int64).random_())


@stock
class Dropout(nn.Module):
    """``nn.Dropout`` whose CPU masks come from the run's stream (the module docstring): Philox's (natively, or the
    same mask in PyTorch operations), or two 24-bit uniforms per 64-bit word of torch's generator. Elsewhere (other
    devices, code being compiled) it is ``F.dropout``."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0:
            return x
        if x.device.type != "cpu" or torch.compiler.is_compiling():  # (a graph draws its mask as F.dropout does)
            return F.dropout(x, self.p, True)
        if masks() == "torch":
            return self._mask(x)
        seed = dropout_seed()
        return dispatch(
            "native_dropout", self, lambda: ops.dropout(x, self.p, seed, False),
            lambda: philox.dropout(x, self.p, seed), operands=(x,),
        )  # fmt: skip

    def _mask(self, x: Tensor) -> Tensor:
        """The ``"torch"`` stream: two 24-bit uniforms per random word of torch's generator."""
        n = x.numel()
        words = torch.empty((n + 1) // 2, dtype=torch.int64).random_()  # 63 random bits each
        uniform24 = words.view(torch.int32)[:n].bitwise_and(0xFFFFFF)  # two per word: bits 0-23 and 32-55
        keep = uniform24.ge(round(self.p * (1 << 24))).view(x.shape)
        return x.mul(keep).mul_(1.0 / (1.0 - self.p))

    def relu(self, x: Tensor) -> Tensor:
        """``self(F.relu(x))``: in one native pass where the Philox stream's native dropout runs (the same mask)."""
        native = self.training and self.p > 0 and x.device.type == "cpu" and not torch.compiler.is_compiling()
        if not native or masks() == "torch":
            return self(F.relu(x))
        fused = lambda: ops.dropout(x, self.p, dropout_seed(), True)  # noqa: E731 (its seed drawn as forward's)
        return dispatch("native_relu_dropout", self, fused, lambda: self(F.relu(x)), operands=(x,))

    def extra_repr(self) -> str:
        return f"p={self.p}"
