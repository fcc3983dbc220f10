"""Data preparation at WikiText-103 scale: tokenization speed and peak memory of `prepare_corpus`.

Generates a synthetic word corpus the size of WikiText-103's training split (~540 MB, ~103 M tokens, ~267 K
word types, Zipf-distributed, ~1.8 M lines with blank lines between paragraphs) plus small valid/test splits, then
runs the wt103 recipe (count the vocabulary on train, encode all three splits to uint32 memmaps) in a fresh
process per repeat and reports wall time, MB/s, tokens/s and peak RSS (medians and ranges).

    python benchmarks/data_prep.py [--scale 1.0] [--repeats 3] [--workdir /tmp/txl-data-bench] \\
        [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

from _report import replace_section

WT103 = {"bytes": 539_000_000, "tokens": 103_227_021, "types": 267_735, "lines": 1_801_350}


def make_corpus(folder: Path, scale: float, seed: int = 0) -> dict:
    """Write train/valid/test.txt; return what was written."""
    rng = np.random.default_rng(seed)
    n_types = int(WT103["types"] * min(1.0, scale**0.5))
    n_tokens = int(WT103["tokens"] * scale)
    letters = np.frombuffer(b"etaoinshrdlcumwfgypbvkjxqz", dtype=np.uint8)
    # frequent words are short, as in English: length grows with log(rank)
    lengths = np.clip(1 + np.log(np.arange(n_types) + 2).astype(int) // 2 + rng.integers(0, 2, n_types), 1, 16)
    words, seen = [], set()
    for n in lengths:
        while True:
            w = letters[rng.integers(0, 26, n)].tobytes().decode()
            if w not in seen:
                seen.add(w)
                words.append(w)
                break
    vocab = np.array(words, dtype=object)
    cdf = np.cumsum(1.0 / (np.arange(n_types) + 2.7))
    cdf /= cdf[-1]
    # every type occurs at least once in train, as in WikiText-103 (its vocabulary is its train split)
    first = rng.permutation(n_types)
    folder.mkdir(parents=True, exist_ok=True)
    stats = {"tokens": 0, "lines": 0}
    for split, n in [("train", n_tokens), ("valid", n_tokens // 440), ("test", n_tokens // 420)]:
        with open(folder / f"{split}.txt", "w", encoding="utf-8") as f:
            done, chunk = 0, 2_000_000
            while done < n:
                k = min(chunk, n - done)
                ids = np.searchsorted(cdf, rng.random(k))
                if split == "train" and done < n_types:
                    m = min(k, n_types - done)
                    ids[:m] = first[done : done + m]
                toks = vocab[ids]
                cuts = np.cumsum(rng.geometric(1 / 80, size=k // 20 + 2))
                cuts = cuts[cuts < k]
                out = []
                for a, b in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [k]]), strict=True):
                    out.append(" " + " ".join(toks[a:b]) + " \n \n")  # WikiText's " text \n" + blank line
                f.write("".join(out))
                stats["lines"] += 2 * len(out)
                done += k
            stats["tokens"] += n
    stats["bytes"] = sum((folder / f"{s}.txt").stat().st_size for s in ("train", "valid", "test"))
    stats["train_bytes"] = (folder / "train.txt").stat().st_size
    stats["types"] = n_types
    return stats


def run_once(folder: Path, cache: Path) -> dict:
    """prepare_corpus in a fresh process: wall time and peak RSS of that process."""
    script = textwrap.dedent(f"""
        import json, re, shutil, time
        shutil.rmtree({str(cache)!r}, ignore_errors=True)
        from txl.data import prepare_corpus
        t = time.perf_counter()
        c = prepare_corpus(path={str(folder)!r}, dataset="wt103", cache_dir={str(cache)!r}, log=lambda m: None)
        wall = time.perf_counter() - t
        peak = int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) / 1024
        n = sum(c.n_tokens(s) for s in ("train", "valid", "test"))
        print(json.dumps({{"wall_s": wall, "peak_rss_mib": peak, "tokens": n, "vocab": c.tokenizer.vocab_size,
                          "dtype": str(c.splits["train"].dtype)}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of WikiText-103's size")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/txl-data-bench"))
    ap.add_argument("--write", type=Path, default=None, help="update this markdown file's data-prep section")
    args = ap.parse_args()
    folder = args.workdir / f"corpus-{args.scale:g}"
    meta = folder / "corpus.json"
    if meta.exists():
        stats = json.loads(meta.read_text())
    else:
        t = time.perf_counter()
        stats = make_corpus(folder, args.scale)
        meta.write_text(json.dumps(stats))
        print(f"generated {stats['bytes'] / 1e6:.0f} MB in {time.perf_counter() - t:.0f} s", flush=True)
    runs = []
    for i in range(args.repeats):
        r = run_once(folder, args.workdir / "cache")
        runs.append(r)
        print(f"run {i + 1}: {r}", flush=True)
    wall = [r["wall_s"] for r in runs]
    rss = [r["peak_rss_mib"] for r in runs]
    med = statistics.median(wall)
    rows = [
        "| corpus | tokens | types (vocab) | wall time | MB/s | tokens/s | peak RSS |",
        "|---|---|---|---|---|---|---|",
        f"| synthetic WT103-sized, {stats['bytes'] / 1e6:,.0f} MB ({stats['lines']:,} lines) | {runs[0]['tokens']:,} "
        f"| {runs[0]['vocab']:,} | {med:.0f} s (min {min(wall):.0f}, max {max(wall):.0f}) "
        f"| {stats['bytes'] / 1e6 / med:.1f} | {runs[0]['tokens'] / med / 1e6:.2f} M "
        f"| {statistics.median(rss):,.0f} MiB (max {max(rss):,.0f}) |",
    ]
    cmd = f"python benchmarks/data_prep.py --scale {args.scale:g} --repeats {args.repeats}"
    section = "\n".join(
        [
            "## Data preparation (WikiText-103 scale)",
            "",
            f"Command: `{cmd}` (2 CPU cores; one fresh process per repeat; median of {args.repeats}).",
            "The wt103 recipe: count the vocabulary on train (two passes over the text in all: count, then encode),",
            f"write {runs[0]['dtype']} id arrays for all three splits, hash sources and arrays into meta.json.",
            "Targets: under 10 minutes, peak RSS under 3 GB.",
            "",
            *rows,
            "",
        ]
    )
    print(section)
    if args.write:
        replace_section(args.write, "## Data preparation (WikiText-103 scale)", section)


if __name__ == "__main__":
    main()
