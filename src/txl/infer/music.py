"""Music from a REMI model: continue a piece (or start one) for some bars or events, keeping it valid REMI.
Design notes: docs/internals.md#txlinfermusic."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field

import numpy as np
import torch

from txl.data.music import MusicTokenizer
from txl.data.remi_grammar import Grammar, Sounding
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


def compose(*args, **kwargs) -> Composition:
    """:func:`compose_steps` run to its end (the same arguments): the piece."""
    steps = compose_steps(*args, **kwargs)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def compose_steps(
    model: TransformerXLLM, tok: MusicTokenizer, prompt_ids: list[int], *, bars: int | None = None,
    max_new_tokens: int = 1024, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, grammar: bool = True,
    generator: torch.Generator | None = None, reading: Reading | None = None, mems: list[torch.Tensor] | None = None,
) -> Generator[None, None, Composition]:  # fmt: skip
    """Continue ``prompt_ids`` (a piece's start: its BOS and events) by up to ``max_new_tokens`` ids, stopping
    before the event that would begin bar ``bars + 1`` of the new music (None: no bar limit). ``grammar``: keep every
    new event valid (else sample freely, stop at EOS, and count the invalid events). A generator that yields after
    each new id (a server runs it one step at a time beside other work) and returns the :class:`Composition`."""
    rules = Grammar(tok, allow_end=not grammar)
    state = rules.start(prompt_ids)
    held = Sounding(rules)  # (no pitch struck while it still sounds: MIDI would cut the note before it)
    for i in prompt_ids:
        held.push(i)
    device = next(model.parameters()).device
    out = Composition(list(prompt_ids), len(prompt_ids), 0)
    stops = [] if grammar else [tok.eos_id]

    def allowed() -> torch.Tensor:
        return torch.from_numpy(rules.mask(state) & ~held.blocked())[None].to(device)  # [1, V]

    def observe(log_probs: torch.Tensor, tokens: torch.Tensor) -> None:
        nonlocal state
        ok = torch.from_numpy(rules.mask(state)).to(device)
        out.invalid_mass.append(float(log_probs[0].exp()[~ok].sum()))
        state, bad = rules.advance(state, int(tokens[0]))
        held.push(int(tokens[0]))
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
        yield
    return out


def piece_score(tok: MusicTokenizer, ids: list[int], prompt_score=None):
    """The ``symusic.Score`` of the piece ``ids``, at the first tempo of ``prompt_score`` where it has one (REMI here
    keeps no tempo: the piece plays as fast as the MIDI file it continues)."""
    score = tok.decode_score(ids)
    if prompt_score is not None and len(prompt_score.tempos):
        import symusic

        score.tempos = [symusic.Tempo(0, float(prompt_score.tempos[0].qpm))]
    return score


def notes_in_seconds(score) -> list[list[float]]:
    """The notes of ``score`` as [onset, duration] in seconds (its tempo map) with [pitch, velocity]: what a page
    plays with Web Audio."""
    timed = score.to("second")
    notes = [[n.time, n.duration, n.pitch, n.velocity] for t in timed.tracks for n in t.notes]
    return sorted([round(a, 4), round(b, 4), int(p), int(v)] for a, b, p, v in notes)


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


# ------------------------------------------------------------------------------------------------ measures
# The measures of generated music the literature reports (Wu & Yang 2020, "The Jazz Transformer on the Front Line";
# the Pop Music Transformer, Huang & Yang 2020), computed on a piece's notes and its bars:
# * H: the entropy (bits) of the pitch-class histogram (note counts) of a window of 1 or 4 bars, averaged over the
#   piece's windows: how tonal (low) or chromatic (high) the piece is;
# * GS: grooving-pattern similarity: each bar's onsets as a binary vector over its positions, and for every pair of
#   bars 1 - (their differing positions) / (positions), averaged: how consistent the rhythm is;
# * beats and downbeats: the Pop Music Transformer measures beat and downbeat regularity with an audio beat tracker;
#   symbolic music has its grid, so here it is the share of onsets on a beat and the share of bars with a note on
#   their downbeat.


def bars_of(score) -> list[tuple[float, float, list[tuple[float, int]]]]:
    """The piece's bars: (start, length in quarter notes, the notes (onset, pitch) that start in it)."""
    data = roll(score)
    starts = data["bars"]
    notes = sorted((o, p) for o, _, p in data["notes"])
    out, k = [], 0
    for i, start in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else data["end"] + 1e-9
        inside = []
        while k < len(notes) and notes[k][0] < end - 1e-9:
            inside.append(notes[k])
            k += 1
        out.append((start, end - start, inside))
    return out


def pitch_class_entropy(bars: list, window: int = 1) -> float:
    """H over windows of ``window`` bars (:func:`bars_of`'s; bits; nan for a piece without notes)."""
    values = []
    for i in range(0, len(bars), window):
        pcs = [p % 12 for b in bars[i : i + window] for _, p in b[2]]
        if pcs:
            h = np.bincount(pcs, minlength=12) / len(pcs)
            h = h[h > 0]
            values.append(float(-(h * np.log2(h)).sum()))
    return float(np.mean(values)) if values else float("nan")


def grooving_similarity(bars: list, per_quarter: int = 8) -> float:
    """GS over every pair of bars (:func:`bars_of`'s) with notes (onsets on a grid of ``per_quarter`` positions per
    quarter note)."""
    vectors = []
    for start, length, notes in bars:
        q = max(1, round(length * per_quarter))
        if notes:
            v = np.zeros(q, dtype=bool)
            for o, _ in notes:
                v[min(q - 1, round((o - start) * per_quarter))] = True
            vectors.append(v)
    sims = [
        1 - float(np.count_nonzero(a != b)) / len(a)
        for i, a in enumerate(vectors)
        for b in vectors[i + 1 :]
        if len(a) == len(b)
    ]
    return float(np.mean(sims)) if sims else float("nan")


def beat_statistics(score, bars: list) -> dict[str, float]:
    """The share of onsets on a beat (a quarter note, or the denominator's note), and of bars with a downbeat note
    (``bars``: :func:`bars_of` ``score``)."""
    sigs = sorted((ts.time / score.ticks_per_quarter, 4 / ts.denominator) for ts in score.time_signatures)
    sigs = sigs or [(0.0, 1.0)]
    on_beat = total = downbeats = bars_with_notes = 0
    for start, _, notes in bars:
        beat = [b for t, b in sigs if t <= start + 1e-9][-1] if sigs[0][0] <= start + 1e-9 else sigs[0][1]
        if notes:
            bars_with_notes += 1
            downbeats += any(abs(o - start) < 1e-6 for o, _ in notes)
        for o, _ in notes:
            total += 1
            x = (o - start) / beat
            on_beat += abs(x - round(x)) < 1e-6
    return {
        "onsets_on_beat": on_beat / total if total else float("nan"),
        "bars_with_downbeat": downbeats / bars_with_notes if bars_with_notes else float("nan"),
    }


def measures(score) -> dict[str, float]:
    """H1, H4, GS and the beat statistics of one piece."""
    bars = bars_of(score)
    return {
        "H1": pitch_class_entropy(bars, 1),
        "H4": pitch_class_entropy(bars, 4),
        "GS": grooving_similarity(bars),
        **beat_statistics(score, bars),
        "notes_per_bar": score.note_num() / max(1, len(bars)),
    }
