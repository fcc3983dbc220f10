"""The package's one timer: a fast path and its reference timed in paired, alternating rounds
(:func:`paired`), and what the rounds say (:class:`Paired`: the median ratio, its standard error, whether it is
settled). ``txl.kernels.measured`` decides the CPU fast paths with it, ``txl.kernels.runtime`` the fp32 route."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from txl.kernels.admission import check_scope

ROUNDS = 7  # paired rounds after the warm-up
Z = 2.0  # the confidence rule: settled where |log median| > Z standard errors
timer: Callable[[], float] = time.perf_counter
"""The clock of the measurements (a test replaces it to fake one)."""


def margin(median: float, error: float) -> float:
    """How many ``Z`` standard errors (``error``, of the log) a median ratio lies from 1; above 1: settled."""
    return abs(math.log(median)) / max(Z * error, 1e-9)


def spread(error: float) -> float:
    """The half-width of a ratio's ``Z``-error interval, in percent (what logs and ``txl --version`` print)."""
    return 100 * (math.exp(Z * error) - 1)


@dataclass(frozen=True)
class Paired:
    """The samples of a paired measurement: each round's reference time over the fast path's."""

    ratios: tuple[float, ...]

    @property
    def median(self) -> float:
        return math.exp(statistics.median(self._logs()))

    @property
    def error(self) -> float:
        """The standard error of the median's log (robust: from the median absolute deviation)."""
        logs = self._logs()
        mid = statistics.median(logs)
        mad = statistics.median(abs(v - mid) for v in logs)
        return 1.2533 * 1.4826 * mad / math.sqrt(len(logs))

    @property
    def margin(self) -> float:
        """How many ``Z`` errors the median lies from 1 (log space); 1 or more: settled."""
        return margin(self.median, self.error)

    @property
    def settled(self) -> bool:
        return len(self.ratios) >= 5 and self.margin > 1.0

    def _logs(self) -> list[float]:
        return [math.log(max(r, 1e-9)) for r in self.ratios]


def _once(fn: Callable[[], Any], grad_of: Sequence[Tensor]) -> float:
    t = timer()
    out = fn()
    if grad_of:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        outs = [o for o in outs if isinstance(o, Tensor) and o.requires_grad]
        torch.autograd.grad(outs, list(grad_of), [torch.ones_like(o) for o in outs], allow_unused=True)
    return timer() - t


def paired(fast: Callable[[], Any], reference: Callable[[], Any], grad_of: Sequence[Tensor] = (),
           rounds: int = ROUNDS) -> Paired:  # fmt: skip
    """The one timer: one warm-up call of each, then ``rounds`` paired rounds (which goes first alternates), each
    giving the reference's time over the fast path's; with ``grad_of`` (operands that require gradients) their
    backward too. Torch's random state is as before."""
    grad_of = [t for t in grad_of if isinstance(t, Tensor) and t.requires_grad] if torch.is_grad_enabled() else []
    with torch.random.fork_rng(devices=[]), check_scope():
        _once(fast, grad_of), _once(reference, grad_of)
        ratios = []
        for i in range(rounds):
            if i % 2:
                r, f = _once(reference, grad_of), _once(fast, grad_of)
            else:
                f, r = _once(fast, grad_of), _once(reference, grad_of)
            ratios.append(r / max(f, 1e-9))
    return Paired(tuple(ratios))
