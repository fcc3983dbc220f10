"""Why the memory matters: classifying documents by a phrase near their start (`txl finetune`).

    .venv/bin/python experiments/long_doc_classification.py --write docs/paper.md     # ~10 minutes on 2 cores
    .venv/bin/python experiments/long_doc_classification.py --budget quick             # ~3 minutes, a look

A synthetic task that a fixed-context model cannot solve: every document is 2,000+ characters of Shakespeare (a
random stretch of the corpus, starting at a line) with one of two marker phrases put among its first 100 characters;
the label is which phrase. Train documents come from the train split, valid documents from the valid split, half
of each class, so chance is 50%.

A small character-level language model is trained first (`txl train` on ``configs/shakespeare_char.yaml``, a few
hundred steps), then its classification head is fine-tuned twice with the same data, steps and learning rates
(`txl finetune`): once reading each document segment by segment with the memory carried (``--mem_len`` as long
as the document, so the last segment's queries attend to the marker directly), once with ``--memory false`` (only
the last segment, the fixed-context baseline). Both runs are ordinary run folders under ``--runs`` (a finished run
is kept, an interrupted one resumes); valid accuracy is read from their metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Long documents: why the memory matters (`experiments/long_doc_classification.py`)"
MARKERS = {"aye": "XXXXX " * 10, "nay": "ZZZZZ " * 10}  # a marker line of 60 characters: rare letters, none shared
BUDGETS = {  # LM steps, fine-tuning steps, train documents, valid documents
    "quick": dict(lm_steps=200, steps=60, n_train=240, n_valid=60),
    "full": dict(lm_steps=600, steps=150, n_train=600, n_valid=200),
}


def txl(*args: str) -> str:
    """Run `python -m txl ARGS` and return its stdout (stderr passes through)."""
    res = subprocess.run([sys.executable, "-m", "txl", *args], stdout=subprocess.PIPE, text=True, check=True)
    return res.stdout


def make_documents(text: str, n: int, length: int, rng: random.Random) -> list[dict]:
    """``n`` documents of ``length`` characters of ``text`` (from a line start), a marker among the first 100
    characters (at a line break, so it reads as a line of its own); the classes alternate (exactly balanced)."""
    starts = [i + 1 for i in range(len(text) - length - 1) if text[i] == "\n"]
    docs = []
    for k in range(n):
        label = "aye" if k % 2 == 0 else "nay"
        body = text[(s := rng.choice(starts)) : s + length]
        breaks = [i + 1 for i in range(min(100, len(body))) if body[i] == "\n"] or [0]
        at = rng.choice(breaks)
        docs.append({"text": body[:at] + MARKERS[label].strip() + "\n" + body[at:], "label": label})
    rng.shuffle(docs)
    return docs


def last_valid(run: Path) -> dict:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("split") == "valid"][-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", choices=sorted(BUDGETS), default="full")
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "shakespeare"))
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "long_doc")
    ap.add_argument("--length", type=int, default=2048, help="characters of Shakespeare per document")
    ap.add_argument("--tgt_len", type=int, default=256, help="segment length when fine-tuning")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", type=Path, help="replace this experiment's section in this Markdown file")
    args = ap.parse_args()
    budget = BUDGETS[args.budget]
    args.runs.mkdir(parents=True, exist_ok=True)

    lm = args.runs / "lm"
    t0 = time.perf_counter()
    txl("train", "--config", str(ROOT / "configs" / "shakespeare_char.yaml"), "--run_dir", str(lm),
        "--data.path", args.data, "--train.max_steps", str(budget["lm_steps"]), "--train.eval_interval", "0",
        "--train.checkpoint_interval", str(budget["lm_steps"]))  # fmt: skip
    lm_time = time.perf_counter() - t0

    data = args.runs / f"data-{args.budget}"
    data.mkdir(exist_ok=True)
    rng = random.Random(args.seed)
    for split, n in (("train", budget["n_train"]), ("valid", budget["n_valid"])):
        text = (Path(args.data) / f"{split}.txt").read_text(encoding="utf-8")
        docs = make_documents(text, n, args.length, rng)
        (data / f"{split}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    longest = max(len(json.loads(x)["text"]) for x in (data / "train.jsonl").read_text().splitlines())

    results = {}
    for name, memory in (("with memory", True), ("without memory", False)):
        run = args.runs / f"{'mem' if memory else 'nomem'}-{args.budget}"
        t0 = time.perf_counter()
        txl("finetune", "--model", str(lm), "--data", str(data), "--run_dir", str(run), "--tgt_len", str(args.tgt_len),
            "--mem_len", str(-(-longest // args.tgt_len) * args.tgt_len), "--memory", str(memory).lower(),
            "--max_steps", str(budget["steps"]), "--eval_interval", str(budget["steps"] // 3),
            "--checkpoint_interval", str(budget["steps"]), "--batch_size", "8", "--lr", "5e-4", "--head_lr", "5e-3",
            "--warmup_steps", "10", "--seed", str(args.seed))  # fmt: skip
        results[name] = {"valid": last_valid(run), "seconds": time.perf_counter() - t0}

    lines = [
        HEADING,
        "",
        f"Documents of {args.length:,} characters of Shakespeare with a marker phrase among their first 100 characters "
        f"(`{MARKERS['aye']}` or `{MARKERS['nay']}`, the label); {budget['n_train']} train documents (train split), "
        f"{budget['n_valid']} valid (valid split), balanced: chance is 50%. Language model: "
        f"`configs/shakespeare_char.yaml`, {budget['lm_steps']} steps ({lm_time:.0f} s); then {budget['steps']} "
        f"fine-tuning steps of 8 documents, segments of {args.tgt_len} characters, the same for both rows.",
        "",
        "| reading | memory | valid accuracy | valid loss | fine-tuning time |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        mem = f"{-(-longest // args.tgt_len) * args.tgt_len} (whole document)" if name == "with memory" else "none"
        v = r["valid"]
        lines.append(f"| {name} | {mem} | {v['accuracy']:.1%} | {v['loss']:.4f} | {r['seconds']:.0f} s |")
    acc = {k: r["valid"]["accuracy"] for k, r in results.items()}
    lines += [
        "",
        f"With the memory carried the label is read from {args.length:,} characters back ({acc['with memory']:.1%}); "
        f"without it, the last segment alone holds no trace of the marker and the head guesses "
        f"({acc['without memory']:.1%}, chance 50%).",
        "",
        "Command (2 CPU cores):",
        "",
        "```",
        f".venv/bin/python experiments/long_doc_classification.py --budget {args.budget} --write docs/paper.md",
        "```",
        "",
    ]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _report import publish

    publish("\n".join(lines), args.write, HEADING)


if __name__ == "__main__":
    main()
