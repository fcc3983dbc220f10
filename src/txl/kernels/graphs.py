"""A cached segment's pass through every layer (evaluation, scoring), a named operation with two backends: the layers'
own forward (the reference) and, on the devices of ``Backends.graph_segments`` (CUDA), the same kernels replayed as
CUDA graphs. Design notes: docs/internals.md#txlkernelsgraphs."""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx.experimental.proxy_tensor import make_fx

from txl.kernels.admission import global_hooks, own_hooks
from txl.kernels.backends import backends, use_backends
from txl.kernels.registry import REGISTRY, Backend, register

MAX_GRAPHS = 32
"""Graphs per cache (one per offset of the window in the cache's buffer; 12 for tgt_len 64, mem_len 640)."""


class _Graph:
    """One recorded step: its static input and output, the recorded function (kept alive with everything it read:
    the mask, the positional tables) and its graph (a CUDA graph; on the CPU, the step traced by ``make_fx``)."""

    def __init__(self, run: Callable[[Tensor], Tensor], static_in: Tensor):
        self.run, self.input = run, static_in
        self.output: Tensor | None = None
        self.graph: Any = None

    def replay(self, h: Tensor) -> Tensor:
        self.input.copy_(h)
        if isinstance(self.graph, torch.fx.GraphModule):  # (the CPU's stand-in: the traced step, static buffers)
            self.output = self.graph(self.input)
        else:
            self.graph.replay()
        return self.output.clone()  # (the next replay overwrites the output buffer)


class SegmentGraphs:
    """A cache's graphs for one key (``KVCache.segment_graphs``)."""

    def __init__(self, key: tuple):
        self.key = key
        self.graphs: dict[int, _Graph] = {}
        self.pool: Any = None
        self.failed = False


_SCALARS = (bool, int, float, str)


def module_state(module: nn.Module) -> tuple:
    """What a graph of ``module``'s kernels depends on besides the inputs: its parameters' and buffers' addresses and
    dtypes, every plain value its modules hold (an attention's ``scale``, ``pre_lnorm``, a norm's ``eps``: a graph
    bakes them in), and whether any forward hook (the module's, its submodules', or a global one) is registered."""
    tensors = tuple((t.data_ptr(), t.dtype) for t in (*module.parameters(), *module.buffers()))
    values = tuple(
        (k, v) for m in module.modules() for k, v in m.__dict__.items() if type(v) in _SCALARS and k != "training"
    )
    hooked = global_hooks() or any(own_hooks(m) for m in module.modules())  # (txl.kernels.admission's one check)
    return tensors, values, hooked


def capture_undone(
    step: Callable[[], Tensor], kept: Sequence[Tensor], device: torch.device
) -> tuple[torch.cuda.CUDAGraph, Tensor]:
    """``step()`` recorded as a CUDA graph, for a step that moves its own bookkeeping on (txl.infer.static_decode's
    ring, txl.rl.acting's): a warm-up run first, on a side stream (as CUDA graphs ask: libraries allocate their
    workspaces there), after which the tensors ``kept`` get their values back (the warm-up's other writes are the
    ones the first replay makes again), then the capture. (thread_local: other threads' unsafe calls are not made
    errors; their work can still break the capture, a RuntimeError for the caller, which ran nothing.) Returns the
    graph and its output buffer (each replay overwrites it)."""
    saved = [t.clone() for t in kept]
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device=device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        step()
        for t, value in zip(kept, saved, strict=True):
            t.copy_(value)
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = step()
    return graph, out


def _autocast(dev: torch.device) -> torch.dtype | None:
    return torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else None


register(
    Backend(
        "graph_segments",
        "segment_layers",
        "the layers' forward on a cached segment",
        lambda p, dev: dev in p.graph_segments,
        measured=False,
    )
)
register(
    Backend(
        "graph_decode",
        "decode_step",
        "the K/V cache's one-token step, kernel by kernel",
        lambda p, dev: p.graph_decode and dev == "cuda",
        deep=True,
        measured=False,
    )
)
register(
    Backend(
        "graph_act",
        "act_step",
        "the agents' memory step by the K/V cache",
        lambda p, dev: dev in p.graph_act,
        deep=True,
        measured=False,
    )
)


def _capturing(dev: torch.device) -> bool:
    return dev.type == "cuda" and torch.cuda.is_current_stream_capturing()


def segment_layers(model: nn.Module, s: Any, record: tuple[list, list] | None, need_weights: bool) -> Tensor:
    """Every layer of ``model`` (a ``TransformerXL``) for its prepared cached segment ``s`` (``s.h`` [B, T, D]):
    ``model.layers_forward`` (the reference; ``record``, lists or None, receives each layer's output and weights),
    or where this step applies (see the module's note) on a device of ``Backends.graph_segments``, the same
    computation replayed as a graph, keyed by what its kernels read from the host."""
    h, cache, read = s.h, s.cache, s.read
    dev = h.device
    applies = record is None and not need_weights and model.config.attn_type == 0 and s.mask is not None
    applies = applies and s.mask.dim() == 2 and all(m is None for m in s.heads)  # (no padding, no head mask)
    applies = applies and not cache.compressive  # (not yet replayed with a compressed memory: its start moves)
    if (
        not applies
        or not REGISTRY["graph_segments"].switch(backends(), dev.type)
        or _capturing(dev)
        or torch.compiler.is_compiling()
    ):
        return model.layers_forward(s, need_weights, record)
    autocast = _autocast(dev)
    if autocast is None and h.dtype not in (torch.float16, torch.bfloat16):
        return model.layers_forward(s)  # (fp32 steps are bound by their arithmetic here: see the module's note)
    state, values, hooked = module_state(model)
    if hooked:
        return model.layers_forward(s)
    key = (s.T, s.mlen, read.same_length, s.window, read.clamp_len, cache.k.data_ptr(), cache.v.data_ptr())
    key = (key, tuple(h.shape), h.dtype, autocast, state, values)
    graphs = cache.segment_graphs
    if graphs is None or graphs.key != key:
        cache.segment_graphs = SegmentGraphs(key)  # (a new key's first step: the reference, no capture)
        return model.layers_forward(s)
    entry = graphs.graphs.get(cache.start)
    if entry is not None:
        return entry.replay(h)
    if graphs.failed or len(graphs.graphs) >= MAX_GRAPHS:
        return model.layers_forward(s)
    # The graph keeps its function alive (and what its kernels read) in the cache: it holds the cache weakly, so that
    # a cache nobody uses is freed at once with its graphs' memory, not at the next cycle collection (a reference
    # cycle: GPU memory that Python's collector does not see).
    cache_ref, seg = weakref.ref(cache), dataclasses.replace(s, cache=None)

    def run(x: Tensor) -> Tensor:  # the step from the input x
        return model.layers_forward(dataclasses.replace(seg, h=x, cache=cache_ref()))

    return _record(graphs, cache.start, h, run)


def _record(graphs: SegmentGraphs, offset: int, h: Tensor, run: Callable[[Tensor], Tensor]) -> Tensor:
    """Run this step (the warm-up a capture needs) and record it as the graph of ``offset``; returns the step's
    output."""
    dev = h.device
    entry = _Graph(run, h.clone())
    if dev.type != "cuda":  # (the CPU's stand-in, for tests: the step traced, every host-side value fixed)
        out = run(entry.input)
        with use_backends(native_kernels=False):  # (a trace, like a graph, records torch's kernels only)
            entry.graph = make_fx(run)(entry.input)  # (runs the step again: the same writes to the cache)
        graphs.graphs[offset] = entry
        return out
    dtype = _autocast(dev)

    def casts():  # (autocast's cache of cast weights off: a graph casts them itself at each replay, CUDA graphs' rule)
        return torch.autocast("cuda", dtype=dtype, cache_enabled=False) if dtype else contextlib.nullcontext()

    current = torch.cuda.current_stream(dev)
    side = torch.cuda.Stream(device=dev)
    side.wait_stream(current)
    with torch.cuda.stream(side), casts():  # this step, computed: the warm-up (libraries set up their workspaces)
        out = run(entry.input)
    current.wait_stream(side)
    out = out.clone()
    graph = torch.cuda.CUDAGraph()
    if graphs.pool is None:
        graphs.pool = torch.cuda.graph_pool_handle()
    try:
        # (thread_local: other threads' unsafe calls are not made errors; their work can still break the capture)
        with casts(), torch.cuda.graph(graph, pool=graphs.pool, capture_error_mode="thread_local"):
            entry.output = run(entry.input)  # (recorded, not run: the cache is as the warm-up left it)
    except RuntimeError:
        graphs.failed = True
        return out
    entry.graph = graph
    graphs.graphs[offset] = entry
    return out
