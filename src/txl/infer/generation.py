"""Sampling from a Transformer-XL LM with a K/V-cached memory: the prompt once, then one token per step.
Design notes: docs/internals.md#txlinfergeneration."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from txl.infer import static_decode
from txl.infer.beams import BeamBook, padded
from txl.infer.prompt import read_prompt
from txl.kernels.runtime import fp32_route
from txl.model.cache import no_kv_cache_reason
from txl.model.config import Reading
from txl.model.modeling import KVCache, NonFiniteError, TransformerXLLM, supports_kv_cache, transposed_weights


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


BAN = -100.0
"""A ``logit_bias`` of this or less bans its token (OpenAI's -100 "should result in a ban"): its score becomes -inf."""


@dataclass(frozen=True)
class Penalties:
    """What the history of a sequence does to its next token's scores (log-probabilities), before temperature and
    filtering. ``repetition_penalty`` and ``no_repeat_ngram_size`` are Hugging Face's (CTRL's penalty on every token
    of the prompt and the text so far: a score s < 0 becomes s * penalty, s > 0 s / penalty; no n-gram of the whole
    sequence twice; no end of text before ``min_new_tokens``); ``presence_penalty``, ``frequency_penalty`` and
    ``logit_bias`` are OpenAI's (subtracted once for a token the new text holds, and once per time it holds it; added
    per token id)."""

    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_new_tokens: int = 0
    """Hugging Face's: the ``eos_token_ids`` cannot come before this many new tokens."""
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty = {self.repetition_penalty}: must be > 0 (1 is none)")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens = {self.min_new_tokens}: must be >= 0")
        if self.no_repeat_ngram_size < 0:
            raise ValueError(f"no_repeat_ngram_size = {self.no_repeat_ngram_size}: must be >= 0 (0 is none)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} = {getattr(self, name)}: must be a finite number")

    @functools.cached_property
    def any(self) -> bool:
        """Whether these change anything (checked once per generated token: the history is kept only then; eos ids
        alone, as ``generate`` always passes them, change nothing)."""
        return bool(
            self.repetition_penalty != 1.0 or self.no_repeat_ngram_size or self.presence_penalty
            or self.frequency_penalty or self.logit_bias or self.min_new_tokens and self.eos_token_ids
        )  # fmt: skip

    def apply(self, scores: Tensor, history: Tensor, new_from: int, padding: Tensor | None = None) -> Tensor:
        """``scores`` [B, V] of the token after ``history`` [B, L] (the prompt and the text so far; the new text
        starts at column ``new_from``; ``padding`` [B, new_from], True = a prompt's left padding, not part of it)."""
        B, V = scores.shape
        real = torch.ones_like(history, dtype=torch.bool)  # [B, L]: the positions that are part of the sequence
        if padding is not None:
            real[:, : padding.shape[1]] = ~padding
        if self.repetition_penalty != 1.0:
            held = torch.zeros(B, V, device=scores.device).scatter_add_(1, history, real.float()) > 0  # [B, V]
            p = self.repetition_penalty
            scores = torch.where(held, torch.where(scores < 0, scores * p, scores / p), scores)
        n = self.no_repeat_ngram_size
        if n and history.shape[1] >= n:  # (a shorter history holds no n-gram to repeat)
            grams = history.unfold(1, n, 1)  # [B, W, n]: every n-gram of the sequence
            tail = history[:, history.shape[1] - n + 1 :]  # [B, n - 1]: the n - 1 tokens a new one would follow
            repeat = (grams[:, :, :-1] == tail[:, None, :]).all(-1)  # [B, W]
            repeat &= real.unfold(1, n, 1).all(-1) & real[:, history.shape[1] - n + 1 :].all(-1, keepdim=True)
            banned = torch.zeros(B, V, device=scores.device).scatter_add_(1, grams[:, :, -1], repeat.float())
            scores = scores.masked_fill(banned > 0, float("-inf"))
        if self.presence_penalty or self.frequency_penalty:
            new = history[:, new_from:]
            ones = torch.ones_like(new, dtype=scores.dtype)
            counts = torch.zeros(B, V, device=scores.device, dtype=scores.dtype).scatter_add_(1, new, ones)
            scores = scores - self.frequency_penalty * counts - self.presence_penalty * (counts > 0)
        if self.min_new_tokens and self.eos_token_ids and history.shape[1] - new_from < self.min_new_tokens:
            scores = scores.index_fill(1, torch.tensor(self.eos_token_ids, device=scores.device), float("-inf"))
        if self.logit_bias:
            ids = torch.tensor([i for i, _ in self.logit_bias], device=scores.device)
            bias = torch.tensor([b for _, b in self.logit_bias], device=scores.device, dtype=scores.dtype)
            bias = bias.masked_fill(bias <= BAN, float("-inf"))  # (-100: the token is banned, as OpenAI's is)
            scores = scores.index_add(1, ids, bias.expand(B, -1))
        return scores


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


class NoTokenLeftError(ValueError):
    """The penalties (``no_repeat_ngram_size``, ``logit_bias``, ...) rule out every token of a row: greedy search,
    sampling and beam search all refuse to go on (the server answers 400)."""


def check_left(scores: Tensor, n: int) -> None:
    """Raise :class:`NoTokenLeftError` where a row of ``scores`` [R, V] (after the penalties) has no finite entry
    for new token ``n``."""
    if not bool((scores > float("-inf")).any(-1).all()):
        raise NoTokenLeftError(
            f"no token is left for new token {n}: the penalties (no_repeat_ngram_size, logit_bias) or the grammar rule "
            "out every one; ask for fewer tokens or relax them"
        )


def choose(
    log_probs: Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None
) -> Tensor:
    """The next token [B] from log-probabilities [B, V]: the arg max at temperature 0, else a sample."""
    if temperature == 0:
        return log_probs.argmax(-1)
    # the best stays 0 at any temperature; one outside the dtype's normal numbers would be 0 or inf in it (0 / 0,
    # -inf / inf: NaN), so it is clamped into them
    finfo = torch.finfo(log_probs.dtype)
    temperature = min(max(temperature, finfo.tiny), finfo.max)
    scaled = (log_probs - log_probs.amax(-1, keepdim=True)) / temperature
    probs = filter_logits(scaled, top_k, top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def _new_cache(
    model: TransformerXLLM, input_ids: Tensor, mems: list[Tensor] | None, reading: Reading, max_new_tokens: int
) -> KVCache:
    """A K/V cache for ``input_ids`` [B, T] and ``max_new_tokens`` after them (a short generation: a small buffer),
    holding ``mems`` where they are given."""
    B, T = input_ids.shape
    written = (mems[0].shape[1] if mems else 0) + T + max_new_tokens
    dtype = next(model.parameters()).dtype
    cache = KVCache(model.config, B, reading.mem_len, T, positions=written, device=input_ids.device, dtype=dtype)
    if mems:
        model.transformer.fill_cache(cache, mems, reading.mem_len)
    return cache


def _reading(model: TransformerXLLM, reading: Reading | None, mem_len: int | None) -> Reading:
    reading = Reading.of(reading, model.config, mem_len=mem_len)
    if reading.mem_len <= 0:
        raise ValueError("generation carries memory between steps: set mem_len > 0")
    return reading


def _stepper(
    model: TransformerXLLM, input_ids: Tensor, padding: Tensor | None, mems: list[Tensor] | None, reading: Reading,
    max_new_tokens: int,
) -> tuple[Callable[..., Tensor], KVCache | None]:  # fmt: skip
    """The step of :func:`stream` (ids [B, n] and their padding -> the last position's hidden state [B, D]) and the
    K/V cache it reads through (None for attn_type 2, 3: absolute positions move with the window, so the memory is
    recomputed each step)."""
    if supports_kv_cache(model.config):
        cache = _new_cache(model, input_ids, mems, reading, max_new_tokens)

        def cached(ids: Tensor, pad: Tensor | None = None) -> Tensor:  # (a long prompt in pieces; a token in one)
            with contextlib.nullcontext() if ids.shape[1] > 1 else fp32_route(False):  # (3x slower routed)
                return read_prompt(model, ids, cache, reading, pad)[:, -1]

        return cached, cache
    if padding is not None:
        raise ValueError(
            f"padding needs a K/V cache, and {no_kv_cache_reason(model.config)}: give prompts of one length"
        )
    memory = [mems]

    def recomputed(ids: Tensor, pad: Tensor | None = None) -> Tensor:
        out = model.transformer(ids, memory[0], reading=reading)
        memory[0] = out.mems
        return out.last_hidden_state[:, -1]

    return recomputed, None


@torch.no_grad()
def stream(
    model: TransformerXLLM, input_ids: Tensor, max_new_tokens: int, *, temperature: float = 1.0, top_k: int = 0,
    top_p: float = 1.0, mem_len: int | None = None, generator: torch.Generator | None = None,
    padding: Tensor | None = None, stop_tokens: Sequence[int] = (), pad_id: int | None = None,
    mems: list[Tensor] | None = None, observe: Callable[[Tensor, Tensor], None] | None = None,
    penalties: Penalties | None = None, reading: Reading | None = None, allowed: Callable[[], Tensor] | None = None,
) -> Iterator[Tensor]:  # fmt: skip
    """Yield up to ``max_new_tokens`` tokens [B, 1] continuing ``input_ids`` [B, T], each as soon as it is chosen.

    ``temperature == 0`` is greedy. ``padding`` [B, T] (True = padding) lets prompts of different lengths share
    the batch: pad them on the left. A row that produced one of ``stop_tokens`` is finished: from then on it yields
    ``pad_id`` (default: the first stop token), and the iteration ends when every row is finished. ``mems``: the
    memory the prompt starts from (``n_layer`` tensors [B, M, d_model]; default: empty, as the model's forward),
    e.g. ``[torch.zeros(B, mem_len, d_model)] * n_layer`` for Hugging Face's and the TF code's zero memory.
    ``observe(log_probs [B, V], tokens [B])`` is called with each step's log-probabilities (the model's, before
    temperature and filtering) and chosen tokens, before they are yielded. ``penalties`` (:class:`Penalties`) change
    the scores by what each row holds so far (its prompt, padding included, and its new tokens). ``reading``
    (:class:`~txl.model.config.Reading`): how the model reads, its same_length and clamp_len (and mem_len, which the
    argument overrides); None: the model's config. ``allowed()`` [B, V] (bool), called before each choice: only the
    tokens it allows can be chosen (a grammar, e.g. REMI's in :mod:`txl.infer.music`, which follows the chosen
    tokens through ``observe``).
    """
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError("input_ids must be a non-empty [batch, seq_len] tensor")
    reading = _reading(model, reading, mem_len)
    if padding is not None and (padding.shape != input_ids.shape or bool(padding[:, -1].any())):
        raise ValueError("padding must be [batch, seq_len], True on the left of each prompt (its last token is real)")
    was_training = model.training
    model.eval()
    try:
        B, T = input_ids.shape
        step, cache = _stepper(model, input_ids, padding, mems, reading, max_new_tokens)
        with transposed_weights():  # (the weights are fixed while generating)
            h = step(input_ids, padding)
            decoder = None  # the later steps as one CUDA graph, where it applies
            if static_decode.applies(model, h.device, max_new_tokens):  # (attn_type 0: the K/V cache above)
                graph = h.device.type == "cuda"
                decoder = static_decode.StaticDecoder(model, cache, reading.mem_len, graph=graph, reading=reading)
                cache = None  # (the decoder's ring holds the memory now: the cache's buffers can go)
            stops = torch.tensor(list(stop_tokens), dtype=torch.long, device=input_ids.device)
            pad_id = int(stops[0]) if pad_id is None and len(stops) else pad_id
            done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
            history = input_ids if penalties is not None and penalties.any else None  # [B, T + new]
            for i in range(max_new_tokens):
                if i == 0 or decoder is None:
                    _, log_probs = model.crit(h, return_log_probs=True)  # [B, V]
                if not bool(torch.isfinite(log_probs).all()):
                    raise NonFiniteError(f"the model gave non-finite log-probabilities for new token {i + 1}")
                scores = log_probs if history is None else penalties.apply(log_probs, history, T, padding)
                if allowed is not None:
                    scores = scores.masked_fill(~allowed(), float("-inf"))
                if history is not None or allowed is not None:
                    check_left(scores, i + 1)
                nxt = choose(scores, temperature, top_k, top_p, generator)  # [B]
                if len(stops):
                    nxt = nxt.masked_fill(done, pad_id)
                    done |= torch.isin(nxt, stops)
                if observe is not None:
                    observe(log_probs, nxt)
                yield nxt[:, None]
                if len(stops) and bool(done.all()) or i == max_new_tokens - 1:
                    return
                if history is not None:
                    history = torch.cat([history, nxt[:, None]], dim=1)  # [B, T + i + 1]
                if decoder is None:
                    h = step(nxt[:, None])
                else:
                    log_probs = decoder(nxt)
    finally:
        model.train(was_training)  # (a model sampled from during training goes on training with its dropout)


def beam_search(model: TransformerXLLM, input_ids: Tensor, max_new_tokens: int, **kwargs: Any) -> Tensor:
    """Beam search as Hugging Face's ``generate(num_beams=...)`` does it, on the K/V cache (reordered with the beams).

    Each step extends every one of the ``num_beams`` sequences of a prompt by every token, scored by the sum of
    their log-probabilities (after ``penalties``), and keeps the best ``num_beams`` that do not end with an
    ``eos_token_ids`` token; one that does (among the best ``num_beams``) is a finished hypothesis, scored by its sum
    over its new length (``eos`` included) to the power ``length_penalty``. A prompt is done when ``num_beams``
    hypotheses are finished and (``early_stopping=False``) none of its running sequences can beat the worst of them.
    Returns the best ``num_return_sequences`` hypotheses per prompt [B * n, T + new], the shorter ones followed by an
    eos and then ``pad_id``. The keyword arguments are :func:`beam_steps`'.
    """
    steps = beam_steps(model, input_ids, max_new_tokens, **kwargs)
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value


@torch.no_grad()  # (on a generator: gradients off while it runs, the caller's own setting between its steps)
def beam_steps(
    model: TransformerXLLM, input_ids: Tensor, max_new_tokens: int, *, num_beams: int, length_penalty: float = 1.0,
    early_stopping: bool = False, num_return_sequences: int = 1, eos_token_ids: Sequence[int] = (),
    pad_id: int | None = None, mem_len: int | None = None, padding: Tensor | None = None,
    mems: list[Tensor] | None = None, penalties: Penalties | None = None, reading: Reading | None = None,
) -> Generator[None, None, Tensor]:  # fmt: skip
    """:func:`beam_search` one model call at a time: the generator yields after each call (the prompt's, then one per
    new token) and returns the result (``StopIteration.value``), so a caller can run other work between two steps
    or stop the search (``close()``). Arguments and result as :func:`beam_search`'s. Until it ends or is closed the
    model stays in eval mode and a :func:`~txl.model.modeling.transposed_weights` scope stays open: do not train the
    model between two steps."""
    if num_beams < 2 or not 1 <= num_return_sequences <= num_beams:
        raise ValueError(f"beam search needs num_beams >= 2 and 1 <= num_return_sequences <= num_beams ({num_beams})")
    if not supports_kv_cache(model.config):
        raise ValueError(f"beam search reorders a K/V cache, and {no_kv_cache_reason(model.config)}")
    check_sampling(max_new_tokens)
    B, T = input_ids.shape
    K, dev = num_beams, input_ids.device
    reading = _reading(model, reading, mem_len)
    eos = [int(e) for e in eos_token_ids]
    fill = pad_id if pad_id is not None else (eos[0] if eos else 0)  # (after a hypothesis, and in done rows)
    if max_new_tokens == 0:  # (nothing to search: every hypothesis is the prompt)
        return input_ids.repeat_interleave(num_return_sequences, 0)
    penalties = penalties or Penalties()
    seq = input_ids.repeat_interleave(K, 0)  # [B * K, T + new]
    pad = None if padding is None else padding.repeat_interleave(K, 0)
    was_training = model.training
    model.eval()
    try:
        cache = _new_cache(model, input_ids, mems, reading, max_new_tokens)
        with transposed_weights():
            # The prompt's one pass, once per prompt: its K beams start from copies of its keys, values and state.
            h = read_prompt(model, input_ids, cache, reading, padding)[:, -1]  # [B, D]
            cache.select([b for b in range(B) for _ in range(K)])  # [B * K] rows, beam k of prompt b at b * K + k
            h = h.repeat_interleave(K, 0)  # [B * K, D]
            yield
            beam_scores = torch.zeros(B, K, device=dev)
            beam_scores[:, 1:] = -1e9  # (the K copies of a prompt: only the first one's continuations at first)
            beam_scores = beam_scores.view(-1)  # [B * K]
            book = BeamBook(B, K, eos, fill, length_penalty, early_stopping)

            for step in range(max_new_tokens):
                _, log_probs = model.crit(h, return_log_probs=True)  # [B * K, V]
                if not bool(torch.isfinite(log_probs).all()):
                    raise NonFiniteError(f"the model gave non-finite log-probabilities for new token {step + 1}")
                scores = F.log_softmax(log_probs.float(), dim=-1)  # (renormalised, as HF does with its logits)
                if penalties.any:
                    scores = penalties.apply(scores, seq, T, pad)
                V = scores.shape[-1]
                total = (scores + beam_scores[:, None]).view(B, K * V)
                live = torch.tensor([not d for d in book.done], device=dev)  # (a finished prompt's rows run on, unused)
                check_left(total[live], step + 1)  # (every beam of a prompt banned: the same rule as sampling)
                top_scores, top = total.topk(max(2, 1 + len(eos)) * K, dim=1)  # [B, 2K or more], best first
                new_len = seq.shape[1] + 1 - T
                rows, tokens, next_scores = book.step(
                    top.tolist(), top_scores.tolist(), V, new_len, lambda r, seq=seq: seq[r].clone()
                )
                index = torch.tensor(rows, device=dev)
                seq = torch.cat([seq[index], torch.tensor(tokens, device=dev)[:, None]], dim=1)
                beam_scores = torch.tensor(next_scores, device=dev)
                if all(book.done) or step == max_new_tokens - 1:
                    break
                cache.select(rows)
                with fp32_route(False):  # (products of a few rows: 3x slower routed)
                    out = model.transformer(seq[:, -1:], cache=cache, reading=reading)
                    h = out.last_hidden_state[:, -1]
                yield
    finally:
        model.train(was_training)
    best = book.best(lambda r: seq[r], beam_scores.tolist(), seq.shape[1] - T, num_return_sequences)
    rows = padded([hyp.tolist() for hyp in best], fill, eos, T + max_new_tokens)
    return torch.tensor(rows, dtype=torch.long, device=dev)


def generate(model: TransformerXLLM, input_ids: Tensor, max_new_tokens: int, **kwargs) -> Tensor:
    """``input_ids`` [B, T] followed by the new tokens (see :func:`stream` for the options)."""
    return torch.cat([input_ids, *stream(model, input_ids, max_new_tokens, **kwargs)], dim=1)


def _new_tokens(prompt_len: int, max_new_tokens: int | None, max_length: int | None) -> int:
    """Hugging Face's length arguments as new tokens: ``max_new_tokens``, or ``max_length`` counting the prompt (20
    when neither is given)."""
    if max_new_tokens is not None:
        if max_length is not None:
            raise ValueError("give max_new_tokens or max_length (which counts the prompt), not both")
        return max_new_tokens
    max_length = 20 if max_length is None else max_length
    if max_length <= prompt_len:
        raise ValueError(
            f"max_length = {max_length} counts the prompt of {prompt_len} tokens: nothing to generate; "
            "give max_new_tokens (new tokens only) or a larger max_length"
        )
    return max_length - prompt_len


def _hf_padding(attention_mask: Tensor | None, input_ids: Tensor) -> Tensor | None:
    """Hugging Face's ``attention_mask`` [B, T] (1 = token, 0 = left padding) as txl's padding (True = padding;
    None where there is none)."""
    if attention_mask is None:
        return None
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids {tuple(input_ids.shape)}")
    padding = attention_mask.to(input_ids.device) == 0
    if not bool(padding.any()):
        return None
    if bool(padding[:, -1].any()):
        raise ValueError("attention_mask has padding at the end of a prompt: pad prompts on the left")
    return padding


def generate_like_hf(
    model: TransformerXLLM, input_ids: Tensor, max_new_tokens: int | None = None, *, max_length: int | None = None,
    do_sample: bool = False, temperature: float = 1.0, top_k: int = 50, top_p: float = 1.0,
    attention_mask: Tensor | None = None, eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None, mem_len: int | None = None, generator: torch.Generator | None = None,
    mems: list[Tensor] | None = None, num_return_sequences: int = 1, repetition_penalty: float = 1.0,
    no_repeat_ngram_size: int = 0, min_new_tokens: int | None = None, min_length: int | None = None, num_beams: int = 1,
    length_penalty: float = 1.0, early_stopping: bool = False, **hf_options: Any,
) -> Tensor:  # fmt: skip
    """``model.generate`` with Hugging Face's arguments and defaults, on the K/V-cached :func:`stream`.

    Greedy unless ``do_sample`` (then ``temperature``, ``top_k`` = 50 and ``top_p`` as HF's defaults);
    ``max_new_tokens``, or ``max_length`` counting the prompt (20 when neither is given, as HF);
    ``attention_mask`` [B, T] (1 = token, 0 = left padding); ``eos_token_id`` (one id or several) ends a row,
    which is then filled with ``pad_token_id`` (default: the first eos id); ``mems``: the starting memory (see
    :func:`stream`; HF 4.46 started from ``mem_len`` zero vectors); ``num_return_sequences`` samples per prompt
    (with ``do_sample``; rows grouped by prompt); ``repetition_penalty``, ``no_repeat_ngram_size``,
    ``min_new_tokens`` and ``min_length`` (counting the prompt) as HF's (:class:`Penalties`); ``num_beams`` > 1 is
    HF's beam search (:func:`beam_search`, with ``length_penalty`` and ``early_stopping``; ``num_return_sequences``
    of its best hypotheses). HF's options that change nothing here (``use_cache``, ...) are accepted at their
    neutral value; the others are refused by name. Returns [B * num_return_sequences, T + new tokens].
    """
    _check_hf_options(hf_options)
    beams = num_beams > 1
    if beams and do_sample:
        raise ValueError("num_beams > 1 with do_sample=True (beam sampling) is not implemented: give one of them")
    if num_beams < 1 or beams and num_return_sequences > num_beams:
        raise ValueError(f"num_beams = {num_beams}: must be >= 1 and >= num_return_sequences ({num_return_sequences})")
    if num_return_sequences < 1 or num_return_sequences > 1 and not (do_sample or beams):
        raise ValueError(
            f"num_return_sequences = {num_return_sequences}: must be 1 for greedy decoding (its sequences would be "
            "the same), or >= 1 with do_sample=True"
        )
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    max_new_tokens = _new_tokens(input_ids.shape[-1], max_new_tokens, max_length)
    padding = _hf_padding(attention_mask, input_ids)
    stops = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if min_new_tokens is not None and min_length is not None:
        raise ValueError("give min_new_tokens or min_length (which counts the prompt), not both")
    least = min_new_tokens if min_new_tokens is not None else max(0, (min_length or 0) - input_ids.shape[-1])
    penalties = Penalties(
        repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size, min_new_tokens=least,
        eos_token_ids=tuple(stops),
    )  # fmt: skip
    if beams:
        return beam_search(
            model, input_ids, max_new_tokens, num_beams=num_beams, length_penalty=length_penalty,
            early_stopping=early_stopping, num_return_sequences=num_return_sequences, eos_token_ids=stops,
            pad_id=pad_token_id, mem_len=mem_len, padding=padding, mems=mems, penalties=penalties,
        )  # fmt: skip
    if num_return_sequences > 1:  # each prompt's row repeated, as HF does
        input_ids = input_ids.repeat_interleave(num_return_sequences, 0)
        padding = None if padding is None else padding.repeat_interleave(num_return_sequences, 0)
        mems = None if mems is None else [m.repeat_interleave(num_return_sequences, 0) for m in mems]
    return generate(
        model, input_ids, max_new_tokens, temperature=temperature if do_sample else 0.0,
        top_k=top_k if do_sample else 0, top_p=top_p if do_sample else 1.0, mem_len=mem_len, generator=generator,
        padding=padding, stop_tokens=stops, pad_id=pad_token_id, mems=mems, penalties=penalties,
    )  # fmt: skip


# Hugging Face generate() options: their values that change nothing here, and why the others are not honoured.
_HF_NEUTRAL = {
    "use_cache": True, "num_beam_groups": 1, "return_dict_in_generate": False,
    "output_scores": False, "output_logits": False, "output_attentions": False, "output_hidden_states": False,
    "diversity_penalty": 0.0, "typical_p": 1.0,
    "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "penalty_alpha": None, "bad_words_ids": None, "force_words_ids": None,
    "streamer": None, "generation_config": None, "constraints": None,
}  # fmt: skip
_HF_WHY = {
    "num_beam_groups": "group (diverse) beam search is not implemented; num_beams alone is beam search",
    "streamer": "txl.infer.generation.stream(model, ...) yields each token as it is chosen",
    "return_dict_in_generate": "generate returns the ids; txl.infer.generation.stream(..., observe=) sees the scores",
}


def _check_hf_options(options: dict[str, Any]) -> None:
    unknown = sorted(set(options) - set(_HF_NEUTRAL))
    if unknown:
        raise TypeError(f"generate() got unexpected keyword argument(s): {', '.join(unknown)}")
    for name, value in options.items():
        if value != _HF_NEUTRAL[name]:
            why = _HF_WHY.get(name, f"not supported by txl (only {_HF_NEUTRAL[name]!r}, Hugging Face's default)")
            raise ValueError(f"{name} = {value!r}: {why}")
