"""REMI's grammar: which event may come next, so a sampler can keep every piece valid and count what it prevented.
Design notes: docs/internals.md#txldataremi_grammar."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np

from txl.data.music import MusicTokenizer

_NEVER = {"PAD", "MASK", "PitchDrum"}


@dataclass(frozen=True)
class State:
    """Where a REMI sequence is: the previous event's type, the bar's position (-1: none yet), the bar's length in
    positions, and the highest pitch struck at the current position (-1: none yet)."""

    prev: str = ""
    pos: int = -1
    bar_len: int = 0
    pitch: int = -1
    ended: bool = False


class Grammar:
    """REMI's rules for one tokenizer's vocabulary (see the module docstring)."""

    def __init__(self, tok: MusicTokenizer, allow_end: bool = False):
        self.tok, self.allow_end = tok, allow_end
        remi = tok.remi
        graph = remi.tokens_types_graph
        self.next_types = {t: {n.split("_")[0] for n in nxt} - _NEVER - {"BOS"} for t, nxt in graph.items()}
        self.next_types[""] = {"BOS", "Bar"}  # (a piece's start)
        self.next_types["BOS"] = {"Bar"}
        self.next_types["TimeSig"] = self.next_types.get("TimeSig", set()) - {"Pitch"}  # (a note needs a Position)
        # positions per beat, MidiTok's beat being the time signature's denominator's note (an eighth in 12/8)
        self.per_beat = int(remi.config.max_num_pos_per_beat)
        self.default_bar = 4 * self.per_beat  # (4/4 until a TimeSig says otherwise)
        self.events = [
            [(e.split("_")[0], e.split("_", 1)[1]) for e in tok.base_tokens(i)] for i in range(tok.vocab_size)
        ]
        self._masks: dict[State, np.ndarray] = {}

    # -- one event
    def step(self, s: State, kind: str, value: str) -> tuple[State, bool]:
        """The state after an event, and whether the event was valid there (an invalid one still moves the
        state, as MidiTok's count goes on)."""
        ok = kind in self.next_types.get(s.prev, set()) and not s.ended
        if kind == "EOS":
            return replace(s, prev="EOS", ended=True), ok and self.allow_end
        if kind == "BOS":  # (a piece's first event: at the start, or after the previous piece's EOS)
            return State(prev="BOS"), s == State() or s.ended
        if kind == "Bar":
            return State(prev="Bar", pos=-1, bar_len=s.bar_len or self.default_bar), ok
        if kind == "TimeSig":
            num = int(value.split("/")[0])
            return replace(s, prev="TimeSig", bar_len=num * self.per_beat), ok
        if kind == "Position":
            p = int(value)
            bar_len = s.bar_len or self.default_bar
            ok = ok and s.pos < p < bar_len
            return replace(s, prev="Position", pos=p, pitch=-1), ok
        if kind == "Pitch":
            p = int(value)
            ok = ok and s.pos >= 0 and p > s.pitch
            return replace(s, prev="Pitch", pitch=max(p, s.pitch)), ok
        return replace(s, prev=kind), ok and kind not in _NEVER

    def advance(self, s: State, token_id: int) -> tuple[State, int]:
        """The state after one id, and its number of invalid events."""
        errors = 0
        for kind, value in self.events[int(token_id)]:
            s, ok = self.step(s, kind, value)
            errors += not ok
        return s, errors

    def start(self, ids: Iterable[int] = ()) -> State:
        """The state after ``ids`` (from the start of a piece: its BOS, or none)."""
        s = State()
        for i in ids:
            s, _ = self.advance(s, i)
        return s

    # -- all ids at once
    def mask(self, s: State) -> np.ndarray:
        """Which ids may come next [V] (bool), cached per state."""
        m = self._masks.get(s)
        if m is None:
            m = np.array([self.advance(s, i)[1] == 0 for i in range(self.tok.vocab_size)], dtype=bool)
            if len(self._masks) > 100_000:
                self._masks.clear()
            self._masks[s] = m
        return m

    def errors(self, ids: Iterable[int], s: State | None = None) -> tuple[int, int]:
        """(invalid events, events) of ``ids`` read from state ``s`` (default: a piece's start)."""
        s = s or State()
        bad = n = 0
        for i in ids:
            s, e = self.advance(s, int(i))
            bad += e
            n += len(self.events[int(i)])
        return bad, n


class Sounding:
    """The notes still sounding along a REMI sequence, so that a sampler never strikes a pitch that is still held:
    MIDI cannot hold one pitch twice (a reader ends the first note where the second starts), so such a note would
    change the one before it, a prompt's included, when the piece is written. Real pieces have a few (two voices
    meeting on one pitch: 0.7% of the chorales' notes), so this is a rule of generation, not of REMI's validity.

    Time is counted in positions from the piece's start (a Bar adds its bar's length); a Duration ``b.p.r`` is
    ``(b + p / r)`` beats of ``per_beat`` positions."""

    def __init__(self, grammar: Grammar):
        self.g = grammar
        self.ends: dict[int, int] = {}  # pitch -> the position where its latest note ends
        self.bar_start, self.bar_len, self.now, self.pitch = 0, grammar.default_bar, 0, None
        self.started = False
        tok = grammar.tok
        self._pitch_ids: dict[int, list[int]] = {}
        for i, events in enumerate(grammar.events):
            first = next((int(v) for k, v in events if k == "Pitch"), None)
            if first is not None:
                self._pitch_ids.setdefault(first, []).append(i)
        self.multi = tok.remi.is_trained  # (BPE ids: several events, checked one by one)

    def _duration(self, value: str) -> int:
        b, p, r = (int(x) for x in value.split("."))
        return round((b + p / r) * self.g.per_beat)

    def _event(self, kind: str, value: str) -> bool:
        """Follow one event; whether it strikes a pitch still sounding."""
        bad = False
        if kind == "Bar":
            if self.started:
                self.bar_start += self.bar_len
            self.started, self.now = True, self.bar_start
        elif kind == "TimeSig":
            self.bar_len = int(value.split("/")[0]) * self.g.per_beat
        elif kind == "Position":
            self.now = self.bar_start + int(value)
        elif kind == "Pitch":
            self.pitch = int(value)
            bad = self.ends.get(self.pitch, -1) > self.now
        elif kind == "Duration" and self.pitch is not None:
            self.ends[self.pitch] = max(self.ends.get(self.pitch, -1), self.now + self._duration(value))
            self.pitch = None
        return bad

    def push(self, token_id: int) -> None:
        for kind, value in self.g.events[int(token_id)]:
            self._event(kind, value)

    def blocked(self) -> np.ndarray:
        """The ids [V] (bool) that would strike a pitch still sounding now."""
        out = np.zeros(self.g.tok.vocab_size, dtype=bool)
        held = [p for p, end in self.ends.items() if end > self.now]
        if not self.multi:
            for p in held:
                out[self._pitch_ids.get(p, [])] = True
            return out
        for i, events in enumerate(self.g.events):
            if any(k == "Pitch" for k, _ in events):  # (followed on a copy: this one stays where it is)
                probe = copy.copy(self)
                probe.ends = dict(self.ends)
                out[i] = any([probe._event(k, v) for k, v in events])
        return out
