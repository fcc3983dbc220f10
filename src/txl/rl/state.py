"""The memory of N environments at one moment (``MemoryState``): what a training window starts from, given by both
acting memories (txl.rl.memory's ``AgentMemory``, txl.rl.acting's ``RingMemory``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class MemoryState:
    """The memory of N environments at one moment: what a training window starts from."""

    hidden: Tensor
    """[N, L, M, D]: each layer's input at the last M steps, oldest first."""
    invalid: Tensor
    """[N, M] bool: True where a step is never attended (before the episode's start, or before the first step)."""

    def to(self, *args, **kwargs) -> MemoryState:
        """The state with ``hidden`` moved or cast (``Tensor.to``'s arguments; the flags keep their dtype)."""
        hidden = self.hidden.to(*args, **kwargs)
        return MemoryState(hidden, self.invalid.to(hidden.device))

    def index(self, rows: Tensor) -> MemoryState:
        """The state of these environments (``rows``: indices or a bool mask over N)."""
        return MemoryState(self.hidden[rows], self.invalid[rows])

    @staticmethod
    def stack(states: list[MemoryState]) -> MemoryState:
        """The states of several windows as one batch (their environments one after another)."""
        return MemoryState(torch.cat([s.hidden for s in states]), torch.cat([s.invalid for s in states]))

    def nbytes(self) -> int:
        return self.hidden.numel() * self.hidden.element_size() + self.invalid.numel()
