"""Sampling from a Transformer-XL LM, carrying the memory from token to token."""

from __future__ import annotations

import torch
from torch import Tensor

from txl.modeling import TransformerXLLM


def filter_logits(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Keep the ``top_k`` largest logits and the smallest set whose probability reaches ``top_p``."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # tokens after the nucleus is complete
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


@torch.no_grad()
def generate(
    model: TransformerXLLM,
    input_ids: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    mem_len: int | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Continue ``input_ids`` [B, T] by ``max_new_tokens``; ``temperature == 0`` is greedy.

    The prompt is run once, then one token per step on top of the memory (the last ``mem_len`` states).
    """
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError("input_ids must be a non-empty [batch, seq_len] tensor")
    mem_len = model.config.mem_len if mem_len is None else mem_len
    if mem_len <= 0:
        raise ValueError("generation carries memory between steps: set mem_len > 0")
    model.eval()
    mems, new = None, []
    step_input = input_ids
    for _ in range(max_new_tokens):
        res = model.transformer(step_input, mems, mem_len=mem_len)
        mems = res.mems
        _, logits = model.crit(res.last_hidden_state[:, -1], return_log_probs=True)  # [B, V] log-probs
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            logits = filter_logits(logits / temperature, top_k, top_p)
            nxt = torch.multinomial(logits.softmax(-1), 1, generator=generator)
        new.append(nxt)
        step_input = nxt
    return torch.cat([input_ids, *new], dim=1)
