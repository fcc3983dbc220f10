"""Which recipe lets Transformer-XL use a memory longer than in training? The levers of issue 41, screened on valid.

    .venv/bin/python experiments/long_range_levers.py --write docs/paper.md    # ~1 hour on 2 CPU cores
    .venv/bin/python experiments/long_range_levers.py --steps 12 --docs 1 --doc_chars 2000 --memories 128 \\
        --model '{"n_layer": 2, "d_model": 64, "n_head": 2, "d_head": 32, "d_inner": 128, "mem_len": 32}' \\
        --tgt_len 32 --batch 4 --runs /tmp/levers   # a check in seconds

Each lever is the xl row of `experiments/long_range.py` (`configs/sympy_char.yaml`) with one change, trained for the
same steps and seed (shorter than the full experiment: a screen), then scored on the first valid documents (never
test) read as one stream, at its training memory and at the longest evaluation memory: the goal of issue 41 is a
bpc at least 2% lower at the longest memory. A lever that needs no training of its own (an evaluation setting)
reuses the baseline's run. Run folders are kept under --runs (an interrupted screen resumes; a finished row is
reused), and the scores are cached per run with their settings.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import long_range as lr  # noqa: E402  (the experiment's training, documents and scoring)

HEADING = "## Beyond a fixed-length context: levers screened on valid (`experiments/long_range_levers.py`)"
NAMES = ["baseline", "eval clamp", "clamp at memory", "half loss", "memory x2", "growing memory", "same length",
         "segment / 2", "steps x2", "deeper"]  # fmt: skip


def lever(name: str, cfg, steps: int) -> tuple[str, dict | None, int | None]:
    """(what it is, its `txl train` options over the recipe's (None: the baseline's run, not trained again), the
    evaluation clamp_len or None for the run's own), for the recipe ``cfg`` (a RunConfig)."""
    mem, tgt, batch, m = cfg.model.mem_len, cfg.train.tgt_len, cfg.train.batch_size, cfg.model
    third = [[0, mem // 4], [steps // 3, mem // 2], [2 * steps // 3, mem]]
    deeper = {"n_layer": 2 * m.n_layer, "d_model": 3 * m.d_model // 4, "n_head": 3 * m.n_head // 4, "d_head": m.d_head,
              "d_inner": 3 * m.d_inner // 4}  # fmt: skip
    deeper["d_inner"] = same_parameters(m, deeper)
    return {
        "same length": ("every query sees mem_len keys in training too", {"model.same_length": "true"}, None),
        "segment / 2": (
            f"segments of {tgt // 2} characters, {2 * batch} of them per step (the same tokens), memory {mem}",
            {"train.tgt_len": tgt // 2, "train.batch_size": 2 * batch},
            None,
        ),
        "steps x2": (f"{2 * steps} steps", {"train.max_steps": 2 * steps}, None),
        "deeper": (
            f"{deeper['n_layer']} layers of d_model {deeper['d_model']}, d_inner {deeper['d_inner']} (same parameters)",
            {f"model.{k}": v for k, v in deeper.items()},
            None,
        ),
        "baseline": (f"the recipe: memory {mem}, distances not clamped", {}, None),
        "eval clamp": (
            f"the baseline's run; distances beyond training's longest ({mem + tgt - 1}) clamped in evaluation",
            None,
            mem + tgt - 1,
        ),
        "clamp at memory": (
            f"distances >= {mem} share one embedding, in training and evaluation",
            {"model.clamp_len": mem},
            None,
        ),
        "half loss": (
            "only the last half of each segment scored (the paper's Table 6)",
            {"train.loss_fraction": 0.5},
            None,
        ),
        "memory x2": (f"training memory {2 * mem}", {"model.mem_len": 2 * mem}, None),
        "growing memory": (
            f"the memory grows in training: {mem // 4}, {mem // 2} from step {steps // 3}, {mem} from {2 * steps // 3}",
            {"train.mem_len_schedule": json.dumps(third)},
            None,
        ),
    }[name]


def same_parameters(model, shape: dict) -> int:
    """The d_inner that gives ``shape`` (model settings over ``model``'s) the parameters of ``model``."""
    import dataclasses

    from txl.model.modeling import TransformerXLLM

    def count(cfg) -> int:
        return sum(p.numel() for p in TransformerXLLM(cfg, init=False).parameters())

    cfg = dataclasses.replace(model, **shape)
    return lr.matched_d_inner(cfg, count(cfg), count(model))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1500, help="training steps per lever")
    ap.add_argument("--levers", help="comma-separated names (default: all)")
    ap.add_argument("--recipe", default=str(lr.ROOT / "configs" / "sympy_char.yaml"))
    ap.add_argument("--data", type=Path, default=lr.ROOT / "data" / "sympy")
    ap.add_argument("--runs", type=Path, default=lr.ROOT / "runs" / "long_range_levers")
    ap.add_argument("--docs", type=int, default=6, help="valid documents scored")
    ap.add_argument("--doc_chars", type=int, help="cut each document to this many characters")
    ap.add_argument("--memories", default="2048", help="the longest evaluation memory (also any others, e.g. 512,2048)")
    ap.add_argument("--model", default="{}", help="model settings over the recipe's (JSON), e.g. for a quick check")
    ap.add_argument("--batch", type=int, help="training batch size (default: the recipe's)")
    ap.add_argument("--tgt_len", type=int, help="training and evaluation segment length (default: the recipe's)")
    ap.add_argument("--cache_dir", help="where the tokenized corpus is cached (default: txl's)")
    ap.add_argument("--write", type=Path, help="write the table into this markdown file")
    args = ap.parse_args()
    names = args.levers.split(",") if args.levers else NAMES
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise SystemExit(f"--levers: unknown {unknown}; choose from {NAMES}")
    if not (args.data / "train.txt").is_file():
        lr.txl("data", "get", "sympy", "--out", str(args.data))
    sys.path.insert(0, str(lr.ROOT / "src"))
    import yaml

    from txl.config import load_recipe

    model = json.loads(args.model)
    train = {k: v for k, v in (("tgt_len", args.tgt_len), ("batch_size", args.batch)) if v}
    base_cfg = load_recipe(args.recipe, {"model": model, "train": train})
    common = ["--config", args.recipe, "--data.path", str(args.data), "--data.dataset", "sympy",
              "--train.max_steps", str(args.steps), "--train.eval_interval", "0", "--train.device", "cpu"]  # fmt: skip
    common += lr.flags("model", model) + (["--train.batch_size", str(args.batch)] if args.batch else [])
    common += ["--train.tgt_len", str(args.tgt_len)] if args.tgt_len else []
    common += ["--data.cache_dir", args.cache_dir] if args.cache_dir else []
    docs = lr.documents(args.data, "valid", args.docs, args.doc_chars)
    longest = [int(m) for m in args.memories.split(",")]
    t0 = time.time()
    rows = {}
    for name in names:
        what, options, eval_clamp = lever(name, base_cfg, args.steps)
        run = args.runs / ("baseline" if options is None else re.sub(r"[^a-z0-9]+", "-", name).strip("-"))
        extra = [f"--{k}={v}" for k, v in (options or {}).items()]
        lr.txl("train", *common, "--run_dir", str(run), *extra)  # (after --config, which sets a run_dir)
        saved = yaml.safe_load((run / "config.yaml").read_text())
        train_memory, clamp = saved["model"]["mem_len"], saved["model"]["clamp_len"]
        clamp = eval_clamp if eval_clamp is not None else clamp
        if max(longest) <= train_memory:
            raise SystemExit(
                f"--memories {args.memories}: the longest must exceed {name}'s training memory {train_memory}"
            )
        memories = sorted({train_memory, *longest})
        key = {"steps": args.steps, "docs": len(docs), "doc_chars": args.doc_chars, "memories": memories,
               "clamp_len": clamp}  # fmt: skip
        cache = run / f"levers_{clamp}.json"
        scores = json.loads(cache.read_text()) if cache.exists() else {}
        if scores.get("key") != key:
            settings = {"tgt_len": base_cfg.train.tgt_len, "clamp_len": clamp}
            sweep = lr.evaluate_row("xl", run, docs, {"memories": memories}, settings, "cpu")["sweep"]
            scores = {"key": key, "sweep": sweep}
            cache.write_text(json.dumps(scores))
        rows[name] = {"what": what, "train_memory": train_memory, "clamp_len": clamp, "sweep": scores["sweep"]}
        at_train, at_longest = scores["sweep"][str(train_memory)], scores["sweep"][str(max(longest))]
        print(f"{name}: {at_train['bpc']:.4f} at {train_memory}, {at_longest['bpc']:.4f} at {max(longest)} "
              f"({100 * (1 - at_longest['bpc'] / at_train['bpc']):+.2f}%)", flush=True)  # fmt: skip
    text = report(args, rows, docs, base_cfg, (time.time() - t0) / 60)
    print(text)
    if args.write:
        lr.write_section(args.write, HEADING, text)


def report(args, rows: dict, docs: list[str], cfg, minutes: float) -> str:
    longest = max(int(m) for m in args.memories.split(","))
    buckets = [f"{lo}-{hi or '...'}" for lo, hi in lr.BUCKETS]
    lines = [
        HEADING,
        "",
        f"Command: `python experiments/long_range_levers.py --steps {args.steps}"
        + (" --write docs/paper.md`" if args.write else "`")
        + f"; wall time {minutes:.0f} minutes ({cfg.train.threads} CPU threads). Each lever: the xl model of "
        "`configs/sympy_char.yaml` "
        f"({cfg.model.n_layer} layers, d_model {cfg.model.d_model}) with one change, {args.steps} steps of "
        f"{args.batch or cfg.train.batch_size} x {cfg.train.tgt_len} characters, the same seed; scored on the first "
        f"{len(docs)} valid documents ({sum(len(d) for d in docs):,} characters, one stream, same_length). The goal: "
        f"bpc at the longest memory ({longest}) at least 2% below the bpc at the training memory.",
        "",
        f"| lever | what | bpc at training memory | bpc at {longest} | relative | gain by position ("
        + ", ".join(buckets)
        + ") |",
        "|---|---|---|---|---|---|",
    ]

    def gain(r: dict) -> float:
        return 1 - r["sweep"][str(longest)]["bpc"] / r["sweep"][str(r["train_memory"])]["bpc"]

    for name, r in rows.items():
        train, far = r["sweep"][str(r["train_memory"])], r["sweep"][str(longest)]
        pairs = zip(train["positions"], far["positions"], strict=True)
        by_pos = ", ".join("" if a is None else f"{a - b:+.3f}" for a, b in pairs)
        lines.append(
            f"| {name} | {r['what']} | {train['bpc']:.4f} (memory {r['train_memory']}) | {far['bpc']:.4f} | "
            f"{100 * gain(r):+.2f}% | {by_pos} |"
        )
    best = max(rows, key=lambda n: gain(rows[n]))
    lines += [
        "",
        f"Largest relative gain: **{best}**. (Positive: the longest memory scores lower; by position: bpc at the "
        "training memory minus bpc at the longest, characters from each document's start.)",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
