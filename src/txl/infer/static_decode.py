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

from txl.kernels.registry import admitted
from txl.model.cache import Ring
from txl.model.config import Reading
from txl.model.modeling import KVCache, RelPartialLearnableMultiHeadAttn, TransformerXLLM

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
        and not model.config.cmem_len  # (the ring holds no compressed slots)
        and max_new_tokens >= MIN_NEW_TOKENS
        and admitted("graph_decode", model.transformer.layers, "layers", device.type)  # (stock layers: else said)
        and not torch.is_autocast_enabled(device.type)
    )


class StaticDecoder(Ring):
    """The step of one new token per row for ``model`` (attn_type 0, eval mode), continuing the memory held by a
    prompt's ``cache``: ``log_probs = decoder(ids)`` ([B] -> [B, V]). ``mem_len``: the generation's memory length
    (the one the cache was filled with). ``graph``: capture the step as a CUDA graph at the first call (CUDA only).
    The memory is a :class:`~txl.model.cache.Ring`: the prompt's window in slots 0..L-1, its padding not valid."""

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
        B = cache.k.shape[1]
        super().__init__(cfg, B, mem_len, cache.k.device, cache.k.dtype, read.same_length, read.clamp_len, graph)
        self.model = model
        tr = model.transformer
        L = cache.length
        self.k[:, :, :, :L] = cache.k[:, :, :, cache.start : cache.end]
        self.v[:, :, :, :L] = cache.v[:, :, :, cache.start : cache.end]
        self.slot_pos[:L] = torch.arange(L, device=self.k.device)
        self.valid[:, :L] = ~cache.padding[:, cache.start : cache.end]
        self.pos.fill_(L)  # the newest position
        self.ids = torch.zeros(B, dtype=torch.long, device=self.k.device)  # the step's input tokens
        self.positions(tr.layers)
        self.biases = RelPartialLearnableMultiHeadAttn.biases(tr)

    def __call__(self, ids: Tensor) -> Tensor:
        """The log-probabilities [B, V] of the token after ``ids`` [B] (appended to the memory)."""
        self.ids.copy_(ids.reshape(-1))
        return self.replayed(self.step) if self.graph else self.step()

    @torch.no_grad()
    def step(self) -> Tensor:
        """One position for every row: embed ``ids``, run the layers over the ring, advance ``pos``; returns the
        log-probabilities [B, V]. Only device tensors change (nothing is read back to the host)."""
        tr = self.model.transformer
        slot = self.advance()
        h = tr.drop(tr.word_emb(self.ids[:, None]))  # [B, 1, D]
        h = self.run(h, tr.layers, self.biases, slot)  # [B, 1, D]
        _, log_probs = self.model.crit(tr.drop(h)[:, 0], return_log_probs=True)  # [B, V]
        return log_probs
