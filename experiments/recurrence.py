"""Does the memory help? Transformer-XL with and without recurrence on Shakespeare char, evaluated the paper's ways.

    .venv/bin/python experiments/recurrence.py --steps 1500 --write docs/paper.md    # ~8 minutes on 2 cores

Trains two models with `configs/shakespeare_char.yaml` (same size, tokens and schedule), each an ordinary run
folder under ``--runs`` (an interrupted experiment resumes where it stopped):

* **xl**: the recipe (training memory 64, segments of 64);
* **no-recurrence**: the same with ``model.mem_len 0`` in training (the paper's "without recurrence" ablation).

Then, on the first ``--tokens`` characters of the test split:

1. a memory sweep of each model (``txl eval --mem_len ...``): bpc against the evaluation memory length; the
   paper's claim is that XL keeps improving with a longer memory than in training;
2. the no-recurrence model read as a vanilla model (``txl eval --sliding_window 64``: one prediction per window);
3. RECL of the two (``txl recl``, r = 0.1, 0.5, 1.0).

Everything goes through the `txl` command, as a user runs it; the numbers are written as measured.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Recurrence: memory sweeps, the vanilla evaluation and RECL (`experiments/recurrence.py`)"


def txl(*args: str) -> str:
    """Run `python -m txl ARGS` and return its stdout (stderr passes through)."""
    res = subprocess.run([sys.executable, "-m", "txl", *args], stdout=subprocess.PIPE, text=True, check=True)
    return res.stdout


def summary(sweeps: dict, recl: dict, runs: Path) -> str:
    """What the numbers say about the paper's claims, computed from them (never edited by hand)."""
    best = {m: min(r["bpc"] for r in rows) for m, rows in sweeps.items()}
    train_mem = {r["mem_len"]: r["bpc"] for r in sweeps["xl"]}.get(64, float("nan"))
    xl, nr = str(runs / "xl"), str(runs / "no-recurrence")
    longer = ", ".join(str(x["r"]) for x in recl["results"] if x["recl"][xl] > x["recl"][nr]) or "none"
    ratios = ", ".join(str(x["r"]) for x in recl["results"])
    helps = "helps" if best["xl"] < train_mem else "does not help"
    better = "xl better" if best["xl"] < best["no-recurrence"] else "xl NOT better"
    return (
        f"Reading: the best bpc over the sweep is {best['xl']:.4f} for xl and {best['no-recurrence']:.4f} without "
        f"recurrence ({better}: the paper's Table 6 ordering); xl at its training memory (64) {train_mem:.4f}, at "
        f"its best {best['xl']:.4f} (a longer evaluation memory {helps}); xl's RECL is longer than the "
        f"no-recurrence model's at r = {longer} of {ratios} (the paper's Table 8 ordering)."
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1500, help="training steps per model")
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "shakespeare"))
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "recurrence")
    ap.add_argument("--tokens", type=int, default=20000, help="test characters scored")
    ap.add_argument("--mem", default="0,32,64,128,256,512", help="evaluation memory lengths of the sweep")
    ap.add_argument("--contexts", default="16,32,48,64,80,96,112,128", help="RECL context lengths")
    ap.add_argument("--cache_dir", help="where the tokenized corpus is cached (default: txl's)")
    ap.add_argument("--write", type=Path, help="write the results section into this markdown file")
    args = ap.parse_args()
    recipe = str(ROOT / "configs" / "shakespeare_char.yaml")
    common = ["--data.path", args.data, "--train.max_steps", str(args.steps), "--train.max_time", "null"]
    common += ["--train.eval_interval", "0", "--train.checkpoint_interval", "500"]
    common += ["--data.cache_dir", args.cache_dir] if args.cache_dir else []
    models = {"xl": [], "no-recurrence": ["--model.mem_len", "0"]}
    for name, extra in models.items():  # a finished run is not trained again (resume: auto)
        txl("train", "--config", recipe, "--run_dir", str(args.runs / name), *common, *extra)
    # the evaluation text: the first --tokens characters of the test split, as a file (scored whole)
    test = Path(args.data) / "test.txt"
    text = test.read_text(encoding="utf-8")[: args.tokens]
    sample = args.runs / "test_sample.txt"
    sample.write_text(text, encoding="utf-8")
    sweeps = {}
    for name in models:
        out = txl("eval", "--model", str(args.runs / name), "--data", str(sample), "--mem_len", args.mem,
                  "--same_length", "false", "--batch_size", "1", "--plot", str(args.runs / f"{name}_sweep.png"),
                  "--json")  # fmt: skip
        sweeps[name] = [json.loads(line) for line in out.strip().splitlines()]
    vanilla = json.loads(
        txl(
            "eval",
            "--model",
            str(args.runs / "no-recurrence"),
            "--data",
            str(sample),
            "--sliding_window",
            "64",
            "--batch_size",
            "32",
            "--json",
        )  # fmt: skip
    )
    recl_out = txl(
        "recl", "--models", f"[{args.runs / 'xl'}, {args.runs / 'no-recurrence'}]", "--contexts", args.contexts,
        "--data", str(sample), "--tokens", str(min(args.tokens, 5000)), "--out", str(args.runs),
    )  # fmt: skip
    lengths = [x["mem_len"] for x in sweeps["xl"]]
    lines = [
        HEADING,
        "",
        f"Command: `python experiments/recurrence.py --steps {args.steps} --tokens {args.tokens} --write "
        f"docs/paper.md`. Two models of `configs/shakespeare_char.yaml` (867,668 parameters), {args.steps} steps "
        "each of 16 × 64 characters (about 2 minutes each on 2 cores); `no-recurrence` trains with `model.mem_len 0`. "
        f"Scored: the first {len(text):,} characters of the test split, one column (batch 1), tgt_len 64, "
        "same_length false, clamp_len 128 (the recipe's).",
        "",
        "**Memory sweep** (bpc; `txl eval --mem_len " + args.mem + "`):",
        "",
        "| model | " + " | ".join(f"mem {m}" for m in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]
    for name, rows in sweeps.items():
        lines.append(f"| {name} | " + " | ".join(f"{r['bpc']:.4f}" for r in rows) + " |")
    lines += [
        "",
        f"**The vanilla evaluation** of the no-recurrence model (`txl eval --sliding_window 64`, one prediction per "
        f"window, no memory): {vanilla['bpc']:.4f} bpc over {vanilla['tokens']:,} characters.",
        "",
        f"**RECL** (`txl recl --contexts {args.contexts}`, first {min(args.tokens, 5000):,} characters; XL and "
        "no-recurrence both read with a memory of c):",
        "",
        *[ln.replace(f"{args.runs}/", "") for ln in recl_out.strip().splitlines() if ln.startswith("|")],
        "",
        "(`N+`: the gain never fell below 0.01 up to the longest length.)",
        "",
        summary(sweeps, json.loads((args.runs / "recl.json").read_text()), args.runs),
        "",
    ]
    if args.write:  # the plots beside the markdown file
        img = args.write.parent / "img"
        img.mkdir(parents=True, exist_ok=True)
        for png in ("xl_sweep.png", "no-recurrence_sweep.png", "recl.png"):
            shutil.copyfile(args.runs / png, img / f"recurrence_{png}")
        lines += [
            "![bpc against the evaluation memory, xl](img/recurrence_xl_sweep.png)",
            "![bpc against the evaluation memory, no-recurrence](img/recurrence_no-recurrence_sweep.png)",
            "![RECL gain curves](img/recurrence_recl.png)",
            "",
        ]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _report import publish

    publish("\n".join(lines), args.write, HEADING)


if __name__ == "__main__":
    main()
