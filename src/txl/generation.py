"""Sampling from a Transformer-XL LM, carrying the memory from token to token."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import Tensor

from txl.evaluate import NonFiniteError
from txl.modeling import TransformerXLLM


def check_sampling(max_new_tokens: int = 0, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> None:
    """Raise ``ValueError`` naming the first sampling parameter out of range."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens = {max_new_tokens}: must be >= 0")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature = {temperature}: must be >= 0 (0 is greedy decoding)")
    if top_k < 0:
        raise ValueError(f"top_k = {top_k}: must be >= 0 (0 keeps every token)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p = {top_p}: must be in (0, 1] (1 keeps every token)")


def filter_logits(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Keep the ``top_k`` largest logits and the smallest set whose probability reaches ``top_p``; the most
    likely token is always kept."""
    check_sampling(top_k=top_k, top_p=top_p)
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # tokens after the nucleus is complete
        drop[..., 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


@torch.no_grad()
def stream(
    model: TransformerXLLM,
    input_ids: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    mem_len: int | None = None,
    generator: torch.Generator | None = None,
) -> Iterator[Tensor]:
    """Yield the ``max_new_tokens`` tokens [B, 1] that continue ``input_ids`` [B, T], each as soon as it is chosen.

    The prompt is run once, then one token per step on top of the memory (the last ``mem_len`` states).
    ``temperature == 0`` is greedy.
    """
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError("input_ids must be a non-empty [batch, seq_len] tensor")
    mem_len = model.config.mem_len if mem_len is None else mem_len
    if mem_len <= 0:
        raise ValueError("generation carries memory between steps: set mem_len > 0")
    model.eval()
    mems, step_input = None, input_ids
    for i in range(max_new_tokens):
        res = model.transformer(step_input, mems, mem_len=mem_len)
        mems = res.mems
        _, log_probs = model.crit(res.last_hidden_state[:, -1], return_log_probs=True)  # [B, V]
        if not bool(torch.isfinite(log_probs).all()):
            raise NonFiniteError(f"the model gave non-finite log-probabilities for new token {i + 1}")
        if temperature == 0:
            nxt = log_probs.argmax(-1, keepdim=True)
        else:  # shifted so that the best token stays at 0 however small the temperature
            scaled = (log_probs - log_probs.amax(-1, keepdim=True)) / temperature
            nxt = torch.multinomial(filter_logits(scaled, top_k, top_p).softmax(-1), 1, generator=generator)
        yield nxt
        step_input = nxt


def generate(model: TransformerXLLM, input_ids: Tensor, max_new_tokens: int, **kwargs) -> Tensor:
    """``input_ids`` [B, T] followed by ``max_new_tokens`` new tokens (see :func:`stream` for the options)."""
    return torch.cat([input_ids, *stream(model, input_ids, max_new_tokens, **kwargs)], dim=1)
