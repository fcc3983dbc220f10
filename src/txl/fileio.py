"""Crash-safe writes: after a crash a file holds its old content or its complete new content, never a torn mix.

Every file txl writes (weights, training state, metadata, checkpoint markers, tokenizers, cached ids, extracted
datasets) goes through :func:`atomic_path`: the content is written to a temporary file in the same folder, the
temporary file is fsynced, renamed over the destination, and the folder is fsynced, so the rename itself survives
a power cut. On any error the temporary file is removed and the destination is untouched. A failure to write (a
full disk, a read-only folder, a file-size limit) is an ``OSError`` that names the destination: torch's and
safetensors' own writers report such failures as ``RuntimeError``/``SafetensorError``, so :func:`save_torch` and
:func:`save_safetensors` turn them back into the ``OSError`` they came from.
"""

from __future__ import annotations

import io
import os
import re
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_UMASK = os.umask(0)
os.umask(_UMASK)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the entries of a folder (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


@contextmanager
def atomic_path(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temporary path beside ``dest`` to write to; on success it becomes ``dest`` durably."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_UMASK)  # as a plain open() would create it (some writers make files private)
        _fsync_file(tmp)
        os.replace(tmp, dest)
        fsync_dir(dest.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.filename is None:  # a failed write() names no file: name the destination
            raise OSError(e.errno, e.strerror or str(e), str(dest)) from e
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes(dest: str | os.PathLike, data: bytes | Iterable[bytes]) -> None:
    """Write ``data`` (bytes, or an iterable of chunks streamed in bounded memory) to ``dest`` atomically."""
    with atomic_path(dest) as tmp, open(tmp, "xb") as f:
        for chunk in [data] if isinstance(data, bytes | bytearray) else data:
            f.write(chunk)


class _Recorder(io.RawIOBase):
    """A writable file that remembers the OSError of a failed write (torch.save reports it as a RuntimeError)."""

    def __init__(self, f) -> None:
        self.f, self.error = f, None

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        try:
            return self.f.write(b)
        except OSError as e:
            self.error = e
            raise


def save_torch(obj: Any, dest: str | os.PathLike) -> None:
    """``torch.save(obj)`` to ``dest`` atomically (read back with ``torch.load(weights_only=True)``)."""
    import torch

    with atomic_path(dest) as tmp, open(tmp, "xb") as f:
        recorder = _Recorder(f)
        try:
            torch.save(obj, recorder)
        except RuntimeError:
            if recorder.error is not None:
                raise recorder.error from None
            raise


def save_safetensors(tensors: dict, dest: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file`` to ``dest`` atomically."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    with atomic_path(dest) as tmp:
        try:
            save_file(tensors, str(tmp), metadata=metadata)
        except SafetensorError as e:
            code = re.search(r"os error (\d+)", str(e))
            if code is None:
                raise
            errno = int(code.group(1))
            raise OSError(errno, os.strerror(errno)) from None
