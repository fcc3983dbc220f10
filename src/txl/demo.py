"""``make demo``: get Shakespeare, train a character-level Transformer-XL on it, evaluate test bpc with the training
memory and with a 4x longer one, sample ~500 characters, plot the loss curves, and say where everything is.

Re-running it continues the run (``--resume auto``); a finished run is only evaluated and sampled again.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from txl.cli import main as txl

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "shakespeare_char.yaml"


def _section(title: str) -> None:
    print(f"\n== {title} ==", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", type=Path, default=Path("data/shakespeare"), help="where the corpus goes")
    ap.add_argument("--run_dir", type=Path, default=Path("runs/shakespeare_char"), help="the run folder")
    ap.add_argument("--budget", type=float, default=600.0, help="training wall-clock budget in seconds")
    ap.add_argument("--max_steps", type=int, default=None, help="override the recipe's step count")
    ap.add_argument("--config", type=Path, default=CONFIG)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()

    _section(f"1/5 data: txl data get shakespeare --out {args.data}")
    txl(["data", "get", "shakespeare", "--out", str(args.data)])

    _section(f"2/5 train: txl train --config {args.config.name} (budget {args.budget:.0f} s)")
    train = ["train", "--config", str(args.config), "--data.path", str(args.data), "--run_dir", str(args.run_dir)]
    train += ["--train.max_time", str(args.budget + trained_for(args.run_dir)), "--resume", "auto"]
    if args.max_steps is not None:
        train += ["--train.max_steps", str(args.max_steps)]
    txl(train)
    from txl.model.pretrained import read_json
    from txl.train.checkpoint import resolve_model_dir

    model = resolve_model_dir(args.run_dir)
    cut = budget_note(model, args.budget)
    if cut:
        print(cut, flush=True)

    _section("3/5 test bpc with the training memory, then with 4x longer memory")
    mem = read_json(model / "run.json")["eval"]["mem_len"]
    for m in (mem, 4 * mem):
        txl(["eval", "--model", str(args.run_dir), "--mem_len", str(m)])

    _section("4/5 sample: 500 characters after 'ROMEO:' (temperature 0.8, memory carried between steps)")
    txl(
        ["generate", "--model", str(args.run_dir), "--prompt", "ROMEO:", "--max_new_tokens", "500"]
        + ["--temperature", "0.8", "--seed", "0", "--mem_len", str(4 * mem)]
    )

    _section("5/5 loss curves")
    txl(["plot", str(args.run_dir)])

    print(
        f"\nDone in {time.perf_counter() - t0:.0f} s. Where things are:\n"
        f"  corpus            {args.data}/{{train,valid,test}}.txt\n"
        f"  run folder        {args.run_dir}/ (config.yaml, metrics.jsonl, train.log)\n"
        f"  model used above  {model}/ (model.safetensors, config.json, tokenizer.json)\n"
        f"  loss curves       {args.run_dir}/loss.png\n"
        f"The txl command is in .venv/bin: put it on your PATH with `. .venv/bin/activate`, then try\n"
        f"  txl generate --model {args.run_dir} --prompt 'JULIET:' --max_new_tokens 300\n"
        f"  txl serve --model {args.run_dir}     # a web page and an HTTP API at http://127.0.0.1:8000/"
        + (f"\n{cut}" if cut else "")
    )


def trained_for(run_dir: Path) -> float:
    """Seconds of training in the run's latest checkpoint (0 for a new run): a demo run again gets its budget anew."""
    from txl.train.checkpoint import latest_checkpoint, load_states

    latest = latest_checkpoint(run_dir) if run_dir.is_dir() else None
    return float(load_states(latest)[0]["elapsed"]) if latest is not None else 0.0


def budget_note(model: Path, budget: float) -> str | None:
    """What to expect when the time budget, not the recipe's step count, ended training (a busy or slow machine)."""
    from txl.model.pretrained import read_json
    from txl.train.checkpoint import read_metadata

    step = read_metadata(model).get("step", 0)
    max_steps = read_json(model / "run.json")["train"]["max_steps"]
    if step >= max_steps:
        return None
    return (
        f"note: the {budget:.0f}-s budget ended training at step {step:,} of the recipe's {max_steps:,} (this machine "
        "is slower or busier than the README's), so the bpc below is higher than the README's 2.33; `make demo` "
        "again trains on from there for another budget"
    )


if __name__ == "__main__":
    main()
