"""Training throughput of ``txl train`` on bench-char and bench-word (``../shared/research/BENCH.md``), fp32 and
bf16, side by side with the bare model step and Hugging Face TransfoXL's step measured in the same run.

    make bench-train      # = .venv/bin/python benchmarks/train_speed.py --write docs/benchmarks.md

Each ``txl train`` case is a fresh process running ``configs/bench_{char,word}.yaml`` on Shakespeare (bytes /
words cut to a 32,000 vocabulary) with ``--train.log_interval 1``: the trainer's own per-step tokens/s (batch
fetch + forward/backward over the chunks + NaN/inf checks + clipping + Adam, excluding logging and checkpoints).
The first ``--warmup`` steps are dropped; rounds alternate the cases and are pooled. The reference columns come
from ``model_speed.measure`` (random tokens, the same shapes, fp32): the bare txl model + Adam loop, and HF's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from _report import replace_section

ROOT = Path(__file__).resolve().parents[1]
CASES = {"bench-char": "bench_char.yaml", "bench-word": "bench_word.yaml"}
HEADING = "## Training throughput of `txl train`"


def run_case(config: str, precision: str, data: Path, work: Path, warmup: int, steps: int) -> list[float]:
    run = Path(tempfile.mkdtemp(dir=work))
    args = [sys.executable, "-m", "txl", "train", "--config", str(ROOT / "configs" / config)]
    args += ["--data.path", str(data), "--data.cache_dir", str(work / f"cache-{config}"), "--run_dir", str(run)]
    args += ["--train.max_steps", str(warmup + steps), "--train.precision", precision, "--resume", "none"]
    args += ["--train.threads", "2", "--train.eval_interval", "0", "--train.checkpoint_interval", "0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    subprocess.run(args, check=True, env=env, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["tokens_per_s"] for r in rows if r["split"] == "train" and r["step"] > warmup]


def fmt(v: list[float]) -> str:
    return f"{statistics.median(v):,.0f} ({min(v):,.0f}–{max(v):,.0f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shared = ROOT.parent / "shared" / "data" / "shakespeare"
    ap.add_argument("--data", type=Path, default=shared if shared.exists() else ROOT / "data" / "shakespeare")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per round and case")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--no_hf", action="store_true", help="skip the reference columns (no transformers needed)")
    ap.add_argument("--write", type=Path, help="update this markdown file's section")
    args = ap.parse_args()
    torch.set_num_threads(2)
    work = Path(tempfile.mkdtemp(prefix="txl-train-bench-"))
    got: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for name, config in CASES.items():
            for precision in ("fp32", "bf16"):
                tps = run_case(config, precision, args.data, work, args.warmup, args.steps)
                got.setdefault((name, precision), []).extend(tps)
                print(f"{name} {precision}: {fmt(got[(name, precision)])} tok/s", flush=True)
    ref = {}
    if not args.no_hf:
        from model_speed import measure

        for name in CASES:
            ref[name] = measure(name, True, args.warmup, args.steps * args.rounds)
    header = "| config | txl train fp32 | txl train bf16 | bf16 / fp32 |"
    sep = "|---|---|---|---|"
    if ref:
        header += " bare txl model step fp32 | HF TransfoXL step fp32 | txl train fp32 / HF |"
        sep += "---|---|---|"
    lines = [header, sep]
    for name in CASES:
        f32, b16 = got[(name, "fp32")], got[(name, "bf16")]
        line = f"| {name} | {fmt(f32)} | {fmt(b16)} | {statistics.median(b16) / statistics.median(f32):.2f}× |"
        if ref:
            hf = ref[name]["hf"]
            line += f" {fmt(ref[name]['txl'])} | {fmt(hf)} | {statistics.median(f32) / statistics.median(hf):.2f}× |"
        lines.append(line)
    table = "\n".join(lines)
    print(table)
    try:
        native_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        native_bf16 = False
    section = (
        f"{HEADING} (`benchmarks/train_speed.py`)\n\n"
        f"Command: `make bench-train` (= `python benchmarks/train_speed.py --warmup {args.warmup} --steps {args.steps} "
        f"--rounds {args.rounds} --write docs/benchmarks.md`). Machine: {platform.machine()}, 2 threads, torch "
        f"{torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, native bf16 "
        f"{'yes' if native_bf16 else 'no (emulated)'}. Tokens/s per training step (batch 8 × tgt_len 128, "
        f"mem_len 128, Adam), median (min–max) over {args.steps * args.rounds} steps after {args.warmup} warm-up "
        "steps per process. `txl train` reads Shakespeare through the data pipeline; the reference columns "
        "(`model_speed.measure`, same process) use random tokens.\n\n"
    )
    if args.write:
        replace_section(args.write, HEADING, section + table)


if __name__ == "__main__":
    main()
