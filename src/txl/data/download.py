"""Resumable HTTP downloads checked by size and sha256 (standard library only)."""

from __future__ import annotations

import hashlib
import http.client
import os
import shutil
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.error import HTTPError, URLError
from urllib.request import Request, urlopen

from txl.data.errors import DataError
from txl.util.fileio import write_bytes

CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK * 8):
            h.update(chunk)
    return h.hexdigest()


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _fetch(url: str, part: Path, size: int | None, log: Callable[[str], None], timeout: float) -> None:
    """Append the rest of ``url`` to ``part`` (HTTP Range), or restart it when the server ignores ranges."""
    have = part.stat().st_size if part.exists() else 0
    if size is not None and have == size:
        return
    headers = {"User-Agent": "txl-data/1"}
    if have:
        headers["Range"] = f"bytes={have}-"
    try:
        resp = urlopen(Request(url, headers=headers), timeout=timeout)
    except HTTPError as e:
        if e.code == 416 and have:  # nothing left to send: the part file is complete
            return
        raise
    with resp:
        if have and resp.status == 206:
            got = resp.headers.get("Content-Range", "")
            if not got.startswith(f"bytes {have}-"):
                raise OSError(f"server answered range {got!r} to a request from byte {have}")
            mode, done = "ab", have
            log(f"resuming {part.name} at {have:,} bytes")
        else:
            mode, done = "wb", 0
        total = size or (done + int(resp.headers.get("Content-Length") or 0)) or None
        next_report = 0.1
        with open(part, mode) as f:
            while chunk := resp.read(CHUNK):
                f.write(chunk)
                done += len(chunk)
                if total and done / total >= next_report:
                    log(f"  {part.name[:-5]}: {done / total:4.0%} of {total:,} bytes")
                    next_report += 0.1


def _attempt(url: str, part: Path, size: int | None, log, timeout: float, failures: list[str]) -> bool:
    """One try at completing ``part`` from ``url``; a failure is appended to ``failures``."""
    try:
        _fetch(url, part, size, log, timeout)
        if size is not None and part.stat().st_size != size:
            raise OSError(f"got {part.stat().st_size:,} bytes, expected {size:,}")
        return True
    except (URLError, HTTPError, OSError, http.client.HTTPException) as e:
        failures.append(f"{url}: {e}")
        if size is not None and part.exists() and part.stat().st_size > size:
            part.unlink()
        return False


def download(
    urls: Sequence[str],
    dest: Path,
    *,
    sha256: str | None = None,
    size: int | None = None,
    log: Callable[[str], None] = _say,
    attempts: int = 3,
    timeout: float = 60.0,
    check: Callable[[Path], str | None] | None = None,
    trust_first: bool = True,
) -> Path:
    """Download the first URL that works to ``dest``, resuming a partial ``dest.part``, then check it.

    An existing ``dest`` is re-checked and reused. Without a pinned ``sha256`` the digest of the first download is
    recorded in ``dest.sha256`` and checked on every later use (trust on first use; the message says so), once
    ``check`` (a function returning what is wrong with the file, or None) accepts the content, so that an error page
    or a truncated file is never the one trusted. A failed transfer keeps ``dest.part`` so the next run resumes; a
    wrong checksum or content moves the file to ``dest.bad``. With ``trust_first=False`` (a file from a mirror) the
    first digest is printed, never recorded: nothing from that source becomes a trusted checksum.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    record = dest.with_name(dest.name + ".sha256")
    expected = sha256 or (record.read_text().strip() if record.exists() else None)
    if dest.exists():
        if expected is None or sha256_file(dest) == expected:
            return dest
        log(f"{dest}: checksum mismatch, downloading it again")
        dest.unlink()
    part = dest.with_name(dest.name + ".part")
    failures: list[str] = []
    url = next((u for u in urls for _ in range(attempts) if _attempt(u, part, size, log, timeout, failures)), None)
    if url is None:
        kept = f"; the partial file {part} is kept and the next run resumes it" if part.exists() else ""
        counts = Counter(failures)  # (each URL's error once, with how many attempts gave it; in order)
        lines = [f if n == 1 else f"{f} ({n} attempts)" for f, n in counts.items()]
        raise DataError(f"could not download {dest.name}{kept}:\n  " + "\n  ".join(lines))
    digest = sha256_file(part)
    problem = f"sha256 {digest}, expected {expected}" if expected is not None and digest != expected else None
    if problem is None and expected is None and check is not None:
        problem = check(part)
    if problem is not None:
        bad = dest.with_name(dest.name + ".bad")
        shutil.move(part, bad)
        raise DataError(
            f"{dest.name} from {url}: {problem}. The file was moved to {bad}; the source may have changed or the "
            "transfer was corrupted. Delete it and retry, or use another mirror."
        )
    os.replace(part, dest)
    if expected is None and trust_first:
        write_bytes(record, (digest + "\n").encode())
        log(f"{dest.name}: sha256 {digest} (not pinned by txl; recorded in {record} and checked from now on)")
    elif expected is None:
        log(
            f"{dest.name}: sha256 {digest} from {url}; txl has no published checksum of this file, so it is not "
            "recorded or trusted: compare it with the original's yourself"
        )
    return dest
