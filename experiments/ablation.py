"""Table 6 of the paper at CPU scale: which part of Transformer-XL matters (recurrence, encoding, loss).

    .venv/bin/python experiments/ablation.py --budget full --write docs/paper.md    # ~1 hour on 2 cores
    .venv/bin/python experiments/ablation.py --budget quick                        # ~2 minutes a row

Trains the paper's rows with `configs/shakespeare_char.yaml` (any recipe and dataset by --recipe/--data), each an
ordinary run folder under ``--runs`` (an interrupted experiment resumes where it stopped; a finished row is not
trained again), with the same tokens and schedule and the same parameter count (within 2%: the feed-forward width
``d_inner`` of each row is set so; the learned position tables of Shaw et al. and Al-Rfou et al. cost parameters):

| row | recurrence | encoding (``model.attn_type``) | loss (``train.loss_fraction``) |
|---|---|---|---|
| xl | yes | ours (0) | full |
| shaw-rec | yes | Shaw et al. (1) | full |
| xl-half | yes | ours (0) | half |
| xl-norec | no | ours (0) | full |
| shaw-norec | no | Shaw et al. (1) | full |
| vaswani-norec-half | no | Vaswani et al. (2) | half |
| alrfou-half | no | Al-Rfou et al. (3) | half |

"Recurrence: no" trains with ``model.mem_len 0``. Each model is then scored on the first ``--tokens`` characters of
the test split at a sweep of *attention lengths* A (the number of keys every scored token attends to): models with
relative positions read the text segment by segment with a memory of A and ``same_length`` (each query sees exactly
A keys; evaluation may use a memory although training had none, as in the paper); models with absolute positions
cannot (their positions move with the window) and are scored as Al-Rfou et al. score a vanilla model, one
prediction per window of A tokens (``txl eval --sliding_window A``). As in the paper's table, for every row:
"init" is the bpc at the attention length of training (tgt_len + training mem_len), "best" the lowest bpc over the
sweep and "attn len" the attention length where it is reached (the shortest, on ties). Everything goes through the
``txl`` command, as a user runs it; the numbers are written as measured.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Table 6 at CPU scale: the ablations (`experiments/ablation.py`)"
# name: (recurrence, attn_type, loss_fraction, encoding as the paper names it)
ROWS = {
    "xl": (True, 0, 1.0, "Ours"),
    "shaw-rec": (True, 1, 1.0, "Shaw et al. (2018)"),
    "xl-half": (True, 0, 0.5, "Ours"),
    "xl-norec": (False, 0, 1.0, "Ours"),
    "shaw-norec": (False, 1, 1.0, "Shaw et al. (2018)"),
    "vaswani-norec-half": (False, 2, 0.5, "Vaswani et al. (2017)"),
    "alrfou-half": (False, 3, 0.5, "Al-Rfou et al. (2018)"),
}
# The paper's Table 6 (WikiText-103, word-level perplexity: PPL init, PPL best, attention length), as we read it.
PAPER = {
    "xl": (27.02, 26.77, 500),
    "shaw-rec": (27.94, 27.94, 256),
    "xl-half": (28.69, 28.33, 460),
    "xl-norec": (29.59, 29.02, 260),
    "shaw-norec": (29.75, 29.75, 120),
    "vaswani-norec-half": (30.97, 30.97, 120),
    "alrfou-half": (31.16, 31.16, 120),
}
BUDGETS = {  # steps per row, characters scored, attention lengths of the sweep
    "quick": dict(steps=300, tokens=3000, lengths="32,64,128,256"),
    "full": dict(steps=2000, tokens=10000, lengths="32,64,128,256,512"),
}


def txl(*args: str) -> str:
    """Run `python -m txl ARGS` and return its stdout (stderr passes through)."""
    res = subprocess.run([sys.executable, "-m", "txl", *args], stdout=subprocess.PIPE, text=True, check=True)
    return res.stdout


def row_overrides(name: str, recipe: str, common: list[str]) -> tuple[list[str], int]:
    """The `txl train` options of a row, with d_inner set so that its parameter count is the xl row's (returned)."""
    from txl.config import load_recipe
    from txl.model.modeling import TransformerXLLM

    rec, attn_type, fraction, _ = ROWS[name]
    opts = {"model": {"attn_type": attn_type}, "train": {"loss_fraction": fraction}}
    if not rec:
        opts["model"]["mem_len"] = 0
    if attn_type in (2, 3):
        opts["eval"] = {"clamp_len": -1}  # (absolute positions have no distances to clamp)

    def count(overrides: dict) -> tuple[int, int]:
        cfg = load_recipe(recipe, overrides).model
        cfg.n_token = load_recipe(recipe).model.n_token
        return sum(p.numel() for p in TransformerXLLM(cfg, init=False).parameters()), cfg.d_inner

    target, _ = count({})
    n, d_inner = count(opts)
    cfg = load_recipe(recipe, opts).model
    per_unit = cfg.n_layer * (2 * cfg.d_model + 1)  # parameters of one unit of d_inner
    opts["model"]["d_inner"] = d_inner + round((target - n) / per_unit)
    n, _ = count(opts)
    if abs(n - target) > 0.02 * target:
        raise SystemExit(f"row {name}: {n:,} parameters, more than 2% from {target:,}")
    args = [f"--{section}.{k}={v}" for section, values in opts.items() for k, v in values.items()]
    return [*common, *args], n


def evaluate_row(name: str, run: Path, sample: Path, lengths: list[int], train_len: int) -> list[dict]:
    """bpc at each attention length: with a memory of A (relative positions) or windows of A (absolute)."""
    _, attn_type, _, _ = ROWS[name]
    if attn_type in (0, 1):
        out = txl("eval", "--model", str(run), "--data", str(sample), "--mem_len", ",".join(map(str, lengths)),
                  "--same_length", "true", "--tgt_len", "32", "--batch_size", "1", "--clamp_len", str(train_len),
                  "--plot", str(run / "attn_len_sweep.png"), "--json")  # fmt: skip
        return [{"attn_len": r["mem_len"], "bpc": r["bpc"]} for r in map(json.loads, out.strip().splitlines())]
    rows = []
    for a in lengths:
        r = json.loads(
            txl(
                "eval",
                "--model",
                str(run),
                "--data",
                str(sample),
                "--sliding_window",
                str(a),
                "--batch_size",
                "32",
                "--json",
            )  # fmt: skip
        )
        rows.append({"attn_len": a, "bpc": r["bpc"]})
    return rows


def summarize(points: list[dict], train_len: int) -> dict:
    by_len = {p["attn_len"]: p["bpc"] for p in points}
    best = min(round(p["bpc"], 4) for p in points)
    return {
        "init": by_len[train_len],
        "best": min(by_len.values()),
        "attn_len": min(a for a, b in by_len.items() if round(b, 4) == best),
    }


def reading(results: dict) -> str:
    """What the numbers say about the paper's claims, computed from them (never edited by hand)."""

    def best(name: str) -> float:
        return results[name]["summary"]["best"]

    def says(claim: str, holds: bool) -> str:
        return f"{claim}: {'yes' if holds else 'NO'}"

    xl = results["xl"]["summary"]
    checks = [
        says("XL best of all rows", all(best("xl") <= best(n) for n in results)),
        says("XL better than without recurrence", best("xl") < best("xl-norec")),
        says("XL better than the vanilla model (Al-Rfou)", best("xl") < best("alrfou-half")),
        says("full loss better than half loss (XL)", best("xl") < best("xl-half")),
        says("our encoding better than Shaw et al. with recurrence", best("xl") < best("shaw-rec")),
        says("a longer evaluation memory helps XL (best < init)", xl["best"] < xl["init"]),
    ]
    return "Reading (computed from the table): " + "; ".join(checks) + "."


def recl_reading(record: dict, runs: Path) -> str:
    """Whether XL's RECL is longer than the others', at each r (computed, never edited)."""
    xl = str(runs / "xl")
    parts = []
    for res in record["results"]:
        others = {Path(m).name: v for m, v in res["recl"].items() if m != xl}
        longer = all(res["recl"][xl] > v for v in others.values())
        parts.append(f"r = {res['r']}: {'yes' if longer else 'NO'}")
    return "RECL of xl longer than both others: " + "; ".join(parts) + "."


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results.items():
        pts = r["points"]
        ax.plot([p["attn_len"] for p in pts], [p["bpc"] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("attention length at evaluation (keys per scored token)")
    ax.set_ylabel("test bpc")
    ax.set_title("Table 6 at CPU scale (Shakespeare char)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", choices=sorted(BUDGETS), default="quick", help="quick (tests, a look) or full (docs)")
    ap.add_argument("--steps", type=int, help="training steps per row (default: the budget's)")
    ap.add_argument("--tokens", type=int, help="test characters scored (default: the budget's)")
    ap.add_argument("--lengths", help="attention lengths of the sweep (default: the budget's)")
    ap.add_argument("--rows", default=",".join(ROWS), help="which rows (comma-separated names)")
    ap.add_argument("--recipe", default=str(ROOT / "configs" / "shakespeare_char.yaml"))
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "shakespeare"))
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "ablation")
    ap.add_argument("--cache_dir", help="where the tokenized corpus is cached (default: txl's)")
    ap.add_argument("--write", type=Path, help="write the results section into this markdown file")
    args = ap.parse_args()
    budget = BUDGETS[args.budget]
    steps = args.steps or budget["steps"]
    tokens = args.tokens or budget["tokens"]
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    sys.path.insert(0, str(ROOT / "src"))
    from txl.config import load_recipe

    recipe_cfg = load_recipe(args.recipe)
    tgt_len, train_mem = recipe_cfg.train.tgt_len, recipe_cfg.model.mem_len
    common = ["--data.path", args.data, "--train.max_steps", str(steps), "--train.max_time", "null"]
    common += ["--train.eval_interval", "0", "--train.checkpoint_interval", str(max(1, steps // 4))]
    common += ["--data.cache_dir", args.cache_dir] if args.cache_dir else []
    test = Path(args.data) / "test.txt"
    sample = args.runs / "test_sample.txt"
    args.runs.mkdir(parents=True, exist_ok=True)
    sample.write_text(test.read_text(encoding="utf-8")[:tokens], encoding="utf-8")
    results = {}
    sweep = {int(x) for x in (args.lengths or budget["lengths"]).split(",")}
    lengths = sorted(sweep | {tgt_len, tgt_len + train_mem})  # every row at both training attention lengths
    for name in rows:
        run = args.runs / name
        opts, n_params = row_overrides(name, args.recipe, common)
        txl("train", "--config", args.recipe, "--run_dir", str(run), *opts)  # resumes; a finished run is kept
        train_len = tgt_len + (train_mem if ROWS[name][0] else 0)
        key = {"steps": steps, "tokens": tokens, "lengths": lengths}
        cached = run / "ablation_eval.json"  # the row's scores, reused when the settings are the same
        saved = json.loads(cached.read_text()) if cached.exists() else {}
        if saved.get("key") != key:
            saved = {"key": key, "points": evaluate_row(name, run, sample, lengths, train_len)}
            cached.write_text(json.dumps(saved))
        results[name] = {"params": n_params, "train_len": train_len, "points": saved["points"]}
        results[name]["summary"] = summarize(saved["points"], train_len)
        s = results[name]["summary"]
        print(f"{name}: {n_params:,} parameters, init {s['init']:.4f}, best {s['best']:.4f} at {s['attn_len']}")
    (args.runs / "ablation.json").write_text(json.dumps(results, indent=1))
    plot(results, args.runs / "ablation.png")
    lines = [
        HEADING,
        "",
        f"Command: `python experiments/ablation.py --budget {args.budget}"
        + (f" --steps {steps}" if args.steps else "")
        + (" --write docs/paper.md`." if args.write else "`."),
        f"Seven models of `configs/shakespeare_char.yaml`, {steps} steps each of 16 × {tgt_len} characters (same "
        f'tokens, schedule and seed); "rec" rows train with a memory of {train_mem}, the others with none; '
        "`d_inner` is adjusted per row to keep the parameter count of the xl row. Scored: the first "
        f"{tokens:,} characters of the test split; attention length A = keys per scored token (memory rows: "
        "`txl eval --mem_len A --same_length true --tgt_len 32 --clamp_len <training span>`; absolute-position rows: "
        "`txl eval --sliding_window A`, one prediction per window). The paper's columns are word-level perplexity on "
        "WikiText-103 (its Table 6, as we read it); ours are bpc.",
        "",
        "| row | recurrence | encoding | loss | params | bpc init (A) | bpc best | attn len | paper PPL init | "
        "paper PPL best | paper attn len |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        rec, _, fraction, encoding = ROWS[name]
        s, p = r["summary"], PAPER[name]
        lines.append(
            f"| {name} | {'yes' if rec else 'no'} | {encoding} | {'full' if fraction == 1 else 'half'} | "
            f"{r['params']:,} | {s['init']:.4f} ({r['train_len']}) | {s['best']:.4f} | {s['attn_len']} | {p[0]} | "
            f"{p[1]} | {p[2]} |"
        )
    lengths = sorted({p["attn_len"] for r in results.values() for p in r["points"]})
    lines += ["", "bpc at every attention length:", ""]
    lines += ["| row | " + " | ".join(f"A={a}" for a in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for name, r in results.items():
        by_len = {p["attn_len"]: p["bpc"] for p in r["points"]}
        lines.append(f"| {name} | " + " | ".join(f"{by_len[a]:.4f}" if a in by_len else "-" for a in lengths) + " |")
    lines += [""]
    if set(rows) == set(ROWS):
        lines += [reading(results), ""]
    group = [n for n in ("xl", "xl-norec", "alrfou-half") if n in results]
    if len(group) == 3:  # RECL (Table 8): XL against the same model without recurrence and the vanilla model
        contexts = ",".join(str(16 * i) for i in range(1, 9))
        recl_tokens = min(tokens, 3000)
        out = txl("recl", "--models", "[" + ", ".join(str(args.runs / n) for n in group) + "]", "--sliding",
                  f"[{args.runs / 'alrfou-half'}]", "--contexts", contexts, "--data", str(sample), "--tokens",
                  str(recl_tokens), "--out", str(args.runs))  # fmt: skip
        record = json.loads((args.runs / "recl.json").read_text())
        lines += [
            f"**RECL** of xl, xl-norec and the vanilla model (alrfou-half, scored by sliding windows) on the first "
            f"{recl_tokens:,} characters (`txl recl --contexts {contexts}`; the paper's Table 8 compares the same "
            "kinds of models):",
            "",
            *[ln.replace(f"{args.runs}/", "") for ln in out.strip().splitlines() if ln.startswith("|")],
            "",
            "(`N+`: the gain never fell below 0.01 up to the longest length.) " + recl_reading(record, args.runs),
            "",
        ]
    if args.write:
        img = args.write.parent / "img"
        img.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(args.runs / "ablation.png", img / "ablation.png")
        lines += ["![bpc against the attention length, every row](img/ablation.png)", ""]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _report import publish

    publish("\n".join(lines), args.write, HEADING)


if __name__ == "__main__":
    main()
