"""Reading a prompt into a K/V cache in pieces, with what one pass of the whole prompt computes.
Design notes: docs/internals.md#txlinferprompt."""

from __future__ import annotations

import torch
from torch import Tensor

from txl.model.config import Reading
from txl.model.modeling import KVCache, TransformerXLLM

PROMPT_CHUNK = 1024
"""Positions of a prompt read in one pass; a longer prompt is read in pieces of this many."""


def last_piece(prompt_len: int, memory: int, mem_len: int, same_length: bool) -> tuple[int, int]:
    """(queries, keys) of the largest attention :func:`read_prompt` holds for a prompt of ``prompt_len`` after
    ``memory`` positions: its last piece's, which sees with ``same_length`` a window of ``mem_len`` before it, else
    the memory and the whole prompt (the memory estimates count it)."""
    piece = min(prompt_len, PROMPT_CHUNK)
    return piece, (mem_len + piece if prompt_len > PROMPT_CHUNK and same_length else memory + prompt_len)


def read_prompt(
    model: TransformerXLLM,
    ids: Tensor,
    cache: KVCache,
    reading: Reading,
    padding: Tensor | None = None,
    chunk: int = PROMPT_CHUNK,
) -> Tensor:
    """Read ``ids`` [B, T] (``padding`` [B, T]: True on the left of shorter prompts) into ``cache``, in pieces of
    ``chunk`` positions where T is longer, and return every position's last hidden state [B, T, D]. ``reading``: how
    the model reads (mem_len, same_length, clamp_len; None fields: its config's). Afterwards the cache holds the last
    ``mem_len`` positions, as after one pass of the whole prompt."""
    if chunk < 1:
        raise ValueError(f"chunk = {chunk}: a prompt is read in pieces of at least one position")
    read = Reading.of(reading, model.config)
    T = ids.shape[1]
    if T <= chunk or read.cmem_len:  # (a compressed memory: one pass, which compresses what leaves the memory)
        return model.transformer(ids, cache=cache, padding=padding, reading=read).last_hidden_state
    keep = read.mem_len if read.same_length else cache.length + T  # (what the pieces' queries must see)
    hidden = []
    for start in range(0, T, chunk):
        piece = slice(start, start + chunk)
        pad = None if padding is None else padding[:, piece]
        out = model.transformer(ids[:, piece], cache=cache, padding=pad, reading=read.over(mem_len=keep))
        hidden.append(out.last_hidden_state)
    cache.end_segment(0, read.mem_len)  # (the window the one pass leaves: its last mem_len positions)
    return torch.cat(hidden, dim=1)  # [B, T, D]
