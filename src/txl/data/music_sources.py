"""``txl data get chorales|quartets``: symbolic music that a pip package ships, rendered to MIDI deterministically.
Design notes: docs/internals.md#txldatamusic_sources."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from txl.data.download import _say
from txl.data.errors import DataError
from txl.data.ledger import Ledger
from txl.data.readers import hash_split

MUSIC21_VERSION = "10.5.1"
"""The music21 version whose corpus the recorded checksums are of (the ``music`` extra pins it)."""
MUSIC_PERCENT = 10
"""The share of scores held out for test, and again for valid, chosen by a hash of each score's path."""
QUARTET_COMPOSERS = ("beethoven", "haydn", "mozart")
MUSIC_DATASETS = ("chorales", "quartets")
"""Symbolic music rendered from music21's corpus."""
MUSIC_SHA256 = {
    "chorales": "e1a1f72cfd7823d6d4efd4d4d38bd42d2bb19e123883558d35012f1d0f9f7ca8",
    "quartets": "7c2e4d1a67c053760a97c015945266c3c95ceeca61a64e9f58edcf8fa8c83d82",
}
"""sha256 of the sorted ``{path: sha256}`` list of every MIDI file written, with music21 :data:`MUSIC21_VERSION`."""
MUSIC_FILES = {"chorales": 410, "quartets": 46}


def music_split(path: str, percent: int = MUSIC_PERCENT) -> str:
    """The split of a score: :func:`~txl.data.readers.hash_split` of its path, ``percent`` test and as many valid
    (the sympy corpus's rule)."""
    return hash_split(path, percent, percent)


def _music21():
    try:
        import music21
    except ImportError:
        raise DataError(
            "txl data get chorales/quartets renders music21's corpus: pip install 'transformer-xl[music]' "
            f"(music21=={MUSIC21_VERSION})"
        ) from None
    return music21


def corpus_scores(name: str) -> list[str]:
    """The corpus paths (relative to music21's corpus folder, '/'-separated, sorted) of the scores of ``name``."""
    music21 = _music21()
    from music21 import corpus

    root = Path(music21.__file__).parent / "corpus"
    if name == "chorales":
        paths = [p for p in corpus.getComposer("bach") if p.suffix in (".mxl", ".xml") and p.name.startswith("bwv")]
    elif name == "quartets":
        paths = [
            p
            for c in QUARTET_COMPOSERS
            for p in corpus.getComposer(c)
            if p.suffix == ".mxl" and "k545" not in p.parts  # (K. 545 is a piano sonata)
        ]
    else:
        raise DataError(f"unknown music corpus {name!r}; txl data get knows: {', '.join(MUSIC_DATASETS)}")
    return sorted(Path(p).relative_to(root).as_posix() for p in paths)


def render_score(rel: str) -> bytes:
    """The MIDI bytes of music21's corpus score ``rel``: parsed from its source (no pickle read or written)."""
    music21 = _music21()
    root = Path(music21.__file__).parent / "corpus"
    score = music21.converter.parseFile(root / rel, forceSource=True, storePickle=False)
    try:
        return bytes(music21.midi.translate.streamToMidiFile(score).writestr())
    except music21.repeat.ExpanderException:  # (repeats music21 cannot expand: the score is played through once)
        for m in score.recurse().getElementsByClass(music21.stream.Measure):
            if isinstance(m.leftBarline, music21.bar.Repeat):
                m.leftBarline = None
            if isinstance(m.rightBarline, music21.bar.Repeat):
                m.rightBarline = None
        for e in list(score.recurse().getElementsByClass(music21.repeat.RepeatExpression)):
            e.activeSite.remove(e)
        return bytes(music21.midi.translate.streamToMidiFile(score).writestr())


def midi_name(rel: str) -> str:
    """``bach/bwv10.7.mxl`` -> ``bach-bwv10.7.mid`` (one flat folder per split)."""
    return rel.rsplit(".", 1)[0].replace("/", "-") + ".mid"


def listing_sha256(files: dict[str, str]) -> str:
    """The checksum of a corpus: sha256 of its sorted ``{path: sha256}`` listing as compact JSON."""
    return hashlib.sha256(json.dumps(dict(sorted(files.items())), separators=(",", ":")).encode()).hexdigest()


def get_music(name: str, out: Path, *, workers: int | None = None, log: Callable[[str], None] = _say) -> Path:
    """Render music21's corpus ``name`` (:data:`MUSIC_DATASETS`) to ``out/{train,valid,test}/*.mid``."""
    music21 = _music21()
    rels = corpus_scores(name)
    out = Path(out)
    ledger = Ledger(out)
    targets = {rel: f"{music_split(rel)}/{midi_name(rel)}" for rel in rels}
    ledger.check(targets.values())
    done = {t: ledger.files[t]["sha256"] for t in targets.values() if ledger.ours(t)}
    if len(done) == len(targets):
        log(f"{out}: {name} already there ({len(done)} MIDI files, unchanged since txl wrote them)")
        return out
    todo = [rel for rel in rels if targets[rel] not in done]
    log(f"rendering {len(todo)} scores of music21 {music21.__version__}'s corpus ({name}) to MIDI in {out}")
    workers = workers or min(len(todo), os.cpu_count() or 1)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for i, (rel, data) in enumerate(zip(todo, pool.map(render_score, todo, chunksize=4), strict=True), 1):
            ledger.write(targets[rel], [data])
            done[targets[rel]] = ledger.files[targets[rel]]["sha256"]
            if i % 50 == 0 or i == len(todo):
                log(f"  {i}/{len(todo)} scores")
    digest = listing_sha256(done)
    expected = MUSIC_SHA256.get(name)
    if not expected:
        log(f"wrote {out}/{{train,valid,test}}/*.mid: {len(done)} scores (sha256 {digest}; none recorded to check)")
    elif music21.__version__ != MUSIC21_VERSION or digest != expected:
        log(
            f"note: {name} rendered by music21 {music21.__version__} has sha256 {digest}, not the {expected} of "
            f"music21 {MUSIC21_VERSION}: results are not comparable with docs/music.md's"
        )
    else:
        log(f"wrote {out}/{{train,valid,test}}/*.mid: {len(done)} scores (sha256 verified)")
    return out
