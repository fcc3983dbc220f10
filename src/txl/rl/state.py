"""The memory of N environments at one moment (``MemoryState``): what a training window starts from, given by both
acting memories (txl.rl.memory's ``AgentMemory``, txl.rl.acting's ``RingMemory``); and the check both make before
allocating (``check_fits``)."""

from __future__ import annotations

import contextlib
import os
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


def _bytes_free(device: torch.device) -> int | None:
    """Memory the process can still take on ``device`` (None: unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        with contextlib.suppress(ValueError, OSError, AttributeError):
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return None


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def check_fits(need: int, device, n_envs: int, mem_len: int) -> None:
    """One line, before anything is allocated, where ``need`` bytes do not fit the device's free memory."""
    free = _bytes_free(torch.device(device))
    if free is not None and need > free:
        raise ValueError(
            f"the memory of {n_envs} environments x mem_len {mem_len} needs {need / 2**30:.2f} GiB and "
            f"{torch.device(device)} has {free / 2**30:.2f} GiB free: use fewer environments or a shorter mem_len"
        )
