"""The layer call, a named operation with two backends: the module's own forward (the reference) and, for training
on the devices of ``Backends.compiled_layers``, the same forward traced by ``torch.compile`` (Inductor): one graph
per layer shape, shared by every layer of that shape (the modules' parameters are its inputs), forward and backward.
Design notes: docs/internals.md#txlkernelscompiled."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import Tensor, nn

from txl.kernels.backends import Backends, backends, traced_policy

RECOMPILE_LIMIT = 16
"""Graphs kept per layer call (Dynamo's ``recompile_limit``): shapes of segment and memory, train and eval."""


def _call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return module(*args, **kwargs)


def _call_graphed(module: nn.Module, *args: Any, **kwargs: Any) -> Any:  # (another code object: its own graphs)
    return module(*args, **kwargs)


@functools.cache
def _compiled(graphs: bool = False):
    """The compiled layer call; ``graphs``: its kernels replayed as CUDA graphs (Inductor's "reduce-overhead" mode,
    ``Backends.compiled_layers_graphs``). (Inductor's C++ wrapper, which would launch the kernels with less host
    time, fails to compile the layers' backward on CUDA in torch 2.11: "CudaKernelParamCache not populated", seen on
    an H100.)"""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
    if graphs:
        return torch.compile(_call_graphed, dynamic=False, mode="reduce-overhead")
    return torch.compile(_call, dynamic=False)


@functools.cache
def _traced(policy: Backends) -> Backends:
    """The policy compiled code reads: the caller's, without the native CPU kernels and the SDPA call (the traced
    scores are fused by the compiler instead)."""
    return dataclasses.replace(policy, native_kernels=False, sdpa_training_devices=())


def compiled_applies(h: Tensor, module: nn.Module, need_weights: bool = False, cache: Any = None) -> bool:
    """Whether :func:`layer_call` compiles: a training call (gradients on, the module in training mode) on a device
    of ``Backends.compiled_layers``, no attention probabilities asked for, no K/V cache, and no graph being traced,
    compiled or exported already."""
    return bool(
        h.device.type in backends().compiled_layers
        and module.training
        and torch.is_grad_enabled()
        and not need_weights
        and cache is None
        and not torch.compiler.is_compiling()
        and not torch.compiler.is_exporting()
        and not torch.jit.is_tracing()
    )


def layer_call(module: nn.Module, h: Tensor, *args: Any, **kwargs: Any) -> Any:
    """``module(h, *args, **kwargs)``: compiled where :func:`compiled_applies` (the same values up to rounding),
    else the module's own call."""
    if not compiled_applies(h, module, kwargs.get("need_weights", False), kwargs.get("cache")):
        return module(h, *args, **kwargs)
    policy = backends()
    previous = traced_policy(_traced(policy))
    try:
        return _compiled(h.device.type in policy.compiled_layers_graphs)(module, h, *args, **kwargs)
    finally:
        traced_policy(previous)
