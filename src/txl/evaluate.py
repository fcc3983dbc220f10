"""Evaluation of a language model over a whole split, with the memory carried from segment to segment."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np
import torch

from txl.data import OrderedIterator, SentenceStreamIterator
from txl.distributed import World, all_reduce_sum
from txl.modeling import TransformerXLLM


@dataclass
class EvalResult:
    loss: float
    """Mean negative log-likelihood per token (nats)."""
    tokens: int
    """Number of tokens scored."""
    batches: int

    @property
    def ppl(self) -> float:
        return metric_value(self.loss, "ppl")

    @property
    def bpc(self) -> float:
        """Bits per character (per byte for byte-level data)."""
        return metric_value(self.loss, "bpc")


def metric_name(tokenizer_kind: str) -> str:
    """``bpc`` for character- and byte-level data, ``ppl`` for words (as the paper reports them)."""
    return "ppl" if tokenizer_kind == "word" else "bpc"


def metric_value(loss: float, name: str) -> float:
    """A mean NLL in nats as bits per character (``bpc``) or perplexity (``ppl``)."""
    return loss / math.log(2) if name == "bpc" else math.exp(min(loss, 700.0))


def autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "fp16" and device.type != "cuda":
        raise ValueError("precision fp16 needs CUDA (GradScaler); on CPU use bf16")
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


@torch.no_grad()
def evaluate(
    model: TransformerXLLM,
    data: np.ndarray | list,
    *,
    batch_size: int,
    tgt_len: int,
    mem_len: int,
    clamp_len: int | None = None,
    same_length: bool | None = None,
    max_batches: int | None = None,
    precision: str = "fp32",
    world: World | None = None,
) -> EvalResult:
    """Mean NLL over the split ``data`` (an id stream, or lm1b sentence shards), all processes together.

    The stream is cut into ``batch_size`` columns (rows split over the processes of ``world``) and read
    ``tgt_len`` tokens at a time; each segment attends to the last ``mem_len`` hidden states of its column.
    """
    world = world or World()
    device = world.device
    kw = dict(batch_size=batch_size, tgt_len=tgt_len, rank=world.rank, world_size=world.size, device=device)
    if isinstance(data, list):
        it = SentenceStreamIterator(data, shuffle=False, **kw)
    else:
        it = OrderedIterator(data, **kw)
    was_training = model.training
    model.eval()
    nll = torch.zeros((), dtype=torch.float64, device=device)
    tokens = batches = 0
    mems = None
    try:
        for batch in it:
            if max_batches is not None and batches >= max_batches:
                break
            with autocast(device, precision):
                out = model(
                    batch.input,
                    batch.target,
                    mems=mems,
                    mem_len=mem_len,
                    clamp_len=clamp_len,
                    same_length=same_length,
                )
            mems = out.mems
            nll += out.losses.double().sum()
            tokens += batch.target.numel()
            batches += 1
    finally:
        model.train(was_training)
    total, count = all_reduce_sum(world, nll.item(), tokens)
    return EvalResult(loss=total / max(count, 1), tokens=int(count), batches=batches)
