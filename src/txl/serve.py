"""``txl serve``: an HTTP API (FastAPI) over a trained model, with a web page, batched streaming generation and
long-text scoring.

Endpoints: ``POST /v1/generate`` (JSON, or server-sent events with ``"stream": true``), ``POST /v1/score``,
``GET /v1/model``, ``GET /health``, ``GET /`` (the page; OpenAPI docs at ``/docs``), and OpenAI's
``POST /v1/completions`` and ``GET /v1/models``, so that clients of that API work unchanged. Every model call runs
on the :class:`~txl.engine.Engine`'s thread, which batches concurrent generations step by step; the event loop only
decodes text and talks HTTP. Bad input is a 4xx with a one-line message naming the field.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from txl.engine import Engine, EngineStopped, Generation, QueueFull


@dataclass
class ServeLimits:
    """Caps that keep one client from taking the server (each a `txl serve` option)."""

    max_prompt_tokens: int = 4096
    max_new_tokens: int = 1024
    max_batch: int = 8
    max_queue: int = 64
    max_score_tokens: int = 200_000
    max_mem_len: int = 8192


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str | None = Field(None, description="Prompt text (read with the model's tokenizer).")
    prompt_ids: list[int] | None = Field(None, description="Prompt token ids, instead of prompt.")
    max_new_tokens: int = Field(64, ge=0, description="Tokens to generate.")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature (0: greedy).")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens (0: all).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold (1: off).")
    seed: int | None = Field(None, description="Random seed: the same seed gives the same text.")
    stop: list[str] = Field(default_factory=list, description="Stop before the first of these strings.")
    mem_len: int | None = Field(None, ge=1, description="Memory length (default: the model's).")
    stream: bool = Field(False, description="Stream the tokens as server-sent events.")


class CompletionRequest(BaseModel):
    """OpenAI's completions request. Fields of OpenAI's that txl does not have are refused when set to anything
    but their neutral value; fields unknown to OpenAI too are ignored, as clients send some of their own."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="Any name: the server has one model.")
    prompt: str | list[str] | list[int] | list[list[int]] = Field(..., description="Text or token ids: one prompt.")
    max_tokens: int | None = Field(16, ge=0, description="Tokens to generate (OpenAI's default: 16).")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature (0: greedy).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold (1: off).")
    stop: str | list[str] | None = Field(None, description="Stop before the first of these strings.")
    seed: int | None = Field(None, description="Random seed: the same seed gives the same text.")
    echo: bool = Field(False, description="Give the prompt's text before the completion.")
    stream: bool = Field(False, description="Stream the text as server-sent events, ending with data: [DONE].")
    n: int = 1
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str | None = Field(None, description="The text to score (any length), read with the model's tokenizer.")
    ids: list[int] | None = Field(None, description="Token ids to score, instead of text.")
    tgt_len: int | None = Field(None, ge=1, description="Segment length (default: the run's evaluation settings).")
    mem_len: int | None = Field(None, ge=0, description="Memory length (default: the run's evaluation settings).")
    clamp_len: int | None = Field(None, description="Clamp relative distances above this (-1: none).")
    same_length: bool | None = Field(None, description="Every query sees mem_len keys.")
    per_token: bool = Field(False, description="Also return every token with its log-probability.")


class BadRequest(ValueError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _field_error(e: RequestValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            parts.append("the request body is not valid JSON")
        elif not loc and err.get("type") in ("model_attributes_type", "dict_type"):
            why = "a JSON object, sent with Content-Type: application/json (curl: -H 'Content-Type: application/json')"
            parts.append(f"the request body must be {why}")
        elif err.get("type") == "extra_forbidden":
            parts.append(f"{'.'.join(loc)}: unknown field")
        else:
            parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)


class Server:
    """The model, its tokenizer and settings, and the engine, for one app."""

    def __init__(self, model_dir: str | Path, limits: ServeLimits, api_key: str | None = None):
        import torch

        from txl.checkpoint import read_run_config, resolve_model_dir
        from txl.data import Tokenizer
        from txl.evaluate import metric_name
        from txl.modeling import TransformerXLLM

        self.source = Path(model_dir)
        self.folder = resolve_model_dir(model_dir)
        self.run = read_run_config(self.folder)
        self.model = TransformerXLLM.from_pretrained(self.folder).eval()
        tok_file = self.folder / "tokenizer.json"
        self.tokenizer = Tokenizer.load(tok_file) if tok_file.exists() else None
        self.metric = metric_name(self.tokenizer.kind) if self.tokenizer else "ppl"
        self.limits = limits
        self.api_key = api_key
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.name = self.source.resolve().name  # (what OpenAI's API calls the model)
        self.engine: Engine | None = None
        self._torch = torch

    # -- requests -----------------------------------------------------------------------------------------------

    def _encode(self, text: str | None, ids: list[int] | None, field: str, ids_field: str) -> list[int]:
        if (text is None) == (ids is None):
            raise BadRequest(422, f"{field}: give either {field} or {ids_field}")
        if ids is not None:
            bad = [i for i in ids if not 0 <= i < self.model.config.n_token]
            if bad:
                raise BadRequest(422, f"{ids_field}: ids must be in [0, {self.model.config.n_token}), got {bad[0]}")
            return list(ids)
        if self.tokenizer is None:
            raise BadRequest(422, f"{field}: the model has no tokenizer.json; send {ids_field}")
        try:
            return self.tokenizer.encode(text)
        except ValueError as e:
            raise BadRequest(422, f"{field}: {e}") from None

    def generation(self, req: GenerateRequest, emit) -> tuple[Generation, list[int]]:
        ids = self._encode(req.prompt, req.prompt_ids, "prompt", "prompt_ids")
        lim = self.limits
        if not ids:
            raise BadRequest(422, "prompt: encodes to no tokens")
        if len(ids) > lim.max_prompt_tokens:
            raise BadRequest(422, f"prompt: {len(ids)} tokens, more than the limit of {lim.max_prompt_tokens}")
        if req.max_new_tokens > lim.max_new_tokens:
            raise BadRequest(422, f"max_new_tokens: {req.max_new_tokens} is more than the limit {lim.max_new_tokens}")
        if any(s == "" for s in req.stop):
            raise BadRequest(422, "stop: a stop string must not be empty")
        mem_len = req.mem_len or self.model.config.mem_len
        if mem_len > lim.max_mem_len:
            raise BadRequest(422, f"mem_len: {mem_len} is more than the limit {lim.max_mem_len}")
        if mem_len < 1:
            raise BadRequest(422, "mem_len: the model has no memory length; give mem_len >= 1")
        gen = Generation(
            prompt_ids=ids, max_new_tokens=req.max_new_tokens, emit=emit, mem_len=mem_len,
            temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=req.seed,
        )  # fmt: skip
        return gen, ids

    def completion_request(self, req: CompletionRequest) -> tuple[GenerateRequest, str]:
        """The generation an OpenAI completions request asks for, and its prompt's text (for ``echo``)."""
        refused = {
            "n": (req.n != 1, "one completion per request (send several: they are batched)"),
            "best_of": (req.best_of not in (None, 1), "one completion per request"),
            "logprobs": (req.logprobs is not None, "not given here; POST /v1/score gives each token's log-probability"),
            "suffix": (req.suffix is not None, "insertion is not something a left-to-right model does"),
            "presence_penalty": (req.presence_penalty != 0, "not supported (0 only)"),
            "frequency_penalty": (req.frequency_penalty != 0, "not supported (0 only)"),
            "logit_bias": (bool(req.logit_bias), "not supported"),
        }
        for name, (bad, why) in refused.items():
            if bad:
                raise BadRequest(422, f"{name}: {why}")
        if (req.max_tokens or 0) > self.limits.max_new_tokens:
            raise BadRequest(422, f"max_tokens: {req.max_tokens} is more than the limit {self.limits.max_new_tokens}")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise BadRequest(422, "prompt: one prompt per request (send several requests: they are batched)")
            prompt = prompt[0]
        ids = self._encode(None, list(prompt), "prompt", "prompt") if isinstance(prompt, list) else None
        text = prompt if ids is None else (self.tokenizer.decode(ids) if self.tokenizer else "")
        gen = GenerateRequest(
            prompt=None if ids is not None else prompt, prompt_ids=ids,
            max_new_tokens=16 if req.max_tokens is None else req.max_tokens, temperature=req.temperature,
            top_p=req.top_p, seed=req.seed, stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            stream=req.stream,
        )  # fmt: skip
        return gen, text

    def score(self, req: ScoreRequest) -> dict[str, Any]:
        import numpy as np

        from txl.evaluate import eval_settings, evaluate

        ids = self._encode(req.text, req.ids, "text", "ids")
        if len(ids) < 2:
            raise BadRequest(422, "text: needs at least 2 tokens (the first one is only context)")
        if len(ids) > self.limits.max_score_tokens:
            raise BadRequest(422, f"text: {len(ids)} tokens, more than the limit of {self.limits.max_score_tokens}")
        try:
            s = eval_settings(
                self.run, self.model.config, tgt_len=req.tgt_len, mem_len=req.mem_len, clamp_len=req.clamp_len,
                same_length=req.same_length,
            )  # fmt: skip
        except ValueError as e:
            raise BadRequest(422, str(e).replace("--", "")) from None
        if s.mem_len > self.limits.max_mem_len:
            raise BadRequest(422, f"mem_len: {s.mem_len} is more than the limit {self.limits.max_mem_len}")
        array = np.asarray(ids, dtype=np.int64)

        def run():
            return evaluate(
                self.model, array, batch_size=1, tgt_len=s.tgt_len, mem_len=s.mem_len, clamp_len=s.clamp_len,
                same_length=s.same_length, return_losses=req.per_token,
            )  # fmt: skip

        return {"ids": ids, "settings": s, "run": run}

    def info(self) -> dict[str, Any]:
        from txl.metrics import read_metrics

        metrics = {}
        for folder in (self.source, self.folder, self.folder.parent, self.folder.parent.parent):
            rows = read_metrics(folder)
            if rows:
                for split in ("train", "valid"):
                    last = [r for r in rows if r.get("split") == split]
                    if last:
                        metrics[split] = last[-1]
                break
        return {
            "model": str(self.folder),
            "parameters": self.n_params,
            "config": self.model.config.to_dict(),
            "tokenizer": None if self.tokenizer is None else {"kind": self.tokenizer.kind,
                                                              "vocab_size": self.tokenizer.vocab_size},
            "metric": self.metric,
            "limits": self.limits.__dict__,
            "batched": bool(self.engine and self.engine.batched),
            "training_metrics": metrics,
        }  # fmt: skip


def _stop_cut(text: str, stops: list[str]) -> tuple[int | None, int]:
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


def create_app(model_dir: str | Path, limits: ServeLimits | None = None, api_key: str | None = None) -> FastAPI:
    """The FastAPI app of ``txl serve`` for one model (the engine starts and stops with the app's lifespan)."""
    server = Server(model_dir, limits or ServeLimits(), api_key)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine = Engine(server.model, max_batch=server.limits.max_batch, max_queue=server.limits.max_queue)
        try:
            yield
        finally:
            await asyncio.to_thread(server.engine.shutdown)

    app = FastAPI(title="txl serve", description=f"Transformer-XL model {server.folder}", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        return JSONResponse({"error": _field_error(e)}, status_code=422)

    @app.exception_handler(BadRequest)
    async def bad(request: Request, e: BadRequest):
        return JSONResponse({"error": str(e)}, status_code=e.status)

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if server.api_key and request.url.path != "/health":
            given = request.headers.get("x-api-key") or request.query_params.get("key") or ""
            auth = request.headers.get("authorization", "")
            if auth.lower().startswith("bearer "):
                given = auth[7:]
            if not hmac.compare_digest(given.encode(), server.api_key.encode()):
                return JSONResponse({"error": "missing or wrong API key (X-API-Key header)"}, status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        engine = server.engine
        return {"status": "ok", "active": engine.active if engine else 0, "waiting": engine.waiting if engine else 0}

    @app.get("/v1/model")
    async def model_info() -> dict[str, Any]:
        return server.info()

    @app.get("/", response_class=HTMLResponse)
    async def page() -> str:
        return resources.files("txl").joinpath("static/index.html").read_text(encoding="utf-8")

    @app.post("/v1/score")
    async def score(req: ScoreRequest) -> dict[str, Any]:
        job = server.score(req)
        try:
            res = await asyncio.wrap_future(server.engine.call(job["run"]))
        except (QueueFull, EngineStopped) as e:
            raise BadRequest(429 if isinstance(e, QueueFull) else 503, str(e)) from None
        from txl.evaluate import metric_value

        s = job["settings"]
        out = {
            "loss": res.loss, server.metric: metric_value(res.loss, server.metric), "metric": server.metric,
            "tokens": res.tokens,
            "settings": {"tgt_len": s.tgt_len, "mem_len": s.mem_len, "clamp_len": s.clamp_len,
                         "same_length": s.same_length},
        }  # fmt: skip
        if req.per_token:
            ids = job["ids"]
            pieces = _pieces(server, ids)
            scored = zip(pieces[1:], ids[1:], res.losses, strict=True)
            out["per_token"] = [{"text": pieces[0], "id": ids[0], "logprob": None}] + [
                {"text": p, "id": i, "logprob": -float(x)} for p, i, x in scored
            ]
        return out

    def start(req: GenerateRequest) -> tuple[Any, Any, Generation]:
        """Submit a generation (a bad or refused request raises here, before any response starts); return the
        iterator of (token id, text so far, new ids) as they come, ending with (None, text, new ids), and the
        function that sums a generation up."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        gen, ids = server.generation(req, lambda tok: loop.call_soon_threadsafe(queue.put_nowait, tok))
        try:
            server.engine.submit(gen)
        except QueueFull as e:
            raise BadRequest(429, f"busy: {e}; retry later") from None
        except EngineStopped as e:
            raise BadRequest(503, str(e)) from None
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
                    new.append(tok)
                    if decoder:
                        text += decoder.push(tok)
                    yield tok, text, new
            finally:
                gen.cancel()

        def summary(text: str, new: list[int], reason: str) -> dict[str, Any]:
            elapsed = max(time.monotonic() - begun, 1e-9)
            return {
                "text": text, "token_ids": new, "prompt_tokens": len(ids), "new_tokens": len(new),
                "finish_reason": reason, "error": gen.error, "seconds": elapsed, "tokens_per_s": len(new) / elapsed,
            }  # fmt: skip

        return tokens, summary, gen

    async def finished(started, stop: list[str]) -> dict[str, Any]:
        """The whole generation's summary (text cut before the first stop string): the end of :func:`pieces`."""
        async with aclosing(pieces(started, stop)) as events:  # (closing it cancels the generation)
            async for _, final in events:
                if final is not None:
                    if final["finish_reason"] == "error":
                        raise BadRequest(500, f"generation failed: {final['error']}")
                    return final
        raise AssertionError("pieces() always ends with the summary")

    async def pieces(started, stop: list[str]):
        """({"token_id", "text"}, None) for each piece of text that is safe to send (no stop string can begin in
        it), then (None, the summary)."""
        tokens, summary, gen = started
        sent = 0
        try:
            async for tok, text, new in tokens():
                cut, safe = _stop_cut(text, stop)
                end = cut if cut is not None else (len(text) if tok is None else safe)
                if tok is not None and cut is None or end > sent:
                    yield {"token_id": tok, "text": text[sent:end]}, None
                    sent = end
                if cut is not None or tok is None:
                    yield None, summary(text[:end], new, "stop" if cut is not None else (gen.finish_reason or "length"))
                    return
        finally:
            gen.cancel()

    def sse(events) -> StreamingResponse:
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/generate")
    async def generate(req: GenerateRequest):
        started = start(req)
        if not req.stream:
            return await finished(started, req.stop)

        async def events():
            async for piece, final in pieces(started, req.stop):
                yield f"data: {json.dumps(piece if final is None else final | {'done': True})}\n\n"

        return sse(events())

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        """OpenAI's model list: this server's one model."""
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": 0, "owned_by": "txl"}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        """OpenAI's completions API (a client library or tool that speaks it works unchanged): ``prompt`` (text or
        token ids), ``max_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed``, ``echo``, ``stream``."""
        gen_req, prompt_text = server.completion_request(req)
        started = start(gen_req)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": req.model or server.name}  # fmt: skip

        def choice(text: str, reason: str | None) -> dict[str, Any]:
            return {"text": text, "index": 0, "logprobs": None, "finish_reason": reason}

        def usage(final: dict[str, Any]) -> dict[str, int]:
            n, m = final["prompt_tokens"], final["new_tokens"]
            return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}

        echo = prompt_text if req.echo else ""
        if not req.stream:
            final = await finished(started, gen_req.stop)
            return head | {"choices": [choice(echo + final["text"], final["finish_reason"])], "usage": usage(final)}

        async def events():
            if echo:
                yield f"data: {json.dumps(head | {'choices': [choice(echo, None)]})}\n\n"
            async for piece, final in pieces(started, gen_req.stop):
                if final is None:
                    yield f"data: {json.dumps(head | {'choices': [choice(piece['text'], None)]})}\n\n"
                else:
                    last = head | {"choices": [choice("", final["finish_reason"])], "usage": usage(final)}
                    yield f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n"

        return sse(events())

    return app


def _pieces(server: Server, ids: list[int]) -> list[str]:
    """The text of each token, as it appears in the decoded text (a word with its separator)."""
    if server.tokenizer is None:
        return [str(i) for i in ids]
    decoder = server.tokenizer.stream_decoder()
    pieces = [decoder.push(i) for i in ids]
    pieces[-1] += decoder.flush()
    return pieces
