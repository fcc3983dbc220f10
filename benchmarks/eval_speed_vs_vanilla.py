"""The paper's Table 9: evaluation time per token of Transformer-XL (state reuse) against a vanilla Transformer's
sliding window (every prediction recomputes its whole window), at the same attention length.

    .venv/bin/python benchmarks/eval_speed_vs_vanilla.py --quick --write docs/benchmarks.md     # ~3 minutes
    .venv/bin/python benchmarks/eval_speed_vs_vanilla.py --write docs/benchmarks.md             # the paper's lengths,
                                                                                                 # ~10 minutes

One model (the bench-char shape of ``BENCH.md``: 6 layers, d_model 256; random weights: only time matters), batch
1 for Transformer-XL, fp32, 2 threads. For an attention length L:

* **Transformer-XL**: segments of ``--tgt_len`` (128) with a full memory of L - tgt_len kept as keys and values
  (what ``txl.infer.evaluate`` does), so the last query of a segment attends to L keys; time per scored token;
* **vanilla**: windows of L tokens, each scoring its last position, recomputed for every prediction (stride 1,
  what ``txl.evaluate_sliding`` does after its first window, as Al-Rfou et al. evaluate), ``--windows`` windows
  per batch; time per scored token.

The paper measured 363x (L = 800) to 1,874x (L = 3,800) on a GPU; the ratio grows with L because the vanilla
model's cost per token grows with L while Transformer-XL's stays nearly flat. Medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from _report import median_time, replace_section
from model_speed import cpu_description
from txl.kernels.runtime import configure_allocator
from txl.model.modeling import KVCache, TransformerXLConfig, TransformerXLLM

HEADING = "## Evaluation speed against a vanilla Transformer (Table 9)"  # --quick
HEADING_FULL = "## Table 9 at the paper's attention lengths"
PAPER = {800: 363, 1800: 1067, 2800: 1485, 3800: 1874}  # the paper's Table 9 (GPU)


@torch.no_grad()
def xl_per_token(model: TransformerXLLM, L: int, T: int, segments: int, repeats: int) -> float:
    """Seconds per token of Transformer-XL evaluation with a full memory of L - T (K/V cache), segments of T."""
    mem = L - T
    ids = torch.randint(0, model.config.n_token, (1, mem + T * (segments + 1) + 1))
    cache = KVCache(model.config, 1, mem, T)
    for i in range(0, mem, T):  # fill the memory (not timed)
        model(ids[:, i : i + T], ids[:, i + 1 : i + T + 1], cache=cache, mem_len=mem)
    start = -(-mem // T) * T  # where the filling stopped

    def run() -> None:
        for s in range(segments):
            i = start + s * T
            model(ids[:, i : i + T], ids[:, i + 1 : i + T + 1], cache=cache, mem_len=mem).loss.item()

    return median_time(run, repeats) / (segments * T)


@torch.no_grad()
def vanilla_per_token(model: TransformerXLLM, L: int, windows: int, repeats: int) -> float:
    """Seconds per token of the sliding-window evaluation: a batch of windows of L tokens, each scoring only its
    last position (what ``txl.evaluate_sliding`` does for every window after the first), no memory."""
    ids = torch.randint(0, model.config.n_token, (windows, L + 1))

    def run() -> None:
        model(ids[:, :L], ids[:, L:], mem_len=0).loss.item()

    return median_time(run, repeats) / windows


def plot(rows: list[tuple[int, float, float]], path: Path, machine: str) -> None:
    """Time per token of both against L (left) and their ratio beside the paper's (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Ls = [L for L, _, _ in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(Ls, [xl * 1e3 for _, xl, _ in rows], "o-", label="Transformer-XL (state reuse)")
    a.plot(Ls, [van * 1e3 for _, _, van in rows], "s-", label="vanilla (sliding window)")
    a.set_yscale("log")
    a.set_xlabel("attention length L")
    a.set_ylabel("ms per token")
    a.legend()
    a.grid(alpha=0.3)
    b.plot(Ls, [van / xl for _, xl, van in rows], "o-", label=f"measured ({machine.split(';')[0]})")
    paper = [(L, PAPER[L]) for L in Ls if L in PAPER]
    if paper:
        b.plot([L for L, _ in paper], [r for _, r in paper], "s--", label="the paper (GPU)")
    b.set_xlabel("attention length L")
    b.set_ylabel("speed-up (vanilla / XL)")
    b.legend()
    b.grid(alpha=0.3)
    fig.suptitle("Table 9: evaluation time per token", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="800,1800,2800,3800", help="attention lengths (the paper's)")
    ap.add_argument("--quick", action="store_true", help="lengths 256,512,1024 instead")
    ap.add_argument("--tgt_len", type=int, default=128)
    ap.add_argument("--xl_segments", type=int, default=8, help="segments timed per Transformer-XL run")
    ap.add_argument("--windows", type=int, default=8, help="windows per vanilla batch (and per run)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--write", type=Path)
    ap.add_argument("--plot", type=Path, help="the PNG (default with --write: img/table9.png beside it)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    configure_allocator()
    lengths = [256, 512, 1024] if args.quick else [int(x) for x in args.lengths.split(",")]
    torch.manual_seed(0)
    cfg = TransformerXLConfig(n_token=256, n_layer=6, d_model=256, n_head=8, d_head=32, d_inner=1024, mem_len=128)
    model = TransformerXLLM(cfg).eval()
    rows = []
    print(f"machine: {cpu_description()}", flush=True)
    for L in lengths:
        T = min(args.tgt_len, L)
        xl = xl_per_token(model, L, T, args.xl_segments, args.repeats)
        vanilla = vanilla_per_token(model, L, args.windows, args.repeats)
        rows.append((L, xl, vanilla))
        paper = f"{PAPER[L]:,}×" if L in PAPER else ""
        print(f"L {L}: XL {xl * 1e3:.3f} ms/token, vanilla {vanilla * 1e3:.2f} ms/token, {vanilla / xl:.0f}× {paper}")
    machine = cpu_description()
    name = "table9_quick.png" if args.quick else "table9.png"
    plot_path = args.plot or (args.write.parent / "img" / name if args.write else None)
    if plot_path:
        plot_path.parent.mkdir(parents=True, exist_ok=True)
        plot(rows, plot_path, machine)
        print(f"plot: {plot_path}")
    if args.write:
        cmd = (
            "python benchmarks/eval_speed_vs_vanilla.py "
            + ("--quick " if args.quick else "")
            + (f"--windows {args.windows} " if args.windows != 8 else "")
            + "--write docs/benchmarks.md"
        )
        text = [
            f"{HEADING if args.quick else HEADING_FULL} (`benchmarks/eval_speed_vs_vanilla.py`)",
            "",
            f"Command: `{cmd}`. Machine: {cpu_description()}; 2 threads, torch {torch.__version__}. The bench-char "
            f"model (6 layers, d_model 256), fp32, batch 1 for Transformer-XL (segments of {args.tgt_len}, memory "
            f"L - {args.tgt_len}, K/V cache, {args.xl_segments} segments timed once the memory is full); the "
            f"vanilla evaluation in batches of {args.windows} windows of L tokens, each scoring its last position "
            f"(stride 1, no memory). Medians over {args.repeats} runs.",
            "",
            "| attention length L | Transformer-XL ms/token | vanilla ms/token | vanilla / XL | the paper (GPU) |",
            "|---|---|---|---|---|",
        ]
        for L, xl, van in rows:
            paper = f"{PAPER[L]:,}×" if L in PAPER else ""
            text.append(f"| {L:,} | {xl * 1e3:.3f} | {van * 1e3:.2f} | **{van / xl:,.0f}×** | {paper} |")
        if plot_path:
            text += ["", f"![time per token and speed-up against L]({plot_path.relative_to(args.write.parent)})"]
        replace_section(args.write, HEADING if args.quick else HEADING_FULL, "\n".join(text))


if __name__ == "__main__":
    main()
