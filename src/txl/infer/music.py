"""Music from a REMI model: continue a piece (or start one) for some bars or events, keeping it valid REMI.

:func:`compose` samples with the model's K/V cache (:func:`txl.infer.generation.stream`), each choice restricted to
what REMI's grammar allows next (:class:`txl.data.remi_grammar.Grammar`: the event order, time forward inside the
bar, notes inside their bars, no pitch struck twice at one position). It also measures what the grammar prevented:
at every step the probability the model gave to invalid events (``invalid_mass``: the rate at which an unconstrained
sampler at temperature 1 would break the grammar), and, with ``grammar=False``, the invalid events actually sampled.

The piece's MIDI is the decoded events (:meth:`txl.data.music.MusicTokenizer.decode_score`), the prompt's events
first and unchanged, then the new ones, with the prompt's tempo.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from txl.data.music import MusicTokenizer
from txl.data.remi_grammar import Grammar, State
from txl.infer.generation import stream
from txl.model.config import Reading
from txl.model.modeling import TransformerXLLM


@dataclass
class Composition:
    """A generated piece: the ids (prompt first), and what the grammar saw."""

    ids: list[int]
    prompt_len: int
    bars: int
    """Bars begun by the new events."""
    invalid_mass: list[float] = field(default_factory=list)
    """Per new event: the probability the model gave to events the grammar rules out there."""
    invalid_events: int = 0
    """Invalid events among the new ones (0 with the grammar on)."""
    events: int = 0
    """REMI events among the new ids (a BPE id is several)."""

    @property
    def new_ids(self) -> list[int]:
        return self.ids[self.prompt_len :]

    def summary(self) -> dict:
        mass = float(np.mean(self.invalid_mass)) if self.invalid_mass else 0.0
        return {
            "prompt_tokens": self.prompt_len,
            "new_tokens": len(self.new_ids),
            "new_events": self.events,
            "bars": self.bars,
            "invalid_events": self.invalid_events,
            "invalid_rate": self.invalid_events / self.events if self.events else 0.0,
            "invalid_mass_mean": mass,
        }


def compose(
    model: TransformerXLLM,
    tok: MusicTokenizer,
    prompt_ids: list[int],
    *,
    bars: int | None = None,
    max_new_tokens: int = 1024,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    grammar: bool = True,
    generator: torch.Generator | None = None,
    reading: Reading | None = None,
    mems: list[torch.Tensor] | None = None,
) -> Composition:
    """Continue ``prompt_ids`` (a piece's start: its BOS and events) by up to ``max_new_tokens`` ids, stopping
    before the event that would begin bar ``bars + 1`` of the new music (None: no bar limit). ``grammar``: keep every
    new event valid (else sample freely, stop at EOS, and count the invalid events)."""
    rules = Grammar(tok, allow_end=not grammar)
    state = rules.start(prompt_ids)
    device = next(model.parameters()).device
    out = Composition(list(prompt_ids), len(prompt_ids), 0)
    stops = [] if grammar else [tok.eos_id]

    def allowed() -> torch.Tensor:
        return torch.from_numpy(rules.mask(state))[None].to(device)  # [1, V]

    def observe(log_probs: torch.Tensor, tokens: torch.Tensor) -> None:
        nonlocal state
        ok = torch.from_numpy(rules.mask(state)).to(device)
        out.invalid_mass.append(float(log_probs[0].exp()[~ok].sum()))
        state, bad = rules.advance(state, int(tokens[0]))
        out.invalid_events += bad
        out.events += len(rules.events[int(tokens[0])])

    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    steps = stream(
        model, ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator,
        stop_tokens=stops, mems=mems, observe=observe, reading=reading, allowed=allowed if grammar else None,
    )  # fmt: skip
    for t in steps:
        token = int(t[0, 0])
        new_bars = sum(kind == "Bar" for kind, _ in rules.events[token])
        if bars is not None and out.bars + new_bars > bars:
            out.events -= len(rules.events[token])  # (the event that opens the next bar is not kept)
            out.invalid_mass.pop()
            break
        out.bars += new_bars
        out.ids.append(token)
        if token == tok.eos_id:
            break
    return out


def piece_state(tok: MusicTokenizer, ids: list[int]) -> State:
    """The grammar's state after ``ids`` (for tests and tools)."""
    return Grammar(tok).start(ids)


def write_midi(tok: MusicTokenizer, ids: list[int], path, prompt_score=None) -> object:
    """Write the piece of ``ids`` as a MIDI file (the prompt's first tempo kept); return the ``symusic.Score``."""
    from txl.util.fileio import write_bytes

    score = tok.decode_score(ids)
    if prompt_score is not None and len(prompt_score.tempos):
        import symusic

        score.tempos = [symusic.Tempo(0, float(prompt_score.tempos[0].qpm))]
    write_bytes(path, bytes(score.dumps_midi()))
    return score


def roll(score) -> dict:
    """A piano roll's data of ``score``: notes as (onset, duration, pitch) in quarter notes, and the bar lines."""
    tpq = score.ticks_per_quarter
    notes = [(n.time / tpq, n.duration / tpq, n.pitch) for t in score.tracks for n in t.notes]
    end = max((o + d for o, d, _ in notes), default=0.0)
    lines, t = [], 0.0
    sigs = sorted((ts.time / tpq, ts.numerator * 4 / ts.denominator) for ts in score.time_signatures) or [(0.0, 4.0)]
    k = 0
    length = sigs[0][1]
    while t <= end and len(lines) < 100_000:
        while k + 1 < len(sigs) and sigs[k + 1][0] <= t + 1e-9:
            k += 1
            length = sigs[k][1]
        lines.append(t)
        t += length
    return {"notes": notes, "bars": lines, "end": end}
