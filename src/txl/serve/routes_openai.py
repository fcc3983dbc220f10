"""OpenAI's API (``GET /v1/models``, ``POST /v1/completions``), so that clients of that API work unchanged, and
vLLM's tokenizer endpoints (``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``), so that
lm-evaluation-harness's ``local-completions`` model scores and generates through the server with the model's own
tokenizer."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request

from txl.serve.engine import TokenScore
from txl.serve.http import ApiError, error_body, invalid, sse_error
from txl.serve.schemas import STREAMED, CompletionRequest, DetokenizeRequest, TokenizeRequest
from txl.serve.state import Choice, Server
from txl.serve.streams import Started, finished, merged, pieces, sse, start, unless_disconnected


def router(server: Server) -> APIRouter:
    """The routes of OpenAI's and vLLM's APIs over ``server``, each built by its own function below."""
    api = APIRouter()
    _tokenizer_routes(api, server)
    _models_route(api, server)
    _completions_route(api, server)
    return api


def _tokenizer_routes(api: APIRouter, server: Server) -> None:
    """vLLM's ``GET /tokenizer_info``, ``POST /tokenize`` and ``POST /detokenize`` (lm-evaluation-harness's
    ``tokenizer_backend=remote``)."""

    @api.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        """vLLM's tokenizer description (with ``/tokenize`` and ``/detokenize``, lm-evaluation-harness's
        ``tokenizer_backend=remote``): the end-of-text token is the text a document is read after (the line end)."""
        tok = server.tokenizer_or_400("tokenizer_info")
        return {
            "tokenizer_class": f"txl.Tokenizer ({tok.kind})", "eos_token": tok.document_start()[0],
            "bos_token": None, "pad_token": None, "model_max_length": server.limits.max_prompt_tokens,
            "vocab_size": tok.vocab_size,
        }  # fmt: skip

    @api.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        ids = server._encode(req.prompt, None, "prompt", "prompt", req.unknown)
        return {"tokens": ids, "count": len(ids), "max_model_len": server.limits.max_prompt_tokens}

    @api.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        tok = server.tokenizer_or_400("detokenize")
        server.check_ids(req.tokens, "tokens")
        try:
            return {"prompt": tok.decode(req.tokens)}
        except ValueError as e:
            raise invalid("tokens", str(e)) from None


def _models_route(api: APIRouter, server: Server) -> None:
    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        """OpenAI's model list: this server's one model (under its first served name)."""
        return {
            "object": "list",
            "data": [{"id": server.served_names[0], "object": "model", "created": 0, "owned_by": "txl"}],
        }


def _completions_route(api: APIRouter, server: Server) -> None:
    @api.post("/v1/completions", responses=STREAMED)
    async def completions(req: CompletionRequest, request: Request):
        """OpenAI's completions API (a client library or tool that speaks it works unchanged): ``prompt`` (text or
        token ids, one or a list), ``max_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed``, ``echo``, ``n``,
        ``logprobs`` (with ``echo``, the prompt's tokens' too: lm-evaluation-harness's loglikelihood),
        ``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``stream``."""
        completion = _Completion(server, req)
        if not req.stream:
            return await completion.whole(request)
        return sse(completion.events())


class _Completion:
    """One OpenAI completions request: its choices submitted (a refused one cancels those before it), then the
    response, whole (:meth:`whole`) or as server-sent events (:meth:`events`)."""

    def __init__(self, server: Server, req: CompletionRequest):
        self.server, self.req = server, req
        self.wanted: list[Choice] = server.completion_requests(req)
        self.started: list[Started] = []
        group = object()  # (the request's choices: one caller, for the engine's fairness)
        try:
            for c in self.wanted:
                prompt_logprobs = req.echo and req.logprobs is not None
                self.started.append(start(server, c.request, req.logprobs, prompt_logprobs, group))
        except ApiError:
            self.cancel()
            raise
        self.head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                     "model": req.model or server.served_names[0]}  # fmt: skip

    def cancel(self) -> None:
        for s in self.started:
            s.gen.cancel()

    @staticmethod
    def choice(k: int, text: str, reason: str | None, logprobs: dict | None = None) -> dict[str, Any]:
        return {"text": text, "index": k, "logprobs": logprobs, "finish_reason": reason}

    def usage(self, finals: list[dict[str, Any]]) -> dict[str, int]:
        n = sum(f["prompt_tokens"] for f in finals[:: self.req.n])  # (each prompt once)
        m = sum(f["new_tokens"] for f in finals)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}

    def writer(self, k: int) -> tuple[_Logprobs, dict[str, list]] | None:
        """Choice k's log-probability writer, past its prompt, and the prompt's log-probabilities (with echo)."""
        if self.req.logprobs is None:
            return None
        gen, text = self.started[k].gen, self.wanted[k].prompt_text
        w = _Logprobs(self.server.tokenizer)
        prompt = w.add(gen.prompt_ids, [None, *gen.prompt_scores]) if self.req.echo else w.skip(gen.prompt_ids)
        w.offset = len(text) if self.req.echo else 0  # (the completion's text follows the prompt's as given)
        return w, prompt

    async def whole(self, request: Request) -> dict[str, Any]:
        """The response at the end: every choice's text (and log-probabilities), the usage."""
        req = self.req
        done = (finished(s, c.request.stop) for s, c in zip(self.started, self.wanted, strict=True))
        try:
            finals = await unless_disconnected(request, asyncio.gather(*done), self.cancel)
        except BaseException:  # (one failed, or the client left: the others stop too)
            self.cancel()
            raise
        choices = []
        for k, final in enumerate(finals):
            echo = self.wanted[k].prompt_text if req.echo else ""
            lp = None
            if (written := self.writer(k)) is not None:
                w, lp = written
                end = len(echo) + len(final["text"]) if final["finish_reason"] == "stop" else None
                new = w.add(final["token_ids"], self.started[k].gen.scores, end=end, last=True)
                lp = {key: lp[key] + new[key] for key in lp}
            choices.append(self.choice(k, echo + final["text"], final["finish_reason"], lp))
        return self.head | {"choices": choices, "usage": self.usage(finals)}

    async def one(self, k: int):
        """Choice k's chunks, each with None, then its last chunk with its summary. The first comes once the
        engine has read the prompt (the echo's log-probabilities are known then)."""
        c, gen = self.wanted[k], self.started[k].gen
        scores, written, begun, count = gen.scores, None, False, 0
        async with aclosing(pieces(self.started[k], c.request.stop)) as events:
            async for piece, final in events:
                if not begun:
                    begun, written = True, self.writer(k)
                    gen.prompt_scores = []  # (written into the first chunk: not kept for the stream)
                    if self.req.echo:
                        yield self.choice(k, c.prompt_text, None, written and written[1]), None
                if final is not None:
                    yield self.choice(k, "", final["finish_reason"]), final
                    return
                lp = None
                if piece["token_id"] is not None:
                    if written is not None:
                        # (kept after they are sent: TokenScores holds 164 bytes per token at 20 alternatives,
                        # 168 KB for the longest generation)
                        lp = written[0].add([piece["token_id"]], scores[count : count + 1])
                    count += 1
                yield self.choice(k, piece["text"], None, lp), None

    async def events(self):
        """OpenAI's chunks, then ``[DONE]``; a choice that fails ends the stream (and the other choices) with an
        error event (OpenAI's shape) and ``[DONE]``."""
        finals: list[dict[str, Any] | None] = [None] * len(self.started)
        try:
            async for chunk, final in merged([self.one(k) for k in range(len(self.started))]):
                k = chunk["index"]
                if final is not None:
                    if final["finish_reason"] == "error":
                        yield sse_error({"error": final["error"]})
                        return
                    finals[k] = final
                    if all(f is not None for f in finals):
                        yield f"data: {json.dumps(self.head | {'choices': [chunk], 'usage': self.usage(finals)})}\n\n"
                        continue
                yield f"data: {json.dumps(self.head | {'choices': [chunk]})}\n\n"
        except Exception as e:  # (e.g. the tokenizer failed on a token)
            yield sse_error(error_body(500, f"generation failed: {type(e).__name__}: {e}"))
            return
        finally:
            self.cancel()
        yield "data: [DONE]\n\n"


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
