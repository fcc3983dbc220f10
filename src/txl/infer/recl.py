"""Relative Effective Context Length (RECL, the paper's Sec. 4.3 and Appendix C).
Design notes: docs/internals.md#txlinferrecl."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from txl.util.distributed import World
from txl.util.plot import save_figure


@dataclass
class ReclResult:
    r: float
    contexts: list[int]
    recl: dict[str, int]
    """Per model: its RECL (the last context length when the gain never falls below the threshold)."""
    reached: dict[str, bool]
    """Per model: whether the gain fell below the threshold within the lengths measured."""
    gains: dict[str, list[float]]
    """Per model: g(c_i, c_{i+1}) for every i."""


def check_contexts(contexts: Sequence[int]) -> list[int]:
    """The context lengths as ints: at least two, increasing, evenly spaced (else a ValueError saying so)."""
    contexts = [int(c) for c in contexts]
    if any(c < 1 for c in contexts):  # (probes.md r3, r4: a memory of 0 or less was a message about same_length)
        raise ValueError(f"contexts {contexts}: each length must be >= 1 (a context of {min(contexts)} tokens)")
    if len(contexts) < 2 or any(b <= a for a, b in zip(contexts, contexts[1:], strict=False)):
        raise ValueError(f"contexts {contexts}: need at least two increasing lengths")
    if len({b - a for a, b in zip(contexts, contexts[1:], strict=False)}) != 1:
        raise ValueError(f"contexts {contexts}: RECL steps by one Δ, so the lengths must be evenly spaced")
    return contexts


def check_ratio(r: float) -> None:
    if not 0 < r <= 1:
        raise ValueError(f"r = {r}: must be in (0, 1]")


def relative_gains(losses: Mapping[str, np.ndarray], r: float) -> dict[str, list[float]]:
    """g_m(c_i, c_{i+1}) for every model of the group; ``losses[m]`` is [n_contexts, n_tokens]."""
    check_ratio(r)
    arrays = {m: np.asarray(v, dtype=np.float64) for m, v in losses.items()}
    shapes = {a.shape for a in arrays.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"every model needs losses of one shape [n_contexts, n_tokens], got {sorted(shapes)}")
    n_contexts, n_tokens = next(iter(shapes))
    base = np.min(np.stack(list(arrays.values())), axis=0)  # b(c, t), [C, N]
    k = max(1, int(round(r * n_tokens)))
    gains: dict[str, list[float]] = {m: [] for m in arrays}
    for i in range(n_contexts - 1):
        top = np.argsort(-base[i], kind="stable")[:k]  # T_r(c_i): the largest baseline losses
        ref = np.exp(base[i, top].mean())  # exp f(c_i, c_i)
        for m, a in arrays.items():
            f = np.minimum(base[i, top], a[i + 1, top]).mean()  # f_m(c_i, c_{i+1})
            gains[m].append(float((ref - np.exp(f)) / ref))
    return gains


def recl(losses: Mapping[str, np.ndarray], contexts: Sequence[int], r: float, threshold: float = 0.01) -> ReclResult:
    """RECL of every model of the group at ratio ``r`` (see the module docstring)."""
    contexts = check_contexts(contexts)
    gains = relative_gains(losses, r)
    n = len(contexts)
    if any(len(g) != n - 1 for g in gains.values()):
        raise ValueError(f"the losses have {len(next(iter(gains.values()))) + 1} context lengths, not {n}")
    result, reached = {}, {}
    for m, g in gains.items():
        below = [i for i, v in enumerate(g) if v < threshold]
        reached[m] = bool(below)
        result[m] = contexts[below[0]] if below else contexts[-1]
    return ReclResult(r=r, contexts=contexts, recl=result, reached=reached, gains=gains)


def context_losses(
    model, ids: np.ndarray, contexts: Sequence[int], *, sliding: bool, tgt_len: int, clamp_len: int | None = None,
    same_length: bool | None = None, batch_size: int = 16, max_window: int | None = None, world: World | None = None,
) -> np.ndarray:  # fmt: skip
    """[n_contexts, len(ids) - 1] per-token losses of one model: with a memory of c (Transformer-XL: segments of
    ``tgt_len``, one column so that every token has the whole text before it) or, with ``sliding``, a window of c
    tokens recomputed for every prediction (a vanilla model). ``max_window`` (sliding): the longest window the model
    reads; a longer context is scored with this window (a model with a learned position table sees no further than
    its table, as the paper scores its vanilla Transformer at its training length). ``world``: where the model is
    (default: one process on the CPU)."""
    from txl.infer.evaluate import evaluate, evaluate_sliding

    if max_window is not None and max_window < 1:
        raise ValueError(f"max_window = {max_window}: must be >= 1 (or None: no cap)")
    rows: list[np.ndarray] = []
    windows: dict[int, np.ndarray] = {}  # window -> losses (every context beyond the cap reads the same window)
    for c in contexts:
        if sliding:
            window = c if max_window is None else min(c, max_window)
            if window not in windows:
                windows[window] = evaluate_sliding(
                    model, ids, window=window, stride=1, batch_size=batch_size, clamp_len=clamp_len,
                    return_losses=True, world=world,
                ).losses  # fmt: skip
            rows.append(windows[window])
        else:
            res = evaluate(
                model, ids, batch_size=1, tgt_len=tgt_len, mem_len=c, clamp_len=clamp_len, same_length=same_length,
                return_losses=True, world=world,
            )  # fmt: skip
            rows.append(res.losses)
    return np.stack(rows)


def plot_gains(results: Sequence[ReclResult], out, threshold: float = 0.01) -> None:
    """One panel per r: the relative gain g(c, c + Δ) of every model against c, with the threshold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.8), squeeze=False)
    for ax, res in zip(axes[0], results, strict=True):
        for m, g in res.gains.items():
            ax.plot(res.contexts[:-1], g, "o-", markersize=3, label=f"{m} (RECL {res.recl[m]})")
        ax.axhline(threshold, color="grey", linestyle="--", linewidth=1)
        ax.set_title(f"r = {res.r}")
        ax.set_xlabel("context length c")
        ax.set_ylabel("relative gain g(c, c + Δ)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, Path(out))
