"""Transformer-XL on symbolic music (REMI): its baselines at equal training compute, memory sweeps, generated pieces.

    .venv/bin/python experiments/music.py --budget cpu --write docs/music.md     # ~60 minutes on 2 CPU cores
    .venv/bin/python experiments/music.py --budget quick                        # ~3 minutes (a smoke run)
    python3 experiments/music.py --budget gpu --device cuda --write docs/music.md   # a lent GPU (bigger models)

Data: `txl data get chorales` and `txl data get quartets` (music21's corpus rendered to MIDI; docs/music.md). Every
row is an ordinary run folder under ``--runs``, trained by `txl train` (an interrupted experiment resumes, a finished
run is kept), all with the same steps, batch, segment length, schedule and (within 2%) parameters:

| row | what | training memory | positions |
|---|---|---|---|
| xl | Transformer-XL (configs/chorales.yaml) | the recipe's mem_len | relative (attn_type 0) |
| xl-norec | the same without recurrence | 0 | relative |
| vanilla | a vanilla Transformer (Al-Rfou et al., 2018), read by sliding windows | 0 | learned absolute (attn_type 3) |
| lstm | a 2-layer LSTM, its state carried from segment to segment (truncated BPTT) | its state | none |

Measured (test split; the NLL is nats per REMI event, the ppl its exponential):
1. the NLL of every row and seed on the chorales (xl read with its training memory, xl-norec with none, vanilla by
   windows of its training length sliding by a quarter of it, the LSTM with its state carried through the split);
2. the memory sweep on the quartets (long pieces): xl and xl-norec read with memories 0 ... 2,048;
3. generated pieces (16 bars from nothing, the grammar on) against held-out real ones: pitch-class entropy H1/H4,
   grooving-pattern similarity GS, onsets on the beat, bars with a downbeat note, notes per bar; and the share of
   grammar-invalid events when sampling without the grammar, with the model's probability of invalid events.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Results (`experiments/music.py`)"
ROWS = {"xl": (0, True), "xl-norec": (0, False), "vanilla": (3, False)}
BUDGETS = {
    "quick": dict(
        steps=20, seeds=[1111], model=dict(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, mem_len=32),
        train=dict(batch_size=4, tgt_len=32), quartet_steps=20, memories=[0, 32, 64], pieces=2, bars=2,
        eval_tokens=3000, device="cpu",
    ),
    "cpu": dict(
        steps=400, seeds=[1111, 1112, 1113], model={}, train={}, quartet_steps=400,
        memories=[0, 128, 256, 512, 1024, 2048], pieces=20, bars=16, eval_tokens=None, device="cpu",
    ),
    "gpu": dict(
        steps=4000, seeds=[1111, 1112, 1113],
        model=dict(n_layer=12, d_model=512, n_head=8, d_head=64, d_inner=2048, mem_len=512),
        train=dict(batch_size=16, tgt_len=256, precision="bf16", max_time=None, threads=4, lr=0.0004),
        quartet_steps=4000, memories=[0, 256, 512, 1024, 2048, 4096], pieces=50, bars=32, eval_tokens=None,
        device="cuda",
    ),
}  # fmt: skip


def txl(*args: str) -> str:
    """Run `python -m txl ARGS` and return its stdout (stderr passes through)."""
    res = subprocess.run([sys.executable, "-m", "txl", *args], stdout=subprocess.PIPE, text=True, check=True)
    return res.stdout


def flags(section: str, values: dict) -> list[str]:
    return [f"--{section}.{k}={'null' if v is None else v}" for k, v in values.items()]


def params_of(recipe: str, model: dict, train: dict) -> tuple[int, object]:
    from txl.config import load_recipe
    from txl.model.modeling import TransformerXLLM

    over = {"model": model, "train": train} | ({"eval": {"clamp_len": -1}} if model.get("attn_type") == 3 else {})
    cfg = load_recipe(recipe, over).model
    return sum(p.numel() for p in TransformerXLLM(cfg, init=False).parameters()), cfg


def row_model(name: str, recipe: str, budget: dict) -> tuple[dict, int]:
    """A row's model settings over the recipe's, d_inner matching the xl row's parameters (within 2%)."""
    attn_type, recurrence = ROWS[name]
    model = dict(budget["model"], attn_type=attn_type)
    if not recurrence:
        model["mem_len"] = 0
    if attn_type == 3:
        model["clamp_len"] = -1
    target, _ = params_of(recipe, budget["model"], budget["train"])
    n, cfg = params_of(recipe, model, budget["train"])
    model["d_inner"] = cfg.d_inner + round((target - n) / (cfg.n_layer * (2 * cfg.d_model + 1)))
    n, _ = params_of(recipe, model, budget["train"])
    assert abs(n - target) <= 0.02 * target, (name, n, target)
    return model, n


def train_row(name: str, recipe: str, budget: dict, seed: int, run: Path, data: str, steps: int) -> dict:
    model, n = row_model(name, recipe, budget)
    extra = flags("eval", {"clamp_len": -1}) if model["attn_type"] == 3 else []
    txl(
        "train", "--config", recipe, "--run_dir", str(run), "--data.path", data, "--train.max_steps", str(steps),
        "--train.max_time", "null", "--train.eval_interval", "0", "--train.checkpoint_interval", str(steps),
        "--train.seed", str(seed), "--device", budget["device"], *flags("model", model),
        *flags("train", budget["train"]), *extra,
    )  # fmt: skip
    return {"params": n, "train_seconds": train_seconds(run)}


def train_seconds(run: Path) -> float:
    """The training's own time: its tokens over the median of its logged throughputs (evaluation and start-up left
    out, as the LSTM's is measured; the median, so that an interval slowed by another process does not count)."""
    from txl.util.metrics import read_metrics

    rows = [r for r in read_metrics(run) if r.get("split") == "train" and r.get("tokens_per_s")]
    return rows[-1]["tokens"] / float(np.median([r["tokens_per_s"] for r in rows])) if rows else float("nan")


def eval_row(name: str, run: Path, tgt_len: int, budget: dict, mem_len: int | None = None) -> dict:
    args = ["eval", "--model", str(run), "--split", "test", "--json", "true", "--device", budget["device"]]
    if budget["eval_tokens"]:
        args += ["--max_batches", str(max(1, budget["eval_tokens"] // (10 * tgt_len)))]
    if name == "vanilla":
        args += ["--sliding_window", str(tgt_len), "--stride", str(max(1, tgt_len // 4))]
    elif mem_len is not None:
        args += ["--mem_len", str(mem_len)]
    return json.loads(txl(*args).strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------ the LSTM row
def lstm_row(recipe: str, budget: dict, seed: int, data: str, steps: int, target_params: int, out: Path) -> dict:
    """A 2-layer LSTM language model trained on the same batches (the trainer's ordered columns, the same tokens,
    Adam, learning rate, warm-up, cosine schedule and clipping), its state carried between segments; test NLL with
    the state carried through each column of the split."""
    import torch
    from torch import nn

    from txl.config import load_recipe
    from txl.data import prepare_corpus
    from txl.data.iterators import OrderedIterator

    if out.is_file():
        return json.loads(out.read_text())
    cfg = load_recipe(recipe, {"model": budget["model"], "train": budget["train"]})
    t, d = cfg.train, cfg.model
    corpus = prepare_corpus(cfg.data, path=data)
    V = corpus.tokenizer.vocab_size
    emb = d.d_model

    def count(h: int) -> int:
        return V * emb + 4 * h * (emb + h + 2) + 4 * h * (2 * h + 2) + h * V + V

    hidden = min(range(16, 4096), key=lambda h: abs(count(h) - target_params))

    class LSTMLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, emb)
            self.rnn = nn.LSTM(emb, hidden, num_layers=2, batch_first=True, dropout=d.dropout)
            self.drop = nn.Dropout(d.dropout)
            self.out = nn.Linear(hidden, V)

        def forward(self, x, state):
            h, state = self.rnn(self.drop(self.emb(x)), state)
            return self.out(self.drop(h)), state

    torch.manual_seed(seed)
    dev = torch.device(budget["device"])
    lm = LSTMLM().to(dev)
    n = sum(p.numel() for p in lm.parameters())
    opt = torch.optim.Adam(lm.parameters(), lr=t.lr)
    warm = t.warmup_steps

    def lr_at(step: int) -> float:
        if step < warm:
            return t.lr * (step + 1) / warm
        frac = (step - warm) / max(1, steps - warm)
        return t.eta_min + 0.5 * (t.lr - t.eta_min) * (1 + math.cos(math.pi * frac))

    it = OrderedIterator(np.asarray(corpus.splits["train"]), t.batch_size, t.tgt_len, seed=seed, device=dev)
    state, step, t0 = None, 0, time.time()
    lm.train()
    while step < steps:
        for batch in it:
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            logits, state = lm(batch.input, state)
            state = tuple(s.detach() for s in state)
            loss = nn.functional.cross_entropy(logits.reshape(-1, V), batch.target.reshape(-1))
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(lm.parameters(), t.clip)
            opt.step()
            step += 1
            if step >= steps:
                break
    seconds = time.time() - t0
    lm.eval()
    test = np.asarray(corpus.splits["test"])
    if budget["eval_tokens"]:
        test = test[: budget["eval_tokens"]]
    it = OrderedIterator(test, 10, t.tgt_len, device=dev)
    total, count_tokens, state = 0.0, 0, None
    with torch.no_grad():
        for batch in it:
            logits, state = lm(batch.input, state)
            total += float(
                nn.functional.cross_entropy(logits.reshape(-1, V), batch.target.reshape(-1), reduction="sum")
            )
            count_tokens += batch.target.numel()
    result = {
        "params": n,
        "hidden": hidden,
        "train_seconds": seconds,
        "loss": total / count_tokens,
        "tokens": count_tokens,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result))
    return result


# ------------------------------------------------------------------------------------------------ generation
def generated_measures(run: Path, budget: dict, data: Path) -> dict:
    """Measures of ``pieces`` generated pieces (grammar on), ``pieces`` sampled without it (invalid events), and the
    first ``bars`` bars of as many test pieces."""
    import torch

    from txl.infer.load import load
    from txl.infer.music import compose, measures

    loaded = load(run, torch.device(budget["device"]))
    lm, tok = loaded.model, loaded.tokenizer
    rows: dict[str, list[dict]] = {"generated": [], "real (test)": []}
    invalid, events, mass = 0, 0, []
    for k in range(budget["pieces"]):
        g = torch.Generator(device=budget["device"]).manual_seed(k)
        piece = compose(lm, tok, [tok.bos_id], bars=budget["bars"], max_new_tokens=600 * budget["bars"],
                        temperature=1.0, generator=g, reading=loaded.reading)  # fmt: skip
        rows["generated"].append(measures(tok.decode_score(piece.ids)))
        mass += piece.invalid_mass
        g = torch.Generator(device=budget["device"]).manual_seed(10_000 + k)
        free = compose(lm, tok, [tok.bos_id], max_new_tokens=len(piece.new_ids), grammar=False, generator=g,
                       reading=loaded.reading)  # fmt: skip
        invalid += free.invalid_events
        events += free.events
    for f in sorted((data / "test").glob("*.mid"))[: budget["pieces"]]:
        ids = tok.encode_midi(f)
        kept, bars = [], 0
        for i in ids:  # (the first `bars` bars)
            bars += sum(e == "Bar_None" for e in tok.base_tokens(i))
            if bars > budget["bars"]:
                break
            kept.append(i)
        rows["real (test)"].append(measures(tok.decode_score(kept)))
    table = {name: {k: (float(np.nanmean([r[k] for r in rs])), float(np.nanstd([r[k] for r in rs]))) for k in rs[0]}
             for name, rs in rows.items()}  # fmt: skip
    return {"table": table, "invalid_free": invalid / max(1, events), "free_events": events,
            "invalid_mass": float(np.mean(mass)) if mass else 0.0}  # fmt: skip


# ------------------------------------------------------------------------------------------------ the page
def machine() -> str:
    import platform

    import torch

    flags_ = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags_ = set(line.split(":")[1].split())
                break
    except OSError:
        pass
    simd = [f for f in ("avx2", "fma", "avx512f") if f in flags_]
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, {' '.join(simd)}"


def mean_sd(xs: list[float]) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.4f}"
    return f"{np.mean(xs):.4f} ± {np.std(xs, ddof=1):.4f}"


def write_page(results: dict, args, path: Path) -> None:
    r = results
    lines = [HEADING, "", f"Command: `python experiments/music.py --budget {args.budget}"
             f"{' --device ' + args.device if args.device else ''} --write {path}`; machine: {r['machine']}; "
             f"{r['minutes']:.0f} minutes.", ""]  # fmt: skip
    lines += ["### 1. NLL per event on the chorales' test split, at equal training compute", ""]
    lines += [f"Each row: {r['steps']} steps of {r['batch']} x {r['tgt_len']} events (the same tokens in the same "
              f"order); xl and xl-norec with seeds {', '.join(map(str, r['seeds']))}, vanilla and the LSTM with "
              "the first, and with all three where it lies within 3 standard deviations of xl's seeds; mean ± "
              "standard deviation over the seeds. Training seconds: the training steps alone (the tokens over the "
              "median logged throughput).", ""]  # fmt: skip
    lines += ["| row | parameters | test NLL (nats/event) | ppl | training seconds (mean) |", "|---|---|---|---|---|"]
    for name, seeds in r["nll"].items():
        losses = [s["loss"] for s in seeds]
        lines.append(
            f"| {name} ({len(seeds)} seed{'s' if len(seeds) > 1 else ''}) | {seeds[0]['params']:,} | "
            f"{mean_sd(losses)} | "
            f"{math.exp(np.mean(losses)):.3f} | "
            f"{np.mean([s['train_seconds'] for s in seeds]):.0f} |"
        )
    lines += ["", "### 2. Memory at evaluation, on the quartets (long pieces)", ""]
    lines += [f"xl trained for {r['quartet_steps']} steps with a memory of {r['quartet_mem']}, segments of "
              f"{r['tgt_len']}; the test split read with each memory (same_length, the recipe's clamp_len; 0: no "
              "memory at all). Test NLL (nats/event):", ""]  # fmt: skip
    mems = [m for m, _ in r["sweep"]["xl"]]
    lines += ["| evaluation memory | " + " | ".join(str(m) for m in mems) + " |", "|---" * (len(mems) + 1) + "|"]
    for name, pts in r["sweep"].items():
        lines.append(f"| {name} | " + " | ".join(f"{v:.4f}" for _, v in pts) + " |")
    lines += ["", f"### 3. Generated pieces ({r['pieces']} x {r['bars']} bars from nothing, temperature 1, the "
              "grammar on) against the first bars of as many test pieces", ""]  # fmt: skip
    keys = list(next(iter(r["gen"]["table"].values())))
    lines += ["| pieces | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for name, row in r["gen"]["table"].items():
        lines.append(f"| {name} | " + " | ".join(f"{row[k][0]:.3f} ± {row[k][1]:.3f}" for k in keys) + " |")
    lines += ["", f"Without the grammar, {r['gen']['invalid_free']:.2%} of {r['gen']['free_events']:,} sampled events "
              f"were invalid; under it the model gave invalid events a probability of {r['gen']['invalid_mass']:.2%} "
              "per step on average (the grammar removed that mass).", ""]  # fmt: skip
    lines += [r["reading"], ""]
    text = path.read_text() if path.exists() else ""
    head, _, _ = text.partition(HEADING)
    path.write_text(head.rstrip() + "\n\n" + "\n".join(lines))


def reading(r: dict) -> str:
    """What the numbers say, computed from them (never edited by hand)."""
    mean = {k: float(np.mean([s["loss"] for s in v])) for k, v in r["nll"].items()}
    order = " < ".join(sorted(mean, key=mean.get))
    sweep = dict(r["sweep"]["xl"])
    at_train = sweep.get(r["quartet_mem"], float("nan"))
    best_mem, best = min(r["sweep"]["xl"], key=lambda p: p[1])
    beyond = "helps" if best < at_train - 1e-4 and best_mem > r["quartet_mem"] else "does not help"
    return (
        f"Reading: on the chorales the test NLL orders {order} (lower is better). On the quartets xl reads "
        f"{at_train:.4f} with its training memory ({r['quartet_mem']}) and {best:.4f} at its best ({best_mem}): a "
        f"memory beyond the training span {beyond} here."
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", choices=BUDGETS, default="quick")
    ap.add_argument("--data", type=Path, default=ROOT / "data")
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "music")
    ap.add_argument("--device", help="cpu or cuda (default: the budget's)")
    ap.add_argument("--write", type=Path, help="write the results section into this markdown file")
    args = ap.parse_args()
    budget = dict(BUDGETS[args.budget])
    if args.device:
        budget["device"] = args.device
    t_start = time.time()
    if not (args.data / "chorales" / "test").is_dir():
        txl("data", "get", "chorales", "--out", str(args.data / "chorales"))
    recipe = str(ROOT / "configs" / "chorales.yaml")
    runs = args.runs / args.budget
    results: dict = {"nll": {}, "seeds": budget["seeds"], "steps": budget["steps"], "machine": machine()}
    from txl.config import load_recipe

    cfg = load_recipe(recipe, {"model": budget["model"], "train": budget["train"]})
    results.update(batch=cfg.train.batch_size, tgt_len=cfg.train.tgt_len)
    chorales = str(args.data / "chorales")

    def txl_row(name: str, seed: int) -> dict:
        run = runs / f"chorales-{name}-s{seed}"
        stamp = run / "experiment.json"
        if stamp.is_file():
            row = json.loads(stamp.read_text())
        else:
            row = train_row(name, recipe, budget, seed, run, chorales, budget["steps"])
            row.update({k: v for k, v in eval_row(name, run, cfg.train.tgt_len, budget).items() if k != "seconds"})
            stamp.write_text(json.dumps(row))
        row["train_seconds"] = train_seconds(run)
        print(f"{name} seed {seed}: {row['loss']:.4f}", file=sys.stderr)
        return row

    def small(name: str) -> bool:
        """Whether a row's first seed lies within 3 standard deviations of xl's seeds: then it gets every seed."""
        xl = [r["loss"] for r in results["nll"]["xl"]]
        sd = float(np.std(xl, ddof=1)) if len(xl) > 1 else 0.0
        return abs(results["nll"][name][0]["loss"] - float(np.mean(xl))) < 3 * max(sd, 1e-3)

    target = 0
    for name in (*ROWS, "lstm"):  # (xl and xl-norec with every seed; vanilla and the LSTM too where they are close)
        for k, seed in enumerate(budget["seeds"]):
            if k == 1 and name in ("vanilla", "lstm") and not small(name):
                break
            if name == "lstm":
                out = runs / f"chorales-lstm-s{seed}.json"
                row = lstm_row(recipe, budget, seed, chorales, budget["steps"], target, out)
                print(f"lstm seed {seed}: {row['loss']:.4f}", file=sys.stderr)
            else:
                row = txl_row(name, seed)
            results["nll"].setdefault(name, []).append(row)
        target = results["nll"]["xl"][0]["params"]
    # 2. the quartets' memory sweep
    if not (args.data / "quartets" / "test").is_dir():
        txl("data", "get", "quartets", "--out", str(args.data / "quartets"))
    quartets = str(args.data / "quartets")
    results.update(quartet_steps=budget["quartet_steps"], quartet_mem=cfg.model.mem_len, sweep={})
    for name in ("xl",):  # (the sweep of the paper: Transformer-XL's memory, 0 = no memory at all)
        run = runs / f"quartets-{name}"
        if not (run / "experiment.json").is_file():
            train_row(name, recipe, budget, budget["seeds"][0], run, quartets, budget["quartet_steps"])
            (run / "experiment.json").write_text("{}")
        points = []
        for m in budget["memories"]:
            out = eval_row(name, run, cfg.train.tgt_len, budget, mem_len=m)
            points.append((m, out["loss"]))
        results["sweep"][name] = points
        print(f"{name} sweep: {points}", file=sys.stderr)
    # 3. generation
    results.update(pieces=budget["pieces"], bars=budget["bars"])
    results["gen"] = generated_measures(runs / f"chorales-xl-s{budget['seeds'][0]}", budget, args.data / "chorales")
    results["minutes"] = (time.time() - t_start) / 60
    results["reading"] = reading(results)
    (runs / "results.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    if args.write:
        write_page(results, args, args.write)


if __name__ == "__main__":
    main()
