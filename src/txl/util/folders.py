"""Where a model is: a model folder (``config.json`` + weights), a run's ``step-N`` checkpoint (complete only with
its ``COMPLETE`` marker), or a run folder (its best or latest checkpoint). Every layer asks this question (the
tokenizer, the model, evaluation, serving, conversion), so it lives at the bottom."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

CONFIG_NAME = "config.json"


class CheckpointError(ValueError):
    """A checkpoint folder or file that cannot be used; the message says which and why."""


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(
            f"{path}: not a JSON text file (byte 0x{e.object[e.start]:02x} at offset {e.start})"
        ) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def hub_hint(path: str | os.PathLike) -> str:
    """For a missing local path that reads as a Hugging Face Hub name (``owner/name``): how to get it."""
    p = Path(path)
    if p.is_absolute() or len(p.parts) != 2 or Path(p.parts[0]).exists():
        return ""
    return (
        f". txl reads local folders only: for a Hugging Face Hub model, download its folder (e.g. `hf download "
        f"{p.as_posix()} --local-dir {p.name}`) and import it with `txl convert hf {p.name} {p.name}-txl` "
        "(--trust-pickle for a vocab.pkl or pytorch_model.bin)"
    )


# ---- Where a model is: a model folder, a run's step-N checkpoint, or a run folder (its best or latest) ----

MARKER = "COMPLETE"
METADATA = "metadata.json"
_STEP = re.compile(r"^step-(\d+)$")


def is_complete(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def list_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP.match(p.name)
        if m and p.is_dir() and is_complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1][1] if ckpts else None


def best_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint with the best validation loss (as recorded by the newest one), else the newest."""
    latest = latest_checkpoint(run_dir)
    if latest is None:
        return None
    best = read_metadata(latest).get("best_step")
    candidate = Path(run_dir) / "checkpoints" / f"step-{best}"
    return candidate if best is not None and is_complete(candidate) else latest


def read_metadata(folder: Path) -> dict[str, Any]:
    return read_json(Path(folder) / METADATA)


def resolve_model_dir(path: str | os.PathLike, prefer: str = "best") -> Path:
    """A run folder (its best or latest checkpoint), a ``step-N`` folder, or a plain model folder."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(
            f"{p}: not found (expected a run folder, a checkpoint step-N folder or a model folder){hub_hint(p)}"
        )
    if p.is_file() and (p.parent / CONFIG_NAME).is_file():  # a file of a model folder (its weights, its config)
        p = p.parent
    if any((p / name).exists() for name in ("checkpoints", "config.yaml", "train.log")) or p.name == "checkpoints":
        run = p.parent if p.name == "checkpoints" else p
        found = best_checkpoint(run) if prefer == "best" else latest_checkpoint(run)
        if found is None:
            raise CheckpointError(f"{p}: the run has no complete checkpoint yet")
        return found
    if _STEP.match(p.name) and not is_complete(p):
        raise CheckpointError(f"{p}: incomplete checkpoint (no {MARKER} marker: its writing was interrupted)")
    if not (p / CONFIG_NAME).is_file():
        raise CheckpointError(f"{p}: no {CONFIG_NAME} here; expected a run folder, step-N folder or model folder")
    return p
