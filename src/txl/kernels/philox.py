"""Philox4x32-10 in PyTorch operations: the reference of the native dropout's mask stream (native/dropout.c).
Design notes: docs/internals.md#txlkernelsphilox."""

from __future__ import annotations

import torch
from torch import Tensor

_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
_LO = 0xFFFFFFFF


def _mulhilo(a: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """The low and high 32 bits of ``a * m`` (``a`` [n] int64 holding 32-bit values)."""
    high = a * (m >> 16)  # < 2**48
    s = a * (m & 0xFFFF) + ((high & 0xFFFF) << 16)  # the product's low 48 bits' sum, < 2**49
    return s & _LO, (high >> 16) + (s >> 32)


def words(seed: int, n: int, device: torch.device | str = "cpu") -> Tensor:
    """The stream's 32-bit words of elements 0 .. n-1, [n] int64 (native: ``txl_dropout_words``)."""
    chunks = (n + 63) // 64
    counter = torch.arange(chunks * 16, dtype=torch.int64, device=device)  # [C * 16]
    c0, c1 = counter & _LO, counter >> 32
    c2 = c3 = torch.zeros_like(c0)
    k0, k1 = seed & _LO, (seed >> 32) & _LO
    for _ in range(10):
        lo0, hi0 = _mulhilo(c0, _M0)
        lo1, hi1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _W0) & _LO, (k1 + _W1) & _LO
    block = torch.stack([c0, c1, c2, c3]).view(4, chunks, 16)  # [j, c, l]
    return block.permute(1, 0, 2).reshape(-1)[:n]  # element 64c + 16j + l


def threshold(p: float) -> int:
    """The smallest kept word for a dropout of probability ``p`` (native: ``_dropout_spec``)."""
    return min(round(p * 2.0**32), 2**32 - 1)


def keep(seed: int, shape: torch.Size, p: float, device: torch.device | str = "cpu") -> Tensor:
    """The kept elements of a tensor of ``shape`` (row-major order), bool."""
    n = 1
    for d in shape:
        n *= d
    return words(seed & (2**64 - 1), n, device).ge(threshold(p)).view(shape)


def dropout(x: Tensor, p: float, seed: int, relu: bool = False) -> Tensor:
    """``x`` (``relu``: relu(x)) times the mask of ``seed`` and 1 / (1 - p): what the native kernel computes."""
    x = torch.relu(x) if relu else x
    return x.mul(keep(seed, x.shape, p, x.device)).mul_(1.0 / (1.0 - p))
