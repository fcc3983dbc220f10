"""Reading a long prompt: in pieces (txl's default past 1,024 positions, ``txl.infer.prompt.read_prompt``) against
one pass of the whole prompt (txl's before, and Hugging Face TransfoXL's forward, which its ``generate()`` makes), in
one run: prompt tokens per second and the process's peak memory during the read, on the bench-char model (the same
weights), batch 1, mem_len 640, same_length off (each piece then attends to the whole prompt before it: the
pieces' worst case); and how far the pieces' last hidden state is from the one pass's.

    python benchmarks/prompt_read.py --write docs/benchmarks.md

The peak is measured in a fresh process per implementation and length (a process's allocator keeps what earlier
reads freed): its resident high-water mark (``VmHWM``) during one read, above its size before it. Timings alternate
between the implementations (each first in turn) after a warm-up read of each; medians, min and max of
``--repeats``. 2 threads on the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from _report import TITLE, publish
from model_speed import build_pair, cpu_description, fmt
from txl.infer.prompt import PROMPT_CHUNK, read_prompt
from txl.model.modeling import KVCache, Reading

HEADING = "## Reading a long prompt: in pieces vs one pass (`benchmarks/prompt_read.py`)"
MEM = 640
MEANING = (
    "What it means: reading a prompt in pieces costs no measurable speed (the ranges overlap; profiled at 8,192 "
    "positions on a 2-core AVX2 EPYC, 2026-11-27, the native attention kernel took 58.4 s in pieces against 55.8 s in "
    "one pass in one run, and plain reads of each, alternated, 56.1 / 54.5 / 57.4 / 56.8 s) and gives the one pass's "
    "hidden states. What it saves grows with the prompt: the one pass's [T, K] mask is T² bytes (67 MB at 8,192, 17 GB "
    "at 130,000, where a prompt was killed by the system before), the pieces' [1,024, K]; at these lengths the cache "
    "and the layers' activations are most of the peak. HF's one pass holds every layer's [T, K] scores and reads half "
    "as fast."
)


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def readers(T: int) -> tuple[dict, dict]:
    """The reads of a prompt of T positions by name, and where txl's put their last hidden state (by chunk)."""
    hf, ours = build_pair("bench-char")
    hf.eval(), ours.eval()
    hf.reset_memory_length(MEM)
    prompt = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(1))
    out: dict = {}

    def txl(chunk: int):
        def run():
            cache = KVCache(ours.config, 1, MEM, T, positions=T + 1)  # (as stream() makes it)
            with torch.no_grad():
                out[chunk] = read_prompt(ours, prompt, cache, Reading(MEM), chunk=chunk)[0, -1]

        return run

    def run_hf():
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf.transformer(prompt)

    return {"pieces": txl(PROMPT_CHUNK), "one pass": txl(T), "hf": run_hf}, out


def peak(T: int, name: str) -> float:
    """MiB of resident memory one read adds at its peak, in a fresh process."""
    code = (
        f"import torch, prompt_read as p; torch.set_num_threads(2); run = p.readers({T})[0][{name!r}]; "
        "open('/proc/self/clear_refs', 'w').write('5'); before = p.rss_kib('VmRSS'); run(); "
        "print((p.rss_kib('VmHWM') - before) / 1024)"
    )  # (clear_refs 5: the high-water mark starts again from the current size)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parent)
    if done.returncode:
        raise SystemExit(done.stderr[-2000:])
    return float(done.stdout.split()[-1])


def measure(T: int, repeats: int, hf_limit: int) -> dict:
    runs, out = readers(T)
    if T > hf_limit:
        del runs["hf"]
    for fn in runs.values():
        fn()  # (warm-up)
    times: dict[str, list[float]] = {k: [] for k in runs}
    names = list(runs)
    for i in range(repeats):
        for k in names[i % len(names) :] + names[: i % len(names)]:  # (each first in turn: after HF's read, whose
            t = time.perf_counter()  # memory the system took back, the next read's allocations fault their pages in)
            runs[k]()
            times[k].append(T / (time.perf_counter() - t))
    diff = float((out[PROMPT_CHUNK] - out[T]).abs().max())
    return {"rates": times, "peaks": {k: [peak(T, k)] for k in runs}, "diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hf_limit", type=int, default=4096, help="HF's one pass only up to this prompt length")
    ap.add_argument("--write", type=Path, help="write the section into this markdown file")
    args = ap.parse_args()
    torch.set_num_threads(2)
    machine = cpu_description()
    print(f"machine: {machine}", flush=True)
    rows = []
    for T in args.lengths:
        r = measure(T, args.repeats, args.hf_limit)
        rates, peaks = r["rates"], r["peaks"]
        hf = f"{fmt(rates['hf'])} | {statistics.median(peaks['hf']):,.0f}" if "hf" in rates else "not run | "
        ratio = statistics.median(rates["pieces"]) / statistics.median(rates["one pass"])
        rows.append(
            f"| {T:,} | {fmt(rates['pieces'])} | {statistics.median(peaks['pieces']):,.0f} | "
            f"{fmt(rates['one pass'])} | {statistics.median(peaks['one pass']):,.0f} | {hf} | {ratio:.2f}× | "
            f"{r['diff']:.1e} |"
        )
        print(rows[-1], flush=True)
    section = "\n".join(
        [
            HEADING,
            "",
            f"Command: `python benchmarks/prompt_read.py --write docs/benchmarks.md`. Machine: {machine}, 2 threads; "
            f"torch {torch.__version__}, transformers 4.46.3.",
            f"bench-char (the same weights in all), batch 1, mem_len {MEM}, same_length off, an empty memory; prompt "
            f"tokens per second of the read, median (min–max) of {args.repeats}, alternating; peak: MiB of resident "
            f"memory the read adds at its high-water mark, in a fresh process. txl's pieces are "
            f"{PROMPT_CHUNK:,} positions; HF's one pass is `transformer(prompt)`, what its `generate()` runs first.",
            "",
            "| prompt | txl pieces tok/s | peak MiB | txl one pass tok/s | peak MiB | HF one pass tok/s | peak MiB | "
            "pieces / one pass | last hidden state, largest difference |",
            "|---:|---|---:|---|---:|---|---:|---|---|",
            *rows,
            "",
            MEANING,
        ]
    )
    publish(section, args.write, HEADING, title=TITLE)


if __name__ == "__main__":
    main()
