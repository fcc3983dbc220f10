"""What the serving engine runs (txl.serve.engine): a generation request and its scores, the jobs, the errors, and
the engine's own records of a batch and of a parked generation."""

from __future__ import annotations

import threading
import time
from array import array
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from txl.infer.generation import Penalties, check_sampling
from txl.model.modeling import KVCache

TokenScore = tuple[float, list[tuple[int, float]]]
"""A token's log-probability and the most likely tokens at its place, as (id, log-probability), best first."""


class TokenScores:
    """Scores of a sequence of tokens, read as a list of :data:`TokenScore` (``len``, index, slice, iteration) and
    stored as flat float32 / int32 arrays: a 4,096-token prompt with 20 alternatives each holds ~0.7 MB, not the
    ~9 MB of Python tuples. The values are the float32 log-probabilities exactly. Written by the engine's thread and
    read by the request's while it grows: an entry's alternatives are stored before its own score, whose count is
    the length, so a reader never sees a part of an entry."""

    def __init__(self) -> None:
        self._chosen, self._ids, self._values = array("f"), array("i"), array("f")
        self._k: int | None = None  # alternatives per entry (one request's ``logprobs``: the same for every entry)

    def extend(self, log_probs: torch.Tensor, tokens: torch.Tensor, top_n: int) -> None:
        """Add the log-probability of each token [N] under ``log_probs`` [N, V], with its ``top_n`` most likely
        tokens."""
        log_probs = log_probs.float()
        k = min(top_n, log_probs.shape[-1])
        if self._k is None:
            self._k = k
        elif k != self._k:
            raise ValueError(f"{k} alternatives per token where the earlier entries have {self._k}")
        chosen = log_probs.gather(-1, tokens[:, None].to(log_probs.device))[:, 0]  # [N]
        if k:
            values, ids = log_probs.topk(k, dim=-1)  # [N, k]
            self._ids.extend(ids.flatten().tolist())
            self._values.extend(values.flatten().tolist())
        self._chosen.extend(chosen.tolist())  # (last: the entries are complete once counted)

    def __len__(self) -> int:
        return len(self._chosen)

    def _entry(self, n: int) -> TokenScore:
        k = self._k or 0
        ids, values = self._ids[n * k : (n + 1) * k], self._values[n * k : (n + 1) * k]
        return self._chosen[n], list(zip(ids, values, strict=True))

    def __getitem__(self, index: int | slice) -> TokenScore | list[TokenScore]:
        if isinstance(index, slice):
            return [self._entry(n) for n in range(*index.indices(len(self)))]
        n = index + len(self) if index < 0 else index
        if not 0 <= n < len(self):
            raise IndexError(f"token score {index} of {len(self)}")
        return self._entry(n)

    def __iter__(self) -> Iterator[TokenScore]:
        return iter(self[: len(self)])

    def __add__(self, other: Sequence[TokenScore]) -> list[TokenScore]:
        return list(self) + list(other)


MAX_LOGPROBS = 20
"""The most alternatives a request can ask for per token."""

PARKED_POLL = 0.02
"""Seconds between two looks at the parked generations when nothing else runs."""

FAIR_WAIT = 0.5
"""Seconds a waiting request waits for a row that a generation whose caller is not taking its tokens holds (one
parked beyond ``max_parked``): then that generation ends (the oldest parked first, an error saying why), and the row
is the request's. So a request waits at most about ceil(max_queue / max_batch) x FAIR_WAIT for its row however many
callers stop reading (4 s at txl serve's defaults), and the memory held stays within max_batch + max_parked rows
(round 6, sv2/sv20: two slow readers of n=8 streams held every row for as long as they read)."""


class QueueFull(RuntimeError):
    """The engine's waiting queue is full: try again later."""


class EngineStopped(RuntimeError):
    """The engine is shutting down (or has failed): it takes no more work."""


class RequestError(ValueError):
    """What ends one request (and only it) with an error: ``status`` 400 when the request asked for something that
    cannot be done (every token ruled out by its penalties), 500 when the model failed it (non-finite scores)."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


@dataclass
class Generation:
    """One generation request. ``emit(token_id)`` is called for each new token and ``emit(None)`` once at the end
    (``finish_reason`` is then set), from the engine's thread; ``cancel()`` may be called from any thread."""

    prompt_ids: list[int]
    max_new_tokens: int
    emit: Callable[[int | None], None]
    mem_len: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: int | None = None
    """Record each new token's log-probability and its ``logprobs`` most likely alternatives in ``scores``."""
    prompt_logprobs: bool = False
    """Record the log-probability of each prompt token after the first in ``prompt_scores``."""
    penalties: Penalties = field(default_factory=Penalties)
    """What the prompt and the text so far do to the next token's scores (repetition, presence, logit bias)."""
    num_beams: int = 1
    """Beam search with this many beams (greedy, ``temperature`` 0, only); 1: one token at a time."""
    length_penalty: float = 1.0
    """Beam search: a finished text's score is its log-probability over its length to this power."""
    finish_reason: str | None = None
    """length (max_new_tokens reached), stop (cancelled by the caller, e.g. a stop string), shutdown or error."""
    error: str | None = None
    error_status: int = 500
    """With finish_reason error: 400 if the request asked for what cannot be done, 500 if the server failed it."""
    _cancelled: threading.Event = field(default_factory=threading.Event)
    generator: torch.Generator = field(init=False)
    produced: int = 0
    read: int = 0
    """Tokens the caller has taken so far (``took()``, from its own thread): a request with ``Engine.max_unread``
    tokens not taken waits, its row given to others, until the caller takes half of them."""
    output_ids: list[int] = field(default_factory=list)
    """The tokens emitted so far."""
    scores: TokenScores = field(default_factory=TokenScores)
    """One per new token, written before the token is emitted (with ``logprobs``)."""
    prompt_scores: TokenScores = field(default_factory=TokenScores)
    """One per prompt token after the first, written before the first token is emitted (``prompt_logprobs``)."""
    queued_at: float = 0.0
    """When the engine queued it (time.monotonic())."""
    group: object | None = None
    """The caller's request it belongs to (an HTTP request's n choices share one): rows are given to the waiting
    generations whose groups hold the fewest rows first, then in arrival order (None: a group of its own)."""

    def __post_init__(self) -> None:
        check_sampling(self.max_new_tokens, self.temperature, self.top_k, self.top_p)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs = {self.logprobs}: must be in [0, {MAX_LOGPROBS}]")
        if self.num_beams < 1:
            raise ValueError(f"num_beams = {self.num_beams}: must be >= 1")
        if self.num_beams > 1 and self.temperature != 0:
            raise ValueError("num_beams > 1 searches for the likeliest text: give temperature 0 (no sampling)")
        if self.num_beams > 1 and (self.logprobs is not None or self.prompt_logprobs):
            raise ValueError("num_beams > 1 gives no log-probabilities: ask for them without beam search")
        self.place(torch.device("cpu"))

    def place(self, device: torch.device) -> None:
        """Sample on ``device`` (the model's): a new generator there, seeded with ``seed`` (random without)."""
        self.generator = torch.Generator(device=device)
        if self.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(self.seed)

    def cancel(self) -> None:
        self._cancelled.set()

    def took(self, n: int = 1) -> None:
        """The caller has taken ``n`` more tokens (from whatever thread reads them: the only one that writes this)."""
        self.read += n

    @property
    def unread(self) -> int:
        return self.produced - self.read

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


@dataclass
class _Batch:
    cache: KVCache
    rows: list[Generation]
    last: torch.Tensor  # [B] the last token of every row


@dataclass
class _Parked:
    """A generation waiting for its caller to take its tokens: its own memory (one row) and its last token."""

    request: Generation
    cache: KVCache
    last: int
    since: float = field(default_factory=time.monotonic)


@dataclass
class _Job:
    """Work other than a generation, on the engine's thread: ``fn()`` run whole between two decoding steps, or (with
    ``stepped``) ``fn()`` making a generator that is advanced one step per engine loop and returns the result."""

    fn: Callable[[], Any]
    future: Future
    stepped: bool
    steps: Generator[None, None, Any] | None = None
    cancelled: threading.Event | None = None
    """Set by the caller (e.g. its client left): a stepped job stops at its next step (EngineStopped)."""
    queued_at: float = 0.0
