"""`txl train` end to end against the bare model step, in one process; and bf16 training against fp32.

    make bench      # also runs this: .venv/bin/python benchmarks/train_speed.py --write docs/benchmarks.md

For configs/shakespeare_char.yaml and the bench recipes (``BENCH.md`` shapes on Shakespeare: bytes, and words cut
to a 32,000 vocabulary): rounds alternate between

* **txl train**: ``Trainer(...).fit()`` for ``--steps`` steps, everything included: the data iterator, the NaN
  guards, gradient clipping, metrics every 10 steps, a checkpoint at the end (written and fsynced; the recipes
  save every 4,000 steps) and the final validation (2 batches); wall time of ``fit()``;
* **bare step**: the same model, optimizer (fused Adam) and clipping on the same batches, sliced in advance: forward,
  backward, clip, step, ``loss.item()``; nothing else.

Reported: tokens/s of both (medians over rounds) and the ratio, the median over rounds of each round's txl train
over the same round's bare step (target: txl train >= 0.95 x bare). With
``--bf16_steps N`` (where the CPU or GPU has native bf16) it also trains N steps in fp32 and in bf16 from the same
start and reports the largest relative gap between their 20-step moving-average loss curves (target: 1%).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from _report import replace_section
from txl.config import load_recipe
from txl.data import OrderedIterator, prepare_corpus
from txl.kernels.runtime import ALLOCATOR_NOTE, choose_fp32_matmul, configure_allocator, fp32_route, native_bf16
from txl.model.modeling import TransformerXLConfig, TransformerXLLM
from txl.train import trainer as trainer_module
from txl.train.optim import build_optimizer
from txl.train.trainer import Trainer
from txl.util.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
CASES = {"shakespeare-char": "shakespeare_char.yaml", "bench-char": "bench_char.yaml", "bench-word": "bench_word.yaml"}
HEADING = "## Training throughput of `txl train`"


def run_config(config: str, data: Path, work: Path, steps: int, device: str, **train):
    overrides = {
        "data": {"path": str(data), "cache_dir": str(work / f"cache-{config}")},
        "train": {
            "max_steps": steps,
            "max_time": None,
            "log_interval": 10,
            "eval_interval": 0,
            "eval_max_steps": 2,
            "checkpoint_interval": 0,  # one checkpoint, when training stops
            "keep_last": 1,
            "progress": False,
            "threads": 2,
            "device": device,
            **train,
        },
        "run_dir": tempfile.mkdtemp(dir=work),
    }
    return load_recipe(ROOT / "configs" / config, overrides)


ROUTE: list = [None]  # the fp32 GEMM route chosen once by main(): both sides compute on it


def txl_train(config: str, data: Path, work: Path, steps: int, device: str) -> tuple[float, float]:
    """Tokens/s of ``fit()`` (start-up excluded: the corpus cache and the model exist before the clock starts),
    with and without the time spent writing checkpoints. The trainer takes the route chosen by main() instead of
    measuring its own at start-up (a choice made again in each round can differ: the check is noisy here, and the
    bare step would then run on the other path)."""
    chosen = ROUTE[0]
    cfg = run_config(config, data, work, steps, device, fp32_route=bool(chosen and chosen.enabled))
    pin = mock.patch.object(trainer_module, "choose_fp32_matmul", lambda **_: chosen) if chosen else None
    with contextlib.redirect_stdout(io.StringIO()), pin or contextlib.nullcontext():  # (the log: train.log)
        trainer = Trainer(cfg, resume="none")
    saving, save = [0.0], trainer.save

    def timed_save():
        t0 = time.perf_counter()
        try:
            return save()
        finally:
            saving[0] += time.perf_counter() - t0

    trainer.save = timed_save
    try:
        t = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.fit()
        if trainer.world.device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
        tokens = steps * cfg.train.batch_size * cfg.train.tgt_len
        return tokens / wall, tokens / (wall - saving[0])
    finally:
        trainer.close()


def bare_step(config: str, data: Path, work: Path, steps: int, device: str) -> float:
    """Tokens/s of forward + backward + clip + optimizer on pre-sliced batches of the same corpus."""
    cfg = run_config(config, data, work, steps, device)
    corpus = prepare_corpus(cfg.data, log=lambda _: None)
    dev = torch.device(device)
    model_cfg = TransformerXLConfig.from_dict({**cfg.model.to_dict(), "n_token": corpus.tokenizer.vocab_size})
    torch.manual_seed(cfg.train.seed)
    model = TransformerXLLM(model_cfg).to(dev)
    params = list(model.parameters())
    opt = build_optimizer(params, cfg.train, dev)
    it = OrderedIterator(corpus.splits["train"], cfg.train.batch_size, cfg.train.tgt_len, device=dev)
    batches = [b for _, b in zip(range(steps), it.forever(), strict=False)]
    route = fp32_route(ROUTE[0].enabled) if ROUTE[0] else contextlib.nullcontext()
    t = time.perf_counter()
    with route:
        _bare_steps(model, batches, params, opt, cfg.train.clip)
    return steps * cfg.train.batch_size * cfg.train.tgt_len / (time.perf_counter() - t)


def _bare_steps(model, batches, params, opt, clip: float) -> None:
    mems = None
    for b in batches:
        out = model(b.input, b.target, mems=mems)
        mems = out.mems
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.loss.item()


def bf16_gap(config: str, data: Path, work: Path, steps: int, device: str) -> float:
    """Largest relative gap between the 20-step moving averages of the fp32 and bf16 training losses."""
    curves = []
    for precision in ("fp32", "bf16"):
        cfg = run_config(config, data, work, steps, device, precision=precision, log_interval=1, max_steps=steps)
        with contextlib.redirect_stdout(io.StringIO()):
            trainer = Trainer(cfg, resume="none")
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                trainer.fit()
        finally:
            trainer.close()
        curves.append([r["loss"] for r in read_metrics(cfg.run_dir) if r["split"] == "train"])

    def smooth(xs):
        return [statistics.fmean(xs[max(0, i - 19) : i + 1]) for i in range(len(xs))]

    a, b = (smooth(c) for c in curves)
    return max(abs(x - y) / x for x, y in zip(a, b, strict=True))


def fmt(v: list[float]) -> str:
    return f"{statistics.median(v):,.0f} ({min(v):,.0f}–{max(v):,.0f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shared = ROOT.parent / "shared" / "data" / "shakespeare"
    ap.add_argument("--data", type=Path, default=shared if shared.exists() else ROOT / "data" / "shakespeare")
    ap.add_argument("--steps", type=int, default=60, help="steps per round and case")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bf16_steps", type=int, default=300, help="0: skip the bf16 loss-curve comparison")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--write", type=Path, help="update this markdown file's section")
    args = ap.parse_args()
    torch.set_num_threads(2)
    notes = []
    if args.device == "cpu":
        notes = [ALLOCATOR_NOTE] if configure_allocator() else []
        ROUTE[0] = choose_fp32_matmul()
        notes.append(ROUTE[0].describe() + ", for both sides")
    work = Path(tempfile.mkdtemp(prefix="txl-train-bench-"))
    lines = [
        "| config | txl train tok/s, end to end | without the checkpoint write | bare model step tok/s "
        "| txl train / bare, paired per round, median (without the checkpoint) |",
        "|---|---|---|---|---|",
    ]
    for name, config in CASES.items():
        txl_train(config, args.data, work, 2, args.device)  # warm-up: corpus cache, first-call costs
        got = {"txl": [], "steps": [], "bare": []}
        for r in range(args.rounds):  # the order alternates, so that a drift of the machine's speed favours neither
            if r % 2:
                got["bare"].append(bare_step(config, args.data, work, args.steps, args.device))
            e2e, steps_only = txl_train(config, args.data, work, args.steps, args.device)
            got["txl"].append(e2e)
            got["steps"].append(steps_only)
            if not r % 2:
                got["bare"].append(bare_step(config, args.data, work, args.steps, args.device))
        paired = {
            k: statistics.median(a / b for a, b in zip(got[k], got["bare"], strict=True)) for k in ("txl", "steps")
        }
        lines.append(
            f"| {name} | {fmt(got['txl'])} | {fmt(got['steps'])} | {fmt(got['bare'])} | "
            f"**{paired['txl']:.3f}** ({paired['steps']:.3f}) |"
        )
        print(lines[-1], flush=True)
    device = torch.device(args.device)
    if args.bf16_steps and native_bf16(device):
        gap = bf16_gap("bench_char.yaml", args.data, work, args.bf16_steps, args.device)
        bf16 = (
            f"bf16 against fp32, {args.bf16_steps} steps of bench-char: largest gap of the 20-step moving averages "
            f"of the loss {100 * gap:.2f}% (target 1%)."
        )
    elif not args.bf16_steps:
        bf16 = "No bf16 loss-curve comparison: --bf16_steps 0."
    else:
        bf16 = "No bf16 loss-curve comparison: this device has no native bf16 (txl trains in fp32 there, with a note)."
    print(bf16)
    table = "\n".join(lines)
    if args.write:
        section = (
            f"{HEADING} (`benchmarks/train_speed.py`)\n\n"
            f"Command: `make bench` (= `python benchmarks/train_speed.py --steps {args.steps} --rounds {args.rounds} "
            f"--bf16_steps {args.bf16_steps} --write docs/benchmarks.md`), device {args.device}, torch "
            f"{torch.__version__}; {'; '.join(notes) or 'no runtime settings'}. End to end = the wall time of "
            f"`Trainer.fit()` for {args.steps} steps (data, NaN guards, clipping, metrics every 10 steps, a "
            "checkpoint at the end, a 2-batch final validation); bare = forward, backward, clip, "
            "fused Adam on pre-sliced batches of the same corpus, same process, alternating (which goes first "
            f"alternates too); medians over {args.rounds} rounds (min–max); the ratio is the median of each round's "
            "txl train over the same round's bare step (a drift of the machine's speed between rounds cancels). "
            "Target: txl train >= 0.95 × bare.\n\n"
        )
        replace_section(args.write, HEADING, section + table + "\n\n" + bf16)


if __name__ == "__main__":
    main()
