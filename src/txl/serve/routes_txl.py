"""txl's own API: ``GET /health``, ``GET /v1/model``, ``POST /v1/generate`` (JSON, or server-sent events),
``POST /v1/score`` and, for a music model, ``POST /v1/music``."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from txl.serve.engine import EngineStopped
from txl.serve.http import ApiError, error_body, sse_error
from txl.serve.schemas import STREAMED, GenerateRequest, MusicRequest, ScoreRequest
from txl.serve.state import Server
from txl.serve.streams import (
    ClientLeft,
    finished,
    pieces,
    sse,
    start,
    submitted,
    token_pieces,
    unless_disconnected,
)


def router(server: Server) -> APIRouter:
    api = APIRouter()

    async def stepped(steps, request: Request, what: str):
        """The value of the engine job ``steps`` (one step per engine loop, beside the running generations); a
        client that leaves cancels it (its row freed); failures are the API's errors (``what`` failed: ...)."""
        left = threading.Event()  # (set when the client leaves: the engine stops the job at its next step)
        future = submitted(lambda: server.engine.call_steps(steps, cancelled=left))
        try:
            return await unless_disconnected(request, asyncio.wrap_future(future), left.set)
        except ClientLeft:
            raise
        except EngineStopped as e:
            raise ApiError(503, str(e), code="service_unavailable") from None
        except ValueError as e:
            raise ApiError(400, f"{what} failed: {e}") from None
        except Exception as e:
            raise ApiError(500, f"{what} failed: {type(e).__name__}: {e}") from None

    @api.get("/health", responses={503: {"model": dict[str, Any], "description": "failed or shutting down"}})
    async def health():
        """ok (200) while requests are served; 503 once the engine failed (the process then exits non-zero) or the
        server is shutting down. Needs no API key."""
        engine = server.engine
        body = {"status": "ok", "active": engine.active if engine else 0, "waiting": engine.waiting if engine else 0}
        if server.failure is not None:
            body |= {"status": "failed"} | error_body(503, f"the engine failed ({server.failure})")
            return JSONResponse(body, status_code=503)
        if server.shutting_down:
            return JSONResponse(body | {"status": "shutting down"}, status_code=503)
        return body

    @api.get("/v1/model")
    async def model_info() -> dict[str, Any]:
        """The model: its configuration, tokenizer, reading settings, the server's limits and its training metrics."""
        return server.info()

    @api.post("/v1/score")
    async def score(req: ScoreRequest, request: Request) -> dict[str, Any]:
        """The loss (and ppl or bpc) of a text, read as ``txl eval`` reads it, one segment per engine step beside
        the running generations; with ``per_token``, every token's log-probability. A client that leaves cancels
        it (its row freed)."""
        from txl.infer.evaluate import metric_value

        job = server.score(req)
        res = await stepped(job["steps"], request, "scoring")
        finite = math.isfinite(res.loss) and (res.losses is None or bool(np.isfinite(res.losses).all()))
        if not finite:
            raise ApiError(500, "scoring failed: the model gave non-finite losses")
        s = job["settings"]
        out = {
            "loss": res.loss, server.metric: metric_value(res.loss, server.metric), "metric": server.metric,
            "tokens": res.tokens,
            "settings": {"tgt_len": s.tgt_len, "mem_len": s.mem_len, "clamp_len": s.clamp_len,
                         "same_length": s.same_length},
        }  # fmt: skip
        if req.per_token:
            ids = job["ids"]
            texts = token_pieces(server, ids)
            scored = zip(texts[1:], ids[1:], res.losses, strict=True)
            out["per_token"] = [{"text": texts[0], "id": ids[0], "logprob": None}] + [
                {"text": p, "id": i, "logprob": -float(x)} for p, i, x in scored
            ]
        return out

    @api.post("/v1/music")
    async def music(req: MusicRequest, request: Request) -> dict[str, Any]:
        """A music model's piece (REMI events, kept valid by their grammar): a MIDI file continued, or a new piece,
        as MIDI (base64) and as notes in seconds, one event per engine step beside the running generations. A
        client that leaves cancels it (its row freed)."""
        job = server.music(req)
        return server.music_result(job, await stepped(job["steps"], request, "music"))

    @api.post("/v1/generate", responses=STREAMED)
    async def generate(req: GenerateRequest, request: Request):
        """Generate from a prompt (text or ids): the whole text as JSON, or with ``stream`` one event per piece of
        text, then the summary, then ``[DONE]``."""
        started = start(server, req)
        if not req.stream:
            return await unless_disconnected(request, finished(started, req.stop), started.gen.cancel)

        async def events():
            """A token's text per event, then the summary (``done``; with finish_reason error, its ``error``), then
            ``[DONE]``."""
            try:
                async for piece, final in pieces(started, req.stop):
                    yield f"data: {json.dumps(piece if final is None else final | {'done': True})}\n\n"
            except Exception as e:  # (e.g. the tokenizer failed on a token): an error event ends the stream
                started.gen.cancel()
                yield sse_error(error_body(500, f"generation failed: {type(e).__name__}: {e}"))
                return
            yield "data: [DONE]\n\n"

        return sse(events())

    return api
