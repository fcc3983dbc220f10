"""Attention maps of a trained model (the paper's Appendix D, Figures 5-7): where each head looks, by relative distance.
Design notes: docs/internals.md#txlinferattention_maps."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from txl.model.modeling import TransformerXLLM
from txl.util.plot import save_figure


@dataclass
class AttentionMaps:
    by_distance: np.ndarray
    """[n_layer, n_head, D]: mean attention probability at relative distance d (over the queries that can see it)."""
    counts: np.ndarray
    """[D]: how many queries contributed at each distance."""
    last: np.ndarray
    """[n_layer, n_head, T, K]: the probabilities of the last segment (T queries, K = M + T keys, memory first)."""
    mem_len: int
    """Memory length of the last segment (M)."""


@torch.no_grad()
def attention_maps(
    model: TransformerXLLM,
    ids: np.ndarray,
    *,
    tgt_len: int,
    mem_len: int,
    same_length: bool = False,
    clamp_len: int | None = None,
) -> AttentionMaps:
    """Attention probabilities of ``model`` over the token stream ``ids`` (read ``tgt_len`` at a time, memory
    ``mem_len``), averaged over queries per relative distance, and the last segment's full maps."""
    if len(ids) < 1:
        raise ValueError("the text has no tokens")
    was_training = model.training
    model.eval()
    try:
        cfg = model.config
        span = min(mem_len, len(ids)) + tgt_len  # (no distance reaches past the text: a longer memory holds no more)
        total = np.zeros((cfg.n_layer, cfg.n_head, span), dtype=np.float64)
        counts = np.zeros(span, dtype=np.int64)
        t = torch.as_tensor(np.asarray(ids, dtype=np.int64))[None]  # [1, N]
        mems, last, last_m = None, None, 0
        for start in range(0, t.shape[1], tgt_len):
            seg = t[:, start : start + tgt_len]  # [1, T]
            out = model.transformer(
                seg, mems, mem_len=mem_len, same_length=same_length, clamp_len=clamp_len, output_attentions=True
            )
            M = mems[0].shape[1] if mems else 0
            T = seg.shape[1]
            probs = torch.stack(out.attentions)[:, 0].numpy()  # [L, H, T, K]
            dist = M + np.arange(T)[:, None] - np.arange(M + T)[None, :]  # [T, K]: i - j
            seen = (dist >= 0) & (dist < mem_len if same_length else True)  # the keys a query may attend to
            d = dist[seen]  # the distance of each key a query may attend to, row by row
            counts += np.bincount(d, minlength=span)[:span]
            for layer, head in np.ndindex(*probs.shape[:2]):  # (sums by distance in one pass: O(T K), in float64)
                total[layer, head] += np.bincount(d, weights=probs[layer, head][seen], minlength=span)[:span]
            mems, last, last_m = out.mems, probs, M
    finally:
        model.train(was_training)
    by_distance = total / np.maximum(counts, 1)
    return AttentionMaps(
        by_distance=by_distance.astype(np.float32), counts=counts, last=last.astype(np.float64), mem_len=last_m
    )


def plot_attention(maps: AttentionMaps, out: str | Path, layer: int = -1, head: int = 0, title: str = "") -> list[Path]:
    """Write ``distance.png`` (one row per layer and head, like the paper's Figure 5: mean attention against the
    relative distance, farthest on the left), ``layer{l}.png`` per layer (one curve per head) and ``full.png``
    (the last segment's [query x key] map of ``layer``/``head``) into the folder ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    L, H, D = maps.by_distance.shape
    D = int(np.nonzero(maps.counts)[0].max()) + 1  # distances seen
    rows = maps.by_distance[..., :D].reshape(L * H, D)[:, ::-1]  # farthest left, as the paper's figures
    written = []
    fig, ax = plt.subplots(figsize=(10, max(2.5, 0.18 * L * H + 1)))
    from matplotlib.colors import LogNorm

    floor = max(float(rows[rows > 0].min()) if (rows > 0).any() else 1e-6, 1e-6)
    norm = LogNorm(vmin=floor, vmax=max(float(rows.max()), floor * 10))  # the far tail is orders of magnitude lower
    im = ax.imshow(
        np.maximum(rows, floor), aspect="auto", cmap="viridis", norm=norm, extent=(-(D - 0.5), 0.5, L * H - 0.5, -0.5)
    )
    ax.set_xlabel("relative position (key - query)")
    ax.set_ylabel("layer.head")
    ax.set_yticks(range(L * H), [f"{i // H}.{i % H}" for i in range(L * H)], fontsize=6)
    ax.set_title(title or "mean attention by relative distance (log scale)", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.03)
    fig.tight_layout()
    written.append(out / "distance.png")
    save_figure(fig, written[-1])
    x = -np.arange(D)
    for layer_i in range(L):
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for h in range(H):
            ax.plot(x, maps.by_distance[layer_i, h, :D], label=f"head {h}", linewidth=1)
        ax.set_yscale("log")
        ax.set_xlabel("relative position (key - query)")
        ax.set_ylabel("mean attention")
        ax.set_title(f"layer {layer_i}", fontsize=9)
        ax.legend(fontsize=6, ncol=2)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        written.append(out / f"layer{layer_i}.png")
        save_figure(fig, written[-1])
    full = maps.last[layer, head]  # [T, K]
    fig, ax = plt.subplots(figsize=(8, 4))
    im = ax.imshow(full, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.axvline(maps.mem_len - 0.5, color="w", linewidth=0.8)  # memory | segment
    ax.set_xlabel(f"key (memory: 0..{maps.mem_len - 1}, then the segment)")
    ax.set_ylabel("query")
    ax.set_title(f"last segment, layer {layer % L}, head {head % H}", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.03)
    fig.tight_layout()
    written.append(out / "full.png")
    save_figure(fig, written[-1])
    return written
