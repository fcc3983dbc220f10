"""The state of one ``txl serve`` app: the model, its tokenizer and reading settings, the engine, the limits, and
what turns a request body into engine work (checked against the limits before anything is admitted)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import numpy as np
from pydantic import ValidationError

from txl.data.text import universal_newlines
from txl.data.tokenizer import UnknownPolicy
from txl.infer.generation import Penalties
from txl.serve.engine import Engine, Generation
from txl.serve.http import ApiError, invalid
from txl.serve.schemas import MAX_SEED, CompletionRequest, GenerateRequest, MusicRequest, ScoreRequest, ServeLimits


@dataclass(frozen=True)
class Choice:
    """One completion an OpenAI request asks for: its generation and its prompt's text (for ``echo``)."""

    request: GenerateRequest
    prompt_text: str


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
        quantization: str | None = None,
    ):

        from txl.infer.evaluate import metric_name
        from txl.infer.load import load
        from txl.util.distributed import resolve_device

        if unknown not in get_args(UnknownPolicy):
            raise ValueError(f"--unknown {unknown}: must be one of {', '.join(get_args(UnknownPolicy))}")
        self.device = resolve_device(device, option="--device")
        self.source = Path(model_dir)
        loaded = load(model_dir, self.device, quantization)
        self.folder, self.run, self.model, self.tokenizer = loaded.folder, loaded.run, loaded.model, loaded.tokenizer
        self.reading = loaded.settings
        """How the model reads text unless a request says otherwise (the one rule:
        txl.infer.evaluate.reading_settings); passed to the engine, never written into the model's config."""
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

    # -- lifecycle ----------------------------------------------------------------------------------------------

    def start(self) -> None:
        lim = self.limits
        self.engine = Engine(
            self.model, max_batch=lim.max_batch, max_queue=lim.max_queue, max_unread=lim.stream_buffer_tokens,
            on_failure=self._fatal, reading=self.reading.reading(),
        )  # fmt: skip

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
        if self.is_music:  # (round 6, vm15: a text request to a music model's server was a 500 with a traceback)
            raise invalid(
                field, f"this server's model reads music (REMI events), not text: send {ids_field}, or a MIDI file "
                "to /v1/music"
            )  # fmt: skip
        tokenizer = self._tokenizer(unknown)
        if tokenizer is None:
            raise invalid(field, f"the model has no tokenizer.json; send {ids_field}")
        check_text(text, field)
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
        for stop in stops:  # (empty ones are refused by the request's schema)
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
            from txl.model.cache import no_kv_cache_reason, supports_kv_cache

            if req.temperature != 0:
                raise invalid("num_beams", "beam search finds the likeliest text: give temperature 0")
            if req.num_beams > lim.max_batch:
                raise invalid("num_beams", f"{req.num_beams} is more than the server's max_batch {lim.max_batch}")
            if not supports_kv_cache(self.model.config):
                raise invalid("num_beams", f"beam search needs a K/V cache: {no_kv_cache_reason(self.model.config)}")
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

    def completion_requests(self, req: CompletionRequest) -> list[Choice]:
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
        if total > max(1, self.limits.max_queue):
            raise invalid(
                "n", f"n = {req.n} with {len(prompts)} prompt(s) is {total} completions, more than the server's "
                f"max_queue of {self.limits.max_queue} (n times the prompts is at most that): send fewer at once"
            )  # fmt: skip
        out = []
        for k, prompt in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{k}]"
            ids = self._encode(None, list(prompt), where, where) if isinstance(prompt, list) else None
            if ids is None:
                check_text(prompt, where)
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
                except ValidationError as e:  # (a field this request gave, read by txl's own request's rules)
                    err = e.errors()[0]
                    name = where if err["loc"][:1] == ("prompt",) else ".".join(map(str, err["loc"]))
                    raise invalid(name, f"{name}: {err['msg']}") from None
                out.append(Choice(gen, text))
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

    @property
    def is_music(self) -> bool:
        """Whether the model reads REMI events (a MidiTok tokenizer.json): /v1/music serves it."""
        return getattr(self.tokenizer, "kind", None) == "remi"

    def music(self, req: MusicRequest) -> dict[str, Any]:
        """The job of a /v1/music request, everything checked first: a music model, the MIDI (base64, a MIDI file
        with notes, time signatures the tokenizer writes), the limits."""
        import base64
        import binascii

        import torch

        from txl.data.errors import DataError
        from txl.data.music import read_midi
        from txl.infer.music import compose_steps

        if not self.is_music:
            raise ApiError(400, "this server's model reads text, not music: /v1/music needs a music (REMI) model")
        tok, lim = self.tokenizer, self.limits
        if req.midi is not None and req.prompt_ids is not None:
            raise invalid("midi", "give midi or prompt_ids, not both")
        score = None
        if req.midi is not None:
            try:
                data = base64.b64decode(req.midi, validate=True)
            except (binascii.Error, ValueError):
                raise invalid("midi", "not base64 (a MIDI file's bytes, base64-encoded)") from None
            try:
                score = read_midi(data, "the MIDI file")
                fix = "send a piece in one of those (this model was trained on them)"
                ids = [tok.bos_id, *tok.encode_score(score, "the MIDI file", fix)]
            except DataError as e:
                raise invalid("midi", str(e)) from None
        elif req.prompt_ids is not None:
            ids = self.check_ids(req.prompt_ids, "prompt_ids")
        else:
            ids = [tok.bos_id]
        if len(ids) > lim.max_prompt_tokens:
            raise invalid("midi", f"{len(ids)} events, more than the limit of {lim.max_prompt_tokens}")
        if req.max_new_tokens > lim.max_new_tokens:
            raise invalid("max_new_tokens", f"{req.max_new_tokens} is more than the limit {lim.max_new_tokens}")
        seed = req.seed if req.seed is not None else int(time.time_ns() % MAX_SEED)
        generator = torch.Generator(device=self.device).manual_seed(seed)

        def steps():
            return compose_steps(
                self.model, tok, ids, bars=req.bars, max_new_tokens=req.max_new_tokens, temperature=req.temperature,
                top_k=req.top_k, top_p=req.top_p, grammar=req.grammar, generator=generator,
                reading=self.reading.reading(),
            )  # fmt: skip

        return {"ids": ids, "score": score, "steps": steps, "seed": seed}

    def music_result(self, job: dict[str, Any], piece) -> dict[str, Any]:
        """The response of a /v1/music request: the piece's MIDI (base64), its notes in seconds (for a player), its
        new ids, what the grammar saw, and what reading the prompt's MIDI as REMI changed (``prompt_changes``: the
        piece holds the prompt as read)."""
        import base64

        from txl.infer.music import notes_in_seconds, piece_score

        score = piece_score(self.tokenizer, piece.ids, job["score"])
        return {
            "midi": base64.b64encode(bytes(score.dumps_midi())).decode(),
            "notes": notes_in_seconds(score),
            "prompt_notes": notes_in_seconds(self.tokenizer.decode_score(job["ids"])) if len(job["ids"]) > 1 else [],
            "new_ids": piece.new_ids,
            "seed": job["seed"],
            "prompt_changes": [] if job["score"] is None else self.tokenizer.read_changes(job["score"], job["ids"][1:]),
            **piece.summary(),
        }

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


def check_text(text: str, field: str) -> None:
    """A request's text holds characters only: JSON can carry a lone surrogate (``"\\ud800"``), which is half of a
    UTF-16 pair, not a character, and which no tokenizer can read."""
    at = next((i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF), None)
    if at is not None:
        raise invalid(
            field, f"character {at} is a lone surrogate (U+{ord(text[at]):04X}), not a character: send the pair it "
            "belongs to, or the character itself"
        )  # fmt: skip
