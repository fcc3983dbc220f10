"""``txl plot RUN``: training and validation curves from ``RUN/metrics.jsonl`` as a PNG; where the commands' images
go, and how they are written."""

from __future__ import annotations

import io
import math
from pathlib import Path

from txl.util.fileio import write_bytes
from txl.util.metrics import METRICS, read_metrics


def image_path(out: str | Path, option: str, default_name: str) -> Path:
    """Where an image given as ``option`` goes, checked before the work that makes it: a folder takes
    ``default_name`` inside it, a name without an extension takes .png (matplotlib would add it, and the command
    named the file without it), and an extension matplotlib cannot write is one error naming the option."""
    from matplotlib.backend_bases import FigureCanvasBase

    out = Path(out)
    if out.is_dir():
        out = out / default_name
    elif not out.suffix:
        out = out.with_name(out.name + ".png")
    formats = FigureCanvasBase.get_supported_filetypes()
    if out.suffix[1:].lower() not in formats:
        raise ValueError(
            f"{option} {out}: an image's format is its extension, and {out.suffix} is none matplotlib writes; give "
            f"one of {', '.join('.' + f for f in sorted(formats))}"
        )
    if not out.parent.is_dir():
        raise ValueError(f"{option} {out}: no folder {out.parent} to write it in")
    return out


def save_figure(fig, out: Path) -> Path:
    """Write ``fig`` to ``out`` (its extension the format) at once, as every file here is written: a failure leaves
    the file that was there as it was; the figure is closed."""
    import matplotlib.pyplot as plt

    data = io.BytesIO()
    try:
        fig.savefig(data, format=out.suffix[1:].lower(), dpi=110)
    finally:
        plt.close(fig)
    write_bytes(out, data.getvalue())
    return out


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the loss curves (bpc or ppl on a second panel; a fine-tuned classifier's accuracy or MSE) of a run to
    ``out`` (default ``RUN/loss.png``; a folder: ``loss.png`` in it)."""
    out = image_path(out if out else Path(run_dir), "--out", "loss.png")
    return save_figure(run_figure(run_dir), out)


def run_figure(run_dir: str | Path):
    """The figure of :func:`plot_run` (a matplotlib ``Figure``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    train = [r for r in rows if r.get("split") == "train"]
    valid = [r for r in rows if r.get("split") == "valid"]
    if not train and not valid:
        path = run_dir / METRICS
        text = path.read_bytes().decode("utf-8", errors="replace") if path.is_file() else ""
        lines = len(text.splitlines())  # (as read_metrics reads them: a last newline ends a line, it starts none)
        if lines:  # (probes.md k08: a file of bad lines was "no metrics yet")
            raise ValueError(
                f"{path}: none of its {lines} line(s) is a metrics row (a JSON object with an integer step, as "
                "txl train writes)"
            )
        raise ValueError(f"{path}: no metrics yet (is this a run folder of `txl train`?)")
    metric = next((m for m in ("bpc", "ppl", "accuracy", "mse") if m in (train or valid)[0]), None)
    per = "document" if metric in ("accuracy", "mse") else "token"  # (txl finetune's runs: a loss per document)
    keys = ["loss", metric] if metric else ["loss"]
    if not any(_value(r.get(k)) is not None for r in train + valid for k in keys):
        raise ValueError(  # (probes pl2, pl7: values of Infinity, 1e308, "high" or [1] were matplotlib's errors)
            f"{run_dir / METRICS}: no row has a finite {' or '.join(keys)} to plot (diverged, or edited by hand)"
        )
    fig, axes = plt.subplots(1, len(keys), figsize=(11 if metric else 6, 4), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        for series, label, style in ((train, "train", "-"), (valid, "valid", "o-")):
            points = [(r["step"], v) for r in series if (v := _value(r.get(key))) is not None]
            if points:
                ax.plot(*zip(*points, strict=True), style, label=label, markersize=3)
        ax.set_xlabel("step")
        ax.set_ylabel(key if key != "loss" else f"loss (nats/{per})")
        if key == "ppl":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    return fig


def _value(v) -> float | None:
    """A metric's value as a number to plot: a finite int or float, within what an axis can span; else None (the
    row is left out of that curve)."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or abs(v) > 1e150:
        return None
    return float(v)


def plot_memory_sweep(points: list[tuple[int, float]], metric: str, out: str | Path, title: str = "") -> Path:
    """The metric (bpc or ppl) against the evaluation memory length, as ``txl eval --mem_len '[...]'`` measures
    (``out``: an :func:`image_path`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([m for m, _ in points], [v for _, v in points], "o-")
    ax.set_xlabel("evaluation memory length (mem_len)")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    return save_figure(fig, Path(out))


def plot_piano_roll(
    notes: list[tuple[float, float, int]],
    bars: list[float],
    out: str | Path,
    title: str = "",
    prompt_end: float | None = None,
) -> Path:
    """A piano roll: each note (onset, duration in quarter notes, MIDI pitch) a bar of its length at its pitch,
    the bar lines dotted, and where the prompt ends (``prompt_end``) a solid line (``out``: an :func:`image_path`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = max((o + d for o, d, _ in notes), default=4.0)
    fig, ax = plt.subplots(figsize=(min(4 + end / 6, 40), 4.5))
    if notes:
        ax.barh(
            [p for _, _, p in notes], [max(d, 0.05) for _, d, _ in notes], left=[o for o, _, _ in notes],
            height=0.8, color="tab:blue", edgecolor="black", linewidth=0.3,
        )  # fmt: skip
        lo, hi = min(p for *_, p in notes), max(p for *_, p in notes)
        ax.set_ylim(lo - 2, hi + 2)
    for x in bars:
        ax.axvline(x, color="0.6", linewidth=0.6, linestyle=":")
    if prompt_end is not None:
        ax.axvline(prompt_end, color="tab:red", linewidth=1.2, label="end of the prompt")
        ax.legend(loc="upper right", fontsize=7)
    ax.set_xlim(0, end)
    ax.set_xlabel("time (quarter notes); dotted: bar lines")
    ax.set_ylabel("MIDI pitch")
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    return save_figure(fig, Path(out))
