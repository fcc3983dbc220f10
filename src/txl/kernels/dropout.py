"""Dropout, the named operation, and its CPU backends: ``F.dropout`` is the reference; on the CPU a cheaper mask
(two 24-bit uniforms per random word) and, where it is built, the native one-pass kernel (``Backends.native_dropout``,
with ReLU fused in: ``Backends.native_relu_dropout``). Every backend draws the same distribution; the native ones
regenerate the mask from its seed in the backward (tests/test_backends_exact.py holds them to the definition)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.kernels import measured, native
from txl.kernels.admission import admits, stock
from txl.kernels.backends import backends
from txl.kernels.native import ops


def _relu_dropout_fused() -> bool:
    policy = backends()
    return policy.native_relu_dropout and policy.native_dropout


def dropout_seed() -> int:
    """The key of one native dropout mask: 63 random bits of torch's generator."""
    return int(torch.empty((), dtype=torch.int64).random_())


@stock
class Dropout(nn.Module):
    """``nn.Dropout`` with a cheaper mask on the CPU. Each call draws one 64-bit seed from torch's generator (so
    ``torch.manual_seed`` and a saved RNG state fix the masks) for :mod:`txl.kernels.native`'s one-pass kernel;
    without it,
    the mask takes two 24-bit uniforms (the resolution of ``torch.rand``) from every 64-bit random word of torch's
    generator, half the cost of ``nn.Dropout``'s one draw per element, for the same distribution. Elsewhere (other
    devices, other dtypes, code being compiled) it is ``F.dropout``. Kept elements are ``x * (1 / (1 - p))``, as in
    ``nn.Dropout``."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0:
            return x
        if x.device.type != "cpu" or torch.compiler.is_compiling():  # (a graph draws its mask as F.dropout does)
            return F.dropout(x, self.p, True)
        if backends().native_dropout and native.dropout_applies(x):
            call = lambda: ops.dropout(x, self.p, dropout_seed(), False)  # noqa: E731
            if measured.faster("native_dropout", [x.shape], x.dtype, call, lambda: self._mask(x), (x,)):
                return call()
        return self._mask(x)

    def _mask(self, x: Tensor) -> Tensor:
        """The PyTorch path: two 24-bit uniforms per random word of torch's generator."""
        n = x.numel()
        words = torch.empty((n + 1) // 2, dtype=torch.int64).random_()  # 63 random bits each
        uniform24 = words.view(torch.int32)[:n].bitwise_and(0xFFFFFF)  # two per word: bits 0-23 and 32-55
        keep = uniform24.ge(round(self.p * (1 << 24))).view(x.shape)
        return x.mul(keep).mul_(1.0 / (1.0 - self.p))

    def relu(self, x: Tensor) -> Tensor:
        """``self(F.relu(x))``: in one native pass where the native dropout runs (the same mask)."""
        if self.training and self.p > 0 and _relu_dropout_fused() and native.dropout_applies(x):
            if admits("native_relu_dropout", self):  # (a subclass's forward, a hook: called below)
                call = lambda: ops.dropout(x, self.p, dropout_seed(), True)  # noqa: E731
                if measured.faster("native_relu_dropout", [x.shape], x.dtype, call, lambda: self(F.relu(x)), (x,)):
                    return call()
        return self(F.relu(x))

    def extra_repr(self) -> str:
        return f"p={self.p}"
