"""The engine behind ``txl serve``: one thread owns the model and runs every model call, so none run concurrently.
Design notes: docs/internals.md#txlserveengine."""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import Future
from typing import Any

import torch

from txl.infer.generation import NoTokenLeftError, beam_steps, check_left, choose, stream
from txl.infer.prompt import read_prompt
from txl.kernels.runtime import fp32_route
from txl.model.cache import mergeable
from txl.model.modeling import KVCache, Reading, TransformerXLLM, transposed_weights
from txl.serve.requests import (
    FAIR_WAIT,
    MAX_LOGPROBS,
    PARKED_POLL,
    EngineStopped,
    Generation,
    QueueFull,
    RequestError,
    TokenScore,
    TokenScores,
    _Batch,
    _Job,
    _Parked,
)
from txl.serve.scheduling import RowScheduler, caller

__all__ = [
    "FAIR_WAIT", "MAX_LOGPROBS", "Engine", "EngineStopped", "Generation", "QueueFull", "RequestError", "TokenScore",
    "TokenScores",
]  # fmt: skip


class Engine(RowScheduler):
    """Runs generation requests and jobs on one thread, at most ``max_batch`` rows in flight in all (a generation is
    a row, a beam search one per beam, a stepped job one; a model without a K/V cache generates one request at a
    time) and at most ``max_queue`` requests waiting for room. A failing request ends alone; if the thread itself
    fails, every request ends with an error, ``failure`` says why, ``on_failure(failure)`` is called and no more
    work is taken."""

    def __init__(
        self,
        model: TransformerXLLM,
        *,
        max_batch: int = 8,
        max_queue: int = 64,
        max_unread: int = 256,
        max_parked: int | None = None,
        on_failure: Callable[[str], None] | None = None,
        reading: Reading | None = None,
        fair_wait: float = FAIR_WAIT,
    ):
        if max_batch < 1 or max_queue < 0 or max_unread < 1 or (max_parked is not None and max_parked < 0):
            raise ValueError("max_batch and max_unread must be >= 1, max_queue and max_parked >= 0")
        self.max_unread = max_unread
        """Tokens of one generation that its caller has not taken yet, at most: with as many, the generation waits
        (parked: its memory kept apart, its row given to others) until the caller has taken half of them."""
        self.max_parked = max_batch if max_parked is None else max_parked
        """Parked generations that take no row: a slow reader's generations wait apart while others use the rows
        (probes s1: one slow reader of an n=8 stream held all 8 rows for as long as it read). Beyond this many, each
        parked one holds its row again, so that the memory held stays within max_batch + max_parked rows, until a
        request has waited ``fair_wait`` seconds for it (:data:`FAIR_WAIT`)."""
        self.fair_wait = fair_wait
        self.model = model.eval()
        self.reading = reading or Reading()
        """How the model reads (same_length, clamp_len; each request's mem_len over it): the config is not changed."""
        self.device = next(model.parameters()).device  # (the requests' tensors and generators go there)
        self.max_batch, self.max_queue = max_batch, max_queue
        self.batched = mergeable(model.config)
        self.on_failure = on_failure
        self.failure: str | None = None
        """Why the engine's thread failed (None while it runs)."""
        # Only the engine's thread touches these four; other threads read the published counts.
        self._batches: dict[int, _Batch] = {}
        self._searches: list[tuple[Generation, Generator[None, None, torch.Tensor]]] = []
        self._solos: list[tuple[Generation, Generator[torch.Tensor, None, None]]] = []  # (no K/V cache: one at a time)
        self._jobs: list[_Job] = []
        self._parked: list[_Parked] = []  # (waiting for their callers to take their tokens)
        # Shared, under the lock:
        self._cond = threading.Condition()
        self._waiting: deque[Generation | _Job] = deque()
        self._counts = (0, 0)  # (requests, rows) in flight, as the engine's thread last published them
        self._draining = False  # no new work is taken
        self._cut = False  # what is left ends now (finish_reason shutdown)
        self._stopping = False  # the thread ends once nothing is left
        self._warm()
        self._thread = threading.Thread(target=self._run, name="txl-engine", daemon=True)
        self._thread.start()

    # -- the caller's side (any thread) -----------------------------------------------------------------------

    @property
    def active(self) -> int:
        """Requests in flight (a beam search and a scored text count once each)."""
        with self._cond:
            return self._counts[0]

    @property
    def rows(self) -> int:
        """Rows in flight, of at most ``max_batch``."""
        with self._cond:
            return self._counts[1]

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    def submit(self, request: Generation) -> None:
        """Queue a generation; raises :class:`QueueFull` when ``max_queue`` requests already wait and
        :class:`EngineStopped` when the engine takes no more work."""
        if self._cost(request) > self.max_batch:
            raise ValueError(f"num_beams = {request.num_beams}: more rows than max_batch {self.max_batch}")
        self._put(request)

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn()`` on the engine's thread between two decoding steps; its result (or error) in the future."""
        return self._put(_Job(fn, Future(), stepped=False))

    def call_steps(
        self, make: Callable[[], Generator[None, None, Any]], cancelled: threading.Event | None = None
    ) -> Future:
        """Run the generator ``make()`` on the engine's thread, one step per engine loop (each generation running
        meanwhile makes a token between two steps), as one of the ``max_batch`` rows; the value it returns (or its
        error) in the future. Setting ``cancelled`` stops it at its next step (its row freed; EngineStopped)."""
        return self._put(_Job(make, Future(), stepped=True, cancelled=cancelled))

    def _put(self, item: Generation | _Job) -> Future | None:
        with self._cond:
            if self.failure is not None:
                raise EngineStopped(f"the engine failed ({self.failure}); restart the server")
            if self._draining:
                raise EngineStopped("the server is shutting down")
            if len(self._waiting) >= self.max_queue and (self._counts[1] >= self.max_batch or self._waiting):
                raise QueueFull(f"{len(self._waiting)} requests are waiting (the limit is {self.max_queue})")
            item.queued_at = time.monotonic()
            self._waiting.append(item)
            self._cond.notify_all()
        return item.future if isinstance(item, _Job) else None

    def drain(self, timeout: float) -> bool:
        """Take no more work (:class:`EngineStopped`); let what was taken, running or waiting, finish for at most
        ``timeout`` seconds, then end what is left (generations with finish_reason ``shutdown``, jobs with
        :class:`EngineStopped`). Whether everything finished by itself in time."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._draining = True
            self._cond.notify_all()
            while not self._idle() and self._thread.is_alive() and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())
            finished = self._idle()
            if not finished:
                self._cut = True
                self._cond.notify_all()
                ends = time.monotonic() + 30  # (the next step ends every row)
                while not self._idle() and self._thread.is_alive() and time.monotonic() < ends:
                    self._cond.wait(0.1)
        return finished

    def shutdown(self, timeout: float = 10.0) -> bool:
        """:meth:`drain` for at most ``timeout`` seconds, then stop the thread. Whether everything had finished."""
        finished = self.drain(timeout)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        return finished

    def _idle(self) -> bool:
        return self._counts[0] == 0 and not self._waiting

    # -- the engine's thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        try:
            with transposed_weights():  # (a served model's weights are fixed)
                self._loop()
        except BaseException as e:  # noqa: B036 - every request is ended and the failure reported below
            self._die(e)

    def _warm(self) -> None:
        """One forward of two tokens before the engine takes requests: the first call of torch's custom ops (the fast
        paths') imports torch._dynamo (2 s on a 2-core machine), which the first request would pay on the engine's
        thread, every other request and a leaving client's cancel waiting behind it. A failure is left to the first
        request."""
        try:
            with torch.no_grad(), fp32_route(False):
                self.model.transformer(torch.zeros(1, 2, dtype=torch.long, device=self.device), reading=self.reading)
        except Exception as e:  # (the same call fails again, for a request, with its error)
            print(f"txl serve: the warm-up call failed ({type(e).__name__}: {e})", file=sys.stderr)

    def _die(self, e: BaseException) -> None:
        """The thread failed outside any one request: end everything with an error and take no more work."""
        print(f"txl serve: the engine failed: {type(e).__name__}: {e}", file=sys.stderr)
        traceback.print_exception(e, file=sys.stderr)
        with self._cond:
            self.failure = f"{type(e).__name__}: {e}"
            waiting = list(self._waiting)
            self._waiting.clear()
            rows = self._rows_running()
            jobs = self._jobs + [w for w in waiting if isinstance(w, _Job)]
            self._batches, self._searches, self._solos, self._jobs, self._parked = {}, [], [], [], []
            self._counts = (0, 0)
            self._cond.notify_all()
        for row in rows + [w for w in waiting if isinstance(w, Generation)]:
            self._finish(row, "error", f"the engine failed ({self.failure})", 500)
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(EngineStopped(f"the engine failed ({self.failure})"))
        if self.on_failure is not None:
            self.on_failure(self.failure)

    def _running(self) -> bool:
        return bool(self._batches or self._searches or self._solos or self._jobs)

    def _stepping(self) -> bool:
        """Whether anything would advance at the next step (parked generations, and solo ones whose callers have
        not taken their tokens, wait for their callers)."""
        return bool(
            self._batches
            or self._searches
            or self._jobs
            or any(not self._held(r) for r, _ in self._solos)
            or any(self._resumable(p.request) for p in self._parked)
        )

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting and self._admissible()) and not self._stepping() and not self._stopping:
                    # (generations waiting for their callers, or requests for a row: look again soon)
                    self._cond.wait(PARKED_POLL if self._parked or self._solos or self._waiting else None)
                if self._stopping and not self._running() and not self._parked and not self._waiting:
                    return
                admitted = self._admit()
                cut = self._cut
            for item in admitted:
                if isinstance(item, _Job):
                    self._start_job(item)
                elif cut:
                    self._finish(item, "shutdown")
                elif item.num_beams > 1:
                    self._search(item)
                elif not self.batched:
                    self._solo(item)
                else:
                    self._start(item)
            if cut:
                for row in self._rows_running():
                    row.cancel()
            self._unpark()
            self._publish()
            for mem_len in list(self._batches):
                self._step(mem_len)
            for search in list(self._searches):
                self._search_step(*search)
            for solo in list(self._solos):
                self._solo_step(*solo)
            for job in list(self._jobs):
                self._job_step(job)
            self._publish()
            if not (admitted or self._batches or self._searches or self._jobs or self._solos):
                with self._cond:  # (nothing could run: parked generations wait for a row or their callers)
                    self._cond.wait(PARKED_POLL)

    def _admit(self) -> list[Generation | _Job]:
        """Take waiting requests, the fairest first (:meth:`_next`), while their rows fit in ``max_batch`` or one can
        be taken back for them (:meth:`_reclaim`; all of them once the engine is cut: they end at once). Called with
        the lock held."""
        admitted, taken = [], 0
        while self._waiting:
            item = self._next(admitted)
            cost = 0 if self._cut else self._cost(item)
            if self._counts_now()[1] + taken + cost > self.max_batch:
                if not self._reclaim(item, admitted):
                    break
                continue
            taken += cost
            self._waiting.remove(item)
            admitted.append(item)
        requests, rows = self._counts_now()
        self._counts = (
            requests + len(admitted),
            rows + taken,
        )  # (in flight from now on: never neither waiting nor active)
        return admitted

    def _publish(self) -> None:
        counts = self._counts_now()
        with self._cond:
            self._counts = counts
            self._cond.notify_all()

    def _start_job(self, job: _Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        if self._cut:
            job.future.set_exception(EngineStopped("the server is shutting down"))
            return
        try:
            if not job.stepped:
                job.future.set_result(job.fn())
                return
            job.steps = job.fn()
        except Exception as e:  # handed to the caller
            job.future.set_exception(e)
            return
        self._jobs.append(job)

    def _job_step(self, job: _Job) -> None:
        """One step of a stepped job; its result or error goes to its future."""
        left = job.cancelled is not None and job.cancelled.is_set()
        if self._cut or left:
            job.steps.close()
            self._jobs.remove(job)
            job.future.set_exception(EngineStopped("the server is shutting down" if self._cut else "cancelled"))
            return
        try:
            next(job.steps)
            return
        except StopIteration as end:
            job.future.set_result(end.value)
        except Exception as e:  # handed to the caller
            job.future.set_exception(e)
        self._jobs.remove(job)

    def _finish(self, request: Generation, reason: str, error: str | None = None, status: int = 500) -> None:
        request.finish_reason, request.error, request.error_status = reason, error, status
        try:
            request.emit(None)
        except Exception as e:  # (the caller is gone, e.g. its event loop closed: nothing waits for the end)
            print(f"txl serve: a request's end could not be handed to its caller: {type(e).__name__}: {e}",
                  file=sys.stderr)  # fmt: skip

    def _fail(self, request: Generation, e: Exception) -> None:
        """End one request with an error (the engine and the other requests go on): a :class:`RequestError`'s
        status, 400 where the penalties leave no token (sampling and beam search alike), else 500. A failure of the
        server's (500, not a request's own fault) also goes to the log with its traceback."""
        status = e.status if isinstance(e, RequestError) else 400 if isinstance(e, NoTokenLeftError) else 500
        if status >= 500 and not isinstance(e, RequestError):
            print(f"txl serve: a request failed: {type(e).__name__}: {e}", file=sys.stderr)
            traceback.print_exception(e, file=sys.stderr)
        self._finish(request, "error", str(e) or type(e).__name__, status)

    @property
    def _ended(self) -> str:
        """The finish_reason of a cancelled request: shutdown once the engine is cut, stop otherwise."""
        return "shutdown" if self._cut else "stop"

    def _emit(self, request: Generation, token: int) -> bool:
        """Give the caller a token; whether the request goes on."""
        request.produced += 1
        request.output_ids.append(token)
        request.emit(token)
        if request.cancelled:
            self._finish(request, self._ended)
            return False
        if request.produced >= request.max_new_tokens:
            self._finish(request, "length")
            return False
        return True

    def _sample(self, request: Generation, log_probs: torch.Tensor) -> int:
        """The next token of a request from its log-probabilities [1, V] (recorded if it asked for them). Raises
        :class:`RequestError` for non-finite log-probabilities and for penalties that leave no token."""
        n = request.produced + 1
        if not bool(torch.isfinite(log_probs).all()):
            raise RequestError(f"the model gave non-finite log-probabilities for new token {n}", 500)
        scores = log_probs
        if request.penalties.any:
            history = torch.tensor(
                [request.prompt_ids + request.output_ids], dtype=torch.long, device=self.device
            )  # [1, L]
            scores = request.penalties.apply(log_probs, history, len(request.prompt_ids))
            check_left(scores, n)  # (NoTokenLeftError: 400, the rule of every mode)
        token = choose(scores, request.temperature, request.top_k, request.top_p, request.generator)  # [1]
        if request.logprobs is not None:
            request.scores.extend(log_probs, token, request.logprobs)
        return int(token[0])

    def _score_prompt(self, request: Generation, hidden: torch.Tensor) -> None:
        """``prompt_scores`` from the prompt's hidden states [T, D]: position t predicts token t + 1."""
        targets = torch.tensor(request.prompt_ids[1:], dtype=torch.long, device=self.device)
        rows = max(1, (1 << 24) // self.model.config.n_token)  # (at most 64 MB of log-probabilities at once)
        for start in range(0, len(targets), rows):
            _, log_probs = self.model.crit(hidden[start : start + rows], return_log_probs=True)  # [rows, V]
            if not bool(torch.isfinite(log_probs).all()):
                raise RequestError("the model gave non-finite log-probabilities for the prompt", 500)
            request.prompt_scores.extend(log_probs, targets[start : start + rows], request.logprobs or 0)

    def _begin(self, request: Generation) -> torch.Tensor | None:
        """The prompt's ids [1, T] on the model's device; None if the request ends before its prompt is read."""
        if request.cancelled or request.max_new_tokens == 0 and not request.prompt_logprobs:
            self._finish(request, self._ended if request.cancelled else "length")
            return None
        if request.generator.device != self.device:
            request.place(self.device)
        return torch.tensor([request.prompt_ids], dtype=torch.long, device=self.device)

    def _start(self, request: Generation) -> None:
        """Run the prompt, emit the first token, and join the batch of its memory length."""
        try:
            ids = self._begin(request)
            if ids is None:
                return
            dtype = next(self.model.parameters()).dtype
            T, config = ids.shape[1], self.model.config
            written = T + request.max_new_tokens  # (a short generation: a small buffer)
            cache = KVCache(config, 1, request.mem_len, T, positions=written, dtype=dtype, device=self.device)
            # [T, D] (in pieces, where it is long)
            hidden = read_prompt(self.model, ids, cache, self.reading.over(mem_len=request.mem_len))[0]
            if request.prompt_logprobs:
                self._score_prompt(request, hidden[:-1])
            if request.max_new_tokens == 0:
                self._finish(request, "length")
                return
            _, log_probs = self.model.crit(hidden[-1:], return_log_probs=True)  # [1, V]
            token = self._sample(request, log_probs)
            if not self._emit(request, token):
                return
            self._join(request, cache, token)
        except Exception as e:  # a bad request must not stop the engine
            self._fail(request, e)

    def _join(self, request: Generation, cache: KVCache, token: int) -> None:
        """Put a generation (its one-row memory ``cache``, its last ``token``) in the batch of its memory length (or,
        if its caller has not taken ``max_unread`` of its tokens, aside until it does)."""
        if self._held(request):
            self._parked.append(_Parked(request, cache, token))
            return
        batch = self._batches.get(request.mem_len)
        last = torch.tensor([token], device=self.device)
        if batch is None:
            self._batches[request.mem_len] = _Batch(cache, [request], last)
        else:
            merged = KVCache.merge([batch.cache, cache])
            batch.cache, batch.last = merged, torch.cat([batch.last, last])
            batch.rows.append(request)

    def _unpark(self) -> None:
        """Parked generations whose callers took their tokens join their batches again (the same memory, so the
        same tokens as if they had never waited), oldest first: at once where it holds a row already (more than
        ``max_parked`` are parked), else while a row is free and no waiting request's group holds fewer rows than
        its own (max-min fairness across callers); cancelled ones end."""
        for parked in sorted((p for p in self._parked if self._resumable(p.request)), key=lambda p: p.since):
            request = parked.request
            if request.cancelled:
                self._parked.remove(parked)
                self._finish(request, self._ended)
                continue
            if len(self._parked) <= self.max_parked:  # (rejoining takes a row)
                if self._counts_now()[1] >= self.max_batch:
                    break
                with self._cond:
                    first = self._next([]) if self._waiting and not self._cut else None
                if first is not None:
                    load = self._load()
                    mine = load[request.group] if request.group is not None else 0
                    if load[caller(first)] < mine:
                        continue  # (the row goes to a caller holding fewer)
            self._parked.remove(parked)
            try:
                self._join(request, parked.cache, parked.last)
            except Exception as e:
                self._fail(request, e)

    def _step(self, mem_len: int) -> None:
        """One token for every row of a batch; finished rows leave it. A row that fails ends alone; a model call
        that fails ends the batch."""
        batch = self._batches[mem_len]
        try:
            with fp32_route(False):  # (products of a few rows: 3x slower routed)
                out = self.model.transformer(
                    batch.last[:, None], cache=batch.cache, reading=self.reading.over(mem_len=mem_len)
                )
            hidden = out.last_hidden_state[:, -1]  # [B, D]
            _, log_probs = self.model.crit(hidden, return_log_probs=True)  # [B, V]
        except Exception as e:
            del self._batches[mem_len]
            for row in batch.rows:
                self._fail(row, e)
            return
        keep, park, tokens = [], [], {}
        for i, row in enumerate(batch.rows):
            if row.cancelled:
                self._finish(row, self._ended)
                continue
            try:
                token = self._sample(row, log_probs[i : i + 1])
                if self._emit(row, token):
                    (park if self._held(row) else keep).append(i)
                    tokens[i] = token
            except Exception as e:
                self._fail(row, e)
        for i in park:  # (their callers are not taking their tokens: each one's memory waits apart)
            try:
                self._parked.append(_Parked(batch.rows[i], batch.cache.take([i]), tokens[i]))
            except Exception as e:
                self._fail(batch.rows[i], e)
        last = [tokens[i] for i in keep]
        kept = [batch.rows[i] for i in keep]
        try:
            if not keep:
                del self._batches[mem_len]
            elif len(keep) < len(batch.rows):
                batch.cache.select(keep)
                batch.rows = kept
            batch.last = torch.tensor(last, dtype=torch.long, device=self.device)
        except Exception as e:
            self._batches.pop(mem_len, None)
            for row in kept:
                self._fail(row, e)

    def _search(self, request: Generation) -> None:
        """Start a beam search (its beams are a batch of their own): its prompt now, one step per loop after."""
        try:
            ids = self._begin(request)
            if ids is None:
                return
            steps = beam_steps(
                self.model, ids, request.max_new_tokens, num_beams=request.num_beams,
                length_penalty=request.length_penalty, mem_len=request.mem_len, penalties=request.penalties,
                reading=self.reading,
            )  # fmt: skip
        except Exception as e:
            self._fail(request, e)
            return
        self._searches.append((request, steps))
        self._search_step(request, steps)

    def _search_step(self, request: Generation, steps: Generator[None, None, torch.Tensor]) -> None:
        """One step of a beam search; when it ends, its best text, token by token. A cancelled one stops here."""
        try:
            if request.cancelled:
                steps.close()
                self._drop(self._searches, request)
                self._finish(request, self._ended)
                return
            try:
                next(steps)
                return
            except StopIteration as end:
                found = end.value[0, len(request.prompt_ids) :].tolist()  # (no end-of-text: max_new_tokens of them)
            self._drop(self._searches, request)
            for token in found:
                if not self._emit(request, token):
                    return
        except Exception as e:  # a bad request must not stop the engine
            self._drop(self._searches, request)
            self._fail(request, e)

    def _solo(self, request: Generation) -> None:
        """Start a generation without a K/V cache (absolute positions): one token per loop, alone."""

        def record(log_probs: torch.Tensor, token: torch.Tensor) -> None:
            if request.logprobs is not None:
                request.scores.extend(log_probs, token, request.logprobs)

        try:
            ids = self._begin(request)
            if ids is None:
                return
            if request.prompt_logprobs:
                out = self.model.transformer(ids, reading=self.reading.over(mem_len=request.mem_len))
                self._score_prompt(request, out.last_hidden_state[0, :-1])
            if request.max_new_tokens == 0:
                self._finish(request, "length")
                return
            tokens = stream(
                self.model, ids, request.max_new_tokens, temperature=request.temperature, top_k=request.top_k,
                top_p=request.top_p, mem_len=request.mem_len, generator=request.generator, observe=record,
                penalties=request.penalties, reading=self.reading,
            )  # fmt: skip
        except Exception as e:
            self._fail(request, e)
            return
        self._solos.append((request, tokens))
        self._solo_step(request, tokens)

    def _solo_step(self, request: Generation, tokens: Generator[torch.Tensor, None, None]) -> None:
        if self._held(request):  # (alone, it simply waits for its caller)
            return
        try:
            if request.cancelled:
                self._drop(self._solos, request)
                self._finish(request, self._ended)
                return
            if not self._emit(request, int(next(tokens))):
                self._drop(self._solos, request)
        except Exception as e:  # (NonFiniteError from stream among them)
            self._drop(self._solos, request)
            self._fail(request, e)

    @staticmethod
    def _drop(running: list, request: Generation) -> None:
        """Take a request out of a list of (request, generator), closing its generator."""
        for i, (r, it) in enumerate(running):
            if r is request:
                del running[i]
                it.close()
                return
