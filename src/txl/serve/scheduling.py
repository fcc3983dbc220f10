"""Who gets a row of the serving engine (txl.serve.engine): the counts, the order of admission, the rows taken back.
Design notes: docs/internals.md#txlservescheduling."""

from __future__ import annotations

import time
from collections import Counter

from txl.serve.requests import Generation, _Job, _Parked

FULL = (
    "ended: the server is full, and this request's other choices hold rows while other callers wait (each caller is "
    "served before a caller gets a second row); ask for fewer choices at once"
)


def caller(item: Generation | _Job) -> object:
    """Whom a request's rows count for: its ``group`` (an HTTP request's n choices share one), else itself."""
    group = getattr(item, "group", None)
    return id(item) if group is None else group


class RowScheduler:
    """The engine's bookkeeping of rows (a mixin of :class:`txl.serve.engine.Engine`, which owns the state it
    reads: ``_batches``, ``_searches``, ``_solos``, ``_jobs``, ``_parked``, ``_waiting``, the limits)."""

    def _held(self, request: Generation) -> bool:
        """A generation whose caller has not taken ``max_unread`` of its tokens (it waits; a cancelled one ends)."""
        return request.unread >= self.max_unread and not request.cancelled

    def _cost(self, item: Generation | _Job) -> int:
        """The rows of ``max_batch`` that a request takes while it runs."""
        if isinstance(item, _Job):
            return int(item.stepped)
        if item.num_beams > 1:
            return item.num_beams
        return 1 if self.batched else self.max_batch

    def _rows_running(self) -> list[Generation]:
        rows = [r for b in self._batches.values() for r in b.rows]
        return rows + [r for r, _ in self._searches] + [r for r, _ in self._solos] + [p.request for p in self._parked]

    def _next(self, admitted: list) -> Generation | _Job:
        """The waiting request whose group holds the fewest rows (running, parked, or admitted just now); among
        those, the group that asks for the fewest in all (held and waiting), then the first come: one caller's n=8
        stream does not keep another's single request waiting behind its eight, nor do twenty such callers that
        hold nothing yet (max-min fairness across callers, the smallest demand filled first). Lock held."""
        held = self._load(admitted)
        demand = held + Counter(map(caller, self._waiting))
        return min(self._waiting, key=lambda it: (held[caller(it)], demand[caller(it)]))

    def _admissible(self) -> bool:
        """Whether a waiting request can be admitted now (a row free, or one to take back). Lock held."""
        item = self._next([])
        if self._cut or self._counts_now()[1] + self._cost(item) <= self.max_batch:
            return True
        return self._preemptable(item) is not None or self._heavy(item, []) is not None

    def _reclaim(self, item: Generation | _Job, admitted: list) -> bool:
        """A row for ``item`` (lock held), once it has waited ``fair_wait``: the oldest parked generation whose caller
        does not read ends, if parked ones hold rows (:meth:`_preemptable`); else a running row of the caller
        holding the most rows, more than ``item``'s caller, is parked (its memory kept: it rejoins when a row is
        free and no waiting caller holds fewer). When ``max_parked`` are parked (the memory bound), a parked one
        ends to make room for it where one may (:meth:`_room`), else the running row ends if its caller holds more
        than ``item``'s + 1 (an n > 1 request keeps a row; a caller's only row is never ended for another's).
        Whether a row was freed."""
        slow = self._preemptable(item)
        if slow is not None:
            self._preempt(slow)
            return True
        victim = self._heavy(item, admitted)
        if victim is None:
            return False
        mem_len, i, margin = victim
        batch = self._batches[mem_len]
        request = batch.rows[i]
        room = self._room(item) if len(self._parked) >= self.max_parked else None
        if room is not None:
            self._preempt(room)
        if len(self._parked) < self.max_parked:
            self._parked.append(_Parked(request, batch.cache.take([i]), int(batch.last[i])))
        elif margin > 1:
            self._finish(request, "error", FULL, 503)
        else:
            return False
        keep = [k for k in range(len(batch.rows)) if k != i]
        if not keep:
            del self._batches[mem_len]
        else:
            batch.cache.select(keep)
            batch.rows = [batch.rows[k] for k in keep]
            batch.last = batch.last[keep]
        return True

    def _heavy(self, item: Generation | _Job, admitted: list) -> tuple[int, int, int] | None:
        """The running row to take back for ``item`` after ``fair_wait``: one of the caller holding the most rows
        (running and parked), if it holds more than ``item``'s caller (max-min fairness), the one that made the most
        tokens: (its batch's mem_len, its index, how many rows its caller holds beyond ``item``'s), or None."""
        if time.monotonic() - item.queued_at < self.fair_wait:
            return None
        load = self._load(admitted)
        mine = load[caller(item)]
        rows = [(load[caller(r)], r.produced, m, i) for m, b in self._batches.items() for i, r in enumerate(b.rows)]
        rows = [row for row in rows if row[0] > mine]
        if not rows:
            return None
        most, _, m, i = max(rows)
        return m, i, most - mine

    def _preemptable(self, item: Generation | _Job) -> _Parked | None:
        """The generation to end for ``item``, a request that waited ``fair_wait`` for a row: the oldest parked one
        whose caller is not taking its tokens, of a caller holding more rows than ``item``'s, if parked ones hold
        rows (more than ``max_parked`` are parked)."""
        if len(self._parked) <= self.max_parked or time.monotonic() - item.queued_at < self.fair_wait:
            return None
        return self._stuck(item)

    def _stuck(self, item: Generation | _Job, load: Counter | None = None) -> _Parked | None:
        """The oldest parked generation whose caller is not taking its tokens, of a caller holding more rows than
        ``item``'s (running or parked; ``load``: :meth:`_load`'s, if the caller has it), or None."""
        load = self._load() if load is None else load
        mine = load[caller(item)]
        stuck = [p for p in self._parked if not self._resumable(p.request) and load[caller(p.request)] > mine]
        return min(stuck, key=lambda p: p.since) if stuck else None

    def _room(self, item: Generation | _Job) -> _Parked | None:
        """The parked generation to end so that a running row can be parked for ``item`` when ``max_parked`` are
        parked: a stuck one (:meth:`_stuck`: a caller that does not read holds a generation only while no one
        waits), else the oldest of the caller holding the most, if it holds more than ``item``'s + 1 (the rule of
        running rows: every caller holding one row, a new caller waits for one to end)."""
        load = self._load()
        stuck = self._stuck(item, load)
        if stuck is not None:
            return stuck
        heavy = [p for p in self._parked if load[caller(p.request)] > load[caller(item)] + 1]
        return min(heavy, key=lambda p: (-load[caller(p.request)], p.since)) if heavy else None

    def _preempt(self, parked: _Parked) -> None:
        """End a parked generation for a request that waited: why, by whether its caller reads."""
        self._parked.remove(parked)
        waited = time.monotonic() - parked.since
        self._finish(
            parked.request, "error",
            FULL if self._resumable(parked.request) else
            f"ended: its client had not read {parked.request.unread} tokens for {waited:.1f} s while other requests "
            "waited for a row (the server holds a generation for a client that does not read only while no one "
            "waits); read the stream as it comes, or ask for fewer choices at once", 503,
        )  # fmt: skip

    def _counts_now(self) -> tuple[int, int]:
        """(requests, rows) in flight: a batch's rows one each, a search one request of num_beams rows, a solo one
        of all rows, a stepped job one of one row. Parked generations (waiting for their callers, or for a row to
        rejoin) hold none up to ``max_parked`` of them, one row each beyond: the memory held stays within max_batch
        + max_parked rows."""
        batched = sum(len(b.rows) for b in self._batches.values())
        parked = max(0, len(self._parked) - self.max_parked)  # (the parked generations that hold a row)
        requests = batched + len(self._parked) + len(self._searches) + len(self._solos) + len(self._jobs)
        rows = batched + parked + sum(r.num_beams for r, _ in self._searches) + len(self._solos) * self.max_batch
        return requests, rows + len(self._jobs)

    def _load(self, admitted: list = ()) -> Counter:
        """Rows each caller holds now (running or parked, and ``admitted``: taken from the queue in this pass), by
        :func:`caller`: the engine's fairness across callers."""
        return Counter(map(caller, (*self._rows_running(), *admitted)))

    def _resumable(self, request: Generation) -> bool:
        """Whether a parked generation goes on: its caller took half of what waited (or it was cancelled)."""
        return request.cancelled or request.unread <= self.max_unread // 2
