"""The engine behind ``txl serve``: one thread owns the model and runs every model call, so none run concurrently.

Generation requests are batched step by step (continuous batching): a new request's prompt is run alone into its
own :class:`~txl.modeling.KVCache`, then the cache joins the running batch (:meth:`KVCache.merge`, each row's memory
right-aligned, so each row computes what it would alone); every decoding step runs one token for every row at
once; a finished or cancelled request leaves between two steps (:meth:`KVCache.select`). Requests with different
memory lengths run in separate batches, taken in turn. Each request samples with its own random generator, so a
seed gives the same tokens whatever else is running. Other work (scoring a text) is a job run between two steps.
Models whose keys cannot be cached (absolute positions, attn_type 2 and 3) generate one request at a time.
A beam search (``num_beams`` > 1, :func:`txl.generation.beam_steps`) is a batch of its own, one step of it beside
each decoding step of the others (the running searches' beams at most ``max_batch`` rows in all); when it ends it
emits its best text token by token, and a cancelled one stops at its next step.
A request can ask for the log-probabilities of its tokens (the model's, before temperature and filtering): of each
new token with its most likely alternatives (``logprobs``), and of each prompt token given the ones before it
(``prompt_logprobs``, from the prompt's own forward pass).

The engine knows nothing about HTTP: tokens go to a callback, from the engine's thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from txl.generation import Penalties, beam_steps, check_sampling, choose, stream
from txl.modeling import KVCache, TransformerXLLM, supports_kv_cache, transposed_weights
from txl.runtime import fp32_route

TokenScore = tuple[float, list[tuple[int, float]]]
"""A token's log-probability and the most likely tokens at its place, as (id, log-probability), best first."""

MAX_LOGPROBS = 20
"""The most alternatives a request can ask for per token."""


class QueueFull(RuntimeError):
    """The engine's waiting queue is full: try again later."""


class EngineStopped(RuntimeError):
    """The engine is shutting down."""


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
    _cancelled: threading.Event = field(default_factory=threading.Event)
    generator: torch.Generator = field(init=False)
    produced: int = 0
    output_ids: list[int] = field(default_factory=list)
    """The tokens emitted so far."""
    scores: list[TokenScore] = field(default_factory=list)
    """One per new token, written before the token is emitted (with ``logprobs``)."""
    prompt_scores: list[TokenScore] = field(default_factory=list)
    """One per prompt token after the first, written before the first token is emitted (``prompt_logprobs``)."""

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

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


def token_scores(log_probs: torch.Tensor, tokens: torch.Tensor, top_n: int) -> list[TokenScore]:
    """The log-probability of each token [N] under ``log_probs`` [N, V], with the ``top_n`` most likely tokens."""
    log_probs = log_probs.float()
    chosen = log_probs.gather(-1, tokens[:, None].to(log_probs.device))[:, 0].tolist()  # [N]
    if top_n == 0:
        return [(c, []) for c in chosen]
    values, ids = log_probs.topk(min(top_n, log_probs.shape[-1]), dim=-1)  # [N, top_n]
    return [(c, list(zip(i, v, strict=True))) for c, i, v in zip(chosen, ids.tolist(), values.tolist(), strict=True)]


@dataclass
class _Batch:
    cache: KVCache
    rows: list[Generation]
    last: torch.Tensor  # [B] the last token of every row


class Engine:
    """Runs generation requests (batched, up to ``max_batch`` rows per memory length) and jobs on one thread."""

    def __init__(self, model: TransformerXLLM, *, max_batch: int = 8, max_queue: int = 64):
        if max_batch < 1 or max_queue < 0:
            raise ValueError("max_batch must be >= 1 and max_queue >= 0")
        self.model = model.eval()
        self.device = next(model.parameters()).device  # (the requests' tensors and generators go there)
        self.max_batch, self.max_queue = max_batch, max_queue
        self.batched = supports_kv_cache(model.config)
        self._waiting: deque[Generation | tuple[Callable[[], Any], Future]] = deque()
        self._batches: dict[int, _Batch] = {}
        self._searches: list[tuple[Generation, Generator[None, None, torch.Tensor]]] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="txl-engine", daemon=True)
        self._thread.start()

    # -- the caller's side ------------------------------------------------------------------------------------

    @property
    def active(self) -> int:
        """Requests being generated now (a beam search counts once)."""
        return sum(len(b.rows) for b in self._batches.values()) + len(self._searches)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def submit(self, request: Generation) -> None:
        """Queue a generation; raises :class:`QueueFull` when ``max_queue`` requests already wait."""
        self._put(request)

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn()`` on the engine's thread between two decoding steps; its result (or error) in the future."""
        fut: Future = Future()
        self._put((fn, fut))
        return fut

    def _put(self, item) -> None:
        with self._cond:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            if len(self._waiting) >= self.max_queue and (self.active >= self.max_batch or self._waiting):
                raise QueueFull(f"{len(self._waiting)} requests are waiting (the limit is {self.max_queue})")
            self._waiting.append(item)
            self._cond.notify()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Let the running requests finish (at most ``timeout`` seconds), then cancel what is left and stop."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and (self.active or self._waiting) and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._cond:
            for row in [r for b in self._batches.values() for r in b.rows] + [r for r, _ in self._searches]:
                row.cancel()
            self._cond.notify()
        self._thread.join(timeout=max(1.0, deadline - time.monotonic()))

    # -- the engine's thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        with transposed_weights():  # (a served model's weights are fixed)
            self._loop()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._batches and not self._searches and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self._batches and not self._searches and not self._waiting:
                    return
                admitted, joining = [], {}
                while self._waiting and (
                    isinstance(self._waiting[0], tuple) or self._has_room(self._waiting[0], joining)
                ):
                    item = self._waiting.popleft()
                    admitted.append(item)
                    if not isinstance(item, tuple):
                        key, rows = ("beams", item.num_beams) if item.num_beams > 1 else (item.mem_len, 1)
                        joining[key] = joining.get(key, 0) + rows
            for item in admitted:
                if isinstance(item, tuple):
                    self._run_job(*item)
                elif self._stopping:
                    self._finish(item, "shutdown")
                elif item.num_beams > 1:
                    self._search(item)
                else:
                    self._start(item)
            for mem_len in list(self._batches):
                self._step(mem_len)
            for search in list(self._searches):
                self._search_step(*search)

    def _has_room(self, request: Generation, joining: dict[int | str, int]) -> bool:
        """Whether the request's batch has a free row (counting the requests admitted with it); a beam search,
        whether its beams fit beside the running searches' in ``max_batch`` rows (their caches, like a batch's)."""
        if request.num_beams > 1:
            running = sum(r.num_beams for r, _ in self._searches) + joining.get("beams", 0)
            return running + request.num_beams <= self.max_batch
        if not self.batched:
            return self.active == 0 and not joining
        batch = self._batches.get(request.mem_len)
        return (len(batch.rows) if batch else 0) + joining.get(request.mem_len, 0) < self.max_batch

    @staticmethod
    def _run_job(fn: Callable[[], Any], fut: Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: B036 - handed to the caller
            fut.set_exception(e)

    def _finish(self, request: Generation, reason: str, error: str | None = None) -> None:
        request.finish_reason, request.error = reason, error
        request.emit(None)

    def _emit(self, request: Generation, token: int) -> bool:
        """Give the caller a token; whether the request goes on."""
        request.produced += 1
        request.output_ids.append(token)
        request.emit(token)
        if request.cancelled:
            self._finish(request, "shutdown" if self._stopping else "stop")
            return False
        if request.produced >= request.max_new_tokens:
            self._finish(request, "length")
            return False
        return True

    def _sample(self, request: Generation, log_probs: torch.Tensor) -> int:
        """The next token of a request from its log-probabilities [1, V] (recorded if it asked for them)."""
        scores = log_probs
        if request.penalties.any:
            history = torch.tensor(
                [request.prompt_ids + request.output_ids], dtype=torch.long, device=self.device
            )  # [1, L]
            scores = request.penalties.apply(log_probs, history, len(request.prompt_ids))
        token = choose(scores, request.temperature, request.top_k, request.top_p, request.generator)  # [1]
        if request.logprobs is not None:
            request.scores += token_scores(log_probs, token, request.logprobs)
        return int(token[0])

    def _score_prompt(self, request: Generation, hidden: torch.Tensor) -> None:
        """``prompt_scores`` from the prompt's hidden states [T, D]: position t predicts token t + 1."""
        targets = torch.tensor(request.prompt_ids[1:], dtype=torch.long, device=self.device)
        rows = max(1, (1 << 24) // self.model.config.n_token)  # (at most 64 MB of log-probabilities at once)
        for start in range(0, len(targets), rows):
            _, log_probs = self.model.crit(hidden[start : start + rows], return_log_probs=True)  # [rows, V]
            request.prompt_scores += token_scores(log_probs, targets[start : start + rows], request.logprobs or 0)

    def _start(self, request: Generation) -> None:
        """Run the prompt, emit the first token, and join the batch of its memory length."""
        if request.cancelled or request.max_new_tokens == 0 and not request.prompt_logprobs:
            self._finish(request, "stop" if request.cancelled else "length")
            return
        ids = torch.tensor([request.prompt_ids], dtype=torch.long, device=self.device)
        if request.generator.device != self.device:
            request.place(self.device)
        try:
            if not self.batched:
                if request.prompt_logprobs:
                    out = self.model.transformer(ids, mem_len=request.mem_len)
                    self._score_prompt(request, out.last_hidden_state[0, :-1])
                self._alone(request, ids)
                return
            dtype = next(self.model.parameters()).dtype
            cache = KVCache(
                self.model.config, 1, request.mem_len, max_segment=ids.shape[1], dtype=dtype, device=self.device
            )
            hidden = self.model.transformer(ids, cache=cache, mem_len=request.mem_len).last_hidden_state[0]  # [T, D]
            if request.prompt_logprobs:
                self._score_prompt(request, hidden[:-1])
            if request.max_new_tokens == 0:
                self._finish(request, "length")
                return
            _, log_probs = self.model.crit(hidden[-1:], return_log_probs=True)  # [1, V]
            token = self._sample(request, log_probs)
        except Exception as e:  # a bad request must not stop the engine
            self._finish(request, "error", str(e))
            return
        if not self._emit(request, token):
            return
        batch = self._batches.get(request.mem_len)
        last = torch.tensor([token], device=self.device)
        if batch is None:
            self._batches[request.mem_len] = _Batch(cache, [request], last)
        else:
            batch.cache = KVCache.merge([batch.cache, cache])
            batch.rows.append(request)
            batch.last = torch.cat([batch.last, last])

    def _search(self, request: Generation) -> None:
        """Start a beam search (its beams are a batch of their own): its prompt now, one step per loop after."""
        if request.cancelled or request.max_new_tokens == 0:
            self._finish(request, "stop" if request.cancelled else "length")
            return
        ids = torch.tensor([request.prompt_ids], dtype=torch.long, device=self.device)
        steps = beam_steps(
            self.model, ids, request.max_new_tokens, num_beams=request.num_beams,
            length_penalty=request.length_penalty, mem_len=request.mem_len, penalties=request.penalties,
        )  # fmt: skip
        self._searches.append((request, steps))
        self._search_step(request, steps)

    def _search_step(self, request: Generation, steps: Generator[None, None, torch.Tensor]) -> None:
        """One step of a beam search; when it ends, its best text, token by token. A cancelled one stops here."""
        if request.cancelled:
            steps.close()
            self._drop_search(request)
            self._finish(request, "shutdown" if self._stopping else "stop")
            return
        try:
            next(steps)
            return
        except StopIteration as end:
            found = end.value[0, len(request.prompt_ids) :].tolist()  # (no end-of-text token: max_new_tokens of them)
        except Exception as e:  # a bad request must not stop the engine
            self._drop_search(request)
            self._finish(request, "error", str(e))
            return
        self._drop_search(request)
        for token in found:
            if not self._emit(request, token):
                return

    def _drop_search(self, request: Generation) -> None:
        self._searches = [s for s in self._searches if s[0] is not request]

    def _alone(self, request: Generation, ids: torch.Tensor) -> None:
        """Generation without a K/V cache (absolute positions): the whole request, one token at a time."""
        if request.max_new_tokens == 0:
            self._finish(request, "length")
            return

        def record(log_probs: torch.Tensor, token: torch.Tensor) -> None:
            if request.logprobs is not None:
                request.scores += token_scores(log_probs, token, request.logprobs)

        tokens = stream(
            self.model,
            ids,
            request.max_new_tokens,
            temperature=request.temperature,
            top_k=request.top_k,
            top_p=request.top_p,
            mem_len=request.mem_len,
            generator=request.generator,
            observe=record,
            penalties=request.penalties,
        )
        for token in tokens:
            if not self._emit(request, int(token)):
                return

    def _step(self, mem_len: int) -> None:
        """One token for every row of a batch; finished rows leave it."""
        batch = self._batches[mem_len]
        try:
            with fp32_route(False):  # (products of a few rows: 3x slower routed)
                out = self.model.transformer(batch.last[:, None], cache=batch.cache, mem_len=mem_len)
            hidden = out.last_hidden_state[:, -1]  # [B, D]
            _, log_probs = self.model.crit(hidden, return_log_probs=True)  # [B, V]
        except Exception as e:
            for row in batch.rows:
                self._finish(row, "error", str(e))
            del self._batches[mem_len]
            return
        keep, last = [], []
        for i, row in enumerate(batch.rows):
            if row.cancelled:
                self._finish(row, "shutdown" if self._stopping else "stop")
                continue
            token = self._sample(row, log_probs[i : i + 1])
            if self._emit(row, token):
                keep.append(i)
                last.append(token)
        if not keep:
            del self._batches[mem_len]
        elif len(keep) < len(batch.rows):
            batch.cache.select(keep)
            batch.rows = [batch.rows[i] for i in keep]
        batch.last = torch.tensor(last, dtype=torch.long, device=self.device)
