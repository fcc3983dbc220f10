"""Generation's one-token step with every shape and address fixed, replayed on CUDA as one graph.
Design notes: docs/internals.md#txlinferstatic_decode."""

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
