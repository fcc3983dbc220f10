"""Tokenize a dataset once, cache the ids as memory-mapped numpy arrays, and check the cache on every load.
Design notes: docs/internals.md#txldatacorpus."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Literal

import numpy as np

from txl.data.download import _say, sha256_file
from txl.data.errors import DataError
from txl.data.music import MusicConfig, MusicTokenizer, merge_tracks, music_layout, read_midi
from txl.data.music_sources import MUSIC_DATASETS
from txl.data.rawtext import Moses, RawText, Text8
from txl.data.readers import DOCUMENTS, SPLITS, Layout, check_data_path, find_splits
from txl.data.sources import DATASETS, cache_home
from txl.data.text import FileRange
from txl.data.tokenizer import Kind, LineEnd, Tokenizer
from txl.util.fileio import LOCK, FolderLock, check_space, write_bytes

FORMAT, FORMAT_VERSION = "txl-corpus", 1
META = "meta.json"
BYTES_PER_WORD = 8  # (for the disk-space check: English text averages 5-6 bytes per word token with its space)


@dataclass
class DataConfig:
    """Which text to read and how to tokenize it (the ``data`` section of a training config)."""

    path: str = "data/shakespeare"
    """Dataset folder (or, for enwik8/text8, the raw file)."""
    dataset: str = "shakespeare"
    """wt103, wt2, ptb, enwik8, text8, lm1b, shakespeare, sympy (Python source, long-range), custom (a folder of
    .txt files, or one text file); music, read as REMI events: chorales, quartets (music21's corpus, rendered by
    txl data get) or midi (a folder of MIDI files)."""
    files: str = "*.txt"
    """custom folders: which files are documents, a glob pattern relative to the folder (or to its train/ valid/
    test/ subfolders), e.g. '**/*.md' for Markdown files at any depth, '*' for every file; hidden ones are left
    out."""
    tokenizer: Kind | None = None
    """word, char or byte (default: the dataset's: word for WikiText/PTB/lm1b/custom, char for text8/Shakespeare,
    byte for enwik8)."""
    tokenizer_file: str | None = None
    """Use this tokenizer.json instead of building a vocabulary (e.g. a pretrained model's): it decides how the
    text is read (word, char or byte, line ends, lower-casing)."""
    raw_text: Literal["moses", "text8"] | None = None
    """The files are raw text: moses (word tokenizers: Moses tokenisation as Hugging Face's TransfoXLTokenizer reads
    WikiText-103-style text) or text8 (char: text8's normalisation). The tokenizer keeps the pipeline for new text.
    Default: the files are already tokenized (the paper's datasets)."""
    paper_compatible: bool = False
    """enwik8 only: drop newline bytes and order the 204 bytes by count, exactly as the original pipeline does."""
    lower_case: bool | None = None
    """Lower-case words (default: True for PTB, else False)."""
    vocab_from: Literal["train", "all"] | None = None
    """Count the vocabulary on the train split or all splits (default: train for WT103 and custom, all for WT2,
    PTB, text8, enwik8 and Shakespeare, as the reference does)."""
    min_freq: int = 1
    """Drop words seen fewer times (needs an <unk> token, which custom word vocabularies have)."""
    max_size: int | None = None
    """Keep at most this many symbols besides the specials."""
    valid_shard: int = 1
    """One Billion Word: the held-out shard used for validation (0 is the test shard; the reference used 0)."""
    encoding_errors: Literal["strict", "replace"] = "strict"
    """strict: a non-UTF-8 byte is an error naming file, line and offset; replace: read it as U+FFFD."""
    music: MusicConfig = field(default_factory=MusicConfig)
    """Music datasets (chorales, quartets, midi): the REMI tokenizer's options."""
    cache_dir: str | None = None
    """Where the encoded ids go (default: $TXL_CACHE_DIR or ~/.cache/txl, under corpora/)."""
    on_stale: Literal["rebuild", "error"] = "rebuild"
    """What to do with a cache whose sources, tokenizer or settings changed, or that is corrupt."""

    def __post_init__(self) -> None:
        if isinstance(self.music, dict):  # (a copy through asdict, or a YAML mapping)
            known = {f.name for f in fields(MusicConfig)}
            unknown = sorted(set(self.music) - known)
            if unknown:
                raise DataError(f"data.music.{unknown[0]}: no such option (known: {', '.join(sorted(known))})")
            self.music = MusicConfig(**self.music)

    def validate(self) -> None:
        """Raise ``DataError`` naming the first bad number as ``data.{field}`` (before any file is read or written)."""
        if self.min_freq < 0:
            raise DataError(
                f"data.min_freq = {self.min_freq}: must be >= 0 (0 and 1 keep every symbol seen; 0 is the original "
                "code's and Hugging Face's default)"
            )
        if self.max_size is not None and self.max_size < 1:
            raise DataError(f"data.max_size = {self.max_size}: must be >= 1 (or null: no limit)")
        if not 0 <= self.valid_shard < 50:
            raise DataError(f"data.valid_shard = {self.valid_shard}: must be in 0..49 (0 is the test shard)")

    @property
    def label(self) -> str:
        """What messages call the text: the dataset's name, or the file or folder name of one's own text (a custom
        one, or any text read with the Shakespeare recipes' rules)."""
        name = Path(self.path).name
        if self.dataset == "custom" or self.dataset == "shakespeare" and name != "shakespeare":
            return name
        return self.dataset


@dataclass(frozen=True)
class _Recipe:
    kind: Kind
    line_end: LineEnd = "none"
    lower_case: bool = False
    vocab_from: str = "all"
    specials: tuple[str, ...] | None = None


RECIPES = {
    "wt103": _Recipe("word", "eos", vocab_from="train"),
    "wt2": _Recipe("word", "eos"),
    "ptb": _Recipe("word", "eos", lower_case=True),
    "enwik8": _Recipe("byte"),
    "text8": _Recipe("char"),
    "lm1b": _Recipe("word", "double"),
    "shakespeare": _Recipe("char"),
    "sympy": _Recipe("char"),
    "custom": _Recipe("word", "eos", vocab_from="train", specials=("<eos>", "<unk>")),
    **{name: _Recipe("remi", vocab_from="train") for name in (*MUSIC_DATASETS, "midi")},  # type: ignore[arg-type]
}
MUSIC = (*MUSIC_DATASETS, "midi")
"""The datasets read as music: MIDI files, REMI events (txl.data.music)."""


@dataclass
class SentenceShard:
    """One file of sentences: all ids back to back, and where each sentence starts (plus the end)."""

    ids: np.ndarray
    starts: np.ndarray

    def __len__(self) -> int:
        return len(self.starts) - 1

    def sentence(self, i: int) -> np.ndarray:
        return self.ids[self.starts[i] : self.starts[i + 1]]


@dataclass
class Corpus:
    """A tokenized dataset: ``splits[name]`` is an ordered id stream, or for lm1b a list of sentence shards."""

    tokenizer: Tokenizer
    splits: dict[str, np.ndarray | list[SentenceShard]]
    path: Path
    meta: dict = field(repr=False)

    def fingerprint(self, split: str = "train") -> str:
        """The sha256 of ``split``'s token ids (of their arrays' recorded digests): the same text read the same way
        gives the same fingerprint wherever its files or cache lie."""
        digests = [[e["file_sha256"], e.get("offsets_sha256")] for e in self.meta["arrays"][split]]
        return hashlib.sha256(json.dumps(digests).encode()).hexdigest()

    def n_tokens(self, split: str) -> int:
        s = self.splits[split]
        return len(s) if isinstance(s, np.ndarray) else sum(len(sh.ids) for sh in s)


def _settings(cfg: DataConfig) -> dict:
    if cfg.dataset not in RECIPES:
        raise DataError(f"unknown dataset {cfg.dataset!r}; expected one of {', '.join(RECIPES)}")
    if cfg.dataset in MUSIC:
        return _music_settings(cfg)
    recipe = RECIPES["custom" if cfg.dataset == "custom" else cfg.dataset]
    kind = cfg.tokenizer or recipe.kind
    if cfg.tokenizer_file:  # a given tokenizer decides how the text is read
        given = Tokenizer.load(Path(cfg.tokenizer_file)).kind
        if cfg.tokenizer and cfg.tokenizer != given:
            raise DataError(f"data.tokenizer = {cfg.tokenizer!r}, but {cfg.tokenizer_file} is a {given} tokenizer")
        kind = given
    if kind != recipe.kind:  # e.g. Shakespeare with words: custom word rules
        recipe = RECIPES["custom"] if kind == "word" else _Recipe(kind)
    if cfg.raw_text is not None and cfg.tokenizer_file:
        raise DataError("data.raw_text builds a tokenizer; a given tokenizer_file already decides how text is read")
    if cfg.raw_text == "moses" and kind != "word" or cfg.raw_text == "text8" and kind != "char":
        need = "word" if cfg.raw_text == "moses" else "char"
        raise DataError(f"data.raw_text = {cfg.raw_text!r} needs data.tokenizer: {need}, not {kind}")
    if cfg.paper_compatible and cfg.dataset != "enwik8":
        raise DataError("paper_compatible is the enwik8 newline rule; other datasets are paper-compatible as is")
    settings = {
        "dataset": cfg.dataset,
        "kind": kind,
        "line_end": recipe.line_end,
        "lower_case": recipe.lower_case if cfg.lower_case is None else cfg.lower_case,
        "vocab_from": cfg.vocab_from or recipe.vocab_from,
        "specials": list(recipe.specials) if recipe.specials else None,
        "drop_newlines": cfg.paper_compatible,
        "min_freq": cfg.min_freq,
        "max_size": cfg.max_size,
        "valid_shard": cfg.valid_shard if cfg.dataset == "lm1b" else None,
        "encoding_errors": cfg.encoding_errors,
        "tokenizer_file": None,
    }
    if cfg.raw_text is not None:  # (only then: caches of already-tokenized text keep their key)
        settings["raw_text"] = cfg.raw_text
    if cfg.files != DOCUMENTS:  # (likewise)
        settings["files"] = cfg.files
    if cfg.tokenizer_file:
        settings["tokenizer_file"] = hashlib.sha256(Path(cfg.tokenizer_file).read_bytes()).hexdigest()
    return settings


def _music_settings(cfg: DataConfig) -> dict:
    if cfg.tokenizer not in (None, "remi"):
        raise DataError(f"data.tokenizer = {cfg.tokenizer!r}: the music dataset {cfg.dataset} is read as REMI events")
    if cfg.raw_text is not None or cfg.paper_compatible:
        raise DataError(f"data.raw_text and data.paper_compatible are for text; {cfg.dataset} is music (MIDI files)")
    cfg.music.validate()
    settings = {"dataset": cfg.dataset, "kind": "remi", "music": asdict(cfg.music), "tokenizer_file": None}
    if cfg.tokenizer_file:
        tok = Tokenizer.load(Path(cfg.tokenizer_file))
        if not isinstance(tok, MusicTokenizer):
            raise DataError(f"data.tokenizer_file {cfg.tokenizer_file}: a text tokenizer; {cfg.dataset} is music")
        settings["tokenizer_file"] = hashlib.sha256(Path(cfg.tokenizer_file).read_bytes()).hexdigest()
    return settings


def _sources(layout: Layout) -> dict[str, list[dict]]:
    digests: dict[Path, str] = {}
    out = {}
    for split, ranges in layout.splits.items():
        out[split] = []
        for r in ranges:
            st = r.path.stat()
            if r.path not in digests:
                digests[r.path] = sha256_file(r.path)
            entry = {"path": str(r.path.resolve()), "start": r.start, "end": r.end, "size": st.st_size}
            out[split].append(
                {**entry, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "sha256": digests[r.path]}
            )
    if layout.vocab_file:
        out["vocab_file"] = [{"path": str(layout.vocab_file.resolve()), "sha256": sha256_file(layout.vocab_file)}]
    return out


def _stale_sources(recorded: dict, layout: Layout) -> str | None:
    """Why the recorded sources no longer describe ``layout`` (None: they still do). Hashes only when needed."""
    want = {s: [(str(r.path.resolve()), r.start, r.end) for r in rs] for s, rs in layout.splits.items()}
    for split, ranges in want.items():
        rec = recorded.get(split, [])
        if [(e["path"], e["start"], e["end"]) for e in rec] != ranges:
            return f"the {split} split now reads other files or byte ranges"
        for e in rec:
            p = Path(e["path"])
            st = p.stat()
            if st.st_size != e["size"]:
                return f"{p} changed size ({e['size']:,} -> {st.st_size:,} bytes)"
            # (the mtime can be set back, e.g. by touch -d or a copy that keeps it, so an unchanged size and mtime
            # are trusted only with an unchanged ctime, which only the system sets; otherwise the content decides)
            unchanged = st.st_mtime_ns == e["mtime_ns"] and st.st_ctime_ns == e.get("ctime_ns")
            if not unchanged and sha256_file(p) != e["sha256"]:
                return f"{p} changed (sha256)"
    if layout.vocab_file and recorded.get("vocab_file", [{}])[0].get("sha256") != sha256_file(layout.vocab_file):
        return f"{layout.vocab_file} changed"
    return None


def _check_arrays(folder: Path, arrays: dict, verify: bool) -> str | None:
    for entries in arrays.values():
        for e in entries:
            for key in ("file", "offsets"):
                if not e.get(key):
                    continue
                p = folder / e[key]
                n = e["n_tokens"] if key == "file" else e["n_sentences"] + 1
                itemsize = np.dtype(e["dtype"] if key == "file" else np.int64).itemsize
                if not p.is_file():
                    return f"{p.name} is missing"
                if p.stat().st_size != n * itemsize:
                    return f"{p.name} has {p.stat().st_size:,} bytes, expected {n * itemsize:,} (corrupt or truncated)"
                if verify and sha256_file(p) != e[f"{key}_sha256"]:
                    return f"{p.name} does not match its recorded sha256 (corrupt)"
    return None


def _default_cache(cfg: DataConfig, settings: dict) -> Path:
    key = json.dumps({"path": str(Path(cfg.path).resolve()), **settings}, sort_keys=True)
    return cache_home() / "corpora" / f"{cfg.dataset}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _write_array(path: Path, chunks, dtype: np.dtype) -> tuple[int, str]:
    """Stream id chunks to ``path`` (atomically); return (count, sha256)."""
    h, n = hashlib.sha256(), 0

    def encoded():
        nonlocal n
        for ids in chunks:
            b = np.ascontiguousarray(ids, dtype=dtype).tobytes()
            h.update(b)
            n += len(ids)
            yield b

    write_bytes(path, encoded())
    return n, h.hexdigest()


def _build_tokenizer(cfg: DataConfig, settings: dict, layout: Layout) -> Tokenizer:
    if cfg.tokenizer_file:
        return Tokenizer.load(Path(cfg.tokenizer_file))
    if cfg.dataset == "lm1b":
        return Tokenizer.from_vocab_file(layout.vocab_file)
    vocab_splits = ("train",) if settings["vocab_from"] == "train" else SPLITS
    sources = [r for s in vocab_splits for r in layout.splits[s]]
    return Tokenizer.build(
        settings["kind"],
        sources,
        specials=settings["specials"],
        min_freq=settings["min_freq"],
        max_size=settings["max_size"],
        line_end=settings["line_end"],
        lower_case=settings["lower_case"],
        drop_newlines=settings["drop_newlines"],
        errors=settings["encoding_errors"],
        raw_text=_raw_text(settings),
    )


def _raw_text(settings: dict) -> RawText | None:
    if settings.get("raw_text") == "text8":
        return Text8()
    if settings.get("raw_text") == "moses":
        specials = tuple(settings["specials"] or ())
        return Moses(never_split=specials, specials=specials)
    return None


def _encode_split(tok: Tokenizer, folder: Path, split: str, ranges: list[FileRange], errors: str) -> list[dict]:
    dtype = tok.dtype
    if tok.line_end != "double":
        chunks = (ids for r in ranges for ids in tok.encode_file(r, errors))
        n, digest = _write_array(folder / f"{split}.bin", chunks, dtype)
        return [{"file": f"{split}.bin", "dtype": dtype.name, "n_tokens": n, "file_sha256": digest}]
    entries = []
    for k, r in enumerate(ranges):
        lengths: list[int] = []

        def ids_and_lengths(r=r, lengths=lengths):
            for ids, lens in tok.encode_sentences(r, errors):
                lengths.extend(lens)
                yield ids

        name = f"{split}-{k:05d}"
        n, digest = _write_array(folder / f"{name}.bin", ids_and_lengths(), dtype)
        starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        _, odigest = _write_array(folder / f"{name}.off.bin", [starts], np.dtype(np.int64))
        entries.append(
            {"file": f"{name}.bin", "dtype": dtype.name, "n_tokens": n, "file_sha256": digest}
            | {"offsets": f"{name}.off.bin", "n_sentences": len(lengths), "offsets_sha256": odigest}
        )
    return entries


def _load(folder: Path, meta: dict, tok: Tokenizer) -> Corpus:
    splits: dict = {}
    for split, entries in meta["arrays"].items():
        if entries[0].get("offsets"):
            splits[split] = [
                SentenceShard(
                    np.memmap(folder / e["file"], dtype=e["dtype"], mode="r", shape=(e["n_tokens"],)),
                    np.fromfile(folder / e["offsets"], dtype=np.int64),
                )
                for e in entries
            ]
        else:
            e = entries[0]
            splits[split] = np.memmap(folder / e["file"], dtype=e["dtype"], mode="r", shape=(e["n_tokens"],))
    return Corpus(tok, splits, folder, meta)


def _locate(cfg: DataConfig | None, overrides: dict) -> tuple[DataConfig, dict, Layout, Path]:
    cfg = DataConfig(**{**(asdict(cfg) if cfg else {}), **overrides})
    cfg.validate()
    settings = _settings(cfg)
    path = check_data_path(cfg.path)
    if not path.exists() and cfg.dataset in DATASETS:
        raise DataError(f"{path}: no such file or folder. Get it with: txl data get {cfg.dataset} --out {path}")
    if cfg.dataset in MUSIC:
        layout = music_layout(path, cfg.music)
    else:
        layout = find_splits(cfg.dataset, path, valid_shard=cfg.valid_shard, files=cfg.files)
    folder = Path(cfg.cache_dir) if cfg.cache_dir else _default_cache(cfg, settings)
    return cfg, settings, layout, folder


def cached_corpus(cfg: DataConfig | None = None, *, verify: bool = True, **overrides) -> Corpus | None:
    """The valid cache of ``cfg``'s dataset, or None if there is none (nothing is built, nothing is changed)."""
    cfg, settings, layout, folder = _locate(cfg, overrides)
    meta_path = folder / META
    if not meta_path.exists() or _why_stale(folder, meta_path, settings, layout, verify) is not None:
        return None
    return _load(folder, json.loads(meta_path.read_text()), Tokenizer.load(folder / "tokenizer.json"))


def prepare_corpus(
    cfg: DataConfig | None = None, *, verify: bool = True, log: Callable[[str], None] = _say, **overrides
) -> Corpus:
    """Tokenize ``cfg``'s dataset (or reuse a valid cache) and return it memory-mapped.

    Keyword ``overrides`` set :class:`DataConfig` fields. ``verify`` re-hashes the cached arrays on load.
    """
    cfg, settings, layout, folder = _locate(cfg, overrides)
    made = not folder.exists()
    # (one process prepares a cache at a time; another one waits and then finds it ready)
    try:
        lock = FolderLock(folder, "txl command preparing this corpus", option="--data.cache_dir", wait=True, say=log)
    except OSError as e:  # (a cache on a read-only medium: read as it is; a rebuild fails to write, saying where)
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS) or not folder.is_dir():
            raise
        lock = None
    try:
        corpus = _prepare(cfg, settings, layout, folder, verify, log)
    except BaseException:
        if lock is not None:
            lock.release(restore=True)
        if made:  # (a cache that never became one leaves nothing behind)
            shutil.rmtree(folder, ignore_errors=True)
        raise
    if lock is not None:
        lock.release()
    return corpus


def _prepare(
    cfg: DataConfig, settings: dict, layout: Layout, folder: Path, verify: bool, log: Callable[[str], None]
) -> Corpus:
    meta_path = folder / META
    reason = "no cache yet"
    if meta_path.exists():
        reason = _why_stale(folder, meta_path, settings, layout, verify)
        if reason is None:
            meta = json.loads(meta_path.read_text())
            return _load(folder, meta, Tokenizer.load(folder / "tokenizer.json"))
        if cfg.on_stale == "error":
            raise DataError(
                f"{folder}: the cached corpus is stale: {reason}. Delete the folder or use --data.on_stale rebuild."
            )
        log(f"rebuilding {folder}: {reason}")
        meta_path.unlink()
    elif any(p.name != LOCK for p in folder.iterdir()):
        reason = "an earlier build did not finish"
    for stale in folder.glob(".*.tmp"):  # (a build killed while writing: its lock is ours now, probes.md n42)
        with contextlib.suppress(OSError):
            stale.unlink()
    log(f"preparing {cfg.label} from {layout.description} into {folder} ({reason})")  # (its lock made the folder)
    if cfg.dataset in MUSIC:
        return _prepare_music(cfg, settings, layout, folder, log)
    tok = _build_tokenizer(cfg, settings, layout)
    text_bytes = sum(r.stop() - r.start for ranges in layout.splits.values() for r in ranges)
    per_token = 1 if tok.kind in ("char", "byte") else BYTES_PER_WORD  # (a char per byte at most; words longer)
    check_space(
        folder, text_bytes // per_token * tok.dtype.itemsize, f"{cfg.label}'s token ids ({text_bytes:,} bytes of "
        f"{tok.kind}-level text)", "free space, or give --data.cache_dir on a disk with more",
    )  # fmt: skip
    arrays = {}
    for split in SPLITS:
        try:
            arrays[split] = _encode_split(tok, folder, split, layout.splits[split], settings["encoding_errors"])
        except DataError as e:  # a symbol that min_freq / max_size left out, and no <unk> to read it as
            limited = not cfg.tokenizer_file and (cfg.min_freq > 1 or cfg.max_size is not None)
            if not limited or tok.unk_id is not None:
                raise
            raise DataError(
                f"{e} (here data.min_freq / data.max_size left it out, and a {tok.kind} vocabulary of {cfg.dataset} "
                "has no <unk>: keep every symbol, the defaults; word vocabularies of custom text have <unk>)"
            ) from None
        if sum(e["n_tokens"] for e in arrays[split]) == 0:
            raise DataError(f"{layout.splits[split][0].describe()}: the {split} split has no tokens")
    return _finish(cfg, settings, layout, folder, tok, arrays, log)


def _finish(
    cfg: DataConfig, settings: dict, layout: Layout, folder: Path, tok, arrays: dict, log: Callable[[str], None]
) -> Corpus:
    meta_path = folder / META
    tok.save(folder / "tokenizer.json")
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "settings": settings,
        "tokenizer_sha256": sha256_file(folder / "tokenizer.json"),
        "vocab_size": tok.vocab_size,
        "sources": _sources(layout),
        "arrays": arrays,
    }
    write_bytes(meta_path, json.dumps(meta, indent=1).encode())
    sizes = ", ".join(f"{s} {sum(e['n_tokens'] for e in arrays[s]):,}" for s in SPLITS)
    log(f"{cfg.label}: vocabulary {tok.vocab_size:,} ({tok.kind}), tokens: {sizes}")
    return _load(folder, meta, tok)


def _music_tokenizer(cfg: DataConfig, layout: Layout, log: Callable[[str], None]) -> MusicTokenizer:
    """The tokenizer of a music corpus, after every file was checked (one line naming every bad one, up to
    ``SHOWN_BAD``: not MIDI, no notes, a time signature the tokenizer does not write), before anything is
    written."""
    tok = Tokenizer.load(Path(cfg.tokenizer_file)) if cfg.tokenizer_file else MusicTokenizer.from_config(cfg.music)
    n = sum(len(rs) for rs in layout.splits.values())
    log(f"checking {n:,} MIDI files ({layout.description})")
    bad = []
    for r in (r for rs in layout.splits.values() for r in rs):
        try:
            tok.check_score(read_midi(r.path), str(r.path))
        except DataError as e:
            bad.append(str(e))
    if len(bad) == 1:
        raise DataError(bad[0])
    if bad:  # (round 6: only the first bad file was named, one fix and run at a time)
        more = f"; and {len(bad) - SHOWN_BAD} more" if len(bad) > SHOWN_BAD else ""
        raise DataError(
            f"{len(bad)} of {n:,} MIDI files cannot be used (fix or remove them; nothing written): "
            + " | ".join(bad[:SHOWN_BAD]) + more
        )  # fmt: skip
    return tok


SHOWN_BAD = 10
"""How many bad MIDI files one error names (with their reasons); it counts them all."""


def _prepare_music(cfg: DataConfig, settings: dict, layout: Layout, folder: Path, log: Callable[[str], None]) -> Corpus:
    """A music corpus: each MIDI file is one piece, ``BOS`` + its REMI ids + ``EOS``, in the split's file order."""
    tok = _music_tokenizer(cfg, layout, log)
    if cfg.music.bpe_vocab_size and not tok.remi.is_trained:
        scores = [merge_tracks(read_midi(r.path)) for r in layout.splits["train"]]  # (checked above)
        log(f"learning BPE merges on {len(scores)} pieces (vocabulary {cfg.music.bpe_vocab_size:,})")
        tok.learn_bpe(scores, cfg.music.bpe_vocab_size)
    arrays = {}
    for split in SPLITS:

        def pieces(split=split):
            for r in layout.splits[split]:
                yield [tok.bos_id, *tok.encode_midi(r.path), tok.eos_id]

        n, digest = _write_array(folder / f"{split}.bin", pieces(), tok.dtype)
        arrays[split] = [{"file": f"{split}.bin", "dtype": tok.dtype.name, "n_tokens": n, "file_sha256": digest}]
    return _finish(cfg, settings, layout, folder, tok, arrays, log)


def _why_stale(folder: Path, meta_path: Path, settings: dict, layout: Layout, verify: bool) -> str | None:
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
            return f"it was written in format {meta.get('format')} v{meta.get('format_version')}"
        if meta["settings"] != settings:
            changed = [k for k in settings if meta["settings"].get(k) != settings[k]]
            return f"settings changed ({', '.join(changed)})"
        tok_path = folder / "tokenizer.json"
        if not tok_path.is_file() or sha256_file(tok_path) != meta["tokenizer_sha256"]:
            return "tokenizer.json is missing or was modified"
        return _stale_sources(meta["sources"], layout) or _check_arrays(folder, meta["arrays"], verify)
    except (ValueError, KeyError, TypeError, OSError) as e:
        return f"{META} is unreadable ({e})"
