"""The memory as cached keys and values (inference: evaluation and generation): over a sliding window
(``KVCache``), and over a ring of fixed shape (``Ring``)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.kernels.graphs import capture_undone
from txl.model.config import TransformerXLConfig
from txl.model.positions import SHIFT_ALIGN, sinusoid_embedding


def ring_scores(
    q: Tensor, u: Tensor, v: Tensor, scale: float, r_k: Tensor, by_distance: Tensor, bias: Tensor
) -> tuple[Tensor, Tensor]:
    """The newest query's terms over a ring of C slots (txl.infer.static_decode, txl.rl.acting): (q + u)/sqrt(Dh)
    [B, H, 1, Dh], and the (b)+(d) scores by slot [B, H, 1, C]: (q + v)/sqrt(Dh) W_kR R_d for the distances
    d = 0..C-1 (``r_k`` [H, Dh, C]), read in slot order by ``by_distance`` [C] (a single query needs no shift), plus
    ``bias`` [B, 1, 1, C] (-inf where a slot is masked)."""
    q_u = (q + u[:, None]) * scale
    bd = torch.matmul((q + v[:, None]) * scale, r_k)  # (b)+(d) by distance, [B, H, 1, C]
    B, H, _, C = bd.shape
    return q_u, bd.gather(-1, by_distance.expand(B, H, 1, C)) + bias


def ring_attend(q_u: Tensor, k: Tensor, v: Tensor, bd: Tensor, exact: torch.dtype) -> Tensor:
    """softmax((a)+(c) + (b)+(d)) v over a ring's slots, the softmax in ``exact`` (fp32 for half precision):
    [B, H, 1, Dh]."""
    ac = torch.matmul(q_u, k.transpose(-1, -2))  # (a)+(c) by slot, [B, H, 1, C]
    prob = (ac + bd).softmax(dim=-1, dtype=exact).to(v.dtype)  # [B, H, 1, C]
    return torch.matmul(prob, v)


class Ring:
    """Every layer's keys and values over a ring of C = mem_len + 1 slots of fixed shape, for a step of one position
    per row that a CUDA graph can replay (nothing read back to the host): the generation's decoder
    (``txl.infer.static_decode.StaticDecoder``) and the agents' acting memory (``txl.rl.acting.RingMemory``) are its
    subclasses. The newest position takes slot ``pos % C``; a query sees the slots that hold a position, are
    ``valid`` for its row (not padding, not before an episode's start) and lie within ``window`` of it
    (same_length); (b)+(d) is read by distance from W_kR R_d (``r_k``, by the attention's own
    ``project_positions``), so no shift is needed."""

    def __init__(self, cfg: TransformerXLConfig, rows: int, mem_len: int, device, dtype: torch.dtype,
                 same_length: bool, clamp_len: int, graph: bool):  # fmt: skip
        L, H, Dh = cfg.n_layer, cfg.n_head, cfg.d_head
        dev = torch.device(device)
        C = self.slots = mem_len + 1
        self.k = torch.zeros(L, rows, H, C, Dh, device=dev, dtype=dtype)  # [L, B, H, C, Dh]
        self.v = torch.zeros_like(self.k)
        self.slot_pos = torch.full((C,), -1, dtype=torch.long, device=dev)  # [C], the position each slot holds
        self.valid = torch.zeros(rows, C, dtype=torch.bool, device=dev)  # [B, C]
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)  # the position about to be taken
        self.window = mem_len + int(cfg.tf_same_length) if same_length else C  # (keys a query sees, itself included)
        self.exact = torch.float64 if dtype == torch.float64 else torch.float32  # R's and the softmax's dtype
        self.r = sinusoid_embedding(C, cfg.d_model, clamp_len, dev, self.exact).flip(0).to(dtype)  # [C, D] by distance
        self.r_k = torch.zeros(L, H, Dh, C, device=dev, dtype=dtype)  # W_kR R_d of each layer, [H, Dh, C]
        self.graph = graph and dev.type == "cuda"
        self._replay: torch.cuda.CUDAGraph | None = None
        self._captured: object = None  # (the key of what the graph was captured for)
        self._out: Tensor | None = None

    def positions(self, layers: nn.ModuleList) -> None:
        """W_kR R of every layer, by its attention's ``project_positions``, written in place (a graph reads them)."""
        for i, layer in enumerate(layers):
            self.r_k[i].copy_(layer.attn.project_positions(self.r))

    def advance(self) -> Tensor:
        """The newest slot ([1], on the device) takes position ``pos`` and is valid for every row."""
        slot = self.pos % self.slots  # [1]
        self.slot_pos.index_copy_(0, slot, self.pos)
        self.valid.index_fill_(1, slot, True)
        return slot

    def run(self, h: Tensor, layers: nn.ModuleList, biases: list, slot: Tensor,
            before: Callable[[int, Tensor], None] | None = None) -> Tensor:  # fmt: skip
        """Every layer's one-token step (``TransformerXLLayer.step``) for the newest position ``h`` [B, 1, D], its
        keys and values written into ``slot``; ``before(i, h)`` sees each layer's input. Advances ``pos``; [B, 1,
        D]."""
        B, C = h.shape[0], self.slots
        dist = self.pos - self.slot_pos  # [C], 0 for the newest position
        seen = self.valid & (self.slot_pos >= 0) & (dist < self.window)  # [B, C]
        bias = torch.zeros(B, 1, 1, C, dtype=self.exact, device=h.device)
        bias.masked_fill_(~seen[:, None, None, :], float("-inf"))  # [B, 1, 1, C]
        by_distance = dist.clamp(0, C - 1)  # [C]
        for i, lay in enumerate(layers):
            if before is not None:
                before(i, h)

            def write(k: Tensor, v: Tensor, i: int = i) -> tuple[Tensor, Tensor]:  # the newest position's slot
                self.k[i].index_copy_(2, slot, k)
                self.v[i].index_copy_(2, slot, v)
                return self.k[i], self.v[i]  # [B, H, C, Dh], in slot order

            def positional(q: Tensor, K: int, i: int = i, lay: nn.Module = lay) -> tuple[Tensor, Tensor]:
                return ring_scores(q, *biases[i], lay.attn.scale, self.r_k[i], by_distance, bias)  # by slot, masked

            h = lay.step(h, write, positional, attend=self.attend)  # [B, 1, D]
        self.pos.add_(1)
        return h

    def attend(self, q_u: Tensor, k: Tensor, v: Tensor, bd: Tensor) -> Tensor:
        """softmax((a)+(c) + (b)+(d)) v over the slots (the softmax in ``exact``): [B, H, 1, Dh]."""
        return ring_attend(q_u, k, v, bd, self.exact)

    def replayed(self, step: Callable[[], Tensor], key: object = None) -> Tensor:
        """``step()`` as a CUDA graph replay: captured at the first call, and again when ``key`` (what the graph
        read from the host: the weights' addresses) changes (``txl.kernels.graphs.capture_undone``: the capture's
        warm-up writes only what the first replay writes again; the bookkeeping is restored). Another thread's CUDA
        work can break a capture: the step then runs eagerly from then on."""
        if self._replay is None or self._captured != key:
            try:
                self._replay, self._out = capture_undone(step, (self.pos, self.slot_pos, self.valid), self.k.device)
            except RuntimeError:  # (it ran nothing)
                self.graph = False
                return step()
            self._captured = key
        self._replay.replay()
        return self._out.clone()  # (the graph's output buffer is overwritten by the next replay)


class KVCache:
    """The memory of every layer as its projected keys and values, for inference (evaluation and generation).

    In the uncached model a segment projects keys/values for [memory; segment] (M + T positions), although the
    memory's were already computed when it was the current segment, with the same weights. The cache keeps them:
    a call projects only its T positions, appends them, attends over the window, and the window slides to the last
    ``mem_len`` positions, which is what ``TransformerXL._update_mems`` keeps. W_kR R is projected once per layer for
    the longest span. Keys stay in time order in one buffer per layer (``[n_layer, B, H, capacity, Dh]``); when its
    end is reached the window is copied to the front once (every ``capacity - mem_len`` positions), so a generated
    token costs no concatenation of the whole memory. Positions can be marked as padding (left-padded prompts of
    different lengths): they are never attended to. For fixed weights only: a model that trains must not reuse it.
    """

    def __init__(
        self, config: TransformerXLConfig, batch_size: int, mem_len: int, max_segment: int = 1, *,
        positions: int | None = None, inputs: bool = False, **kw,
    ):  # fmt: skip
        if not supports_kv_cache(config):
            raise ValueError(
                f"{no_kv_cache_reason(config)} (evaluate without a cache; generation recomputes the memory)"
            )
        self.config = config
        self.capacity = self.capacity_for(mem_len, max_segment, positions)
        shape = (config.n_layer, batch_size, config.n_head, self.capacity, config.d_head)
        # (zeroed now: the pages are touched once here, not on the first pass of the window, where each segment's
        # write would fault them in one by one)
        self.k = torch.zeros(shape, **kw)
        self.v = torch.zeros(shape, **kw)
        self.names = ("k", "v")  # (the buffers indexed by position: [n_layer, B, ., capacity, .])
        self.slots = 0  # (a Compressive Transformer's compressed slots: the first positions of the window)
        if inputs or self.compressive:  # each layer's input at each position, moved with the window (what a
            # Compressive Transformer compresses when it leaves the memory; what txl.rl's training windows start from)
            self.hidden = torch.zeros(config.n_layer, batch_size, 1, self.capacity, config.d_model, **kw)
            self.names = ("k", "v", "hidden")
        self.padding = torch.zeros(batch_size, self.capacity, dtype=torch.bool, device=self.k.device)
        self.padded = False  # whether any position ever written was padding
        self.start = self.end = 0  # the memory is positions [start, end) of the buffer
        self._reset(plan=True, graphs=True, tables=True)

    def _reset(self, *, plan: bool = False, graphs: bool = False, tables: bool = False) -> None:
        """Forget state derived from the buffers or the weights (the one place it is reset): the decoding ``plan``
        (``kernel_state``, txl.kernels.decode's: the model, its layers' weights as decode.c reads them, the native
        kernel's state), the segment ``graphs`` (txl.kernels.graphs: a segment's layers as CUDA graphs, keyed), the
        W_kR R ``tables`` (one per layer, their key, the last view)."""
        if plan:
            self.kernel_state: dict = {}
        if graphs:
            self.segment_graphs = None
        if tables:
            n = self.config.n_layer
            self._r_k: list[Tensor | None] = [None] * n
            self._r_key: tuple | None = None
            self._r_view: list[tuple | None] = [None] * n  # (K, table, its view for K) of the last call

    @staticmethod
    def capacity_for(mem_len: int, max_segment: int = 1, positions: int | None = None) -> int:
        """Positions the buffer holds for a window of ``mem_len`` and segments of up to ``max_segment``; with
        ``positions``, the most that will ever be written (a starting memory, a prompt and its new tokens, a text),
        for a window of no more than those (the buffer grows if a call brings more)."""
        held = mem_len if positions is None else min(mem_len, positions)
        return max(2 * (held + max_segment), 16)

    def weights_changed(self, memory_keys_values: Callable[[int, slice], Tensor]) -> None:
        """The weights changed (an update): forget every W_kR R table, and replace each layer's memory keys and values
        with ``memory_keys_values(layer, positions)`` ([2, B, H, M, Dh]; ``txl.rl`` recomputes them from the layer
        inputs it keeps at those buffer positions)."""
        self._reset(tables=True)
        if self.length:
            window = slice(self.start, self.end)
            for i in range(self.k.shape[0]):
                kv = memory_keys_values(i, window)
                self.k[i, :, :, window], self.v[i, :, :, window] = kv[0], kv[1]

    @property
    def compressive(self) -> bool:
        """Whether the cache holds a Compressive Transformer's memories (compressed slots, kept layer inputs)."""
        return bool(self.config.cmem_len)

    @property
    def length(self) -> int:
        """Number of positions before a segment: the memory's (after a Compressive Transformer's compressed slots,
        which take the window's first ``slots`` positions, one each)."""
        return self.end - self.start

    def begin(self, T: int, padding: Tensor | None = None) -> Tensor | None:
        """Make room for a segment of T positions (``padding`` [B, T]: True where a position is padding); return the
        padding of the window [B, M + T] if any position in it is padding. Every buffer indexed by position
        (``names``) moves with the window."""
        if self.end + T > self.capacity:
            n = self.length
            if n + T > self.capacity:  # a longer segment than planned: grow
                self.capacity = 2 * (n + T)
                for name in self.names:
                    t = getattr(self, name)
                    grown = t.new_empty(*t.shape[:3], self.capacity, t.shape[4])
                    grown[:, :, :, :n] = t[:, :, :, self.start : self.end]
                    setattr(self, name, grown)
                pad = self.padding.new_zeros(self.padding.shape[0], self.capacity)
                pad[:, :n] = self.padding[:, self.start : self.end]
                self.padding = pad
            else:  # slide the window to the front (the source and destination never overlap here)
                for name in self.names:
                    t = getattr(self, name)
                    t[:, :, :, :n] = t[:, :, :, self.start : self.end].clone()
                self.padding[:, :n] = self.padding[:, self.start : self.end].clone()
            self.start, self.end = 0, n
        if padding is not None or self.padded:  # (the buffer holds no padding until a call brings some)
            self.padding[:, self.end : self.end + T] = False if padding is None else padding
            self.padded = self.padded or bool(padding is not None and padding.any())
        window = self.padding[:, self.start : self.end + T]
        return window if self.padded and bool(window.any()) else None

    def forget(self, rows: Tensor) -> Tensor:
        """Mark the whole memory of the rows where ``rows`` [B] (bool) is True as padding, in place: none of it is
        attended again (an agent's episode starts; ``txl.rl``). The positions stay, so distances are unchanged. Their
        keys and values are zeroed: a masked position then adds exactly 0 to the attention, where a non-finite value
        would add 0 x NaN = NaN (one NaN observation would poison the episodes after it). Returns the indices of those
        rows, on the cache's device. (The kept layer inputs, where there are some, are zeroed too.)"""
        gone = rows.nonzero().flatten().to(self.k.device)  # (zeroing only these rows costs what they hold)
        if not len(gone):
            return gone
        self.padding[gone, self.start : self.end] = True
        if self.length:
            for t in map(self.__getattribute__, self.names):
                t[:, gone, :, self.start : self.end] = 0
        self.padded = True
        return gone

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write the segment's keys/values [B, H, T, Dh] of ``layer``; return the window's [B, H, M + T, Dh]."""
        T = k.shape[2]
        self.k[layer, :, :, self.end : self.end + T] = k
        self.v[layer, :, :, self.end : self.end + T] = v
        return self.k[layer, :, :, self.start : self.end + T], self.v[layer, :, :, self.start : self.end + T]

    def positions(self, layer: int, K: int, key: tuple, project: Callable[[int], Tensor]) -> Tensor:
        """W_kR R of ``layer`` for the distances K-1, ..., 0, then ``SHIFT_ALIGN`` zero columns (the padding of the
        shift, see ``shift_padding``): [H, Dh, K + SHIFT_ALIGN], a view of a table that ``project(n)`` made once
        for the longest span seen (for one ``key``: clamp_len, dtype)."""
        if key != self._r_key:
            self._r_k, self._r_key = [None] * self.config.n_layer, key
        view = self._r_view[layer]
        if view is not None and view[0] == K and view[1] is self._r_k[layer]:  # (each step of a full window)
            return view[2]
        table = self._r_k[layer]
        if table is None or table.shape[-1] - SHIFT_ALIGN < K:
            table = project(max(K, self.capacity // 2))
            table = self._r_k[layer] = F.pad(table, (0, SHIFT_ALIGN))
        view = table[..., table.shape[-1] - SHIFT_ALIGN - K :]
        self._r_view[layer] = (K, table, view)
        return view

    def end_segment(self, T: int, mem_len: int) -> None:
        """The segment is now memory; keep the last ``mem_len`` positions (what ``_update_mems`` keeps)."""
        self.end += T
        self.start = max(self.start, self.end - max(mem_len, 0))

    def select(self, rows: list[int]) -> KVCache:
        """Keep only these batch rows, in this order (e.g. the requests that go on when others finished, or a beam
        search's beams). Only the window [start, end) is copied, the rest of the buffer is never read: as many rows
        as before are reordered in place, moving only the rows that change (a beam search's step copied the whole
        buffer, 96% of its time); another number of rows gets new buffers."""
        if len(rows) != self.k.shape[1]:
            return self._copy_rows(rows)
        window, moved = slice(self.start, self.end), [j for j, r in enumerate(rows) if r != j]
        for t in map(self.__getattribute__, self.names):  # (row by row: index_select on the strided view is slower)
            sources = {r: t[:, r, :, window].clone() for r in {rows[j] for j in moved}}  # (read before written)
            for j in moved:
                t[:, j, :, window].copy_(sources[rows[j]])
        self.padding = self.padding[rows]
        self._reset(graphs=True)
        return self

    def _copy_rows(self, rows: list[int]) -> KVCache:
        """:meth:`select` into new buffers (this cache's are left as they were, for :meth:`take`)."""
        window = slice(self.start, self.end)
        for name in self.names:
            old = getattr(self, name)
            new = old.new_empty(old.shape[0], len(rows), *old.shape[2:])
            for j, r in enumerate(rows):
                new[:, j, :, window].copy_(old[:, r, :, window])
            setattr(self, name, new)
        self.padding = self.padding[rows]
        self._reset(graphs=True)
        return self

    def take(self, rows: list[int]) -> KVCache:
        """A new cache of only these batch rows, in this order (copies: this one is unchanged), e.g. a request set
        aside while the others go on."""
        part = copy.copy(self)
        part._r_k, part._r_view = list(self._r_k), list(self._r_view)
        part._reset(plan=True)
        return part._copy_rows(rows)

    @classmethod
    def merge(cls, caches: list[KVCache]) -> KVCache:
        """One cache with the rows of all ``caches`` (one model, in this order), each row's memory right-aligned: a
        shorter memory is preceded by padding positions, which are never attended to and, being on the left, keep
        every row's relative distances. Each row then computes exactly what it would in its own cache."""
        first = caches[0]
        if first.compressive:
            raise ValueError("a Compressive Transformer's caches are not merged: each request runs alone")
        n = max(c.length for c in caches)
        batch = sum(c.k.shape[1] for c in caches)
        merged = cls.__new__(cls)
        merged.config, merged.names, merged.slots = first.config, first.names, 0
        merged.capacity = max(2 * n, first.capacity)
        shape = (first.k.shape[0], batch, first.k.shape[2], merged.capacity, first.k.shape[4])
        merged.k, merged.v = first.k.new_zeros(shape), first.v.new_zeros(shape)
        merged.padding = torch.ones(batch, merged.capacity, dtype=torch.bool, device=first.k.device)
        row = 0
        for c in caches:
            b, m = c.k.shape[1], c.length
            for src, dst in ((c.k, merged.k), (c.v, merged.v)):
                dst[:, row : row + b, :, n - m : n] = src[:, :, :, c.start : c.end]
            merged.padding[row : row + b, n - m : n] = c.padding[:, c.start : c.end]
            row += b
        merged.padding[:, n:] = False
        merged.padded = bool(merged.padding[:, :n].any())
        merged.start, merged.end = 0, n
        merged._reset(plan=True, graphs=True, tables=True)
        return merged


def no_kv_cache_reason(config: TransformerXLConfig) -> str:
    """Why ``config``'s keys and values cannot be cached (where :func:`supports_kv_cache` is False)."""
    absolute = f"attn_type {config.attn_type} has absolute positions"
    return f"{absolute}, which move as the window slides: its keys cannot be cached"


def supports_kv_cache(config: TransformerXLConfig) -> bool:
    """Whether keys and values can be cached across segments (relative positions: attn_type 0 and 1)."""
    return config.attn_type in (0, 1)


def mergeable(config: TransformerXLConfig) -> bool:
    """Whether caches of ``config`` can be merged into one batch (``KVCache.merge``, the server's batches): not a
    Compressive Transformer's, whose rows can hold different numbers of compressed slots."""
    return supports_kv_cache(config) and not config.cmem_len
