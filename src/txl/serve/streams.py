"""How a generation travels from the engine to a client, for both generation endpoints (txl's and OpenAI's): its
submission (refusals as 429 / 503), its tokens as text (cut before stop strings), as one summary or as server-sent
events, and the bounds that keep a client that does not read (or has left) from holding memory or a row.
Design notes: docs/internals.md#txlservestreams."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from txl.serve.engine import EngineStopped, Generation, QueueFull
from txl.serve.http import ApiError, error_body
from txl.serve.schemas import GenerateRequest
from txl.serve.state import Server

DISCONNECT_POLL = 0.25
"""Seconds between two looks for a client that left while its whole answer is being computed."""


@dataclass(frozen=True)
class Started:
    """A submitted generation: ``tokens()`` (an async iterator of (token id, text so far, new ids), ending with
    (None, text, new ids)), ``summary(text, new, reason)`` (the final record), and the engine's generation."""

    tokens: Callable
    summary: Callable
    gen: Generation


"""What :func:`start` returns: the token iterator, the summary function and the generation."""


def submitted(put: Callable[[], Any]) -> Any:
    """``put()`` (a submission to the engine), its refusals as 429 and 503."""
    try:
        return put()
    except QueueFull as e:
        raise ApiError(429, f"busy: {e}; retry later", code="rate_limit_exceeded") from None
    except EngineStopped as e:
        raise ApiError(503, str(e), code="service_unavailable") from None


def start(
    server: Server, req: GenerateRequest, logprobs: int | None = None, prompt_logprobs: bool = False,
    group: object | None = None,
) -> Started:  # fmt: skip
    """Submit a generation (a bad or refused request raises here, before any response starts); return the iterator
    of (token id, text so far, new ids) as they come, ending with (None, text, new ids), the function that sums a
    generation up, and the generation. ``group``: the HTTP request it belongs to (its n choices share one: the
    engine's fairness across callers, ``Generation.group``)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[int | None] = asyncio.Queue()  # (at most Engine.max_unread tokens + the end: see above)
    emit = lambda tok: loop.call_soon_threadsafe(queue.put_nowait, tok)  # noqa: E731
    gen, ids = server.generation(req, emit, logprobs, prompt_logprobs)
    gen.group = group
    submitted(lambda: server.engine.submit(gen))
    decoder = server.tokenizer.stream_decoder() if server.tokenizer else None
    for i in ids:  # (a word tokenizer's separators depend on what came before)
        if decoder:
            decoder.push(i)
    begun = time.monotonic()

    async def tokens():
        """(token id, text so far, new ids) as they come; the request is cancelled if the client leaves."""
        text, new = "", []
        try:
            while True:
                tok = await queue.get()
                if tok is None:
                    if decoder:
                        text += decoder.flush()
                    yield None, text, new
                    return
                gen.took()  # (the engine may generate one more ahead of this client)
                new.append(tok)
                if decoder:
                    text += decoder.push(tok)
                yield tok, text, new
        finally:
            gen.cancel()

    def summary(text: str, new: list[int], reason: str) -> dict[str, Any]:
        elapsed = max(time.monotonic() - begun, 1e-9)
        error = None
        if reason == "error":
            error = error_body(gen.error_status, f"generation failed: {gen.error}")["error"]
        return {
            "text": text, "token_ids": new, "prompt_tokens": len(ids), "new_tokens": len(new),
            "finish_reason": reason, "error": error, "seconds": elapsed, "tokens_per_s": len(new) / elapsed,
        }  # fmt: skip

    return Started(tokens, summary, gen)


async def finished(started: Started, stop: list[str]) -> dict[str, Any]:
    """The whole generation's summary (text cut before the first stop string): the end of :func:`pieces`."""
    async with aclosing(pieces(started, stop)) as events:  # (closing it cancels the generation)
        async for _, final in events:
            if final is not None:
                if final["finish_reason"] == "error":
                    raise ApiError(started.gen.error_status, final["error"]["message"])
                return final
    raise AssertionError("pieces() always ends with the summary")


async def pieces(started: Started, stop: list[str]):
    """({"token_id", "text"}, None) for each piece of text that is safe to send (no stop string can begin in it),
    then (None, the summary)."""
    tokens, summary, gen = started.tokens, started.summary, started.gen
    sent = 0
    try:
        async for tok, text, new in tokens():
            cut, safe = stop_cut(text, stop)
            end = cut if cut is not None else (len(text) if tok is None else safe)
            if tok is not None and cut is None or end > sent:
                yield {"token_id": tok, "text": text[sent:end]}, None
                sent = end
            if cut is not None or tok is None:
                yield None, summary(text[:end], new, "stop" if cut is not None else (gen.finish_reason or "length"))
                return
    finally:
        gen.cancel()


def stop_cut(text: str, stops: list[str]) -> tuple[int | None, int]:
    """(index of the first stop string in ``text`` or None, how much of ``text`` is safe to send: all of it but a
    tail that could still become a stop string)."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    if found:
        return min(found), min(found)
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return None, len(text) - hold


class _ClosingStream(StreamingResponse):
    """A streaming response that closes its events' generator however the response ends (Starlette leaves it
    suspended when a send fails, e.g. a client that stopped reading: its generation would go on, and its tasks would
    be collected pending)."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


def sse(events) -> StreamingResponse:
    return _ClosingStream(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def merged(streams: list):
    """The items of several async iterators as they come (each closed at the end, or when this one is). The queue
    between them holds one item per iterator: an iterator waits while the consumer (a response being sent) does."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=max(1, len(streams)))
    done = object()

    async def pump(it) -> None:
        try:
            async with aclosing(it):
                async for item in it:
                    await queue.put(item)
            await queue.put(done)
        except Exception as e:  # (handed to the consumer)
            await queue.put(e)

    tasks = [asyncio.create_task(pump(it)) for it in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        # (awaited: a pump blocked on the full queue is still pending once cancelled, and asyncio keeps only weak
        # references to tasks: unawaited, it could be collected pending, from whatever thread runs the collector)
        await asyncio.gather(*tasks, return_exceptions=True)


async def unless_disconnected(request: Request, work: Awaitable, on_leave: Callable[[], None]) -> Any:
    """``await work``; if the client leaves first, ``on_leave()`` (e.g. cancel the engine's work, freeing its row)
    and raise :class:`ClientLeft`."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL)
            if done:
                return task.result()
            if await request.is_disconnected():
                on_leave()
                raise ClientLeft()
    finally:
        if not task.done():
            task.cancel()


class ClientLeft(Exception):
    """The client left before its answer was ready (nothing is sent)."""


def token_pieces(server: Server, ids: list[int]) -> list[str]:
    """The text of each token, as it appears in the decoded text (a word with its separator)."""
    if server.tokenizer is None:
        return [str(i) for i in ids]
    decoder = server.tokenizer.stream_decoder()
    out = [decoder.push(i) for i in ids]
    out[-1] += decoder.flush()
    return out
