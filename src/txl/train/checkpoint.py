"""Training checkpoints: ``RUN/checkpoints/step-N/`` folders that count only once their marker is written.
Design notes: docs/internals.md#txltraincheckpoint."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from txl.config import RUN_CONFIG, RunConfig, read_run_config  # noqa: F401  (re-exported)
from txl.data.download import sha256_file
from txl.util.distributed import World, barrier
from txl.util.fileio import FolderInUse, FolderLock, fsync_dir, save_torch, write_bytes
from txl.util.folders import (  # noqa: F401  (re-exported: where a model is found lives in the bottom layer)
    _STEP,
    MARKER,
    METADATA,
    CheckpointError,
    best_checkpoint,
    is_complete,
    latest_checkpoint,
    list_checkpoints,
    read_json,
    read_metadata,
    resolve_model_dir,
)


def state_name(rank: int) -> str:
    return f"train_state-rank{rank}.pt"


def _earlier_checkpoint_hint(folder: Path) -> str:
    """For an unusable checkpoint: how to continue from the complete one before it in its run, if there is one."""
    folder = Path(folder)
    if folder.parent.name != "checkpoints" or not _STEP.match(folder.name):
        return ""
    step = int(_STEP.match(folder.name).group(1))
    before = [path for n, path in list_checkpoints(folder.parent.parent) if n < step]
    return f"; to continue from the checkpoint before it: --resume {before[-1]}" if before else ""


@contextlib.contextmanager
def naming_an_earlier_checkpoint(folder: Path | None) -> Iterator[None]:
    """Reading checkpoint ``folder``: a file that cannot be read (damaged) is an error that also says how to continue
    from the complete checkpoint before it."""
    try:
        yield
    except CheckpointError as e:
        hint = _earlier_checkpoint_hint(folder) if folder is not None else ""
        if not hint:
            raise
        raise CheckpointError(f"{e}{hint}") from None


def _write_marker(folder: Path, step: int) -> None:
    write_bytes(folder / MARKER, f"{step}\n".encode())


def _json_bytes(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, indent=1) + "\n").encode()


def save_checkpoint(
    world: World, run_dir: Path, step: int, *, model: torch.nn.Module, state: dict[str, Any], tokenizer_file: Path,
    run_config: dict[str, Any], metadata: dict[str, Any], keep_last: int, keep_steps: set[int],
    config_name: str = RUN_CONFIG,
) -> Path:  # fmt: skip
    """Write ``step-N`` collectively (every process writes its own state file), then apply retention.

    If a write fails (a full disk, a read-only folder, a file size limit), the partial folder is removed and the
    ``OSError`` propagates; the previous complete checkpoints are untouched.
    """
    root = run_dir / "checkpoints"
    final, tmp = root / f"step-{step}", root / f".step-{step}.partial"
    try:
        if world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier(world)
        save_torch(state, tmp / state_name(world.rank))
        barrier(world)
        if world.is_main:
            model.save_pretrained(tmp)
            write_bytes(tmp / "tokenizer.json", Path(tokenizer_file).read_bytes())
            write_bytes(tmp / config_name, _json_bytes(run_config))
            metadata = {**metadata, CHECKSUMS: _checksums(tmp)}  # (weights and states; resume verifies them)
            write_bytes(tmp / METADATA, _json_bytes(metadata))
            _write_marker(tmp, step)
            if final.exists():  # the same step saved again (a resumed run stopping where it started)
                old = root / f".step-{step}.old"
                shutil.rmtree(old, ignore_errors=True)
                os.rename(final, old)  # (a crash from here on: recover_checkpoints keeps the complete new one)
                os.rename(tmp, final)
                fsync_dir(root)
                shutil.rmtree(old)
            else:
                os.rename(tmp, final)
                fsync_dir(root)
    except OSError:
        if world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if world.is_main:
        prune(run_dir, keep_last, keep_steps)
    barrier(world)
    return final


def recover_checkpoints(run_dir: Path) -> None:
    """Finish a re-save of a step that a crash cut between its two renames (``step-N`` moved to ``.step-N.old``,
    the new copy not yet renamed from ``.step-N.partial``): the complete new copy becomes ``step-N`` (else the old
    one goes back); a left-over ``.old`` beside a complete ``step-N`` is dropped."""
    root = Path(run_dir) / "checkpoints"
    for old in root.glob(".step-*.old") if root.is_dir() else []:
        final = root / old.name[1:].removesuffix(".old")
        partial = root / f".{final.name}.partial"
        if not is_complete(final):
            if final.exists():
                shutil.rmtree(final)
            os.rename(partial if is_complete(partial) else old, final)
            fsync_dir(root)
        shutil.rmtree(old, ignore_errors=True)


def prune(run_dir: Path, keep_last: int, keep_steps: set[int]) -> None:
    """Delete complete checkpoints except the newest ``keep_last`` and ``keep_steps``; drop partial folders."""
    recover_checkpoints(run_dir)
    ckpts = list_checkpoints(run_dir)
    keep = {s for s, _ in ckpts[-max(1, keep_last) :]} | keep_steps
    for s, p in ckpts:
        if s not in keep:
            shutil.rmtree(p)
    for p in (run_dir / "checkpoints").glob(".step-*.partial"):
        shutil.rmtree(p, ignore_errors=True)


SUPERSEDED = "superseded"


def supersede_later_checkpoints(run_dir: Path, step: int) -> list[Path]:
    """A run going on from ``step`` while it holds later checkpoints (resumed from an earlier one): those belong to
    the abandoned continuation. They are moved, not deleted, to ``RUN/superseded/`` (where ``--resume auto``,
    retention and the best-checkpoint choice no longer see them); returns where they went."""
    later = [path for n, path in list_checkpoints(run_dir) if n > step]
    moved = []
    for path in later:
        dest = Path(run_dir) / SUPERSEDED / path.name
        k = 1
        while dest.exists():
            k += 1
            dest = Path(run_dir) / SUPERSEDED / f"{path.name}.{k}"
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.rename(path, dest)
        moved.append(dest)
    if moved:
        fsync_dir(Path(run_dir) / "checkpoints")
        fsync_dir(Path(run_dir) / SUPERSEDED)
    return moved


CHECKSUMS = "sha256"
"""The key of ``metadata.json`` that records the sha256 of the checkpoint's weights and training states, written
with it and verified when a run resumes from it."""


def _checksums(folder: Path) -> dict[str, str]:
    """The sha256 of the checkpoint's binary files: the weights and every process's training state (the JSON files
    are checked by reading them, and may be edited: a run's settings, a tokenizer's symbols)."""
    files = [p for p in sorted(folder.iterdir()) if p.suffix in (".safetensors", ".pt") and p.is_file()]
    return {p.name: sha256_file(p) for p in files}


def verify_checksums(folder: Path) -> None:
    """Check the files of checkpoint ``folder`` against the sha256 its metadata recorded (a checkpoint written before
    they were recorded has none: nothing to check). A damaged file is one error naming it (probes.md n57: a flipped
    bit in the weights trained on silently)."""
    recorded = read_metadata(folder).get(CHECKSUMS)
    if not isinstance(recorded, dict):
        return
    for name, digest in recorded.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (the checkpoint recorded it)")
        if sha256_file(path) != digest:
            raise CheckpointError(
                f"{path}: its sha256 differs from the one recorded when the checkpoint was written ({METADATA}): "
                "the file is damaged"
            )


def load_states(folder: Path) -> list[dict[str, Any]]:
    """Every process's training state of a checkpoint, rank 0 first (a resume then calls :func:`verify_checksums`:
    a file that cannot be read at all is named as such first)."""
    files = sorted(folder.glob("train_state-rank*.pt"), key=lambda p: int(p.stem.rsplit("rank", 1)[1]))
    if not files:
        raise CheckpointError(f"{folder}: no training state (train_state-rank*.pt): a model folder, not a checkpoint")
    states = []
    for f in files:
        try:
            states.append(torch.load(f, map_location="cpu", weights_only=True))
        except Exception as e:  # a truncated or foreign file: say which
            raise CheckpointError(f"{f}: unreadable training state ({type(e).__name__}: {e})") from None
    if len(states) != states[0]["world_size"]:
        raise CheckpointError(f"{folder}: {len(states)} state files for a world of {states[0]['world_size']}")
    return states


class RunLock(FolderLock):
    """The lock of a run folder (:class:`txl.util.fileio.FolderLock`) for the command that writes it (``txl train``,
    ``txl finetune``); a second command on the folder stops with a :class:`CheckpointError`."""

    def __init__(self, run_dir: Path, command: str = "txl train") -> None:
        for folder in (Path(run_dir).resolve(), *Path(run_dir).resolve().parents):  # (probes.md n69)
            if folder.parent.name == "checkpoints" and _STEP.match(folder.name):
                raise CheckpointError(
                    f"{run_dir}: inside {folder}, a checkpoint of another run, whose retention would delete this run "
                    "with it; choose a --run_dir outside it"
                )
        try:
            super().__init__(run_dir, command)
        except FolderInUse as e:
            raise CheckpointError(str(e)) from None
