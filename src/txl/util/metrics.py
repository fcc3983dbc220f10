"""Where a run reports: ``RUN/metrics.jsonl`` (one JSON object per line), ``RUN/train.log``, the console,
optionally TensorBoard, and a tqdm progress bar on a terminal. Only process 0 writes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from txl.util.fileio import write_bytes

METRICS = "metrics.jsonl"


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of ``RUN/metrics.jsonl``: JSON objects with an integer ``step``. A line that is not one (a torn last
    line from a killed process, an edit gone wrong: ``{}``, ``5``, text that is not UTF-8) is skipped, so that the
    rows around it still resume, plot and compare."""
    path = Path(run_dir) / METRICS
    if not path.exists():
        return []
    if not path.is_file():  # (probes pl8: a folder was "Is a directory (check that folder's permissions ...)", exit 1)
        raise ValueError(f"{path}: not a file (a run's metrics are a JSON-lines file that txl train writes)")
    rows = []
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        step = row.get("step") if isinstance(row, dict) else None
        if isinstance(step, int) and not isinstance(step, bool):
            rows.append(row)
    return rows


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop the rows after ``step`` (written by a run that died after its last checkpoint)."""
    path = run_dir / METRICS
    if path.exists():
        kept = [r for r in read_metrics(run_dir) if r["step"] <= step]
        write_bytes(path, "".join(json.dumps(r) + "\n" for r in kept).encode())


def _append(f, text: str) -> None:
    """Write and flush a line; a failure (a full disk, a file-size limit) names the file."""
    try:
        f.write(text)
        f.flush()
    except OSError as e:
        raise OSError(e.errno, e.strerror, f.name) from None


class Reporter:
    """A run's log (``train.log``), metrics rows and progress bar. With ``hold``, nothing is written to the run
    folder until :meth:`commit` (a run that fails while it sets up leaves the folder as it was); what it says
    meanwhile is printed at once and written to the log then."""

    def __init__(
        self, run_dir: Path, *, enabled: bool, progress: bool | None, tensorboard: bool, total: int, hold: bool = False
    ):
        self.enabled = enabled
        self.run_dir = run_dir
        self.bar = self.tb = self._log = self._metrics = None
        self._held: list[str] | None = [] if hold else None
        self._tensorboard = tensorboard
        if not enabled:
            return
        if tensorboard:
            try:
                import torch.utils.tensorboard  # noqa: F401
            except ImportError:
                raise ValueError(
                    "train.tensorboard needs the tensorboard package: pip install 'transformer-xl[tb]'"
                ) from None
        if progress if progress is not None else sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="step", dynamic_ncols=True)
        if not hold:
            self._open()

    def commit(self) -> None:
        """Open the run folder's files and write what was said while held."""
        if not self.enabled or self._held is None:
            return
        held, self._held = self._held, None
        self._open()
        for msg in held:
            _append(self._log, msg + "\n")

    def _open(self) -> None:
        self._log = open(self.run_dir / "train.log", "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self._metrics = open(self.run_dir / METRICS, "a", encoding="utf-8")  # noqa: SIM115
        if self._tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # (its presence checked in __init__)

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"), max_queue=1000)

    def start_at(self, step: int) -> None:
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def say(self, msg: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)
        if self._held is not None:
            self._held.append(msg)
        else:
            _append(self._log, msg + "\n")

    def row(self, row: dict[str, Any]) -> None:
        """Append one metrics row (flushed at once: a crash loses at most the line being written)."""
        if not self.enabled:
            return
        self.commit()  # (a row is written: the run has begun)
        _append(self._metrics, json.dumps(row) + "\n")
        if self.tb is not None:
            prefix = row.get("split", "train")
            for k, v in row.items():
                if k not in ("step", "split") and isinstance(v, int | float):
                    self.tb.add_scalar(f"{prefix}/{k}", v, row["step"])

    def advance(self, n: int, **postfix: Any) -> None:
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        """Close every output (idempotent). Rows were flushed as they were written, so a close that fails (a
        full disk) loses nothing and must not hide the error that stopped the run."""
        if not self.enabled:
            return
        self.enabled = False
        for f in (self._log, self._metrics):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        if self.tb is not None:
            self.tb.close()
        if self.bar is not None:
            self.bar.close()
