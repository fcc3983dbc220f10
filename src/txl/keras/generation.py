"""Generation for the Keras language model, as txl's ``generate`` and ``beam_search`` do it: the prompt is read in one
pass from an empty memory (or the ``mems`` given), then one token per call on top of the last ``mem_len`` states.
Greedy (``temperature=0``) and beam search give txl's tokens; sampling draws from numpy's generator ``seed``."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
from keras import ops

from txl.infer.beams import BeamBook, padded


class Memory:
    """The memory between generation steps, kept at ``mem_len`` positions (zeros in front while it is shorter, which
    no query sees): every step after the prompt has one shape, so a compiler compiles it once."""

    def __init__(self, states: list | None, mem_len: int, real: int):
        self.states, self.mem_len, self.real = states, mem_len, real

    @classmethod
    def of(cls, states: list | None, mem_len: int) -> Memory:
        if not states:
            return cls(None, mem_len, 0)
        M = states[0].shape[1]
        if M < mem_len:
            states = [ops.pad(m, [(0, 0), (mem_len - M, 0), (0, 0)]) for m in states]
        return cls(states, mem_len, min(M, mem_len))

    @property
    def pad(self) -> int:
        return self.mem_len - self.real if self.states is not None else 0

    def take(self, rows: np.ndarray) -> Memory:
        states = None if self.states is None else [ops.take(m, rows, axis=0) for m in self.states]
        return Memory(states, self.mem_len, self.real)


def compiled_step(model: Any) -> Callable[..., Any]:
    """``model.log_probs`` compiled by the backend (``jax.jit`` over the variables' values, ``tf.function``; torch:
    as it is), one per reading of the model (its config: mem_len, same_length, clamp_len); each compiles once per
    shape of its arguments (the prompt's, then one for every later step)."""
    cache = model.__dict__.setdefault("_txl_compiled_steps", {})
    key = json.dumps(model.config.to_dict(), sort_keys=True)
    if key in cache:
        return cache[key]
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        variables = list(model.variables)

        def pure(values: list, ids: Any, mems: Any, pad: Any) -> Any:
            with keras.StatelessScope(state_mapping=list(zip(variables, values, strict=True))):
                return model.log_probs(ids, mems, pad)

        jitted = jax.jit(pure)
        step = lambda ids, mems, pad: jitted([v.value for v in variables], ids, mems, pad)  # noqa: E731
    elif backend == "tensorflow":
        import tensorflow as tf

        step = tf.function(model.log_probs)
    else:
        step = model.log_probs
    cache[key] = step
    return step


def _log_probs(model: Any, ids: np.ndarray, memory: Memory) -> tuple[np.ndarray, Memory]:
    """Log-probs of the next token [B, V] (float64) after ``ids`` [B, T] read on top of ``memory``; the new memory."""
    pad = ops.convert_to_tensor(np.int32(memory.pad))
    lp, new = compiled_step(model)(ops.convert_to_tensor(ids.astype("int32")), memory.states, pad)
    lp = np.asarray(ops.convert_to_numpy(lp), dtype="float64")
    if not np.isfinite(lp).all():
        raise FloatingPointError("the model gave non-finite log-probabilities")
    real = min(memory.real + ids.shape[1], memory.mem_len)
    if memory.states is None:
        return lp, Memory.of(new, memory.mem_len)
    return lp, Memory(new, memory.mem_len, real)


def _start(model: Any, input_ids: Any, mems: list | None) -> tuple[np.ndarray, list | None]:
    ids = np.asarray(ops.convert_to_numpy(input_ids) if not isinstance(input_ids, np.ndarray | list) else input_ids)
    if ids.ndim != 2 or ids.shape[1] == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError("input_ids must be a non-empty [batch, seq_len] array of token ids")
    if model.config.mem_len <= 0:
        raise ValueError("generation carries memory between steps: set mem_len > 0")
    if ids.min() < 0 or ids.max() >= model.config.n_token:
        raise ValueError(f"input_ids must be token ids in [0, {model.config.n_token})")
    bf = None if not mems else [ops.transpose(m, (1, 0, 2)) for m in mems]  # Hugging Face's [M, B, D] -> [B, M, D]
    return ids.astype("int64"), Memory.of(bf, model.config.mem_len)


def _with_mem_len(fn):  # noqa: ANN001, ANN202
    """Run ``fn`` with the model's memory length set to ``mem_len`` (if given), restored afterwards."""
    import functools

    @functools.wraps(fn)
    def run(model: Any, *args: Any, mem_len: int | None = None, **kwargs: Any) -> np.ndarray:
        config = model.config
        if mem_len is not None:
            model.reset_memory_length(mem_len)
        try:
            return fn(model, *args, **kwargs)
        finally:
            model.config = model.transformer.config = config

    return run


@_with_mem_len
def generate(
    model: Any, input_ids: Any, max_new_tokens: int, *, temperature: float = 1.0, top_k: int = 0, num_beams: int = 1,
    mems: list | None = None, seed: int | None = None, **beam_options: Any,
) -> np.ndarray:  # fmt: skip
    """``input_ids`` [B, T] followed by the new tokens ([B, T + max_new_tokens]; beam search: txl's
    ``beam_search`` result). ``temperature=0``: greedy; ``top_k``: sample among the k likeliest. ``mems``: the memory to
    start from (Hugging Face's n_layer x [M, B, d_model]; default: none). ``mem_len``: the memory length to use
    (default: the config's)."""
    if max_new_tokens < 0 or temperature < 0 or top_k < 0:
        raise ValueError("max_new_tokens, temperature and top_k must be >= 0")
    if num_beams > 1:
        return beam_search.__wrapped__(model, input_ids, max_new_tokens, num_beams=num_beams, mems=mems, **beam_options)
    ids, state = _start(model, input_ids, mems)
    rng = np.random.default_rng(seed)
    out = [ids]
    lp, state = _log_probs(model, ids, state)
    for i in range(max_new_tokens):
        if temperature == 0:
            nxt = lp.argmax(-1)
        else:
            scores = lp / temperature
            if top_k:
                kth = np.sort(scores, axis=-1)[:, -top_k][:, None]
                scores = np.where(scores < kth, -np.inf, scores)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            nxt = np.array([rng.choice(len(row), p=row) for row in p])
        out.append(nxt[:, None])
        if i < max_new_tokens - 1:
            lp, state = _log_probs(model, nxt[:, None], state)
    return np.concatenate(out, axis=1)


@_with_mem_len
def beam_search(
    model: Any, input_ids: Any, max_new_tokens: int, *, num_beams: int, length_penalty: float = 1.0,
    early_stopping: bool = False, num_return_sequences: int = 1, eos_token_ids: tuple[int, ...] | list[int] = (),
    pad_id: int | None = None, mems: list | None = None,
) -> np.ndarray:  # fmt: skip
    """txl's ``beam_search`` (Hugging Face's rule): the best ``num_return_sequences`` of ``num_beams`` hypotheses per
    prompt, [B * n, T + new]; the memories follow the beams."""
    if num_beams < 2 or not 1 <= num_return_sequences <= num_beams:
        raise ValueError(f"beam search needs num_beams >= 2 and 1 <= num_return_sequences <= num_beams ({num_beams})")
    ids, state = _start(model, input_ids, mems)
    B, T = ids.shape
    K = num_beams
    eos = [int(e) for e in eos_token_ids]
    fill = pad_id if pad_id is not None else (eos[0] if eos else 0)
    if max_new_tokens == 0:
        return np.repeat(ids, num_return_sequences, axis=0)
    lp, state = _log_probs(model, ids, state)
    rows = np.repeat(np.arange(B), K)
    lp = lp[rows]
    state = state.take(rows)
    seq = ids[rows]
    beam_scores = np.zeros((B, K))
    beam_scores[:, 1:] = -1e9
    beam_scores = beam_scores.reshape(-1)
    book = BeamBook(B, K, eos, fill, length_penalty, early_stopping)
    for step in range(max_new_tokens):
        scores = lp - np.logaddexp.reduce(lp, axis=-1, keepdims=True)  # (renormalised, as txl and Hugging Face do)
        V = scores.shape[-1]
        total = (scores + beam_scores[:, None]).reshape(B, K * V)
        n_top = max(2, 1 + len(eos)) * K
        top = np.argsort(-total, axis=1, kind="stable")[:, :n_top]
        top_scores = np.take_along_axis(total, top, axis=1)
        new_len = seq.shape[1] + 1 - T
        pick, tokens, next_scores = book.step(
            top.tolist(), top_scores.tolist(), V, new_len, lambda r, seq=seq: seq[r].copy()
        )
        index = np.array(pick)
        seq = np.concatenate([seq[index], np.array(tokens)[:, None]], axis=1)
        beam_scores = np.array(next_scores)
        if all(book.done) or step == max_new_tokens - 1:
            break
        state = state.take(index)
        lp, state = _log_probs(model, seq[:, -1:], state)
    best = book.best(lambda r: seq[r], beam_scores.tolist(), seq.shape[1] - T, num_return_sequences)
    return np.array(padded([hyp.tolist() for hyp in best], fill, eos, T + max_new_tokens), dtype="int64")
