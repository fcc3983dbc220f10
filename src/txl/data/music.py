"""Symbolic music as tokens: MIDI files read with symusic, written as REMI events by MidiTok's tokenizer.
Design notes: docs/internals.md#txldatamusic."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from txl.data.errors import DataError
from txl.data.text import smallest_uint

MIDI_SUFFIXES = (".mid", ".midi")
BOS, EOS = "BOS_None", "EOS_None"


def _time_signatures() -> list[str]:
    return ["4/4", "3/4", "2/4", "6/4", "3/2", "2/2", "4/2", "6/8", "9/8", "12/8", "3/8"]


def _beat_res() -> dict[str, int]:
    return {"0-4": 8, "4-12": 4}


@dataclass
class MusicConfig:
    """How MIDI files become REMI tokens (the ``data.music`` section; MidiTok's REMI options)."""

    beat_res: dict[str, int] = field(default_factory=_beat_res)
    """Positions per beat by note length in beats: '0-4': 8 (notes up to 4 beats on a 1/8-beat grid), '4-12': 4.
    The first range's resolution is the onset grid (8 positions per beat)."""
    num_velocities: int = 8
    """Velocity bins (MidiTok's num_velocities)."""
    pitch_range: list[int] = field(default_factory=lambda: [21, 109])
    """Lowest and one past the highest MIDI pitch (a piano's 88 keys)."""
    time_signatures: list[str] = field(default_factory=_time_signatures)
    """The time signatures the tokenizer can write (a file with another one is refused, naming it)."""
    bpe_vocab_size: int = 0
    """Learn BPE merges of the REMI events on the train split up to this vocabulary size (0: none, plain REMI)."""
    held_out_percent: int = 10
    """A folder of MIDI files without train/ valid/ test/ subfolders: this share of the files (by a hash of each
    one's path) is the test split, and again the valid split."""

    def validate(self) -> None:
        """Raise ``DataError`` naming the first bad field as ``data.music.{field}``."""
        if self.num_velocities < 1 or self.num_velocities > 127:
            raise DataError(f"data.music.num_velocities = {self.num_velocities}: must be in 1..127")
        if len(self.pitch_range) != 2 or not 0 <= self.pitch_range[0] < self.pitch_range[1] <= 128:
            raise DataError(
                f"data.music.pitch_range = {self.pitch_range}: must be [low, high] with 0 <= low < high <= 128"
            )
        if not 1 <= self.held_out_percent <= 45:
            raise DataError(f"data.music.held_out_percent = {self.held_out_percent}: must be in 1..45")
        if self.bpe_vocab_size < 0:
            raise DataError(f"data.music.bpe_vocab_size = {self.bpe_vocab_size}: must be >= 0 (0: no BPE)")
        _ts_range(self.time_signatures)
        _beat_ranges(self.beat_res)


def _ts_range(signatures: Sequence[str]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for ts in signatures:
        try:
            num, den = (int(x) for x in str(ts).split("/"))
        except ValueError:
            raise DataError(f"data.music.time_signatures: {ts!r} is not a time signature like '3/4'") from None
        if num < 1 or den not in (1, 2, 4, 8, 16, 32, 64):
            raise DataError(f"data.music.time_signatures: {ts!r}: the numerator must be >= 1, the denominator 1..64")
        out.setdefault(den, []).append(num)
    if not out:
        raise DataError("data.music.time_signatures is empty: give at least one, e.g. ['4/4']")
    return out


def _beat_ranges(beat_res: dict[str, int]) -> dict[tuple[int, int], int]:
    out = {}
    for key, res in beat_res.items():
        try:
            lo, hi = (int(x) for x in str(key).split("-"))
        except ValueError:
            raise DataError(f"data.music.beat_res: {key!r} is not a beat range like '0-4'") from None
        if not (0 <= lo < hi) or not isinstance(res, int) or res < 1:
            raise DataError(f"data.music.beat_res: {key!r}: {res!r}: a range lo-hi (0 <= lo < hi) to positions >= 1")
        out[(lo, hi)] = res
    if not out or min(lo for lo, _ in out) != 0:
        raise DataError("data.music.beat_res must have a range starting at beat 0, e.g. {'0-4': 8}")
    return out


def _miditok():
    try:
        import miditok
        import symusic
    except ImportError:
        raise DataError("music needs MidiTok and symusic: pip install 'transformer-xl[music]'") from None
    return miditok, symusic


def is_miditok_json(obj: object) -> bool:
    """Whether a parsed tokenizer.json is MidiTok's (a music model's)."""
    return isinstance(obj, dict) and "tokenization" in obj and "miditok_version" in obj


# ------------------------------------------------------------------------------------------------ MIDI files
def read_midi(data: bytes | str | Path, where: str | None = None):
    """A ``symusic.Score`` from a MIDI file's path or bytes, or one ``DataError`` line: not a file, not MIDI,
    no notes."""
    _, symusic = _miditok()
    where = where or str(data if not isinstance(data, bytes) else "the MIDI data")
    if not isinstance(data, bytes):
        path = Path(data)
        if not path.is_file():  # (round 6: a folder or a device said "no such file")
            what = "a folder" if path.is_dir() else "not a regular file (a device, a pipe?)" if path.exists() else None
            raise DataError(f"{where}: {'no such file' if what is None else what}; give a MIDI file")
        data = path.read_bytes()
    if data[:4] != b"MThd":
        what = "empty" if not data else f"starts with {data[:4]!r}"
        raise DataError(f"{where}: not a MIDI file ({what}; a Standard MIDI File starts with 'MThd')")
    try:
        score = symusic.Score.from_midi(data)
    except Exception as e:  # (symusic raises RuntimeError/ValueError from C++ on broken chunks)
        raise DataError(f"{where}: not a readable MIDI file ({str(e).splitlines()[0][:200]})") from None
    if score.note_num() == 0:
        raise DataError(f"{where}: the MIDI file has no notes")
    return score


def merge_tracks(score):
    """One piano track with the notes of every non-drum track of ``score`` (sorted), its time signatures and
    tempos: the single stream a REMI language model reads."""
    _, symusic = _miditok()
    out = symusic.Score(score.ticks_per_quarter)
    track = symusic.Track("merged", 0, False)
    for t in score.tracks:
        if not t.is_drum:
            track.notes.extend(t.notes)
    track.notes.sort()
    out.tracks.append(track)
    out.time_signatures = score.time_signatures.copy()
    out.tempos = score.tempos.copy()
    return out


# ------------------------------------------------------------------------------------------------ tokenizer
class MusicTokenizer:
    """MidiTok's REMI tokenizer for one merged stream per piece, with the parts of txl's tokenizer interface that
    commands use. ``kind`` is ``"remi"``."""

    kind = "remi"
    unk_id = None
    unk_token = None

    def __init__(self, remi):
        self.remi = remi
        self.vocab_size = len(remi)
        self.bos_id, self.eos_id, self.pad_id = remi[BOS], remi[EOS], remi["PAD_None"]
        ts = remi.config.time_signature_range
        self.time_signatures = {(num, den) for den, nums in ts.items() for num in nums}

    # -- building, saving, loading
    @classmethod
    def from_config(cls, cfg: MusicConfig) -> MusicTokenizer:
        """A plain REMI tokenizer with ``cfg``'s options (BPE is learned by :meth:`learn_bpe`)."""
        cfg.validate()
        miditok, _ = _miditok()
        config = miditok.TokenizerConfig(
            pitch_range=tuple(cfg.pitch_range),
            beat_res=_beat_ranges(cfg.beat_res),
            num_velocities=cfg.num_velocities,
            special_tokens=["PAD", "BOS", "EOS", "MASK"],
            use_time_signatures=True,
            time_signature_range=_ts_range(cfg.time_signatures),
            use_programs=False,
            use_tempos=False,
            use_chords=False,
            use_rests=False,
            remove_duplicated_notes=True,
        )
        return cls(miditok.REMI(config))

    def learn_bpe(self, scores: Iterable, vocab_size: int) -> None:
        """Learn BPE merges (MidiTok's ``train``, Hugging Face tokenizers' BPE) on the REMI events of ``scores``."""
        if vocab_size <= self.vocab_size:
            raise DataError(
                f"data.music.bpe_vocab_size = {vocab_size}: must be above the {self.vocab_size} REMI events (or 0)"
            )
        remi = self.remi
        texts = []
        for score in scores:
            seq = remi.encode(score, encode_ids=False)[0]
            texts += [remi._ids_to_bytes(s.ids, as_one_str=True) for s in seq.split_per_bars() if len(s)]
        remi.train(vocab_size=vocab_size, model="BPE", iterator=texts)
        self.vocab_size = len(remi)

    @classmethod
    def load(cls, path: str | Path) -> MusicTokenizer:
        """Read MidiTok's ``tokenizer.json`` (JSON only), or raise one ``DataError`` line."""
        miditok, _ = _miditok()
        path = Path(path)
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise DataError(f"{path}: not a readable tokenizer.json ({e})") from None
        if not is_miditok_json(obj) or obj.get("tokenization") != "REMI":
            what = obj.get("tokenization") if isinstance(obj, dict) else type(obj).__name__
            raise DataError(f"{path}: not a MidiTok REMI tokenizer ({what}); txl's music models use REMI")
        try:
            remi = miditok.REMI(params=path)
        except Exception as e:  # (MidiTok raises KeyError/TypeError on a changed file)
            raise DataError(f"{path}: MidiTok could not read this tokenizer ({type(e).__name__}: {e})") from None
        return cls(remi)

    def save(self, path: str | Path) -> Path:
        """Write MidiTok's ``tokenizer.json`` (``path`` may be a folder), atomically."""
        from txl.util.fileio import write_bytes

        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        tmp = path.with_name(f".{path.name}.miditok.tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        self.remi.save(tmp)
        data = tmp.read_bytes()
        tmp.unlink()
        write_bytes(path, data)
        return path

    @property
    def dtype(self) -> np.dtype:
        return smallest_uint(self.vocab_size)

    def for_model(self, n_token: int, where: str | Path) -> MusicTokenizer:
        """This tokenizer, checked to fit a model of ``n_token`` ids."""
        if self.vocab_size != n_token:
            raise DataError(
                f"{where}: the tokenizer has {self.vocab_size} tokens and the model {n_token}: not this model's"
            )
        return self

    def with_unknown(self, policy, replacement=None) -> MusicTokenizer:
        return self

    # -- MIDI <-> ids
    def check_score(self, score, where: str, fix: str = "") -> None:
        """One ``DataError`` line where the tokenizer cannot write ``score`` faithfully (``fix``: what to do about a
        time signature it does not write; default: the recipe's field, for whoever prepares the data)."""
        bad = sorted({(t.numerator, t.denominator) for t in score.time_signatures} - self.time_signatures)
        if bad:
            have = ", ".join(f"{n}/{d}" for n, d in sorted(self.time_signatures, key=lambda x: (x[1], x[0])))
            raise DataError(
                f"{where}: time signature {', '.join(f'{n}/{d}' for n, d in bad)} is not one the tokenizer writes "
                f"({have}); {fix or 'add it to data.music.time_signatures and prepare the data again'}"
            )
        if not any(not t.is_drum and len(t.notes) for t in score.tracks):
            raise DataError(f"{where}: the MIDI file has only drum notes (a REMI model here reads pitched notes)")

    def encode_score(self, score, where: str = "the MIDI file", fix: str = "") -> list[int]:
        """The ids of ``score`` (all non-drum tracks merged, quantized to the grid), without BOS/EOS (``fix``: see
        :meth:`check_score`)."""
        self.check_score(score, where, fix)
        seqs = self.remi.encode(merge_tracks(score))
        ids = list(seqs[0].ids) if seqs else []
        if not ids:
            raise DataError(f"{where}: no notes left on the tokenizer's grid (pitches outside its range?)")
        return ids

    def encode_midi(self, path: str | Path | bytes, where: str | None = None) -> list[int]:
        return self.encode_score(read_midi(path, where), where or str(path))

    def encode(self, text: str, **_) -> list[int]:
        raise ValueError(
            "this is a music model (MidiTok REMI tokens): it reads MIDI, not text; give --prompt_midi FILE.mid "
            "(or --prompt_ids)"
        )

    __call__ = encode

    def base_tokens(self, token_id: int) -> list[str]:
        """The REMI events of one id (one, or several for a BPE id)."""
        remi = self.remi
        if not remi.is_trained:
            return [remi[int(token_id)]]
        return list(remi._vocab_learned_bytes_to_tokens[remi._model.id_to_token(int(token_id))])

    def events(self, ids: Iterable[int]) -> list[str]:
        """The REMI events of ``ids`` (BPE ids expanded)."""
        return [e for i in ids for e in self.base_tokens(int(i))]

    def decode_score(self, ids: Iterable[int]):
        """A ``symusic.Score`` of ``ids`` (special tokens left out; ticks per quarter: the grid's)."""
        miditok, symusic = _miditok()
        events = [e for e in self.events(ids) if e.split("_")[0] not in ("PAD", "BOS", "EOS", "MASK")]
        if not events:
            return symusic.Score(self.remi.time_division)
        seq = miditok.TokSequence(tokens=events)
        base = self.remi
        seq.ids = [base.vocab[e] for e in events]
        seq.are_ids_encoded = False
        return base.decode([seq])

    def read_changes(self, score, ids: Iterable[int]) -> list[str]:
        """What reading ``score`` as REMI events (``ids``, its encoding) changed, a phrase each (empty: nothing): the
        tracks merged into one piano track, drums left out, onsets and durations moved to the grid, velocities to
        the tokenizer's levels. A continuation holds the prompt as read: the commands and the server say so."""
        out = []
        pitched = [t for t in score.tracks if not t.is_drum and len(t.notes)]
        drums = sum(1 for t in score.tracks if t.is_drum and len(t.notes))
        if len(pitched) > 1:
            out.append(f"its {len(pitched)} tracks merged into one piano track")
        if drums:
            out.append(f"{drums} drum track{'s' if drums > 1 else ''} left out")
        tpq, back = score.ticks_per_quarter, self.decode_score(ids)
        btpq = back.ticks_per_quarter

        def notes(sc, q) -> list[tuple]:
            return sorted((n.time / q, n.pitch, n.duration / q, n.velocity) for t in sc.tracks if not t.is_drum
                          for n in t.notes)  # fmt: skip

        before, after = notes(merge_tracks(score), tpq), notes(back, btpq)
        n = len(before)
        if len(after) != n:
            out.append(f"{n - len(after)} of {n} notes dropped (outside the tokenizer's pitch range or grid)")
        else:
            moved = sum(abs(a[0] - b[0]) > 1e-9 or abs(a[2] - b[2]) > 1e-9 for a, b in zip(before, after, strict=True))
            levels = sum(a[3] != b[3] for a, b in zip(before, after, strict=True))
            if moved:
                out.append(f"{moved} of {n} notes moved or resized to its grid of 1/{btpq} quarter note")
            if levels:
                out.append(f"{levels} of {n} velocities set to its {len(self.remi.velocities)} levels")
        return out

    def symbol(self, token_id: int) -> str:
        return " ".join(self.base_tokens(token_id))

    def decode(self, ids: Iterable[int]) -> str:
        """The event names of ``ids``, space-separated (what a terminal shows of a music model's output)."""
        return " ".join(self.symbol(int(i)) for i in ids)

    def stream_decoder(self) -> _EventStream:
        return _EventStream(self)


class _EventStream:
    def __init__(self, tok: MusicTokenizer):
        self.tok, self.first = tok, True

    def push(self, token_id: int) -> str:
        s = ("" if self.first else " ") + self.tok.symbol(token_id)
        self.first = False
        return s

    def flush(self) -> str:
        return ""


# ------------------------------------------------------------------------------------------------ a folder of MIDI
def midi_files(folder: Path) -> list[Path]:
    """The MIDI files under ``folder`` at any depth (.mid/.midi, any case; hidden ones left out), sorted."""
    found = (p for p in Path(folder).rglob("*") if p.suffix.lower() in MIDI_SUFFIXES and p.is_file())
    return sorted(p for p in found if not any(x.startswith(".") for x in p.relative_to(folder).parts))


def music_layout(path: str | Path, cfg: MusicConfig):
    """The train/valid/test MIDI files of a folder: its ``train/ valid/ test/`` subfolders, else every MIDI file
    split by a hash of its path (``cfg.held_out_percent``; :func:`txl.data.music_sources.music_split`)."""
    from txl.data.music_sources import music_split
    from txl.data.readers import SPLITS, Layout
    from txl.data.text import FileRange

    path = Path(path)
    if not path.is_dir():
        raise DataError(f"{path}: a music dataset is a folder of MIDI files (.mid), not a file")
    if all((path / s).is_dir() for s in SPLITS):
        splits = {s: midi_files(path / s) for s in SPLITS}
        where = f"MIDI files in {path}/{{train,valid,test}}/"
    else:
        files = midi_files(path)
        if not files:
            raise DataError(f"{path}: no MIDI files (.mid, .midi) in this folder or below it")
        splits = {s: [] for s in SPLITS}
        for f in files:
            splits[music_split(f.relative_to(path).as_posix(), cfg.held_out_percent)].append(f)
        where = f"{len(files)} MIDI files in {path} (split by a hash of each path)"
    for s, files in splits.items():
        if not files:
            raise DataError(
                f"{path}: the {s} split has no MIDI file ({where}); give it a {s}/ subfolder, more files, or "
                "a larger data.music.held_out_percent"
            )
    return Layout({s: [FileRange(f) for f in fs] for s, fs in splits.items()}, where)
