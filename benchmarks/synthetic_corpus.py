"""A synthetic corpus in WikiText-103's layout (wiki.{train,valid,test}.tokens), for running the paper's recipes where
nothing can be downloaded (a lent GPU machine): V words w0..w{V-1}, each once in train, then Zipf-distributed words
(exponent 1.1), 40 per line.

    python benchmarks/synthetic_corpus.py OUT [--words 260000] [--train 3000000] [--valid 300000]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--words", type=int, default=260_000, help="vocabulary size (> 200,000 keeps WT103's cutoffs)")
    ap.add_argument("--train", type=int, default=3_000_000, help="Zipf-drawn training words (after each word once)")
    ap.add_argument("--valid", type=int, default=300_000, help="words of the valid and of the test split")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    p = 1.0 / np.arange(1, args.words + 1) ** 1.1
    p /= p.sum()
    words = np.array([f"w{i}" for i in range(args.words)])
    args.out.mkdir(parents=True, exist_ok=True)

    def write(name: str, ids: np.ndarray) -> None:
        lines = [" " + " ".join(words[ids[i : i + 40]]) + " " for i in range(0, len(ids), 40)]
        (args.out / name).write_text("\n".join(lines) + "\n")

    write("wiki.train.tokens", np.concatenate([rng.permutation(args.words), rng.choice(args.words, args.train, p=p)]))
    write("wiki.valid.tokens", rng.choice(args.words, args.valid, p=p))
    write("wiki.test.tokens", rng.choice(args.words, args.valid, p=p))
    print(f"{args.out}: {args.words:,} words, {args.words + args.train:,} training tokens")


if __name__ == "__main__":
    main()
