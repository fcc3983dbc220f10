"""Generation's one-token step with every shape and address fixed, replayed on CUDA as one graph.

A cached step of one token (:class:`txl.model.modeling.KVCache`, ``TransformerXL._decode``) launches ~25 small kernels
per layer from Python: on a GPU the step is bound by their launches, not by the arithmetic (the bench-char model:
~0.35 ms of kernels per token, ~4 ms of launching them). A CUDA graph replays all of them in one launch, but only
if no shape, address or host-side decision changes between steps. The KVCache's window does change (it grows to
``mem_len``, then slides along its buffer), so the step here keeps the memory in a ring instead:

* ``C = mem_len + 1`` slots per layer (the memory and the newest position), fixed; the position p of the sequence
  lives in slot ``p % C``, written in place by ``index_copy_`` at a slot computed on the device;
* each slot knows the position it holds (``slot_pos``, -1: empty) and whether it is padding (left-padded prompts);
  the distance of each slot to the newest position is ``pos - slot_pos``;
* the positional term (b)+(d) of the newest query is computed by distance, ``(q + v) W_kR R_d`` for d = 0..C-1
  (W_kR R projected once), and read in slot order with one ``gather`` by those distances: the single newest query
  needs no shift (Appendix B's shift aligns the rows of several queries);
* empty slots, padding, and with ``same_length`` the keys at distance >= the window get -inf before the softmax.

This is the same attention as the KVCache's, over the same keys, with the same positional terms; only the order in
which the keys are summed differs (slot order, not time order): the same log-probabilities up to fp32 rounding
(tested against the uncached model over a sliding window). Everything in a step reads and writes device tensors (the
token ``ids``, ``pos``, the ring), so the step can be captured once (after a warm-up that is undone) and replayed
per token: ``txl.infer.generation.stream`` does so on CUDA when ``Backends.graph_decode`` is on
(:mod:`txl.kernels.backends`) and
the model is attn_type 0. On the CPU the same step runs eagerly (tests); there the native decode kernel is faster.

Threads: while one thread captures (a few milliseconds, once per generation), CUDA work that other threads of the
process launch can be refused ("operation not permitted when stream is capturing", seen on an H100 with a thread
multiplying matrices and synchronizing) or can invalidate the capture, in which case this generation goes on kernel
by kernel. A process that generates while other threads use the GPU should turn ``graph_decode`` off
(``txl.kernels.backends.set_backends``)."""

from __future__ import annotations

import torch
from torch import Tensor

from txl.kernels.graphs import capture_undone
from txl.kernels.registry import admitted
from txl.model.cache import DecodeLayer, ring_attend, ring_scores
from txl.model.config import Reading
from txl.model.modeling import KVCache, RelPartialLearnableMultiHeadAttn, TransformerXLLM, sinusoid_embedding

MIN_NEW_TOKENS = 8
"""Generations of fewer new tokens take the kernel-by-kernel step: capturing the graph (a warm-up step, then the
capture) costs about as much as 3-4 steps launched kernel by kernel on an H100 (benchmarks/gpu_generation.py)."""


def applies(model: TransformerXLLM, device: torch.device, max_new_tokens: int) -> bool:
    """Whether a generation of ``max_new_tokens`` on ``device`` replays :class:`StaticDecoder` as a CUDA graph.
    Not under autocast (e.g. ``txl lm-eval`` with precision bf16): its casts are cached per forward pass, which a
    graph replayed across tokens would not renew; the kernel-by-kernel step runs there."""
    return (
        device.type == "cuda"
        and model.config.attn_type == 0
        and max_new_tokens >= MIN_NEW_TOKENS
        and admitted("graph_decode", model.transformer.layers, "layers", device.type)  # (stock layers: else said)
        and not torch.is_autocast_enabled(device.type)
    )


class StaticDecoder:
    """The step of one new token per row for ``model`` (attn_type 0, eval mode), continuing the memory held by a
    prompt's ``cache``: ``log_probs = decoder(ids)`` ([B] -> [B, V]). ``mem_len``: the generation's memory length
    (the one the cache was filled with). ``graph``: capture the step as a CUDA graph at the first call (CUDA only).
    """

    def __init__(
        self, model: TransformerXLLM, cache: KVCache, mem_len: int, *, graph: bool = False,
        reading: Reading | None = None,
    ):  # fmt: skip
        cfg = model.config
        read = Reading.of(reading, cfg)  # (same_length, clamp_len: how the model reads)
        if cfg.attn_type != 0:
            raise ValueError(f"the static decoder is for attn_type 0 (relative attention), not {cfg.attn_type}")
        if mem_len <= 0:
            raise ValueError("the static decoder needs a memory: mem_len > 0")
        self.model = model
        tr = model.transformer
        self.layers = [DecodeLayer.of(layer) for layer in tr.layers]
        B, H, Dh = cache.k.shape[1], cfg.n_head, cfg.d_head
        dev, dtype = cache.k.device, cache.k.dtype
        C = self.slots = mem_len + 1
        # The ring of every layer's keys and values: the prompt's window, in slots 0..L-1 (positions 0..L-1).
        L = cache.length
        self.k = cache.k.new_zeros(cfg.n_layer, B, H, C, Dh)  # [n_layer, B, H, C, Dh]
        self.v = cache.v.new_zeros(cfg.n_layer, B, H, C, Dh)
        self.k[:, :, :, :L] = cache.k[:, :, :, cache.start : cache.end]
        self.v[:, :, :, :L] = cache.v[:, :, :, cache.start : cache.end]
        self.slot_pos = torch.full((C,), -1, dtype=torch.long, device=dev)  # [C], -1: empty
        self.slot_pos[:L] = torch.arange(L, device=dev)
        self.slot_pad = torch.zeros(B, C, dtype=torch.bool, device=dev)  # [B, C]
        self.slot_pad[:, :L] = cache.padding[:, cache.start : cache.end]
        self.pos = torch.full((1,), L, dtype=torch.long, device=dev)  # the newest position
        self.ids = torch.zeros(B, dtype=torch.long, device=dev)  # the step's input tokens
        # The keys a query sees with same_length (itself included); C sees them all.
        self.window = mem_len + int(cfg.tf_same_length) if read.same_length else C
        # W_kR R_d of every layer for the distances d = 0..C-1 ([H, Dh, C]), and the biases u, v ([H, Dh]).
        self.exact = torch.float64 if dtype == torch.float64 else torch.float32  # R's, the softmax's (fp32 for bf16)
        r = sinusoid_embedding(C, cfg.d_model, read.clamp_len, dev, self.exact).flip(0).to(dtype)  # [C, D], d ascending
        self.r_k = [torch.mm(lay.attn.r_net.weight, r.t()).view(H, Dh, C) for lay in self.layers]
        self.biases = RelPartialLearnableMultiHeadAttn.biases(tr)
        self.graph = graph and dev.type == "cuda"
        self._replay: torch.cuda.CUDAGraph | None = None
        self._out: Tensor | None = None

    def __call__(self, ids: Tensor) -> Tensor:
        """The log-probabilities [B, V] of the token after ``ids`` [B] (appended to the memory)."""
        self.ids.copy_(ids.reshape(-1))
        if not self.graph:
            return self.step()
        if self._replay is None:
            try:
                self._capture()
            except RuntimeError:  # another thread's CUDA work broke the capture (it ran nothing): go on without one
                self.graph = False
                return self.step()
        self._replay.replay()
        return self._out.clone()  # (the graph's output buffer is overwritten by the next replay)

    def _capture(self) -> None:
        """Record :meth:`step` as a CUDA graph (:func:`txl.kernels.graphs.capture_undone`): its warm-up wrote only the
        slot that the first replay writes again, and the slot bookkeeping is restored. Another thread's CUDA work can
        break the capture (see the module's note): __call__ then goes on without it."""
        self._replay, self._out = capture_undone(self.step, (self.pos, self.slot_pos, self.slot_pad), self.ids.device)

    def _attend(self, q_u: Tensor, k: Tensor, v: Tensor, bd: Tensor) -> Tensor:
        """softmax((a)+(c) + (b)+(d)) v over the ring's slots (fp32 softmax for half-precision caches)."""
        return ring_attend(q_u, k, v, bd, self.exact)

    @torch.no_grad()
    def step(self) -> Tensor:
        """One position for every row: embed ``ids``, run the layers over the ring, advance ``pos``; returns the
        log-probabilities [B, V]. Only device tensors change (nothing is read back to the host)."""
        tr = self.model.transformer
        B, C = self.ids.shape[0], self.slots
        slot = self.pos % C  # [1], the slot of the newest position
        self.slot_pos.index_copy_(0, slot, self.pos)
        self.slot_pad.index_fill_(1, slot, False)
        dist = self.pos - self.slot_pos  # [C], 0 for the newest position
        seen = (self.slot_pos >= 0) & (dist < self.window) & ~self.slot_pad  # [B, C]
        h = tr.drop(tr.word_emb(self.ids[:, None]))  # [B, 1, D]
        bias = torch.zeros(B, 1, 1, C, dtype=self.exact, device=h.device)
        bias = bias.masked_fill_(~seen[:, None, None, :], float("-inf"))  # [B, 1, 1, C]
        by_distance = dist.clamp(0, C - 1)  # [C]
        for i, lay in enumerate(self.layers):

            def ring(k: Tensor, v: Tensor, i: int = i) -> tuple[Tensor, Tensor]:  # the newest position's slot
                self.k[i].index_copy_(2, slot, k)
                self.v[i].index_copy_(2, slot, v)
                return self.k[i], self.v[i]  # [B, H, C, Dh], in slot order

            def positional(q: Tensor, K: int, i: int = i, lay: DecodeLayer = lay) -> tuple[Tensor, Tensor]:
                return ring_scores(q, *self.biases[i], lay.attn.scale, self.r_k[i], by_distance, bias)  # by slot

            h = lay.step(h, ring, positional, attend=self._attend)  # [B, 1, D]
        self.pos.add_(1)
        _, log_probs = self.model.crit(tr.drop(h)[:, 0], return_log_probs=True)  # [B, V]
        return log_probs
