"""Streaming reads of text files in bounded memory, with the reference pipeline's line rules.
Design notes: docs/internals.md#txldatatext."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from txl.data.errors import DataError

BLOCK_BYTES = 1 << 22  # 4 MiB per read: bounds memory whatever the line lengths


@dataclass(frozen=True)
class FileRange:
    """Bytes ``[start, end)`` of one file (``end=None``: to the end). A split is a list of these."""

    path: Path
    start: int = 0
    end: int | None = None

    def stop(self) -> int:
        return os.path.getsize(self.path) if self.end is None else self.end

    def describe(self) -> str:
        if self.start == 0 and self.end is None:
            return str(self.path)
        return f"{self.path} [bytes {self.start}:{self.stop()}]"


def iter_bytes(fr: FileRange, block: int | None = None) -> Iterator[tuple[int, bytes]]:
    """``(file offset, bytes)`` blocks of the range (``block`` bytes each, default :data:`BLOCK_BYTES`)."""
    block = block or BLOCK_BYTES
    stop = fr.stop()
    with open(fr.path, "rb") as f:
        f.seek(fr.start)
        pos = fr.start
        while pos < stop:
            data = f.read(min(block, stop - pos))
            if not data:
                break
            yield pos, data
            pos += len(data)


def _utf8_cut(data: bytes) -> int:
    """Length of the longest prefix of ``data`` that does not end inside a UTF-8 sequence."""
    n = len(data)
    i = n - 1
    while i >= 0 and n - i <= 4 and (data[i] & 0xC0) == 0x80:
        i -= 1
    if i < 0 or data[i] < 0x80:
        return n
    lead = data[i]
    need = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
    return i if n - i < need else n


def line_of_offset(path: Path, offset: int) -> tuple[int, int]:
    """1-based (line, column in bytes) of a byte offset, counting ``\\n`` like the reference."""
    line, last_nl = 1, -1
    for pos, data in iter_bytes(FileRange(path, 0, offset)):
        line += data.count(b"\n")
        k = data.rfind(b"\n")
        if k >= 0:
            last_nl = pos + k
    return line, offset - last_nl


def iter_text(fr: FileRange, errors: str = "strict", block: int | None = None) -> Iterator[str]:
    """Decoded text of a file range in blocks, with ``\\r\\n`` and ``\\r`` turned into ``\\n``.

    ``errors`` is ``"strict"`` (a bad byte is a :class:`DataError` with file, line and offset) or ``"replace"``
    (it becomes U+FFFD). Blocks end on character boundaries.
    """
    if errors not in ("strict", "replace"):
        raise DataError(f"encoding_errors must be 'strict' or 'replace', not {errors!r}")
    pending, held_cr, at_start = b"", "", fr.start == 0
    for pos, data in iter_bytes(fr, block):
        data = pending + data
        cut = _utf8_cut(data)
        text = held_cr + _decode(fr, data[:cut], pos - len(pending), errors)
        pending, held_cr = data[cut:], ""
        if at_start and text:
            text, at_start = text.removeprefix("\ufeff"), False
        if text.endswith("\r"):  # a "\r\n" may straddle two blocks: decide with the next one
            text, held_cr = text[:-1], "\r"
        if text:
            yield universal_newlines(text)
    text = held_cr + (_decode(fr, pending, fr.stop() - len(pending), errors) if pending else "")
    if text:
        yield universal_newlines(text)


def universal_newlines(text: str) -> str:
    """CRLF and lone CR as LF, as text files are read."""
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text


def _decode(fr: FileRange, data: bytes, start: int, errors: str) -> str:
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        offset = start + e.start
        line, col = line_of_offset(fr.path, offset)
        raise DataError(
            f"{fr.path}:{line}: invalid UTF-8 byte 0x{data[e.start]:02x} at byte offset {offset} (column {col}). "
            "Fix the file, or read bad bytes as U+FFFD with data.encoding_errors: replace "
            "(--data.encoding_errors replace; txl eval: --encoding_errors replace)."
        ) from None


def smallest_uint(n: int) -> np.dtype:
    """The smallest unsigned integer dtype that holds ids ``0..n-1``."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if n - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.uint64)
