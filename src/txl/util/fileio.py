"""Crash-safe writes: after a crash a file holds its old content or its complete new content, never a torn mix.
Design notes: docs/internals.md#txlutilfileio."""

from __future__ import annotations

import errno
import fcntl
import io
import json
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


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


def _install(tmp: Path, dest: Path, may_replace: Callable[[], bool] | None) -> None:
    """``tmp`` becomes ``dest``. With ``may_replace``, a ``dest`` that exists at that moment is replaced only where
    ``may_replace()`` says so (else FileExistsError, ``tmp`` kept for the caller to remove): where ``dest`` does not
    exist, a hard link installs it, which fails rather than replace a file made meanwhile (a filesystem without hard
    links: the check, then the rename)."""
    if may_replace is None:
        os.replace(tmp, dest)
        return
    try:
        os.link(tmp, dest)
        os.unlink(tmp)
        return
    except FileExistsError:
        pass
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV, errno.EMLINK, errno.ENOSYS, errno.EACCES):
            raise
    if not may_replace():
        raise FileExistsError(errno.EEXIST, "exists, and may not be replaced", str(dest))
    os.replace(tmp, dest)


@contextmanager
def atomic_path(dest: str | os.PathLike, may_replace: Callable[[], bool] | None = None) -> Iterator[Path]:
    """Yield a fresh temporary path beside ``dest`` to write to; on success it becomes ``dest`` durably. With
    ``may_replace``, a file at ``dest`` when the writer is done is replaced only where ``may_replace()`` is true, and
    a file made there while the writer ran is never replaced (FileExistsError naming ``dest``)."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        # the mode a plain open() gives a new file here (the umask's; reading the umask itself would mean setting it,
        # process-wide, for a moment): the file is made so first, and given that mode back after its writer, since
        # some writers make files private
        os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        mode = os.stat(tmp).st_mode & 0o777
        yield tmp
        os.chmod(tmp, mode)
        _fsync_file(tmp)
        _install(tmp, dest, may_replace)
        fsync_dir(dest.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.filename is None:  # a failed write() names no file: name the destination
            raise OSError(e.errno, e.strerror or str(e), str(dest)) from e
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes(
    dest: str | os.PathLike, data: bytes | Iterable[bytes], may_replace: Callable[[], bool] | None = None
) -> None:
    """Write ``data`` (bytes, or an iterable of chunks streamed in bounded memory) to ``dest`` atomically (for
    ``may_replace``, see :func:`atomic_path`)."""
    with atomic_path(dest, may_replace) as tmp, open(tmp, "wb") as f:
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

    with atomic_path(dest) as tmp, open(tmp, "wb") as f:
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
        _sort_metadata(tmp)


def _sort_metadata(path: Path) -> None:
    """The safetensors header's ``__metadata__`` in sorted key order (the writer emits it in its hash map's order,
    which differs from one process to the next: the same tensors gave files with other bytes, probes.md kc2). The
    header keeps its length, and the tensors' order and offsets; a header this does not reproduce is left as is."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        raw = f.read(n)
        header = json.loads(raw)
        meta = header.get("__metadata__")
        if not isinstance(meta, dict) or len(meta) < 2:
            return
        header["__metadata__"] = dict(sorted(meta.items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        same = json.dumps(json.loads(raw), separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) > n or same != raw.rstrip(b" "):  # (a layout this does not write back exactly)
            return
        f.seek(8)
        f.write(text + b" " * (n - len(text)))


LOCK = ".lock"


def free_space(folder: str | os.PathLike) -> int:
    """Bytes free for a new file at ``folder`` (or at its nearest existing parent)."""
    path = Path(folder).resolve()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def check_space(folder: str | os.PathLike, needed: int, what: str, advice: str) -> None:
    """Refuse (a ValueError, one line) to begin writing about ``needed`` bytes into ``folder`` where the disk has
    less free: the write would fail part-way instead, after minutes or hours of work."""
    if needed <= 0:
        return
    free = free_space(folder)
    if needed > free:
        raise ValueError(
            f"{folder}: {what} needs about {_size(needed)} of disk, more than the {_size(free)} free there: {advice}"
        )


def size_of(path: str | os.PathLike) -> int:
    """Bytes of a file, of every file below a folder, or of the files a prefix names (a TF checkpoint's)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    files = path.rglob("*") if path.is_dir() else path.parent.glob(f"{path.name}*") if path.parent.is_dir() else []
    return sum(f.stat().st_size for f in files if f.is_file())


def _size(n: int) -> str:
    unit = next((u for u in range(3, 0, -1) if n >= 2 ** (10 * u)), 0)
    return f"{n / 2 ** (10 * unit):,.1f} {('bytes', 'KiB', 'MiB', 'GiB')[unit]}" if unit else f"{n:,} bytes"


_HELD: set[Path] = set()  # the folders this process holds (a registry of the locks, not a setting)


class FolderInUse(ValueError):
    """Another process holds the folder's :class:`FolderLock`."""


class FolderLock:
    """An exclusive lock on ``folder`` for the lifetime of the command that writes it (made if missing).

    ``command`` names the holder in the message a second command gets ("FOLDER is in use by another txl train (pid
    N on HOST since T); wait for it to finish, or choose another --run_dir"). With ``wait`` the second one instead
    says so through ``say`` and waits for the folder (a shared cache that the first is preparing).
    """

    def __init__(
        self, folder: str | os.PathLike, command: str, *, option: str = "--run_dir", wait: bool = False,
        say: Any = None,
    ) -> None:  # fmt: skip
        folder = Path(folder)
        if wait and folder.resolve() in _HELD:  # (flock would wait on this very process: locks are per open file)
            raise FolderInUse(f"{folder} is already in use by this {command}; give {option} a folder of its own")
        self._made_dir = not folder.exists()
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / LOCK
        self._existed = self.path.exists()
        self._file = open(self.path, "a+")  # noqa: SIM115 (held open for the lock's lifetime)
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "another process"
            if not wait:
                self._file.close()
                raise FolderInUse(
                    f"{folder} is in use by another {holder}; wait for it to finish, or choose another {option}"
                ) from None
            if say is not None:
                say(f"{folder} is in use by another {holder}; waiting for it to finish")
            fcntl.flock(self._file, fcntl.LOCK_EX)
        self._file.seek(0)
        self._previous = self._file.read()
        self._file.seek(0)
        self._file.truncate()
        when = time.strftime("%Y-%m-%d %H:%M:%S")
        self._file.write(f"{command} (pid {os.getpid()} on {socket.gethostname()} since {when})\n")
        self._file.flush()
        _HELD.add(folder.resolve())

    def release(self, restore: bool = False) -> None:
        """Unlock; with ``restore`` (a command that changed nothing else), the lock file as it was before, and no
        folder where there was none."""
        if not self._file.closed:
            if restore:
                self._file.seek(0)
                self._file.truncate()
                self._file.write(self._previous)
                self._file.flush()
                if not self._existed:
                    self.path.unlink(missing_ok=True)
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            _HELD.discard(self.path.parent.resolve())
            if restore and self._made_dir and not any(self.path.parent.iterdir()):
                self.path.parent.rmdir()


def _txl_lock(path: Path) -> bool:
    """Whether ``path`` is a lock file of txl's (empty, or naming a txl command): not another tool's ``.lock`` (pytest
    keeps one with its pid in its temporary folders' root, which every test's folder lies in)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            head = f.read(64)
    except OSError:
        return False
    return not head.strip() or head.startswith("txl")


def _locked_folder_around(target: Path) -> Path | None:
    """The nearest folder at or above ``target`` that has a lock file of txl's (a run folder, a corpus cache), if
    any."""
    return next((a for a in (target, *target.parents) if (a / LOCK).is_file() and _txl_lock(a / LOCK)), None)


@contextmanager
def _unless_in_use(target: Path, command: str, option: str) -> Iterator[None]:
    """Hold the lock of the locked folder ``target`` lies in (if any) while a command writes there."""
    folder = _locked_folder_around(target)
    if folder is None:
        yield
        return
    lock = FolderLock(folder, command, option=option)
    try:
        yield
    finally:
        lock.release(restore=True)  # (the lock file as it was: this command is not the folder's owner)


def _inside(a: Path, b: Path) -> bool:
    return a == b or b in a.parents


@contextmanager
def staged_folder(
    out: str | os.PathLike,
    *,
    overwrite: bool = False,
    sources: Iterable[str | os.PathLike] = (),
    option: str = "out",
    command: str = "txl",
    needed: int = 0,
) -> Iterator[Path]:
    """A new folder to write a command's whole output into, which becomes ``out`` once it is complete.

    Checked first, before anything is written: ``out`` is not a source (a file or folder the command reads), inside
    one, or around one; and it is new or empty, or ``overwrite`` is given. On success the new folder is renamed into
    place (an old ``out`` is kept until then, and removed after); on any error it is removed and ``out`` is as it
    was. Inside a locked folder (a run folder), its lock is held while the output is written and moved (``command``
    names the holder for a command that finds it held). ``needed``: the bytes it will write about, checked against
    the disk's free space first."""
    out = Path(out)
    target = out.resolve()
    for src in sources:
        source = Path(src).resolve()
        if _inside(target, source) or _inside(source, target):
            raise ValueError(
                f"--{option} {out}: it would be written {'into' if _inside(target, source) else 'around'} the source "
                f"{src}; give a folder of its own"
            )
    if out.exists() and not out.is_dir():
        raise ValueError(f"--{option} {out}: a file is there; give a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(
            f"--{option} {out}: the folder exists and is not empty; give a new folder, or --overwrite true to replace "
            "it (it is kept until the new one is complete)"
        )
    check_space(out.parent, needed, f"--{option} {out}", "free space, or write it to a disk with more")
    with _unless_in_use(target, command, f"--{option}"):
        out.parent.mkdir(parents=True, exist_ok=True)
        tag = uuid.uuid4().hex[:12]
        staged = out.parent / f".{out.name}.partial-{tag}"
        staged.mkdir()
        try:
            yield staged
            fsync_dir(staged)
            old = out.parent / f".{out.name}.old-{tag}"
            if out.exists():
                os.replace(out, old)
            os.replace(staged, out)
            fsync_dir(out.parent)
            shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise


@contextmanager
def staged_file(
    out: str | os.PathLike, *, overwrite: bool = False, option: str = "out", command: str = "txl", needed: int = 0
) -> Iterator[Path]:
    """A temporary path beside ``out`` to write a command's output file to, renamed over ``out`` on success and
    removed on any error; an existing ``out`` is refused (before anything is written) unless ``overwrite``."""
    out = Path(out)
    if out.exists() and not out.is_file():
        raise ValueError(f"--{option} {out}: a folder is there; give a file name")
    if out.exists() and not overwrite:
        raise ValueError(f"--{option} {out}: the file exists; give a new name, or --overwrite true to replace it")
    check_space(out.parent, needed, f"--{option} {out}", "free space, or write it to a disk with more")
    with _unless_in_use(out.resolve().parent, command, f"--{option}"):
        out.parent.mkdir(parents=True, exist_ok=True)
        staged = out.with_name(f".{out.stem}.partial-{uuid.uuid4().hex[:12]}{out.suffix}")
        try:  # (before the work: a folder that takes no file is said at once, naming --out, probes.md n43)
            staged.touch(exist_ok=False)
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(out)) from None
        try:
            yield staged
            os.replace(staged, out)
            fsync_dir(out.parent)
        except BaseException:
            staged.unlink(missing_ok=True)
            raise
