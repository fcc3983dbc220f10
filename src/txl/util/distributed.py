"""Process-group plumbing for ``torchrun``: who am I, which device, and the few collectives the trainer needs.
Design notes: docs/internals.md#txlutildistributed."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int = 0
    local_rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def resolve_device(name: str, local_rank: int = 0, option: str = "train.device") -> torch.device:
    """``auto`` (the local rank's GPU if there is one, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``; errors name
    ``option`` (the config field or command-line flag the value came from)."""
    if name == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"{option} = {name!r}: expected cpu, cuda, cuda:N or auto") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{option} = {name!r}: expected cpu, cuda, cuda:N or auto")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{option} = {name!r}, but CUDA is not available here; use cpu or auto")
    if device.type == "cuda" and device.index is None:
        device = torch.device(f"cuda:{local_rank}")
    return device


def init_world(device: str = "auto") -> World:
    """Join the process group when launched by torchrun (``WORLD_SIZE`` > 1)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # before anything is moved to the GPU
    if size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return World(rank, local_rank, size, dev)


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def all_reduce_sum(world: World, *values: float) -> list[float]:
    """Sum of each value over all processes (in float64)."""
    if not world.distributed:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=world.device if world.device.type == "cuda" else "cpu")
    dist.all_reduce(t)
    return t.tolist()


def shutdown(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()
