"""Helpers the commands share: threads, memory checks, text from the command line."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

DEFAULT_GENERATE_THREADS = 1  # token-by-token decoding is latency-bound: more threads rarely pay, and collapse
# on a busy machine (measured: 4,000 tokens in 2.9 s with 1 thread, 56 s with 2 on a 2-core machine under load)


def _set_threads(threads: int | None) -> None:
    import torch

    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads = {threads}: must be >= 1")
        torch.set_num_threads(threads)


def _check_eval_memory(
    config, s, sliding_window: int | None, n_tokens: int | None = None, zero_memory=False, device=None, half=False
) -> None:
    """``txl eval``'s memory estimate (the K/V cache of every layer over mem_len + tgt_len positions, and a
    segment's attention: :func:`attention_pass_bytes`), checked against the free memory before anything is allocated.
    ``n_tokens``: the text's length, whose columns bound a segment and the memory (lengths past them read a column as
    one segment, with all of it before as the memory; ``zero_memory``: the memory starts as mem_len positions)."""
    from txl.kernels.runtime import check_fits

    column = None if n_tokens is None else max(1, n_tokens // s.batch_size - 1)
    seg, mem = (s.tgt_len, s.mem_len) if column is None else (min(s.tgt_len, column), min(s.mem_len, column))
    mem = s.mem_len if zero_memory else mem
    keys = mem + seg if sliding_window is None else sliding_window
    queries = seg if sliding_window is None else sliding_window
    cache = 2 * config.n_layer * s.batch_size * keys * config.n_head * config.d_head * 4
    scores = attention_pass_bytes(config, s.batch_size, queries, keys, device, half)
    check_fits(cache + scores, f"txl eval with mem_len {s.mem_len:,} and tgt_len {s.tgt_len:,}",
               "give a smaller --mem_len, --tgt_len or --batch_size")  # fmt: skip


def attention_pass_bytes(config, rows: int, queries: int, keys: int, device=None, half: bool = False) -> int:  # noqa: ANN001
    """Bytes a segment's pass of ``queries`` positions over ``keys`` keys (the memory and the segment) holds for its
    attention, beside the weights and the cache: its [T, K] mask while it is built, and where no native kernel reads
    the scores in blocks (a GPU, ``half`` precision, the kernels off, attn_type other than 0) the mask's -inf bias and
    every row's fp32 scores and probabilities of a layer [H, T, K]. Measured on the CPU at H = 2, one row: ~2 and ~13
    bytes an entry of [T, K]; these are 3 and 21."""
    import torch

    from txl.kernels.registry import may_run

    blocked = (device is None or torch.device(device).type == "cpu") and config.attn_type == 0 and not half
    blocked = blocked and may_run("native_attention")
    return queries * keys * (3 if blocked else 1 + 4 + rows * 2 * config.n_head * 4)


def _check_generate_memory(
    config, mem_len: int, rows: int, prompt_len: int, new: int, zero_memory: bool, device=None,
    same_length: bool | None = None,
) -> None:  # fmt: skip
    """``txl generate``'s memory estimate, checked against the free memory before anything is allocated: the K/V cache
    of every layer for ``rows`` sequences (what the memory can come to hold, the prompt and the ``new`` tokens or a
    ``zero_memory`` of mem_len positions, at most mem_len, and the prompt, twice over as the cache keeps them), plus
    the larger of the prompt's pass (:func:`attention_pass_bytes`; a long prompt is read in pieces,
    :func:`txl.infer.prompt.read_prompt`: its last piece's) and a step's [rows, vocabulary] log-probabilities (a beam
    search's). ``same_length``: how the model reads (the resolved reading's; None: the config's)."""
    from txl.infer.prompt import last_piece
    from txl.kernels.runtime import check_fits
    from txl.model.cache import KVCache

    positions = KVCache.capacity_for(mem_len, prompt_len, None if zero_memory else prompt_len + new)
    cache = 2 * config.n_layer * rows * positions * config.n_head * config.d_head * 4
    cache *= 2 if rows > 1 else 1  # (a beam search's step reads the beams it reorders out first: up to its window)
    same_length = config.same_length if same_length is None else same_length
    queries, keys = last_piece(prompt_len, mem_len if zero_memory else 0, mem_len, same_length)
    prompt_pass = attention_pass_bytes(config, 1, queries, keys, device)
    steps = 4 * rows * config.n_token * 4  # log-probabilities, renormalised, summed with the beams' scores, a copy
    check_fits(
        cache + max(prompt_pass, steps),
        f"txl generate ({prompt_len:,} prompt tokens, mem_len {mem_len:,}, {rows:,} beam(s))",
        "give a shorter prompt, a smaller --mem_len or fewer --num_beams",
    )


def _utf8_text(raw: bytes | str, where: str) -> str:
    """Text given to a command (standard input's bytes, or an argument, whose undecodable bytes Python keeps as
    surrogates), or one line saying where it is not UTF-8."""
    try:
        data = raw if isinstance(raw, bytes) else raw.encode("utf-8", errors="surrogateescape")
        return data.decode("utf-8")
    except (UnicodeDecodeError, UnicodeEncodeError) as e:
        bad = e.object[e.start] if isinstance(e, UnicodeDecodeError) else None
        what = f"byte 0x{bad:02x} at offset {e.start}" if bad is not None else f"character {e.start}"
        raise ValueError(f"{where}: not UTF-8 text ({what}); give text, e.g. a .txt file's content") from None


def _reading_dict(s) -> dict:
    return {"mem_len": s.mem_len, "clamp_len": s.clamp_len, "same_length": s.same_length}


@contextmanager
def logged_after() -> Iterator[None]:
    """Hold the lines the ``txl`` logger writes (a fast path's first-use measurement, a decline) while a text is
    printed token by token, and write them after it: on a terminal they would otherwise cut the text in two
    (round 6: ``make demo``'s sample)."""
    logger, held = logging.getLogger("txl"), []

    class _Hold(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            held.append(record)

    hold, propagate = _Hold(), logger.propagate
    logger.addHandler(hold)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(hold)
        logger.propagate = propagate
        for record in held:
            logger.handle(record)
