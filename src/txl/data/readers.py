"""Where a dataset's train/valid/test text is, in each layout users have on disk.
Design notes: docs/internals.md#txldatareaders."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from txl.data.errors import DataError
from txl.data.text import FileRange

SPLITS = ("train", "valid", "test")
LM1B_ROOT = "1-billion-word-language-modeling-benchmark-r13output"
LM1B_TRAIN = "training-monolingual.tokenized.shuffled"
LM1B_HELDOUT = "heldout-monolingual.tokenized.shuffled"
LM1B_VOCAB = "1b_word_vocab.txt"
DOCUMENTS = "*.txt"  # the files of a custom folder read as documents (data.files)
HELDOUT_CHARS = 5_000_000  # enwik8 / text8: last 5M valid, last 5M test


@dataclass
class Layout:
    """The files of one dataset: ranges per split, and where they were found (for messages)."""

    splits: dict[str, list[FileRange]]
    description: str
    vocab_file: Path | None = None


def _first(path: Path, candidates: list[str]) -> Path | None:
    for c in candidates:
        if (path / c).is_file():
            return path / c
    return None


def _triple(path: Path, patterns: list[str]) -> dict[str, list[FileRange]] | None:
    """``{split}``-substituted file names, all three present, in the first pattern that has them."""
    for pat in patterns:
        files = [path / pat.format(split=s) for s in SPLITS]
        if all(f.is_file() for f in files):
            return {s: [FileRange(f)] for s, f in zip(SPLITS, files, strict=True)}
    return None


def _looks_prepped(path: Path) -> bool:
    """True for the space-separated symbol files of prep_enwik8.py / prep_text8.py."""
    with open(path, "rb") as f:
        head = f.read(256)
    spaced_chars = len(head) > 4 and head[1:2] == b" " and head[3:4] == b" "  # "a n a r c h ..."
    return spaced_chars or (bool(head) and set(head) <= set(b"0123456789 \n"))  # "60 109 101 ..."


def _tail_split(file: Path, strip: bool) -> dict[str, list[FileRange]]:
    size = os.path.getsize(file)
    if size <= 2 * HELDOUT_CHARS:
        raise DataError(f"{file}: {size} bytes, but the last {2 * HELDOUT_CHARS:,} are the valid and test splits")
    cuts = [0, size - 2 * HELDOUT_CHARS, size - HELDOUT_CHARS, size]
    ranges = zip(SPLITS, cuts[:-1], cuts[1:], strict=True)
    return {s: [_strip(FileRange(file, a, b)) if strip else FileRange(file, a, b)] for s, a, b in ranges}


def _strip(fr: FileRange) -> FileRange:
    """Shrink a range past leading and trailing ASCII whitespace (``str.strip`` on text8's ASCII)."""
    start, stop = fr.start, fr.stop()
    with open(fr.path, "rb") as f:
        while start < stop:
            f.seek(start)
            if f.read(1) not in b" \t\n\r\x0b\x0c":
                break
            start += 1
        while stop > start:
            f.seek(stop - 1)
            if f.read(1) not in b" \t\n\r\x0b\x0c":
                break
            stop -= 1
    return FileRange(fr.path, start, stop)


def _char_dataset(name: str, path: Path, strip: bool) -> Layout:
    if path.is_file():
        return Layout(_tail_split(path, strip), f"{name} raw file {path}")
    raw = _triple(path, ["{split}.txt.raw"])
    if raw:
        if strip:
            raw = {s: [_strip(r) for r in rs] for s, rs in raw.items()}
        return Layout(raw, f"{name} getdata.sh layout ({path}/{{split}}.txt.raw)")
    single = _first(path, [name, f"{name}/{name}"])
    if single:
        return Layout(_tail_split(single, strip), f"{name} raw file {single}")
    txt = _triple(path, ["{split}.txt"])
    if txt:
        if _looks_prepped(txt["train"][0].path):
            raise DataError(
                f"{path}/train.txt is in the space-separated format of prep_{name}.py; txl reads the raw bytes "
                f"beside it ({{split}}.txt.raw, which getdata.sh also writes) or the raw '{name}' file."
            )
        if strip:
            txt = {s: [_strip(r) for r in rs] for s, rs in txt.items()}
        return Layout(txt, f"{name} raw splits ({path}/{{split}}.txt)")
    raise DataError(
        f"{path}: no {name} data found. Expected {{train,valid,test}}.txt.raw (getdata.sh), the raw '{name}' "
        f"file, or raw {{train,valid,test}}.txt. Get it with: txl data get {name} --out {path}"
    )


def _lm1b(path: Path, valid_shard: int) -> Layout:
    root = next((r for r in (path, path / LM1B_ROOT) if (r / LM1B_TRAIN).is_dir()), None)
    if root is None:
        raise DataError(f"{path}: no {LM1B_TRAIN}/ folder (alone or under {LM1B_ROOT}/). Get it: txl data get lm1b")
    train = sorted(p for p in (root / LM1B_TRAIN).glob("news.en-*") if p.is_file())
    if not train:
        raise DataError(f"{root / LM1B_TRAIN}: no news.en-* training shards")
    if not 0 <= valid_shard < 50:
        raise DataError(f"valid_shard must be in 0..49 (0 is the test shard), not {valid_shard}")

    def heldout(k: int, fallback: str) -> Path:
        p = root / LM1B_HELDOUT / f"news.en.heldout-{k:05d}-of-00050"
        if p.is_file():
            return p
        if k == 0 and (path / fallback).is_file():
            return path / fallback
        raise DataError(f"{p}: missing held-out shard {k}")

    vocab = _first(path, [LM1B_VOCAB, f"{LM1B_ROOT}/{LM1B_VOCAB}"]) or _first(root.parent, [LM1B_VOCAB])
    if vocab is None:
        raise DataError(f"{path}: no {LM1B_VOCAB} (the vocabulary of the reference). Get it: txl data get lm1b")
    splits = {
        "train": [FileRange(p) for p in train],
        "valid": [FileRange(heldout(valid_shard, "valid.txt"))],
        "test": [FileRange(heldout(0, "test.txt"))],
    }
    what = f"One Billion Word at {root} ({len(train)} training shards, valid shard {valid_shard})"
    return Layout(splits, what, vocab)


def hash_split(path: str, test_percent: int, valid_percent: int) -> str:
    """The split of a document by its path (relative, '/'-separated): the first 4 bytes of the path's sha256,
    big-endian, modulo 100: below ``test_percent`` test, below ``test_percent + valid_percent`` valid, else train.
    The rule of the corpora that ``txl data get`` splits by file (sympy, the music corpora) and of MIDI folders."""
    bucket = int.from_bytes(hashlib.sha256(path.encode()).digest()[:4], "big") % 100
    if bucket < test_percent:
        return "test"
    return "valid" if bucket < test_percent + valid_percent else "train"


def hold_out(files: list[Path], folder: Path, pattern: str = DOCUMENTS) -> dict[str, list[FileRange]]:
    """A flat folder of documents: sorted, the last ~5% (at least one) test, the ~5% before them valid."""
    if len(files) < 3:
        other = "" if pattern != DOCUMENTS else "; documents of another kind: --data.files, e.g. '**/*.md'"
        broken = [p.name for p in sorted(folder.glob(pattern)) if p.is_symlink() and not p.exists()]
        if broken:  # (probes.md d09: a link to nothing was left unnamed)
            other += f"; {', '.join(broken)} is a link to a file that does not exist"
        raise DataError(
            f"{folder}: {len(files)} file(s) match {pattern!r}; a folder dataset needs train.txt, valid.txt and "
            f"test.txt, train/ valid/ test/ subfolders, or at least 3 documents{other}"
        )
    k = max(1, round(0.05 * len(files)))
    return {
        "train": [FileRange(f) for f in files[: -2 * k]],
        "valid": [FileRange(f) for f in files[-2 * k : -k]],
        "test": [FileRange(f) for f in files[-k:]],
    }


def _line_start_after(f, offset: int, size: int) -> int:
    """The first byte of the line after the one holding ``offset`` (``size`` when there is none)."""
    f.seek(offset)
    while data := f.read(1 << 20):
        ends = [i for i in (data.find(b"\n"), data.find(b"\r")) if i >= 0]
        if ends:
            end = offset + min(ends) + 1
            f.seek(end - 1)
            return end + (f.read(2) == b"\r\n")
        offset += len(data)
    return size


def _single_file(path: Path) -> Layout:
    """One text file: the last ~5% of its bytes test, the ~5% before them valid, each cut at the next line start
    (never inside a line, nor inside a UTF-8 character)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        cuts = [0, *(_line_start_after(f, int(size * q), size) for q in (0.9, 0.95)), size]
    if not cuts[0] < cuts[1] < cuts[2] < cuts[3]:
        raise DataError(
            f"{path}: too few lines to hold out valid and test text from one file (its last ~5% of bytes for test, "
            "the ~5% before them for valid, cut at line ends); give a folder with train.txt, valid.txt and test.txt"
        )
    ranges = zip(SPLITS, cuts[:-1], cuts[1:], strict=True)
    return Layout({s: [FileRange(path, a, b)] for s, a, b in ranges}, f"text file {path} (last ~5% test, ~5% valid)")


def documents(folder: Path, pattern: str = DOCUMENTS) -> list[Path]:
    """The files of ``folder`` that ``pattern`` (a glob, ``**`` for any depth) names, sorted; hidden files and
    folders (``.git``, ``.DS_Store``) left out."""
    glob = f"{pattern}/*" if pattern.endswith("**") else pattern  # ('a/**': every file below a, not its folders)
    try:
        found = [f for f in folder.glob(glob) if f.is_file()]
        return sorted(f for f in found if not any(x.startswith(".") for x in f.relative_to(folder).parts))
    except (ValueError, NotImplementedError) as e:  # (an invalid pattern: '', an absolute path, '**' in a name)
        raise DataError(f"--data.files = {pattern!r}: not a glob pattern relative to {folder} ({e})") from None


def _folder(path: Path, pattern: str = DOCUMENTS) -> Layout:
    txt = _triple(path, ["{split}.txt"])
    if txt:
        return Layout(txt, f"text splits {path}/{{train,valid,test}}.txt")
    if all((path / s).is_dir() for s in SPLITS):
        splits = {s: [FileRange(f) for f in documents(path / s, pattern)] for s in SPLITS}
        for s, rs in splits.items():
            if not rs:
                raise DataError(f"{path / s}: no files match {pattern!r}")
        return Layout(splits, f"text folders {path}/{{train,valid,test}}/{pattern}")
    files = documents(path, pattern)
    return Layout(hold_out(files, path, pattern), f"folder of {len(files)} documents {path}/{pattern}")


def check_data_path(path: str | os.PathLike, option: str = "data.path") -> Path:
    """A dataset's path as given: not empty (which would read the current folder), and a regular file or a folder
    where something is there (a device such as /dev/zero would be read forever)."""
    text = os.fspath(path)
    if not text.strip():
        raise DataError(f"--{option} is empty: give a text file or a folder of text")
    p = Path(text)
    if p.exists() and not (p.is_file() or p.is_dir()):
        raise DataError(
            f"{p}: not a regular file or folder (a device or a pipe?): give a text file or a folder of text"
        )
    return p


def find_splits(dataset: str, path: Path, *, valid_shard: int = 1, files: str = DOCUMENTS) -> Layout:
    """Locate the train/valid/test text of ``dataset`` under ``path`` (see the module docstring); ``files``: which
    files of a custom folder are documents."""
    path = Path(path)
    if not path.exists():  # (txl.data.corpus says first how to get a dataset that `txl data get` fetches)
        raise DataError(f"{path}: no such file or folder")
    if dataset in ("enwik8", "text8"):
        layout = _char_dataset(dataset, path, strip=dataset == "text8")
    elif dataset == "lm1b":
        layout = _lm1b(path, valid_shard)
    elif dataset in ("wt103", "wt2", "ptb"):
        sub = {"wt103": "wikitext-103", "wt2": "wikitext-2", "ptb": "simple-examples/data"}[dataset]
        pats = ["{split}.txt", "wiki.{split}.tokens", f"{sub}/wiki.{{split}}.tokens", "ptb.{split}.txt"]
        pats.append(f"{sub}/ptb.{{split}}.txt")
        splits = _triple(path, pats)
        if splits is None:
            raise DataError(
                f"{path}: no {dataset} splits found (looked for {{train,valid,test}}.txt, wiki.*.tokens, "
                f"ptb.*.txt, also under {sub}/). Get it with: txl data get {dataset} --out {path}"
            )
        layout = Layout(splits, f"{dataset} splits {splits['train'][0].path.parent}")
    else:
        layout = _folder(path, files) if path.is_dir() else _single_file(path)
    for split, ranges in layout.splits.items():
        if sum(r.stop() - r.start for r in ranges) == 0:
            raise DataError(f"{ranges[0].describe()}: the {split} split is empty")
    return layout
