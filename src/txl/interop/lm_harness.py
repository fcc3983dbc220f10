"""EleutherAI's lm-evaluation-harness with txl models: the ``txl`` model type (extra: ``transformer-xl[lmeval]``).
Design notes: docs/internals.md#txlinteroplm_harness."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

try:
    import lm_eval.models  # noqa: F401 - the harness's own models (its registry loads them only while empty)
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError(
        "txl's lm-evaluation-harness model needs the lmeval extra: pip install 'transformer-xl[lmeval]'"
    ) from e

from txl.infer.evaluate import autocast, evaluate, segments_from_end
from txl.infer.generation import Penalties, beam_search, stream
from txl.infer.load import load
from txl.kernels.runtime import effective_precision
from txl.model.modeling import KVCache, supports_kv_cache
from txl.util.distributed import resolve_device


def _int(value: Any, name: str, default: int) -> int:
    if value is None or (isinstance(value, str) and value.startswith("auto")):
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"txl model_args: {name}={value!r} is not an integer") from None


GENERATION_KWARGS = frozenset(
    ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty",
     "no_repeat_ngram_size", "num_beams", "length_penalty", "early_stopping")
)  # fmt: skip
"""The ``generation_kwargs`` of a task that ``generate_until`` uses (others are named in a note)."""


@register_model("txl")
class TransformerXLHarnessLM(LM):
    """A txl language model for lm-evaluation-harness (see the module docstring for the arguments)."""

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> TransformerXLHarnessLM:
        """The harness's constructor from ``--model_args`` as a string, checked by :meth:`_check_args`."""
        from lm_eval.utils import simple_parse_args_string

        cls._check_args(simple_parse_args_string(arg_string or ""), additional_config)
        return super().create_from_arg_string(arg_string, additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> TransformerXLHarnessLM:
        """The harness's constructor from ``--model_args`` as a mapping, checked by :meth:`_check_args`."""
        cls._check_args(arg_dict, additional_config)
        return super().create_from_arg_obj(arg_dict, additional_config)

    @classmethod
    def _check_args(cls, args: dict, additional_config: dict | None = None) -> None:
        """An argument the model does not take is refused by name (a misspelt ``memlen=256`` would otherwise be
        dropped: the run reads with another memory than asked); so is a value of the wrong kind, and an argument the
        harness passes too (``--batch_size``)."""
        given = {k for k, v in (additional_config or {}).items() if v is not None}
        both = sorted(given & set(args))
        if both:  # (probes lm3: the harness's own call failed with "got multiple values for keyword argument")
            raise ValueError(
                f"--model_args {both[0]}: also given by the harness's --{both[0]} option; give it once, as --{both[0]}"
            )
        import difflib
        import inspect

        known = [k for k in inspect.signature(cls.__init__).parameters if k not in ("self", "_ignored")]
        for name in args:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"did you mean {close[0]}? " if close else ""
                raise ValueError(f"--model_args {name}: not an argument of the txl model ({hint}it takes "
                                 f"{', '.join(known)})")  # fmt: skip
        # each value's type, before the model is loaded (probes lm1: mem_len=abc was a TypeError traceback)
        for name, value in args.items():
            if name in ("tgt_len", "mem_len", "clamp_len", "max_gen_toks", "threads") and value is not None:
                if isinstance(value, float) and value.is_integer():  # (the harness reads "-5" as -5.0)
                    value = int(value)
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"--model_args {name}={value!r}: not an integer")
                low = -1 if name == "clamp_len" else 0 if name == "mem_len" else 1
                if value < low:
                    raise ValueError(f"--model_args {name}={value}: must be >= {low}")
            if name == "same_length" and value is not None and not isinstance(value, bool):
                raise ValueError(f"--model_args same_length={value!r}: true or false")
        if "pretrained" in args and not str(args["pretrained"]).strip():  # (probes lm2: read as the current folder)
            raise ValueError(
                "--model_args pretrained is empty: give a run folder, a step-N checkpoint or a model folder"
            )

    def __init__(
        self,
        pretrained: str,
        tgt_len: int | None = None,
        mem_len: int | None = None,
        clamp_len: int | None = None,
        same_length: bool | None = None,
        batch_size: int | str | None = 8,
        max_gen_toks: int = 256,
        device: str | None = "cpu",
        precision: str = "fp32",
        threads: int | None = None,
        **_ignored: Any,  # other harness options (max_batch_size, ...) do not apply
    ) -> None:
        super().__init__()
        if threads is not None:
            torch.set_num_threads(_int(threads, "threads", 1))
        if device and str(device).startswith("cuda") and not torch.cuda.is_available():
            print(
                f"txl: note: device {device} asked for (the harness's default), but CUDA is not here: cpu",
                file=sys.stderr,
            )
            device = "cpu"
        self._device = resolve_device(device or "cpu", option="device")
        self.precision, _ = effective_precision(self._device, precision)
        given = dict(tgt_len=tgt_len, mem_len=mem_len, clamp_len=clamp_len, same_length=same_length)
        loaded = load(str(pretrained), self._device, **given)
        self.model, self.settings = loaded.model, loaded.settings
        if loaded.tokenizer is None:
            raise ValueError(f"{loaded.folder}: no tokenizer.json (lm-eval reads the tasks' text with the model's own)")
        self.tokenizer = loaded.tokenizer
        self.batch_size = _int(batch_size, "batch_size", 8)
        if self.batch_size < 1:
            raise ValueError(f"--batch_size {batch_size}: must be >= 1 (or auto)")
        if self.model.config.cmem_len:  # (a compressed memory reads no padding: rows of different lengths alone)
            self.batch_size = 1
        self.max_gen_toks = _int(max_gen_toks, "max_gen_toks", 256)
        self.prefix = self.tokenizer.document_start()[1]  # (the line end, else a space)
        self._noted: set[str] = set()  # notes given once: unused generation_kwargs, "beam sampling"

    def _encode(self, text: str, where: str) -> list[int]:
        try:
            return self.tokenizer.encode(text)
        except ValueError as e:
            raise ValueError(f"{where}: {e} (the model's tokenizer cannot read this task's text)") from None

    @staticmethod
    def _where(req: Any) -> str:
        return f"task {getattr(req, 'task_name', None)}, document {getattr(req, 'doc_id', None)}"

    # ----------------------------------------------------------------------------------------- rolling
    @torch.no_grad()
    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        s, out = self.settings, []
        for req in requests:
            (text,) = req.args
            ids = self.prefix + self._encode(text, self._where(req))
            res = evaluate(
                self.model,
                np.asarray(ids, dtype=np.int64),
                batch_size=1,
                tgt_len=s.tgt_len,
                mem_len=s.mem_len,
                clamp_len=s.clamp_len,
                same_length=s.same_length,
                precision=self.precision,
            )
            value = -res.loss * res.tokens
            out.append(value)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), value)
        return out

    # ------------------------------------------------------------------------------------ loglikelihood
    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = []
        for req in requests:
            context, continuation = req.args
            where = self._where(req)
            ctx = self.prefix + self._encode(context, where) if context else self.prefix
            cont = self._encode(continuation, where)
            if not cont:
                raise ValueError(f"{where}: the continuation {continuation!r} encodes to no tokens")
            pairs.append((ctx, cont))
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))  # similar lengths
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            for i, r in zip(chunk, self.score([pairs[i] for i in chunk]), strict=True):
                results[i] = r
                self.cache_hook.add_partial("loglikelihood", requests[i].args, r)
        return results  # type: ignore[return-value]

    @torch.no_grad()
    def score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(log-probability of ``cont``, whether every token of it is the greedy choice) after ``ctx``, for each
        (ctx, cont) of token ids: one left-padded batch read ``tgt_len`` tokens at a time with the memory."""
        dev = self._device
        seqs = [ctx + cont for ctx, cont in pairs]
        length = max(len(x) - 1 for x in seqs)  # (left-padded to the longest, read in segments from the end)
        ids = torch.zeros(len(seqs), length, dtype=torch.long)
        tgt = torch.zeros(len(seqs), length, dtype=torch.long)
        pad = torch.ones(len(seqs), length, dtype=torch.bool)
        scored = torch.zeros(len(seqs), length, dtype=torch.bool)
        for b, ((_, cont), x) in enumerate(zip(pairs, seqs, strict=True)):
            n = len(x) - 1
            ids[b, length - n :], tgt[b, length - n :] = torch.tensor(x[:-1]), torch.tensor(x[1:])
            pad[b, length - n :] = False
            scored[b, length - len(cont) :] = True
        ids, tgt, pad, scored = ids.to(dev), tgt.to(dev), pad.to(dev), scored.to(dev)
        logp = torch.zeros(len(seqs), length, dtype=torch.float64, device=dev)
        greedy = torch.ones(len(seqs), length, dtype=torch.bool, device=dev)
        for cols, lp, hit in self._segments(ids, pad, tgt):
            logp[:, cols], greedy[:, cols] = lp.double(), hit
        logp, greedy = logp.masked_fill(~scored, 0), greedy | ~scored
        return [(float(logp[b].sum()), bool(greedy[b].all())) for b in range(len(seqs))]

    def _segments(self, ids: torch.Tensor, pad: torch.Tensor, tgt: torch.Tensor) -> Iterator:
        """For each segment: its columns, the log-prob of its targets [B, T] and whether each is the argmax [B, T]."""
        s, model = self.settings, self.model
        B, length = ids.shape
        T = s.tgt_len
        cached = supports_kv_cache(model.config) and s.mem_len > 0
        dtype = next(model.parameters()).dtype
        cache = (
            KVCache(model.config, B, s.mem_len, T, positions=length, device=ids.device, dtype=dtype) if cached else None
        )
        mems, mem_pad = None, None
        for cols in segments_from_end(length, T):
            seg_pad = pad[:, cols]
            kw = dict(mem_len=s.mem_len, clamp_len=s.clamp_len, same_length=s.same_length, return_log_probs=True)
            with autocast(ids.device, self.precision):
                if cached:
                    out = model(ids[:, cols], cache=cache, padding=seg_pad, **kw)
                else:
                    window = seg_pad if mems is None else torch.cat([mem_pad, seg_pad], dim=1)  # [B, M + T]
                    out = model(ids[:, cols], mems=mems, padding=window, **kw)
                    mems = out.mems
                    if mems is not None:
                        mem_pad = window[:, window.shape[1] - mems[0].shape[1] :]
            lp = out.log_probs.float()  # [B, T, V]
            yield cols, lp.gather(-1, tgt[:, cols, None])[..., 0], lp.argmax(-1) == tgt[:, cols]

    # ------------------------------------------------------------------------------------- generation
    @torch.no_grad()
    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):  # requests with the same options are generated together
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        batch = self.batch_size if supports_kv_cache(self.model.config) else 1
        for key, members in groups.items():
            kwargs = json.loads(key)
            for start in range(0, len(members), batch):
                chunk = members[start : start + batch]
                prompts = [self.prefix + self._encode(requests[i].args[0], self._where(requests[i])) for i in chunk]
                for i, text in zip(chunk, self.generate(prompts, kwargs), strict=True):
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return results  # type: ignore[return-value]

    def generate(self, prompts: list[list[int]], kwargs: dict[str, Any]) -> list[str]:
        """Texts continuing ``prompts`` (token ids), each cut before its first stop sequence."""
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = _int(kwargs.get("max_gen_toks"), "max_gen_toks", self.max_gen_toks)
        sample = bool(kwargs.get("do_sample", False)) and float(kwargs.get("temperature", 1.0)) > 0
        temperature = float(kwargs.get("temperature", 1.0)) if sample else 0.0
        unused = sorted(set(kwargs) - GENERATION_KWARGS - self._noted)
        if unused:
            self._noted.update(unused)
            print(f"txl: note: generation_kwargs {', '.join(unused)} not used by the txl model", file=sys.stderr)
        beams = int(kwargs.get("num_beams", 1) or 1)
        if beams > 1 and sample and "beam sampling" not in self._noted:
            self._noted.add("beam sampling")
            print(
                f"txl: note: num_beams {beams} with do_sample (beam sampling) is not implemented in txl: sampled "
                "without beams (do_sample false searches with beams)",
                file=sys.stderr,
            )
        penalties = Penalties(
            repetition_penalty=float(kwargs.get("repetition_penalty", 1.0) or 1.0),
            no_repeat_ngram_size=int(kwargs.get("no_repeat_ngram_size", 0) or 0),
        )
        longest = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), longest, dtype=torch.long)
        pad = torch.ones(len(prompts), longest, dtype=torch.bool)
        for b, p in enumerate(prompts):
            ids[b, longest - len(p) :], pad[b, longest - len(p) :] = torch.tensor(p), False
        ids, padding = ids.to(self._device), pad.to(self._device) if bool(pad.any()) else None
        texts, done = [""] * len(prompts), [False] * len(prompts)
        decoders = [self.tokenizer.stream_decoder() for _ in prompts]
        with autocast(self._device, self.precision):
            if beams > 1 and not sample:
                found = beam_search(
                    self.model, ids, max_new, num_beams=beams, reading=self.settings.reading(), padding=padding,
                    length_penalty=float(kwargs.get("length_penalty", 1.0)), penalties=penalties,
                    early_stopping=bool(kwargs.get("early_stopping", False)),
                )  # fmt: skip
                steps = iter(found[:, longest:].T[:, :, None])  # (new tokens step by step, [B, 1] each)
            else:
                steps = stream(
                    self.model, ids, max_new, temperature=temperature, top_k=int(kwargs.get("top_k", 0) or 0),
                    top_p=float(kwargs.get("top_p", 1.0) or 1.0), reading=self.settings.reading(), padding=padding,
                    penalties=penalties,
                )  # fmt: skip
            for tok in steps:
                for b in range(len(prompts)):
                    if not done[b]:
                        texts[b] += decoders[b].push(int(tok[b, 0]))
                        done[b] = any(u in texts[b] for u in until)
                if all(done):
                    break
        out = []
        for b, text in enumerate(texts):
            text += "" if done[b] else decoders[b].flush()
            cut = min((text.find(u) for u in until if u in text), default=len(text))
            out.append(text[:cut])
        return out


def cli(argv: list[str]) -> None:
    """``txl lm-eval ARGS``: the harness's own command line (``lm_eval ARGS``) with the ``txl`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["txl lm-eval", *argv]
    try:
        cli_evaluate()
    except ValueError as e:  # (a bad argument: one line, as txl's other commands give it)
        print(f"txl lm-eval: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
