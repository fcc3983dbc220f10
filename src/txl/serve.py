"""``txl serve``: an HTTP API (FastAPI) over a trained model, with a web page, batched streaming generation and
long-text scoring.

Endpoints: ``POST /v1/generate`` (JSON, or server-sent events with ``"stream": true``), ``POST /v1/score``,
``GET /v1/model``, ``GET /health``, ``GET /`` (the page; OpenAPI docs at ``/docs``), OpenAI's
``POST /v1/completions`` and ``GET /v1/models``, so that clients of that API work unchanged, and vLLM's
``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``, so that lm-evaluation-harness's
``local-completions`` model scores and generates through the server with the model's own tokenizer. Every model
call runs on the :class:`~txl.engine.Engine`'s thread, which batches concurrent generations step by step; the event
loop only decodes text and talks HTTP. Bad input is a 4xx with a one-line message naming the field.
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

from txl.engine import MAX_LOGPROBS, Engine, EngineStopped, Generation, QueueFull, TokenScore
from txl.generation import Penalties


@dataclass
class ServeLimits:
    """Caps that keep one client from taking the server (each a `txl serve` option)."""

    max_prompt_tokens: int = 4096
    max_new_tokens: int = 1024
    max_batch: int = 8
    max_queue: int = 64
    max_score_tokens: int = 200_000
    max_mem_len: int = 8192


class OpenAIPenalties(BaseModel):
    """OpenAI's penalties, taken by both generation endpoints."""

    presence_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="OpenAI's: subtracted from a token's score once the new text holds it."
    )
    frequency_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="OpenAI's: subtracted from a token's score per time the new text holds it."
    )
    logit_bias: dict[int, float] | None = Field(
        None, description="Added to the scores of these token ids (-100: never; 100: always)."
    )


class GenerateRequest(OpenAIPenalties):
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
    repetition_penalty: float = Field(
        1.0, gt=0.0, description="Hugging Face's: the log-probability of a token already in the prompt or the text "
        "is multiplied by this (1: none)."
    )  # fmt: skip
    no_repeat_ngram_size: int = Field(0, ge=0, description="Never repeat an n-gram of this many tokens (0: off).")
    num_beams: int = Field(
        1, ge=1, description="Beam search with this many beams, as Hugging Face's generate() (needs temperature 0; "
        "at most the server's max_batch): the likeliest text of max_new_tokens tokens, cut before the first stop "
        "string; its first token is sent when the search ends, other requests go on meanwhile (a step of each "
        "beside each step of the search), and a streaming client that leaves stops it."
    )  # fmt: skip
    length_penalty: float = Field(
        1.0, description="Beam search: a finished text's score is its log-probability over its length to this power."
    )


class CompletionRequest(OpenAIPenalties):
    """OpenAI's completions request. Fields of OpenAI's that txl does not have are refused when set to anything
    but their neutral value; fields unknown to OpenAI too are ignored, as clients send some of their own."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="Any name: the server has one model.")
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="Text or token ids; a list of them for several prompts (a choice each, in order)."
    )
    max_tokens: int | None = Field(16, ge=0, description="Tokens to generate (OpenAI's default: 16).")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature (0: greedy).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold (1: off).")
    stop: str | list[str] | None = Field(None, description="Stop before the first of these strings.")
    seed: int | None = Field(None, description="Random seed: choice k of a prompt samples with seed + k.")
    echo: bool = Field(False, description="Give the prompt's text (and with logprobs, its tokens') first.")
    stream: bool = Field(False, description="Stream the text as server-sent events, ending with data: [DONE].")
    n: int = Field(1, ge=1, description="Completions per prompt.")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS,
        description="Give each token's log-probability and this many most likely tokens at its place.",
    )  # fmt: skip
    best_of: int | None = None
    suffix: str | None = None
    user: str | None = None


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize`` request (lm-evaluation-harness's remote tokenizer)."""

    model_config = ConfigDict(extra="ignore")

    prompt: str = Field(..., description="The text to encode with the model's tokenizer.")
    add_special_tokens: bool = Field(False, description="Accepted for vLLM's clients: txl adds no special tokens.")


class DetokenizeRequest(BaseModel):
    """vLLM's ``/detokenize`` request."""

    model_config = ConfigDict(extra="ignore")

    tokens: list[int] = Field(..., description="Token ids to decode.")


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str | None = Field(None, description="The text to score (any length), read with the model's tokenizer.")
    ids: list[int] | None = Field(None, description="Token ids to score, instead of text.")
    tgt_len: int | None = Field(None, ge=1, description="Segment length (default: the run's evaluation settings).")
    mem_len: int | None = Field(None, ge=0, description="Memory length (default: the run's evaluation settings).")
    clamp_len: int | None = Field(None, description="Clamp relative distances above this (-1: none).")
    same_length: bool | None = Field(None, description="Every query sees mem_len keys.")
    per_token: bool = Field(False, description="Also return every token with its log-probability.")
    zero_memory: bool = Field(False, description="Start from mem_len zero vectors, as Hugging Face's TransfoXL did.")


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

    def __init__(self, model_dir: str | Path, limits: ServeLimits, api_key: str | None = None, device: str = "cpu"):
        import torch

        from txl.checkpoint import read_run_config, resolve_model_dir
        from txl.data import Tokenizer
        from txl.distributed import resolve_device
        from txl.evaluate import metric_name
        from txl.modeling import TransformerXLLM

        self.device = resolve_device(device, option="--device")
        self.source = Path(model_dir)
        self.folder = resolve_model_dir(model_dir)
        self.run = read_run_config(self.folder)
        self.model = TransformerXLLM.from_pretrained(self.folder).eval().to(self.device)
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

    def tokenizer_or_422(self, what: str):
        if self.tokenizer is None:
            raise BadRequest(422, f"{what}: the model has no tokenizer.json")
        return self.tokenizer

    def generation(
        self, req: GenerateRequest, emit, logprobs: int | None = None, prompt_logprobs: bool = False
    ) -> tuple[Generation, list[int]]:
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
        if req.num_beams > 1:
            from txl.modeling import supports_kv_cache

            if req.temperature != 0:
                raise BadRequest(422, "num_beams: beam search finds the likeliest text: give temperature 0")
            if req.num_beams > lim.max_batch:
                raise BadRequest(422, f"num_beams: {req.num_beams} is more than the server's max_batch {lim.max_batch}")
            if not supports_kv_cache(self.model.config):
                attn = self.model.config.attn_type
                raise BadRequest(422, f"num_beams: beam search needs a K/V cache (attn_type 0 or 1), not {attn}")
        bias = req.logit_bias or {}
        bad = [i for i in bias if not 0 <= i < self.model.config.n_token]
        if bad:
            raise BadRequest(422, f"logit_bias: token ids must be in [0, {self.model.config.n_token}), got {bad[0]}")
        if any(not -100 <= b <= 100 for b in bias.values()):
            raise BadRequest(422, "logit_bias: a bias must be in [-100, 100]")
        penalties = Penalties(
            repetition_penalty=req.repetition_penalty, no_repeat_ngram_size=req.no_repeat_ngram_size,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            logit_bias=tuple(sorted(bias.items())),
        )  # fmt: skip
        gen = Generation(
            prompt_ids=ids, max_new_tokens=req.max_new_tokens, emit=emit, mem_len=mem_len, penalties=penalties,
            temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=req.seed, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, num_beams=req.num_beams, length_penalty=req.length_penalty,
        )  # fmt: skip
        return gen, ids

    def completion_requests(self, req: CompletionRequest) -> list[tuple[GenerateRequest, str]]:
        """The generations an OpenAI completions request asks for (``n`` per prompt, in the order of the response's
        choices), each with its prompt's text (for ``echo``)."""
        refused = {
            "best_of": (req.best_of not in (None, req.n), "not supported (give n: every completion is returned)"),
            "suffix": (req.suffix is not None, "insertion is not something a left-to-right model does"),
        }
        for name, (bad, why) in refused.items():
            if bad:
                raise BadRequest(422, f"{name}: {why}")
        if (req.max_tokens or 0) > self.limits.max_new_tokens:
            raise BadRequest(422, f"max_tokens: {req.max_tokens} is more than the limit {self.limits.max_new_tokens}")
        prompts = req.prompt
        if not isinstance(prompts, list) or not prompts or not isinstance(prompts[0], (str, list)):
            prompts = [prompts]  # (one text, or one list of ids)
        total = len(prompts) * req.n
        if total > self.limits.max_queue:
            raise BadRequest(
                422, f"prompt: {len(prompts)} prompt(s) x n = {req.n} is {total} completions, more than the "
                f"server's queue of {self.limits.max_queue}: send fewer at once"
            )  # fmt: skip
        out = []
        for k, prompt in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{k}]"
            ids = self._encode(None, list(prompt), where, where) if isinstance(prompt, list) else None
            text = prompt if ids is None else (self.tokenizer.decode(ids) if self.tokenizer else "")
            for j in range(req.n):
                gen = GenerateRequest(
                    prompt=None if ids is not None else prompt, prompt_ids=ids,
                    max_new_tokens=16 if req.max_tokens is None else req.max_tokens, temperature=req.temperature,
                    top_p=req.top_p, seed=None if req.seed is None else req.seed + j,
                    stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []), stream=req.stream,
                    presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                    logit_bias=req.logit_bias,
                )  # fmt: skip
                out.append((gen, text))
        return out

    def score(self, req: ScoreRequest) -> dict[str, Any]:
        import numpy as np

        from txl.distributed import World
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
                same_length=s.same_length, return_losses=req.per_token, zero_memory=req.zero_memory,
                world=World(device=self.device),
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


def create_app(
    model_dir: str | Path, limits: ServeLimits | None = None, api_key: str | None = None, device: str = "cpu"
) -> FastAPI:
    """The FastAPI app of ``txl serve`` for one model (the engine starts and stops with the app's lifespan);
    ``device``: cpu, cuda, cuda:N or auto (the GPU if there is one)."""
    server = Server(model_dir, limits or ServeLimits(), api_key, device)

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

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        """vLLM's tokenizer description (with ``/tokenize`` and ``/detokenize``, lm-evaluation-harness's
        ``tokenizer_backend=remote``): the end-of-text token is the text a document is read after (the line end)."""
        tok = server.tokenizer_or_422("tokenizer_info")
        return {
            "tokenizer_class": f"txl.Tokenizer ({tok.kind})", "eos_token": tok.document_start()[0],
            "bos_token": None, "pad_token": None, "model_max_length": server.limits.max_prompt_tokens,
            "vocab_size": tok.vocab_size,
        }  # fmt: skip

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        ids = server._encode(req.prompt, None, "prompt", "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": server.limits.max_prompt_tokens}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        tok = server.tokenizer_or_422("detokenize")
        try:
            return {"prompt": tok.decode(req.tokens)}
        except ValueError as e:
            raise BadRequest(422, f"tokens: {e}") from None

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

    def start(req: GenerateRequest, logprobs: int | None = None, prompt_logprobs: bool = False):
        """Submit a generation (a bad or refused request raises here, before any response starts); return the
        iterator of (token id, text so far, new ids) as they come, ending with (None, text, new ids), the
        function that sums a generation up, and the generation."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        emit = lambda tok: loop.call_soon_threadsafe(queue.put_nowait, tok)  # noqa: E731
        gen, ids = server.generation(req, emit, logprobs, prompt_logprobs)
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
        token ids, one or a list), ``max_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed``, ``echo``, ``n``,
        ``logprobs`` (with ``echo``, the prompt's tokens' too: lm-evaluation-harness's loglikelihood),
        ``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``stream``."""
        wanted = server.completion_requests(req)
        started = []
        try:
            for gen_req, _ in wanted:
                started.append(start(gen_req, req.logprobs, req.echo and req.logprobs is not None))
        except BadRequest:
            for _, _, gen in started:
                gen.cancel()
            raise
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": req.model or server.name}  # fmt: skip

        def choice(k: int, text: str, reason: str | None, logprobs: dict | None = None) -> dict[str, Any]:
            return {"text": text, "index": k, "logprobs": logprobs, "finish_reason": reason}

        def usage(finals: list[dict[str, Any]]) -> dict[str, int]:
            n = sum(f["prompt_tokens"] for f in finals[:: req.n])  # (each prompt once)
            m = sum(f["new_tokens"] for f in finals)
            return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}

        def writer(k: int) -> tuple[_Logprobs, dict[str, list]] | None:
            """Choice k's log-probability writer, past its prompt, and the prompt's log-probabilities (with echo)."""
            if req.logprobs is None:
                return None
            gen, text = started[k][2], wanted[k][1]
            w = _Logprobs(server.tokenizer)
            prompt = w.add(gen.prompt_ids, [None, *gen.prompt_scores]) if req.echo else w.skip(gen.prompt_ids)
            w.offset = len(text) if req.echo else 0  # (the completion's text follows the prompt's as given)
            return w, prompt

        if not req.stream:
            try:
                finals = await asyncio.gather(*(finished(s, g.stop) for s, (g, _) in zip(started, wanted, strict=True)))
            except BaseException:  # (one failed, or the client left: the others stop too)
                for _, _, gen in started:
                    gen.cancel()
                raise
            choices = []
            for k, final in enumerate(finals):
                echo = wanted[k][1] if req.echo else ""
                lp = None
                if (written := writer(k)) is not None:
                    w, lp = written
                    end = len(echo) + len(final["text"]) if final["finish_reason"] == "stop" else None
                    new = w.add(final["token_ids"], started[k][2].scores, end=end, last=True)
                    lp = {key: lp[key] + new[key] for key in lp}
                choices.append(choice(k, echo + final["text"], final["finish_reason"], lp))
            return head | {"choices": choices, "usage": usage(finals)}

        async def one(k: int):
            """Choice k's chunks, each with None, then its last chunk with its summary. The first comes once the
            engine has read the prompt (the echo's log-probabilities are known then)."""
            gen_req, prompt_text = wanted[k]
            scores, written, begun, count = started[k][2].scores, None, False, 0
            async with aclosing(pieces(started[k], gen_req.stop)) as events:
                async for piece, final in events:
                    if not begun:
                        begun, written = True, writer(k)
                        if req.echo:
                            yield choice(k, prompt_text, None, written and written[1]), None
                    if final is not None:
                        yield choice(k, "", final["finish_reason"]), final
                        return
                    lp = None
                    if piece["token_id"] is not None:
                        if written is not None:
                            lp = written[0].add([piece["token_id"]], scores[count : count + 1])
                        count += 1
                    yield choice(k, piece["text"], None, lp), None

        async def events():
            finals: list[dict[str, Any] | None] = [None] * len(started)
            async for chunk, final in _merged([one(k) for k in range(len(started))]):
                k = chunk["index"]
                if final is not None:
                    finals[k] = final
                    if all(f is not None for f in finals):
                        yield f"data: {json.dumps(head | {'choices': [chunk], 'usage': usage(finals)})}\n\n"
                        continue
                yield f"data: {json.dumps(head | {'choices': [chunk]})}\n\n"
            yield "data: [DONE]\n\n"

        return sse(events())

    return app


class _Logprobs:
    """OpenAI's ``logprobs`` of one choice, written token by token: ``tokens`` (the text each token adds to the
    decoded text after the tokens before it), ``token_logprobs``, ``top_logprobs`` (the most likely tokens at each
    place and the token itself, keyed by the text each would have added there; where two would add the same text,
    the likelier is kept) and ``text_offset`` (where each token's text begins in the choice's text). A word-level
    model with Moses detokenization gives a word once the next word shows it is whole: its text can come with a
    later token."""

    def __init__(self, tokenizer) -> None:
        self.decoder = tokenizer.stream_decoder() if tokenizer is not None else None
        self.offset = 0

    @staticmethod
    def _empty() -> dict[str, list]:
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def _text(self, token: int, peek: bool = False) -> str:
        if self.decoder is None:
            return str(token)
        return self.decoder.peek(token) if peek else self.decoder.push(token)

    def skip(self, ids: list[int]) -> dict[str, list]:
        """Read tokens that are not written (a prompt without echo)."""
        for i in ids:
            self._text(i)
        return self._empty()

    def add(
        self, ids: list[int], scores: list[TokenScore | None], end: int | None = None, last: bool = False
    ) -> dict[str, list]:
        """The entries of ``ids`` (a missing score is None: a prompt's first token has none); with ``end``, only the
        tokens whose text begins before it (a completion cut at a stop string); ``last``: the text's end follows.
        A prompt that the tokenizer does not read back as given (unknown words, normalisation) has the tokens the
        model read; the completion's offsets count from the end of the prompt as given."""
        out = self._empty()
        for i, score in zip(ids, [*scores, *[None] * (len(ids) - len(scores))], strict=False):
            top = None
            if score is not None:
                top = {}
                for alt, lp in score[1]:
                    top.setdefault(self._text(alt, peek=True), lp)
            text = self._text(i)
            if end is not None and self.offset >= end:
                return out
            if top is not None:  # (the token itself is always there, as vLLM gives it)
                top.setdefault(text, score[0])
            for key, value in zip(out, (text, None if score is None else score[0], top, self.offset), strict=True):
                out[key].append(value)
            self.offset += len(text)
        if last and end is None and self.decoder is not None and out["tokens"]:  # (a cut text has no held tail)
            out["tokens"][-1] += self.decoder.flush()
        return out


async def _merged(streams: list):
    """The items of several async iterators as they come (each closed at the end, or when this one is)."""
    queue: asyncio.Queue = asyncio.Queue()
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


def _pieces(server: Server, ids: list[int]) -> list[str]:
    """The text of each token, as it appears in the decoded text (a word with its separator)."""
    if server.tokenizer is None:
        return [str(i) for i in ids]
    decoder = server.tokenizer.stream_decoder()
    pieces = [decoder.push(i) for i in ids]
    pieces[-1] += decoder.flush()
    return pieces
