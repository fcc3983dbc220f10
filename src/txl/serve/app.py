"""``txl serve``: an HTTP API (FastAPI) over a trained model, with a web page, batched streaming generation and
long-text scoring.

Endpoints: ``POST /v1/generate`` (JSON, or server-sent events with ``"stream": true``), ``POST /v1/score``,
``GET /v1/model``, ``GET /health``, ``GET /`` (the page; OpenAPI docs at ``/docs``), OpenAI's
``POST /v1/completions`` and ``GET /v1/models``, so that clients of that API work unchanged, and vLLM's
``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``, so that lm-evaluation-harness's
``local-completions`` model scores and generates through the server with the model's own tokenizer. Every model
call runs on the :class:`~txl.serve.engine.Engine`'s thread, which batches concurrent generations step by step; the
event
loop only decodes text and talks HTTP.

No request can take the server down: every request's cost is bounded before it is admitted (:class:`ServeLimits`),
one that fails ends alone with an error (OpenAI's shape, :mod:`txl.serve.http`; a stream ends with an error event
and ``[DONE]``), and :meth:`Server.drain` (SIGTERM) stops admitting, lets the work in flight finish for a grace time
and ends what is left with ``finish_reason: "shutdown"``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, get_args

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from txl.data.text import universal_newlines
from txl.data.tokenizer import UnknownPolicy
from txl.infer.generation import Penalties
from txl.serve.engine import MAX_LOGPROBS, Engine, EngineStopped, Generation, QueueFull, TokenScore
from txl.serve.http import ERROR_RESPONSES, ApiError, Gate, docs_page, error_body, invalid, sse_error

MAX_SEED = 2**63 - 1


def _whole_numbers(value: Any) -> Any:
    """A number written with a zero fraction (1.0), also inside lists, as the integer it is (JSON Schema counts it
    as one); everything else as it is."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_whole_numbers(v) for v in value]
    return value


class _Request(BaseModel):
    """A request body, read strictly as its JSON schema says (with each model's strict mode): no true/false or
    string where an integer is meant (pydantic's lax mode would read them as 1/0 or parse them), no integer where a
    boolean is meant; an integer may be written 1.0."""

    @model_validator(mode="before")
    @classmethod
    def _json_integers(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {
            k: _whole_numbers(v) if k in cls.model_fields and "int" in str(cls.model_fields[k].annotation) else v
            for k, v in data.items()
        }


STREAMED: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "JSON, or with stream: true server-sent events (data: JSON per event, then data: [DONE])",
        "content": {
            "text/event-stream": {
                "schema": {  # (one event)
                    "type": "object",
                    "properties": {"data": {"type": "string", "description": "The event's JSON, or [DONE] last."}},
                    "required": ["data"],
                }
            }
        },
    }
}


@dataclass
class ServeLimits:
    """What bounds one request's work, checked before it is admitted (each a `txl serve` option)."""

    max_prompt_tokens: int = 4096
    """Longest prompt, in tokens (it is read in one forward pass)."""
    max_new_tokens: int = 1024
    """Most tokens one generation may ask for."""
    max_batch: int = 8
    """Rows in flight at most, whatever their memory lengths: a generation is one, a beam search one per beam, a
    scored text one."""
    max_queue: int = 64
    """Requests that may wait for a row; more get 429."""
    max_score_tokens: int = 200_000
    """Longest text /v1/score takes, in tokens."""
    max_mem_len: int = 8192
    """Longest memory a request may ask for (its keys and values are kept per row)."""
    max_tgt_len: int = 2048
    """Longest segment /v1/score may ask for (its attention is tgt_len x (tgt_len + mem_len) per head)."""
    max_stops: int = 16
    """Most stop strings per request."""
    max_stop_chars: int = 256
    """Longest stop string, in characters."""
    max_body_bytes: int = 8 << 20
    """Largest request body, in bytes; larger ones get 413."""


class OpenAIPenalties(_Request):
    """OpenAI's penalties, taken by both generation endpoints."""

    presence_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="OpenAI's: subtracted from a token's score once the new text holds it."
    )
    frequency_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="OpenAI's: subtracted from a token's score per time the new text holds it."
    )
    logit_bias: dict[Annotated[int, Strict(False)], float] | None = Field(  # (JSON's keys are strings)
        None, description="Added to the scores of these token ids (-100: never; 100: always)."
    )


class GenerateRequest(OpenAIPenalties):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    prompt: str | None = Field(None, description="Prompt text (read with the model's tokenizer).")
    prompt_ids: list[int] | None = Field(None, description="Prompt token ids, instead of prompt.")
    max_new_tokens: int = Field(64, ge=0, description="Tokens to generate.")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature (0: greedy).")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens (0: all).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold (1: off).")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Random seed: the same seed gives the same text.")
    stop: list[str] = Field(default_factory=list, description="Stop before the first of these strings.")
    mem_len: int | None = Field(
        None, ge=1, description="Memory length (default: the model's; at most the server's max_mem_len)."
    )
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
        1.0, ge=-10.0, le=10.0,
        description="Beam search: a finished text's score is its log-probability over its length to this power.",
    )  # fmt: skip
    unknown: UnknownPolicy | None = Field(
        None, description="Characters outside the model's vocabulary: error (a 400 naming the first one) or replace "
        "(read as the tokenizer's replacement symbol); default: the server's --unknown."
    )  # fmt: skip


class CompletionRequest(OpenAIPenalties):
    """OpenAI's completions request. Fields of OpenAI's that txl does not have are refused when set to anything
    but their neutral value; fields unknown to OpenAI too are ignored, as clients send some of their own."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    model: str | None = Field(None, description="The served model's name (GET /v1/models); default: that model.")
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="Text or token ids; a list of them for several prompts (a choice each, in order)."
    )
    max_tokens: int | None = Field(16, ge=0, description="Tokens to generate (OpenAI's default: 16).")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="Sampling temperature, 0 to 2 (0: greedy).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold (1: off).")
    stop: str | list[str] | None = Field(None, description="Stop before the first of these strings.")
    seed: int | None = Field(
        None, ge=0, le=MAX_SEED, description="Random seed: choice k of a prompt samples with seed + k."
    )
    echo: bool = Field(False, description="Give the prompt's text (and with logprobs, its tokens') first.")
    stream: bool = Field(False, description="Stream the text as server-sent events, ending with data: [DONE].")
    n: int = Field(1, ge=1, le=128, description="Completions per prompt (1 to 128).")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS,
        description="Give each token's log-probability and this many most likely tokens at its place.",
    )  # fmt: skip
    best_of: int | None = None
    suffix: str | None = None
    user: str | None = None
    unknown: UnknownPolicy | None = Field(
        None, description="txl's: characters outside the vocabulary, error or replace."
    )


class TokenizeRequest(_Request):
    """vLLM's ``/tokenize`` request (lm-evaluation-harness's remote tokenizer)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    prompt: str = Field(..., description="The text to encode with the model's tokenizer.")
    add_special_tokens: bool = Field(False, description="Accepted for vLLM's clients: txl adds no special tokens.")
    unknown: UnknownPolicy | None = Field(None, description="Characters outside the vocabulary: error or replace.")


class DetokenizeRequest(_Request):
    """vLLM's ``/detokenize`` request."""

    model_config = ConfigDict(extra="ignore", strict=True)

    tokens: list[int] = Field(..., description="Token ids to decode.")


class ScoreRequest(_Request):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    text: str | None = Field(
        None, description="The text to score (up to the server's max_score_tokens), read with the model's tokenizer."
    )
    ids: list[int] | None = Field(None, description="Token ids to score, instead of text.")
    tgt_len: int | None = Field(
        None, ge=1, description="Segment length (default: the run's evaluation settings; at most the server's "
        "max_tgt_len)."
    )  # fmt: skip
    mem_len: int | None = Field(
        None, ge=0, description="Memory length (default: the run's evaluation settings; at most max_mem_len)."
    )
    clamp_len: int | None = Field(
        None, ge=-1, le=2**31 - 1, description="Clamp relative distances above this (-1: none)."
    )
    same_length: bool | None = Field(None, description="Every query sees mem_len keys.")
    per_token: bool = Field(False, description="Also return every token with its log-probability.")
    zero_memory: bool = Field(False, description="Start from mem_len zero vectors, as Hugging Face's TransfoXL did.")
    unknown: UnknownPolicy | None = Field(None, description="Characters outside the vocabulary: error or replace.")


def _field_error(e: RequestValidationError) -> tuple[str, str | None]:
    """The one-line message of a request that does not match its schema, and the first field at fault."""
    parts, params = [], []
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
        if loc:
            params.append(".".join(loc))
    return "; ".join(parts), (params[0] if params else None)


class Server:
    """The model, its tokenizer and settings, and the engine, for one app."""

    def __init__(
        self,
        model_dir: str | Path,
        limits: ServeLimits,
        api_key: str | None = None,
        device: str = "cpu",
        *,
        unknown: UnknownPolicy = "error",
        served_names: list[str] | None = None,
    ):
        import torch

        from txl.config import read_run_config
        from txl.data import Tokenizer
        from txl.infer.evaluate import metric_name, read_as, reading_settings
        from txl.model.modeling import TransformerXLLM
        from txl.util.distributed import resolve_device
        from txl.util.folders import resolve_model_dir

        if unknown not in get_args(UnknownPolicy):
            raise ValueError(f"--unknown {unknown}: must be one of {', '.join(get_args(UnknownPolicy))}")
        self.device = resolve_device(device, option="--device")
        self.source = Path(model_dir)
        self.folder = resolve_model_dir(model_dir)
        self.run = read_run_config(self.folder)
        self.model = TransformerXLLM.from_pretrained(self.folder).eval().to(self.device)
        self.reading = reading_settings(self.folder, self.model.config)
        """How the model reads text unless a request says otherwise (the one rule:
        txl.infer.evaluate.reading_settings)."""
        read_as(self.model, self.reading)  # (generation reads clamp_len and same_length from the config)
        tok_file = self.folder / "tokenizer.json"
        self.tokenizer = (
            Tokenizer.load(tok_file).for_model(self.model.config.n_token, tok_file) if tok_file.exists() else None
        )
        self.metric = metric_name(self.tokenizer.kind) if self.tokenizer else "ppl"
        self.limits = limits
        self.api_key = api_key
        self.unknown = unknown
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.name = self.source.resolve().name  # (what OpenAI's API calls the model)
        self.served_names = list(served_names or [self.name, "txl"])
        """The names OpenAI's ``model`` field may give (GET /v1/models lists the first)."""
        self.engine: Engine | None = None
        self.on_fatal: list = []
        """Called with the failure when the engine fails (txl serve: stop the HTTP server)."""
        self.shutting_down = False
        self._in_flight = 0
        self._cut = 0
        self._lock = threading.Lock()
        self._torch = torch

    # -- lifecycle ----------------------------------------------------------------------------------------------

    def start(self) -> None:
        self.engine = Engine(
            self.model, max_batch=self.limits.max_batch, max_queue=self.limits.max_queue, on_failure=self._fatal
        )

    def _fatal(self, failure: str) -> None:
        for callback in self.on_fatal:
            callback(failure)

    @property
    def failure(self) -> str | None:
        """Why the engine failed (the process then exits non-zero); None while it runs."""
        return self.engine.failure if self.engine is not None else None

    def response_started(self) -> None:
        with self._lock:
            self._in_flight += 1

    def response_ended(self, complete: bool) -> None:
        with self._lock:
            self._in_flight -= 1
            if not complete and self.shutting_down:
                self._cut += 1

    @property
    def in_flight(self) -> int:
        """Responses begun and not yet sent to their end."""
        with self._lock:
            return self._in_flight

    def drain(self, timeout: float) -> bool:
        """Shut down gracefully (SIGTERM): admit nothing more (503), let the requests in flight finish for at most
        ``timeout`` seconds, end what is left with ``finish_reason: "shutdown"`` (each stream gets its final event),
        and wait for the responses to be sent. Whether everything ended cleanly: the engine did not fail and every
        response was sent to its end."""
        self.shutting_down = True
        if self.engine is not None:
            self.engine.drain(timeout)
        deadline = time.monotonic() + 10  # (the final events are a few bytes each)
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        with self._lock:
            return self.failure is None and self._in_flight == 0 and self._cut == 0

    # -- requests -----------------------------------------------------------------------------------------------

    def _tokenizer(self, unknown: UnknownPolicy | None):
        """The tokenizer reading characters outside its vocabulary by ``unknown`` (the request's; default: the
        server's); None without one."""
        policy = self.unknown if unknown is None else unknown
        if self.tokenizer is None:
            return None
        if policy == self.tokenizer.unknown:
            return self.tokenizer
        try:
            return self.tokenizer.with_unknown(policy)
        except ValueError as e:
            raise invalid("unknown", str(e)) from None

    def check_ids(self, ids: list[int], field: str) -> list[int]:
        bad = [i for i in ids if not 0 <= i < self.model.config.n_token]
        if bad:
            raise invalid(field, f"ids must be in [0, {self.model.config.n_token}), got {bad[0]}")
        return list(ids)

    def _encode(
        self, text: str | None, ids: list[int] | None, field: str, ids_field: str, unknown: UnknownPolicy | None = None
    ) -> list[int]:
        """The ids of a request's text (line ends normalised as training files are: CRLF and CR become LF; characters
        outside the vocabulary by the ``unknown`` policy), or its ids, checked."""
        if (text is None) == (ids is None):
            raise invalid(field, f"give either {field} or {ids_field}")
        if ids is not None:
            return self.check_ids(ids, ids_field)
        tokenizer = self._tokenizer(unknown)
        if tokenizer is None:
            raise invalid(field, f"the model has no tokenizer.json; send {ids_field}")
        try:
            return tokenizer.encode(universal_newlines(text))
        except ValueError as e:
            message = str(e).split(" Remove it, or read")[0]  # (the library's advice names its own options)
            if "not in the vocabulary" in message:
                message = (
                    message.rstrip(".") + '; remove it, or send "unknown": "replace" (txl serve --unknown replace)'
                )
            raise invalid(field, message) from None

    def tokenizer_or_400(self, what: str):
        if self.tokenizer is None:
            raise invalid(what, "the model has no tokenizer.json")
        return self.tokenizer

    def check_stops(self, stops: list[str], field: str = "stop") -> None:
        lim = self.limits
        if len(stops) > lim.max_stops:
            raise invalid(field, f"{len(stops)} stop strings, more than the limit of {lim.max_stops}")
        for stop in stops:
            if stop == "":
                raise invalid(field, "a stop string must not be empty")
            if len(stop) > lim.max_stop_chars:
                raise invalid(
                    field, f"a stop string of {len(stop)} characters, more than the limit {lim.max_stop_chars}"
                )

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.served_names:
            raise ApiError(
                404, f"model: {name!r} is not served here; it serves {self.served_names[0]!r} (GET /v1/models)",
                param="model", code="model_not_found",
            )  # fmt: skip

    def generation(
        self, req: GenerateRequest, emit, logprobs: int | None = None, prompt_logprobs: bool = False
    ) -> tuple[Generation, list[int]]:
        ids = self._encode(req.prompt, req.prompt_ids, "prompt", "prompt_ids", req.unknown)
        lim = self.limits
        if not ids:
            raise invalid("prompt", "encodes to no tokens")
        if len(ids) > lim.max_prompt_tokens:
            raise invalid("prompt", f"{len(ids)} tokens, more than the limit of {lim.max_prompt_tokens}")
        if req.max_new_tokens > lim.max_new_tokens:
            raise invalid("max_new_tokens", f"{req.max_new_tokens} is more than the limit {lim.max_new_tokens}")
        self.check_stops(req.stop)
        mem_len = req.mem_len or self.reading.mem_len
        if mem_len > lim.max_mem_len:
            raise invalid("mem_len", f"{mem_len} is more than the limit {lim.max_mem_len}")
        if mem_len < 1:
            raise invalid("mem_len", "the model has no memory length; give mem_len >= 1")
        if req.num_beams > 1:
            from txl.model.modeling import supports_kv_cache

            if req.temperature != 0:
                raise invalid("num_beams", "beam search finds the likeliest text: give temperature 0")
            if req.num_beams > lim.max_batch:
                raise invalid("num_beams", f"{req.num_beams} is more than the server's max_batch {lim.max_batch}")
            if not supports_kv_cache(self.model.config):
                attn = self.model.config.attn_type
                raise invalid("num_beams", f"beam search needs a K/V cache (attn_type 0 or 1), not {attn}")
        bias = req.logit_bias or {}
        bad = [i for i in bias if not 0 <= i < self.model.config.n_token]
        if bad:
            raise invalid("logit_bias", f"token ids must be in [0, {self.model.config.n_token}), got {bad[0]}")
        if any(not -100 <= b <= 100 for b in bias.values()):
            raise invalid("logit_bias", "a bias must be in [-100, 100]")
        try:
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
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        return gen, ids

    def completion_requests(self, req: CompletionRequest) -> list[tuple[GenerateRequest, str]]:
        """The generations an OpenAI completions request asks for (``n`` per prompt, in the order of the response's
        choices), each with its prompt's text (for ``echo``)."""
        self.check_model(req.model)
        refused = {
            "best_of": (req.best_of not in (None, req.n), "not supported (give n: every completion is returned)"),
            "suffix": (req.suffix is not None, "insertion is not something a left-to-right model does"),
        }
        for name, (bad, why) in refused.items():
            if bad:
                raise invalid(name, why)
        if (req.max_tokens or 0) > self.limits.max_new_tokens:
            raise invalid("max_tokens", f"{req.max_tokens} is more than the limit {self.limits.max_new_tokens}")
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        self.check_stops(stops)
        prompts = req.prompt
        if not isinstance(prompts, list) or not prompts or not isinstance(prompts[0], (str, list)):
            prompts = [prompts]  # (one text, or one list of ids)
        total = len(prompts) * req.n
        if total > self.limits.max_queue:
            raise invalid(
                "prompt", f"{len(prompts)} prompt(s) x n = {req.n} is {total} completions, more than the "
                f"server's queue of {self.limits.max_queue}: send fewer at once"
            )  # fmt: skip
        out = []
        for k, prompt in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{k}]"
            ids = self._encode(None, list(prompt), where, where) if isinstance(prompt, list) else None
            text = prompt if ids is None else (self.tokenizer.decode(ids) if self.tokenizer else "")
            for j in range(req.n):
                try:
                    gen = GenerateRequest(
                        prompt=None if ids is not None else prompt, prompt_ids=ids,
                        max_new_tokens=16 if req.max_tokens is None else req.max_tokens, temperature=req.temperature,
                        top_p=req.top_p, seed=None if req.seed is None else (req.seed + j) % (MAX_SEED + 1),
                        stop=stops, stream=req.stream, presence_penalty=req.presence_penalty,
                        frequency_penalty=req.frequency_penalty, logit_bias=req.logit_bias, unknown=req.unknown,
                    )  # fmt: skip
                except ValidationError as e:
                    raise ApiError(400, str(e).splitlines()[0]) from None
                out.append((gen, text))
        return out

    def score(self, req: ScoreRequest) -> dict[str, Any]:
        """The settings and job of a /v1/score request. Its cost comes from the text: the segment and the memory
        are no longer than the text needs (the same result as the settings asked for), and its work is one
        segment per engine step, beside the running generations."""
        from txl.infer.evaluate import eval_settings, evaluate_steps
        from txl.util.distributed import World

        ids = self._encode(req.text, req.ids, "text", "ids", req.unknown)
        lim = self.limits
        if len(ids) < 2:
            raise invalid("text", "needs at least 2 tokens (the first one is only context)")
        if len(ids) > lim.max_score_tokens:
            raise invalid("text", f"{len(ids)} tokens, more than the limit of {lim.max_score_tokens}")
        try:
            s = eval_settings(
                self.run, self.model.config, tgt_len=req.tgt_len, mem_len=req.mem_len, clamp_len=req.clamp_len,
                same_length=req.same_length,
            )  # fmt: skip
        except ValueError as e:
            raise ApiError(400, str(e).replace("--", "")) from None
        if s.mem_len > lim.max_mem_len:
            raise invalid("mem_len", f"{s.mem_len} is more than the limit {lim.max_mem_len}")
        if s.tgt_len > lim.max_tgt_len:
            raise invalid("tgt_len", f"{s.tgt_len} is more than the limit {lim.max_tgt_len}")
        array = np.asarray(ids, dtype=np.int64)
        targets = len(ids) - 1
        tgt_len = min(s.tgt_len, targets)  # (one segment of the whole text either way)
        mem_len = s.mem_len if req.zero_memory else min(s.mem_len, targets)  # (the memory never holds more)

        def steps():
            return evaluate_steps(
                self.model, array, batch_size=1, tgt_len=tgt_len, mem_len=mem_len, clamp_len=s.clamp_len,
                same_length=s.same_length, return_losses=req.per_token, zero_memory=req.zero_memory,
                world=World(device=self.device),
            )  # fmt: skip

        return {"ids": ids, "settings": s, "steps": steps}

    def info(self) -> dict[str, Any]:
        from txl.util.metrics import read_metrics

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
            "reading": {"mem_len": self.reading.mem_len, "clamp_len": self.reading.clamp_len,
                        "same_length": self.reading.same_length},
            "limits": self.limits.__dict__,
            "unknown": self.unknown,
            "served_names": self.served_names,
            "batched": bool(self.engine and self.engine.batched),
            "training_metrics": metrics,
        }  # fmt: skip


def _document_limits(components: dict[str, Any], lim: ServeLimits) -> None:
    """Write the server's limits into the request schemas (``maximum``, ``maxItems``, ``maxLength``), so that a
    client (or a fuzzer) sees them; the limits that count tokens (prompts, scored texts) are only in the text."""

    def bound(model: str, field: str, **limits: int) -> None:
        prop = components.get(model, {}).get("properties", {}).get(field)
        if prop is None:
            return
        for branch in prop.get("anyOf", [prop]):  # (an optional field: its non-null branch)
            for key, value in limits.items():
                if branch.get("type") == {"maximum": "integer", "maxItems": "array", "maxLength": "string"}[key]:
                    branch[key] = min(value, branch.get(key, value))
                if key == "maxLength" and branch.get("type") == "array":  # (a list of stop strings)
                    branch.setdefault("items", {})["maxLength"] = value

    bound("GenerateRequest", "max_new_tokens", maximum=lim.max_new_tokens)
    bound("GenerateRequest", "mem_len", maximum=lim.max_mem_len)
    bound("GenerateRequest", "num_beams", maximum=lim.max_batch)
    bound("GenerateRequest", "stop", maxItems=lim.max_stops, maxLength=lim.max_stop_chars)
    bound("CompletionRequest", "max_tokens", maximum=lim.max_new_tokens)
    bound("CompletionRequest", "n", maximum=max(1, lim.max_queue))
    bound("CompletionRequest", "stop", maxItems=lim.max_stops, maxLength=lim.max_stop_chars)
    bound("ScoreRequest", "tgt_len", maximum=lim.max_tgt_len)
    bound("ScoreRequest", "mem_len", maximum=lim.max_mem_len)


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
    model_dir: str | Path,
    limits: ServeLimits | None = None,
    api_key: str | None = None,
    device: str = "cpu",
    *,
    unknown: UnknownPolicy = "error",
    served_names: list[str] | None = None,
) -> FastAPI:
    """The FastAPI app of ``txl serve`` for one model (the engine starts and stops with the app's lifespan);
    ``device``: cpu, cuda, cuda:N or auto (the GPU if there is one); ``unknown``: the default policy for characters
    outside the vocabulary (error or replace); ``served_names``: the model names OpenAI's ``model`` field may give
    (default: the folder's name and ``txl``)."""
    server = Server(model_dir, limits or ServeLimits(), api_key, device, unknown=unknown, served_names=served_names)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.engine.shutdown)

    app = FastAPI(
        title="txl serve", description=f"Transformer-XL model {server.folder}", lifespan=lifespan,
        docs_url=None, redoc_url=None, responses=ERROR_RESPONSES,
    )  # fmt: skip
    app.state.server = server
    app.add_middleware(
        Gate, api_key=lambda: server.api_key, max_body_bytes=lambda: server.limits.max_body_bytes,
        public=frozenset({"/health", "/", "/docs", "/openapi.json"}), on_start=server.response_started,
        on_end=server.response_ended,
    )  # fmt: skip
    schema_of = app.openapi

    def openapi() -> dict[str, Any]:
        """FastAPI's schema, less the 422 it documents for bad bodies (they are 400s here), with this server's
        limits as the request fields' maxima."""
        if app.openapi_schema is None:
            schema = schema_of()
            for methods in schema["paths"].values():
                for op in methods.values():
                    op.get("responses", {}).pop("422", None)
            _document_limits(schema["components"]["schemas"], server.limits)
        return app.openapi_schema

    app.openapi = openapi

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError):
        message, param = _field_error(e)
        return JSONResponse(error_body(400, message, param), status_code=400)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        message = f"{request.method} {request.url.path}: {str(e.detail).lower()}"
        return JSONResponse(error_body(e.status_code, message), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception):  # (the traceback goes to the server's log)
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}: {e}"), status_code=500)

    @app.get("/health", responses={503: {"model": dict[str, Any], "description": "failed or shutting down"}})
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

    @app.get("/docs", response_class=HTMLResponse, include_in_schema=False)
    async def docs() -> str:
        """The API as a page of its own (works offline: no script or style from elsewhere)."""
        return docs_page(app.openapi())

    @app.get("/v1/model")
    async def model_info() -> dict[str, Any]:
        return server.info()

    @app.get("/", response_class=HTMLResponse)
    async def page() -> str:
        return resources.files("txl.serve").joinpath("static/index.html").read_text(encoding="utf-8")

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        """vLLM's tokenizer description (with ``/tokenize`` and ``/detokenize``, lm-evaluation-harness's
        ``tokenizer_backend=remote``): the end-of-text token is the text a document is read after (the line end)."""
        tok = server.tokenizer_or_400("tokenizer_info")
        return {
            "tokenizer_class": f"txl.Tokenizer ({tok.kind})", "eos_token": tok.document_start()[0],
            "bos_token": None, "pad_token": None, "model_max_length": server.limits.max_prompt_tokens,
            "vocab_size": tok.vocab_size,
        }  # fmt: skip

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        ids = server._encode(req.prompt, None, "prompt", "prompt", req.unknown)
        return {"tokens": ids, "count": len(ids), "max_model_len": server.limits.max_prompt_tokens}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        tok = server.tokenizer_or_400("detokenize")
        server.check_ids(req.tokens, "tokens")
        try:
            return {"prompt": tok.decode(req.tokens)}
        except ValueError as e:
            raise invalid("tokens", str(e)) from None

    def submitted(put):
        """``put()`` (a submission to the engine), its refusals as 429 and 503."""
        try:
            return put()
        except QueueFull as e:
            raise ApiError(429, f"busy: {e}; retry later", code="rate_limit_exceeded") from None
        except EngineStopped as e:
            raise ApiError(503, str(e), code="service_unavailable") from None

    @app.post("/v1/score")
    async def score(req: ScoreRequest) -> dict[str, Any]:
        import math

        from txl.infer.evaluate import metric_value

        job = server.score(req)
        future = submitted(lambda: server.engine.call_steps(job["steps"]))
        try:
            res = await asyncio.wrap_future(future)
        except EngineStopped as e:
            raise ApiError(503, str(e), code="service_unavailable") from None
        except ValueError as e:
            raise ApiError(400, f"scoring failed: {e}") from None
        except Exception as e:
            raise ApiError(500, f"scoring failed: {type(e).__name__}: {e}") from None
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

        return tokens, summary, gen

    async def finished(started, stop: list[str]) -> dict[str, Any]:
        """The whole generation's summary (text cut before the first stop string): the end of :func:`pieces`."""
        async with aclosing(pieces(started, stop)) as events:  # (closing it cancels the generation)
            async for _, final in events:
                if final is not None:
                    if final["finish_reason"] == "error":
                        raise ApiError(started[2].error_status, final["error"]["message"])
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

    @app.post("/v1/generate", responses=STREAMED)
    async def generate(req: GenerateRequest):
        started = start(req)
        if not req.stream:
            return await finished(started, req.stop)

        async def events():
            """A token's text per event, then the summary (``done``; with finish_reason error, its ``error``), then
            ``[DONE]``."""
            try:
                async for piece, final in pieces(started, req.stop):
                    yield f"data: {json.dumps(piece if final is None else final | {'done': True})}\n\n"
            except Exception as e:  # (e.g. the tokenizer failed on a token): an error event ends the stream
                started[2].cancel()
                yield sse_error(error_body(500, f"generation failed: {type(e).__name__}: {e}"))
                return
            yield "data: [DONE]\n\n"

        return sse(events())

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        """OpenAI's model list: this server's one model (under its first served name)."""
        return {
            "object": "list",
            "data": [{"id": server.served_names[0], "object": "model", "created": 0, "owned_by": "txl"}],
        }

    @app.post("/v1/completions", responses=STREAMED)
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
        except ApiError:
            for _, _, gen in started:
                gen.cancel()
            raise
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": req.model or server.served_names[0]}  # fmt: skip

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
            """OpenAI's chunks, then ``[DONE]``; a choice that fails ends the stream (and the other choices) with an
            error event (OpenAI's shape) and ``[DONE]``."""
            finals: list[dict[str, Any] | None] = [None] * len(started)
            try:
                async for chunk, final in _merged([one(k) for k in range(len(started))]):
                    k = chunk["index"]
                    if final is not None:
                        if final["finish_reason"] == "error":
                            yield sse_error({"error": final["error"]})
                            return
                        finals[k] = final
                        if all(f is not None for f in finals):
                            yield f"data: {json.dumps(head | {'choices': [chunk], 'usage': usage(finals)})}\n\n"
                            continue
                    yield f"data: {json.dumps(head | {'choices': [chunk]})}\n\n"
            except Exception as e:  # (e.g. the tokenizer failed on a token)
                yield sse_error(error_body(500, f"generation failed: {type(e).__name__}: {e}"))
                return
            finally:
                for _, _, gen in started:
                    gen.cancel()
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


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM / SIGINT drains the :class:`Server` ``state`` (:meth:`Server.drain`: no
    new requests, the ones in flight finish or end with finish_reason shutdown within ``drain_timeout``) before
    uvicorn stops; a second one stops at once. ``clean``: whether the drain ended everything cleanly (None: no
    signal came)."""

    def __init__(self, config: uvicorn.Config, state: Server, drain_timeout: float):
        super().__init__(config)
        self.state, self.drain_timeout, self.clean = state, drain_timeout, None
        self._drainer: threading.Thread | None = None

    def handle_exit(self, sig, frame) -> None:
        if self._drainer is not None:  # (a second signal: stop now)
            super().handle_exit(sig, frame)
            return
        print(f"txl serve: shutting down (at most {self.drain_timeout:g} s for the requests in flight)",
              file=sys.stderr, flush=True)  # fmt: skip
        self._drainer = threading.Thread(target=self._drain, name="txl-drain", daemon=True)
        self._drainer.start()

    def _drain(self) -> None:
        self.clean = self.state.drain(self.drain_timeout)
        self.should_exit = True
