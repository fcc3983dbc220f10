"""``txl plot RUN``: training and validation curves from ``RUN/metrics.jsonl`` as a PNG."""

from __future__ import annotations

from pathlib import Path

from txl.util.metrics import METRICS, read_metrics


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the loss curves (bpc or ppl on a second panel; a fine-tuned classifier's accuracy or MSE) of a run to
    ``out`` (default ``RUN/loss.png``)."""
    import matplotlib.pyplot as plt

    fig = run_figure(run_dir)
    out = Path(out) if out else Path(run_dir) / "loss.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


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
    fig, axes = plt.subplots(1, 2 if metric else 1, figsize=(11 if metric else 6, 4), squeeze=False)
    for ax, key in zip(axes[0], ["loss", metric], strict=False):
        for series, label, style in ((train, "train", "-"), (valid, "valid", "o-")):
            if series:
                ax.plot([r["step"] for r in series], [r[key] for r in series], style, label=label, markersize=3)
        ax.set_xlabel("step")
        ax.set_ylabel(key if key != "loss" else f"loss (nats/{per})")
        if key == "ppl":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    return fig


def plot_memory_sweep(points: list[tuple[int, float]], metric: str, out: str | Path, title: str = "") -> Path:
    """The metric (bpc or ppl) against the evaluation memory length, as ``txl eval --mem_len '[...]'`` measures."""
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
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
