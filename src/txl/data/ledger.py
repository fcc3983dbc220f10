"""What ``txl data get`` wrote in an ``--out`` folder: the one rule of every writer there (the text corpora's and the
music corpora's), a file that exists is replaced only when txl wrote it and nobody changed it since."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

from txl.data.download import sha256_file
from txl.data.errors import DataError
from txl.util.fileio import write_bytes

MANIFEST = ".txl-data.json"
"""The file in an ``--out`` folder that lists what ``txl data get`` wrote there (path, size, sha256)."""
_WRITER = "txl data get"


class Ledger:
    """The files ``txl data get`` wrote in ``out``, recorded in ``out/MANIFEST``.

    The one rule of every writer in ``txl data``: a file that exists is replaced only when this ledger lists it with
    its current size and sha256 (txl wrote it, and nobody changed it since). :meth:`check` is called on every path a
    command may write before it writes any; :meth:`write` records each file as soon as it is in place.
    """

    def __init__(self, out: Path):
        self.out, self.path = Path(out), Path(out) / MANIFEST
        self.files: dict[str, dict] = {}
        if self.path.exists() or self.path.is_symlink():
            try:
                doc = json.loads(self.path.read_text(encoding="utf-8"))
                ok = isinstance(doc, dict) and doc.get("written_by") == _WRITER and isinstance(doc.get("files"), dict)
            except (OSError, UnicodeDecodeError, ValueError):
                ok = False
            if not ok:
                raise DataError(
                    f"{self.path}: the file exists and is not txl's list of the files it wrote; nothing written. "
                    "Give --out a new folder, or move the file away"
                )
            self.files = {k: v for k, v in doc["files"].items() if isinstance(v, dict)}

    def ours(self, rel: str) -> bool:
        """Whether ``out/rel`` is a file txl wrote and nobody changed since: its size, then its modification time as
        recorded (rsync's quick check: lm1b's 4 GB of shards are not hashed again), else its sha256."""
        rec, path = self.files.get(rel), self.out / rel
        if rec is None or path.is_symlink() or not path.is_file():
            return False
        stat = path.stat()
        if stat.st_size != rec.get("size"):
            return False
        return stat.st_mtime_ns == rec.get("mtime_ns") or sha256_file(path) == rec.get("sha256")

    def _refuse(self, rel: str) -> DataError:
        path = self.out / rel
        if not path.is_file() or path.is_symlink():
            what = "exists and is not a file"
        elif rel in self.files:
            what = "changed since txl wrote it"
        else:
            what = "the file exists and txl did not write it"
        return DataError(f"{path}: {what}; nothing written. Give --out a new folder, or move the file away")

    def writable(self) -> None:
        """Refuse (DataError naming the folder) an ``--out`` that cannot be written: its nearest existing folder is
        tried with a file made and removed at once, before anything is downloaded."""
        folder = self.out
        while not (folder.exists() or folder.is_symlink()) and folder != folder.parent:
            folder = folder.parent
        probe = folder / f".txl-write-test-{uuid.uuid4().hex[:12]}"
        try:
            if not folder.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "not a folder")
            os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            os.unlink(probe)
        except OSError as e:
            raise DataError(
                f"--out {self.out}: cannot write in {folder} ({e.strerror or e}); nothing downloaded. Give --out a "
                "folder you can write"
            ) from None

    def check(self, rels: Iterable[str] = (), folders: Iterable[str] = (), same: dict[str, bytes] | None = None):
        """Refuse (DataError naming the file) when a path in ``rels``, or any file under one of ``folders``, exists
        and is not :meth:`ours`, or when ``out`` cannot be written; a file whose bytes equal ``same[rel]`` is allowed
        (a re-run finds the same bytes)."""
        self.writable()
        same = same or {}
        for rel in rels:
            path = self.out / rel
            if not (path.exists() or path.is_symlink()) or self.ours(rel):
                continue
            if rel in same and path.is_file() and not path.is_symlink() and path.stat().st_size == len(same[rel]):
                if path.read_bytes() == same[rel]:
                    continue
            raise self._refuse(rel)
        for folder in folders:
            top = self.out / folder
            if top.is_symlink() or top.exists() and not top.is_dir():
                raise DataError(
                    f"{top}: exists and is not a folder; nothing written. Give --out a new folder, or move it away"
                )
            for path in sorted(top.rglob("*")) if top.is_dir() else []:
                rel = path.relative_to(self.out).as_posix()
                if not (path.is_dir() and not path.is_symlink()) and not self.ours(rel):
                    raise self._refuse(rel)

    def write(self, rel: str, chunks: Iterable[bytes]) -> Path:
        """Write ``out/rel`` atomically from ``chunks`` and record its size and sha256."""
        h, size = hashlib.sha256(), 0

        def counted() -> Iterator[bytes]:
            nonlocal size
            for chunk in chunks:
                h.update(chunk)
                size += len(chunk)
                yield chunk

        dest = self.out / rel

        def may_replace() -> bool:  # (asked again when the bytes are in: a file made during a download is the user's)
            if not (dest.exists() or dest.is_symlink()) or self.ours(rel):
                return True
            return (
                dest.is_file()
                and not dest.is_symlink()
                and dest.stat().st_size == size
                and (sha256_file(dest) == h.hexdigest())
            )

        try:
            write_bytes(dest, counted(), may_replace)
        except FileExistsError:
            raise DataError(
                f"{dest}: a file appeared there while txl was writing it, and txl did not write it; it is left as it "
                "is (the downloads stay in the cache). Move it away, or give --out a new folder, and run again"
            ) from None
        self.files[rel] = {"size": size, "sha256": h.hexdigest(), "mtime_ns": dest.stat().st_mtime_ns}
        doc = {"written_by": _WRITER, "files": dict(sorted(self.files.items()))}
        write_bytes(self.path, (json.dumps(doc, indent=1) + "\n").encode())
        return dest
