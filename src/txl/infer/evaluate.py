"""Evaluation of a language model over a whole text, with the memory carried from segment to segment.
Design notes: docs/internals.md#txlinferevaluate."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Generator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from txl.config import EvalConfig, RunConfig, read_run_config
from txl.data import (
    DataConfig,
    FileRange,
    OrderedIterator,
    SentenceStreamIterator,
    Tokenizer,
    cached_corpus,
    prepare_corpus,
)
from txl.data.download import sha256_file
from txl.data.errors import DataError
from txl.data.readers import check_data_path
from txl.model.modeling import (
    KVCache,
    TransformerXLConfig,
    TransformerXLLM,
    supports_kv_cache,
    transposed_weights,
)
from txl.model.modeling import NonFiniteError as NonFiniteError  # (re-exported: it was defined here first)
from txl.util.distributed import World, all_reduce_sum

PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass
class EvalResult:
    loss: float
    """Mean negative log-likelihood per token (nats)."""
    tokens: int
    """Number of tokens scored."""
    batches: int
    losses: np.ndarray | None = None
    """With ``return_losses``: the NLL of every scored token, in the order of the text (one process only)."""


def metric_name(tokenizer_kind: str) -> str:
    """``bpc`` for character- and byte-level data, ``ppl`` for words and REMI events (as the paper reports them)."""
    return "ppl" if tokenizer_kind in ("word", "remi") else "bpc"


def metric_value(loss: float, name: str) -> float:
    """A mean NLL in nats as bits per character (``bpc``) or perplexity (``ppl``)."""
    return loss / math.log(2) if name == "bpc" else math.exp(min(loss, 700.0))


def autocast(device: torch.device, precision: str):
    """The autocast context of ``precision`` (fp32: none). Unknown names and fp16 off CUDA are errors."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "fp16" and device.type != "cuda":
        raise ValueError("precision fp16 needs CUDA (GradScaler); on CPU use bf16")
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


@torch.no_grad()
@transposed_weights()  # (the weights are fixed while evaluating: packed copies may be kept)
def evaluate(model: TransformerXLLM, data: np.ndarray | list, **kwargs: Any) -> EvalResult:
    """Mean NLL over the split ``data`` (an id stream, or lm1b sentence shards), all processes together.

    The stream is cut into ``batch_size`` columns (rows split over the processes of ``world``) and read
    ``tgt_len`` tokens at a time; each segment attends to the last ``mem_len`` hidden states of its column. With
    ``cache`` (the default) the memory is kept as its keys and values (:class:`~txl.model.modeling.KVCache`): the same
    result without projecting the memory again for every segment. ``return_losses`` also returns every token's
    NLL in text order (the columns are contiguous pieces of the text, so that is column by column).
    ``zero_memory``: every column starts from ``mem_len`` zero vectors, as Hugging Face's TransfoXL and the TF code
    evaluated (their numbers; the first segment reads them as keys), instead of the original PyTorch code's empty
    memory. The keyword arguments are :func:`evaluate_steps`'.
    """
    steps = evaluate_steps(model, data, **kwargs)
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value


def evaluate_steps(
    model: TransformerXLLM, data: np.ndarray | list, *, batch_size: int, tgt_len: int, mem_len: int,
    clamp_len: int | None = None, same_length: bool | None = None, cmem_len: int | None = None,
    max_batches: int | None = None, precision: str = "fp32", world: World | None = None, cache: bool = True,
    return_losses: bool = False, zero_memory: bool = False,
) -> Generator[None, None, EvalResult]:  # fmt: skip
    """:func:`evaluate` one segment at a time: the generator yields after each model call and returns the
    :class:`EvalResult` (``StopIteration.value``), so a caller (the server's engine) can run other work between two
    segments or stop early (``close()``). The caller runs it without gradients; the model is in eval mode until it
    ends or is closed."""
    if return_losses and ((world and world.size > 1) or isinstance(data, list)):
        raise ValueError("return_losses needs one process and one token stream")
    per_token = []
    world = world or World()
    device = world.device
    context = autocast(device, precision)  # validates the precision before any work
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
    kv = None
    dtype = next(model.parameters()).dtype
    if zero_memory and mem_len > 0:
        zeros = torch.zeros(batch_size // world.size, mem_len, model.config.d_model, device=device, dtype=dtype)
        mems = [zeros] * model.config.n_layer
    if cache and supports_kv_cache(model.config):  # (absolute positions, attn_type 2 and 3, cannot be cached)
        # (sized by the longest segment and the positions the text gives: lengths past the text's columns read
        # each column as one segment, with all of it before as the memory)
        written = None if zero_memory or it.column_len is None else it.column_len
        rows = batch_size // world.size
        kv = KVCache(model.config, rows, mem_len, it.max_seq_len, positions=written, device=device, dtype=dtype)
        if mems is not None:
            model.transformer.fill_cache(kv, mems, mem_len)
            mems = None
    try:
        for batch in it:
            if max_batches is not None and batches >= max_batches:
                break
            with context:
                out = model(
                    batch.input,
                    batch.target,
                    mems=mems,
                    cache=kv,
                    mem_len=mem_len,
                    clamp_len=clamp_len,
                    same_length=same_length,
                    cmem_len=cmem_len,
                )
            mems = out.mems
            nll += out.losses.double().sum()
            if return_losses:
                per_token.append(out.losses.float().cpu())
            tokens += batch.target.numel()
            batches += 1
            yield
    finally:
        model.train(was_training)
    total, count = all_reduce_sum(world, nll.item(), tokens)
    losses = torch.cat(per_token, dim=1).flatten().numpy() if return_losses and per_token else None
    return EvalResult(loss=total / max(count, 1), tokens=int(count), batches=batches, losses=losses)


def segments_from_end(length: int, tgt_len: int) -> list[slice]:
    """The segments of ``length`` left-padded positions, counted from the end: each ``tgt_len`` long but the first,
    which takes what is left. Rows padded on the left to the longest read the same segments of their own tokens as
    if every row were padded to whole segments, in fewer positions (padding is never attended to)."""
    n = -(-length // tgt_len)
    return [slice(max(0, length - (n - s) * tgt_len), length - (n - 1 - s) * tgt_len) for s in range(n)]


def sliding_windows(n_targets: int, window: int, stride: int) -> list[tuple[int, int]]:
    """The windows of :func:`evaluate_sliding` as (end, scored): target ``j`` is token ``j`` predicted from the
    tokens before it (``1 <= j <= n_targets``); a window ending at target ``end`` reads the ``window`` tokens before
    it and scores its last ``scored`` targets. Every target is scored exactly once."""
    if window < 1 or not 1 <= stride <= window:
        raise ValueError(f"sliding window {window}, stride {stride}: need window >= 1 and 1 <= stride <= window")
    first = min(window, n_targets)
    out = [(first, first)] if first > 0 else []
    for end in range(first + stride, n_targets + stride, stride):
        end = min(end, n_targets)
        out.append((end, end - out[-1][0]))
    return out


@torch.no_grad()
@transposed_weights()
def evaluate_sliding(
    model: TransformerXLLM, data: np.ndarray | list, *, window: int, stride: int = 1, batch_size: int = 16,
    clamp_len: int | None = None, max_batches: int | None = None, precision: str = "fp32", world: World | None = None,
    return_losses: bool = False,
) -> EvalResult:  # fmt: skip
    """Mean NLL of an id stream scored the way Al-Rfou et al. evaluate a vanilla Transformer (the paper's Table 9
    baseline): every prediction sees a fixed window of at most ``window`` previous tokens, recomputed from scratch
    (no memory, nothing reused between windows). The window slides by ``stride`` tokens and scores its last
    ``stride`` positions (``stride=1``: one prediction per window, as in the paper); the first window scores all
    its positions, each of which already sees the whole text before it. ``batch_size`` windows run at once
    (``max_batches`` such batches at most); windows are split over the processes of ``world``.
    ``return_losses`` also returns every scored token's NLL in text order (one process only).
    """
    if return_losses and world is not None and world.size > 1:
        raise ValueError("return_losses needs one process")
    if isinstance(data, list):
        raise ValueError("sliding-window evaluation scores one token stream; sentence shards (lm1b) are not one")
    world = world or World()
    device = world.device
    context = autocast(device, precision)
    ids = torch.as_tensor(np.asarray(data, dtype=np.int64))
    spans = sliding_windows(len(ids) - 1, window, stride)
    per_token = np.full(len(ids) - 1, np.nan, dtype=np.float32) if return_losses else None
    first, rest = spans[:1], spans[1:][world.rank :: world.size]
    groups = [first] if first and world.rank == 0 else []  # the first window (maybe shorter) runs alone
    groups += [rest[i : i + batch_size] for i in range(0, len(rest), batch_size)]
    groups = groups[:max_batches] if max_batches is not None else groups
    was_training = model.training
    model.eval()
    nll = torch.zeros((), dtype=torch.float64, device=device)
    tokens = 0
    try:
        for group in groups:
            length = min(window, group[0][0])  # every window of a group has the same length
            inputs = torch.stack([ids[end - length : end] for end, _ in group]).to(device)  # [b, L]
            targets = torch.stack([ids[end - length + 1 : end + 1] for end, _ in group])  # [b, L]
            scored = max(n for _, n in group)
            targets = targets[:, length - scored :].clone()  # the last positions, right-aligned
            for row, (_, n) in enumerate(group):
                targets[row, : scored - n] = -100  # a shorter last step scores fewer positions
            targets = targets.to(device)
            with context:
                out = model(inputs, targets, mem_len=0, clamp_len=clamp_len)
            nll += out.losses.double().sum()
            tokens += sum(n for _, n in group)  # (known in advance: no device sync)
            if return_losses:
                rows = out.losses.float().cpu()
                for row, (end, n) in enumerate(group):
                    per_token[end - n : end] = rows[row, scored - n :].numpy()  # targets end-n+1..end
    finally:
        model.train(was_training)
    total, count = all_reduce_sum(world, nll.item(), tokens)
    losses = per_token[~np.isnan(per_token)] if per_token is not None else None
    return EvalResult(loss=total / max(count, 1), tokens=int(count), batches=len(groups), losses=losses)


# ---------------------------------------------------------------------------------------------------------
# What `txl eval` scores, and how.
# ---------------------------------------------------------------------------------------------------------


def eval_settings(run: RunConfig | None, model_config: TransformerXLConfig, **given) -> EvalConfig:
    """The evaluation settings: each value in ``given`` that is not None, else the run's ``eval`` section, else
    defaults from the model (its mem_len, clamp_len and same_length). A same_length that is
    not given and comes from the run or the model does not apply without a memory (mem_len 0, e.g. the first
    point of a memory sweep): that evaluation is plain causal attention. Errors name the command-line option
    (``--tgt_len``)."""
    m = model_config
    base = (
        run.eval if run is not None else EvalConfig(mem_len=m.mem_len, clamp_len=m.clamp_len, same_length=m.same_length)
    )
    settings = replace(base, **{k: v for k, v in given.items() if v is not None})
    if settings.mem_len == 0 and given.get("same_length") is None:
        settings = replace(settings, same_length=False)
    settings.validate(prefix="--")
    return settings


def reading_settings(folder: str | Path, model_config: TransformerXLConfig, **given) -> EvalConfig:
    """How a trained model reads text: the one rule of every command and endpoint that does (txl eval, generate,
    lm-eval, the server's score, generate and completions; training and fine-tuning read as the model trained).

    Each of ``mem_len``, ``clamp_len``, ``same_length`` (and ``tgt_len``, ...) is the value given, else the run's
    ``eval`` section (``run.json`` beside the checkpoint: the settings the run was evaluated with, usually a longer
    memory than in training, as the paper evaluates), else the model's ``config.json``. See :func:`eval_settings`."""
    return eval_settings(read_run_config(Path(folder)), model_config, **given)


def describe_reading(s: EvalConfig) -> str:
    """The reading settings as the commands print them."""
    cmem = f", cmem_len {s.cmem_len}" if s.cmem_len else ""
    return f"mem_len {s.mem_len}{cmem}, clamp_len {s.clamp_len}, same_length {s.same_length}"


@dataclass
class EvalText:
    """Token ids to score (a stream, or lm1b sentence shards), the tokenizer that made them, and what they are."""

    ids: np.ndarray | list
    tokenizer: Tokenizer
    description: str


def _midi_text(tokenizer, data: Path, split: str, run: RunConfig | None) -> EvalText:
    """A music model's --data: a MIDI file, or the ``split`` of a folder of them (``train/ valid/ test/``, else split
    by the run's rule), each piece BOS + its events + EOS, as its training corpus holds them."""
    from txl.data.music import MusicConfig, music_layout

    if data.is_file():
        files, what = [data], str(data)
    else:
        layout = music_layout(data, run.data.music if run is not None else MusicConfig())
        files, what = [r.path for r in layout.splits[split]], f"{split} split of {layout.description}"
    ids = [i for f in files for i in (tokenizer.bos_id, *tokenizer.encode_midi(f), tokenizer.eos_id)]
    return EvalText(np.asarray(ids, dtype=np.int64), tokenizer, what)


def eval_text(
    model_dir: Path,
    run: RunConfig | None,
    split: str,
    data: str | Path | None = None,
    dataset: str | None = None,
    encoding_errors: str | None = None,
    raw_text: bool | None = None,
) -> EvalText:
    """The text ``txl eval`` scores, always read with the model's own ``tokenizer.json``.

    ``raw_text``: a ``data`` file is raw text, read through the tokenizer's raw-text pipeline (Moses, text8), not
    as already tokenized (default: as the model's training files were read).

    ``data`` is a text file (scored whole), a folder (its ``split``: ``{split}.txt``, ``{split}/*.txt`` or held-out
    documents, or the layout of ``dataset``), or None: the run's own dataset, from the training cache when its
    tokenizer is the model's (no tokenization at all), else tokenized once with the model's tokenizer.
    ``encoding_errors`` defaults to the run's ``data.encoding_errors``.
    """
    if encoding_errors is None:
        encoding_errors = run.data.encoding_errors if run is not None else "strict"
    tok_file = Path(model_dir) / "tokenizer.json"
    if not tok_file.is_file():
        raise DataError(
            f"{model_dir}: no tokenizer.json; evaluation reads text with the model's own tokenizer "
            "(a model converted from Hugging Face gets one with `txl convert hf --trust-pickle`)"
        )
    tokenizer = Tokenizer.load(tok_file).for_model(TransformerXLLM.load_config(model_dir).n_token, tok_file)
    if data is not None:
        check_data_path(data, "data")
    if data is not None and getattr(tokenizer, "kind", None) == "remi":  # a music model: MIDI files
        return _midi_text(tokenizer, Path(data), split, run)
    if data is not None and Path(data).is_file():
        chunks = list(tokenizer.encode_file(FileRange(Path(data)), encoding_errors, raw=raw_text))
        ids = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)
        if len(ids) == 0:
            raise DataError(f"{data}: no tokens to score (the file is empty)")
        return EvalText(ids, tokenizer, str(data))
    if data is not None:
        files = run.data.files if run is not None else DataConfig.files  # (the run's documents, in a folder like it)
        cfg = DataConfig(path=str(data), dataset=dataset or "custom", encoding_errors=encoding_errors, files=files)
    elif run is not None:
        cfg = replace(run.data, dataset=dataset or run.data.dataset, encoding_errors=encoding_errors)
        if not Path(cfg.path).exists():
            where = "" if Path(cfg.path).is_absolute() else ", relative to the folder txl train ran in"
            raise DataError(f"{cfg.path}: the run's data (data.path{where}) is not here: give the text with --data")
        trained = cached_corpus(cfg)  # the training cache, if its tokenizer is the model's
        if trained is not None and trained.meta["tokenizer_sha256"] == sha256_file(tok_file):
            return EvalText(trained.splits[split], trained.tokenizer, f"{split} split of {cfg.path}")
    else:
        raise DataError(f"{model_dir} has no run configuration (run.json): give the text to score with --data")
    corpus = prepare_corpus(replace(cfg, tokenizer_file=str(tok_file), tokenizer=None))
    return EvalText(corpus.splits[split], corpus.tokenizer, f"{split} split of {cfg.path}")
