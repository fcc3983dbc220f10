"""Beyond a fixed-length context: does Transformer-XL use text beyond its training segment, on a long-range corpus?

    .venv/bin/python experiments/long_range.py --budget full --write docs/paper.md   # ~2 hours on 2 CPU cores
    .venv/bin/python experiments/long_range.py --budget quick                      # ~3 minutes (the slow test)
    python3 experiments/long_range.py --budget gpu --device cuda --write docs/paper.md   # a lent GPU (bigger)

Data: `txl data get sympy` (whole Python source files of sympy 1.14.0; any folder with {train,valid,test}.txt whose
documents end with a form-feed line works, --data). Three models of `configs/sympy_char.yaml` with the same
parameters (within 2%: ``d_inner`` absorbs the learned position table), steps, tokens and seed, each an ordinary
run folder under ``--runs`` (trained by `txl train`; an interrupted experiment resumes, a finished row is kept):

| row | what | training memory | positions |
|---|---|---|---|
| xl | Transformer-XL | the recipe's mem_len | relative (attn_type 0), clamp_len of the recipe |
| xl-norec | the same without recurrence | 0 | relative |
| vanilla | Al-Rfou et al. (2018) | 0 | learned absolute (attn_type 3) |

Measured on whole test documents (each read from its first character, memory empty at its start):
- the memory sweep: bpc of xl and xl-norec at evaluation memories 0 ... 2,048 (and longer where the budget says),
  same_length, the recipe's clamp_len; the vanilla model reads windows of its training length (stride half of it);
- bpc by position inside a document (0-128, 128-512, 512-2k, 2k-8k, 8k+ characters) for every model, xl at its
  training memory and at the longest: where the memory helps, late positions gain most;
- RECL (r = 0.1, 0.5, 1.0; the paper's Appendix C, `txl.infer.recl`) of the three over contexts 128 ... 2,048
  (step 128); the vanilla model reads no further than its learned positions (as the paper's Table 8: 128);
- attention mass by distance (Appendix D, `txl attention`) of xl at the longest memory: which heads reach far.
Every setting was chosen on valid (`--split valid`), never on test; the numbers are written as measured.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Beyond a fixed-length context: a long-range corpus (`experiments/long_range.py`)"
HEADING_GPU = "## Beyond a fixed-length context on a lent GPU (`experiments/long_range.py --budget gpu`)"
ROWS = {  # name: (attn_type, recurrence)
    "xl": (0, True),
    "xl-norec": (0, False),
    "vanilla": (3, False),
}
DOCUMENT_END = "\f\n"  # (txl.data.sources.DOCUMENT_END)
BUCKETS = [(0, 128), (128, 512), (512, 2048), (2048, 8192), (8192, None)]
BUDGETS = {
    "quick": dict(
        steps=30,
        model=dict(n_layer=2, d_model=64, n_head=2, d_head=32, d_inner=128, mem_len=32),
        train=dict(batch_size=8, tgt_len=32),
        memories=[0, 32, 64, 128],
        docs=3,
        doc_chars=3000,
        recl_tokens=200,
        recl_contexts=[32, 64, 96, 128],
        attention_tokens=300,
        device="cpu",
    ),
    "full": dict(
        steps=3000,
        model={},
        train={},
        memories=[0, 128, 256, 512, 1024, 2048],
        docs=20,  # (428,507 characters: the whole test split, 47 documents and 912,730 characters, takes ~2x longer)
        doc_chars=None,
        recl_tokens=1000,
        recl_contexts=list(range(128, 2049, 128)),
        attention_tokens=3000,
        device="cpu",
    ),
    "gpu": dict(
        steps=1000,
        model=dict(n_layer=8, d_model=512, n_head=8, d_head=64, d_inner=2048),
        train=dict(
            batch_size=32,
            precision="bf16",
            max_time=120,
            threads=4,
            log_interval=500,
            eval_interval=4000,
            eval_batch_size=16,
            checkpoint_interval=2000,
        ),
        memories=[0, 256, 1024, 4096],
        docs=6,
        doc_chars=None,
        recl_tokens=2000,
        recl_contexts=list(range(128, 2049, 128)),
        attention_tokens=3000,
        device="cuda",
    ),
}


def txl(*args: str) -> str:
    """Run `python -m txl ARGS` and return its stdout (stderr passes through)."""
    res = subprocess.run([sys.executable, "-m", "txl", *args], stdout=subprocess.PIPE, text=True, check=True)
    return res.stdout


def flags(section: str, values: dict) -> list[str]:
    return [f"--{section}.{k}={v}" for k, v in values.items()]


def row_options(name: str, recipe: str, budget: dict, common: list[str]) -> tuple[list[str], int, dict]:
    """The `txl train` options of a row (the budget's model over the recipe's), with d_inner set so that its
    parameter count is within 2% of the xl row's; returns (options, parameters, the row's model settings)."""
    from txl.config import load_recipe
    from txl.model.modeling import TransformerXLLM

    attn_type, recurrence = ROWS[name]
    model = dict(budget["model"])
    model["attn_type"] = attn_type
    if not recurrence:
        model["mem_len"] = 0
    if attn_type == 3:
        model["clamp_len"] = -1  # (absolute positions: no distances to clamp)

    def count(m: dict) -> tuple[int, object]:
        over = {"model": m, "train": budget["train"]} | ({"eval": {"clamp_len": -1}} if m.get("attn_type") == 3 else {})
        cfg = load_recipe(recipe, over).model
        return sum(p.numel() for p in TransformerXLLM(cfg, init=False).parameters()), cfg

    target, _ = count(budget["model"])
    n, cfg = count(model)
    model["d_inner"] = matched_d_inner(cfg, n, target)
    n, cfg = count(model)
    if abs(n - target) > 0.02 * target:
        raise SystemExit(f"row {name}: {n:,} parameters, more than 2% from {target:,}")
    extra = flags("eval", {"clamp_len": -1}) if attn_type == 3 else []
    return [*common, *flags("model", model), *flags("train", budget["train"]), *extra], n, model


def matched_d_inner(cfg, n: int, target: int) -> int:
    """The d_inner that brings a model ``cfg`` of ``n`` parameters to ``target``: each unit of d_inner is
    2 * d_model + 1 parameters per layer (the two feed-forward matrices and a bias)."""
    return cfg.d_inner + round((target - n) / (cfg.n_layer * (2 * cfg.d_model + 1)))


# -- scoring whole documents ----------------------------------------------------------------------------------------


def documents(data: Path, split: str, count: int | None, max_chars: int | None) -> list[str]:
    """The first ``count`` documents of a split (None: all; each cut to ``max_chars`` where given), without their end
    marks."""
    text = (data / f"{split}.txt").read_text(encoding="utf-8")
    docs = [d for d in text.split(DOCUMENT_END) if d.strip()][:count]
    return [d[:max_chars] if max_chars else d for d in docs]


def load(run: Path, device: str):
    import torch

    from txl.data import Tokenizer
    from txl.model.modeling import TransformerXLLM
    from txl.util.distributed import World
    from txl.util.folders import resolve_model_dir

    folder = resolve_model_dir(run)
    model = TransformerXLLM.from_pretrained(folder).to(device).eval()
    tok = Tokenizer.load(folder / "tokenizer.json").for_model(model.config.n_token, folder / "tokenizer.json")
    return model, tok, World(device=torch.device(device))


def score(model, world, ids, *, memory: int | None, window: int | None, tgt_len: int, clamp_len: int):
    """Per-token losses of a token stream (loss k: token k + 1 predicted from the tokens before it): with a memory
    (relative positions, same_length, one column: every token has the whole stream before it) or, for the vanilla
    model, windows of ``window`` tokens with stride ``window // 2``."""
    import numpy as np

    from txl.infer.evaluate import evaluate, evaluate_sliding

    ids = np.asarray(ids, dtype=np.int64)
    if window is not None:
        res = evaluate_sliding(model, ids, window=window, stride=max(1, window // 2), batch_size=32,
                               return_losses=True, world=world)  # fmt: skip
    else:
        res = evaluate(model, ids, batch_size=1, tgt_len=tgt_len, mem_len=memory, clamp_len=clamp_len,
                       same_length=memory > 0, return_losses=True, world=world)  # fmt: skip
    return res.losses


def stream_of(tok, docs: list[str]):
    """The documents as the split holds them (each followed by its end mark) as one id stream, and each token's
    position inside its document (-1: an end mark)."""
    import numpy as np

    end = tok.encode(DOCUMENT_END)
    ids, pos = [], []
    for d in docs:
        doc = tok.encode(d)
        ids += doc + end
        pos += list(range(len(doc))) + [-1] * len(end)
    return np.asarray(ids, dtype=np.int64), np.asarray(pos)


def reading(losses, positions) -> dict:
    """bpc over the documents' tokens, and by position inside a document (BUCKETS)."""
    import math

    scored = positions[1:]  # (loss k predicts token k + 1)
    keep = scored >= 0
    out = {"bpc": float(losses[keep].sum() / keep.sum() / math.log(2)), "positions": []}
    for lo, hi in BUCKETS:
        sel = keep & (scored >= lo) & (scored < (hi if hi is not None else 1 << 62))
        out["positions"].append(float(losses[sel].sum() / sel.sum() / math.log(2)) if sel.any() else None)
    return out


def evaluate_row(name: str, run: Path, docs: list[str], budget: dict, settings: dict, device: str) -> dict:
    """The row's bpc at each memory (or its windows) and by position, on the documents read in their order as the
    split holds them (one stream, as the model was trained: the memory at a document's start holds the end of the
    one before)."""
    import torch

    model, tok, world = load(run, device)
    ids, positions = stream_of(tok, docs)
    tgt_len, clamp = settings["tgt_len"], settings["clamp_len"]
    result: dict = {"chars": sum(len(d) for d in docs), "tokens": int((positions >= 0).sum()), "sweep": {}}
    with torch.no_grad():
        if ROWS[name][0] == 3:  # absolute positions: windows of the training length
            losses = score(model, world, ids, memory=None, window=settings["window"], tgt_len=tgt_len, clamp_len=-1)
            result["window"] = reading(losses, positions)
            return result
        for m in budget["memories"]:
            t0 = time.perf_counter()
            losses = score(model, world, ids, memory=m, window=None, tgt_len=tgt_len, clamp_len=clamp)
            result["sweep"][str(m)] = reading(losses, positions)  # (str: the keys as the JSON cache holds them)
            print(f"{name}: memory {m}: bpc {result['sweep'][str(m)]['bpc']:.4f} ({time.perf_counter() - t0:.0f} s)")
    return result


def recl_of(runs: dict[str, Path], docs: list[str], budget: dict, settings: dict, device: str) -> dict:
    """RECL (txl.infer.recl) of the rows on the first tokens of the documents read as one stream."""
    import numpy as np

    from txl.infer.recl import context_losses, recl

    losses = {}
    for name, run in runs.items():
        model, tok, world = load(run, device)
        ids = np.asarray(tok.encode(DOCUMENT_END.join(docs))[: budget["recl_tokens"] + 1], dtype=np.int64)
        vanilla = ROWS[name][0] == 3  # (read no further than its learned positions, as the paper's Table 8 does)
        losses[name] = context_losses(
            model, ids, budget["recl_contexts"], sliding=vanilla, tgt_len=settings["tgt_len"],
            clamp_len=settings["clamp_len"] if not vanilla else None, same_length=True, batch_size=32,
            max_window=model.config.max_klen if vanilla else None, world=world,
        )  # fmt: skip
    out = {}
    for r in (0.1, 0.5, 1.0):
        res = recl(losses, budget["recl_contexts"], r)
        out[str(r)] = {"recl": res.recl, "reached": res.reached}
    return out


def attention_reach(run: Path, sample: Path, memory: int, tokens: int, out: Path) -> dict:
    """`txl attention` of a row at ``memory``: each head's attention mass beyond 128 and beyond 512 keys back."""
    txl("attention", "--model", str(run), "--data", str(sample), "--mem_len", str(memory), "--tokens", str(tokens),
        "--same_length", "true", "--out", str(out))  # fmt: skip
    record = json.loads((out / "attention.json").read_text())
    heads = {}
    for layer, per_head in enumerate(record["by_distance"]):  # [L][H][distance]: probability averaged over queries
        for head, curve in enumerate(per_head):
            total = sum(curve) or 1.0
            heads[f"{layer}.{head}"] = {"beyond_128": sum(curve[129:]) / total, "beyond_512": sum(curve[513:]) / total}
    return heads


# -- the report -----------------------------------------------------------------------------------------------------


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, r in results.items():
        if r["sweep"]:
            mems = sorted(r["sweep"], key=int)
            a.plot([max(int(m), 1) for m in mems], [r["sweep"][m]["bpc"] for m in mems], marker="o", label=name)
    a.set_xscale("log", base=2)
    a.set_xlabel("evaluation memory (0 plotted at 1)")
    a.set_ylabel("test bpc")
    a.grid(alpha=0.3)
    a.legend(fontsize=8)
    labels = [f"{lo}-{hi or '...'}" for lo, hi in BUCKETS]
    for name, r in results.items():
        for tag, rec in curves(name, r).items():
            b.plot(range(len(BUCKETS)), rec["positions"], marker="o", label=tag)
    b.set_xticks(range(len(BUCKETS)), labels, fontsize=8)
    b.set_xlabel("position inside the document (characters)")
    b.set_ylabel("bpc")
    b.grid(alpha=0.3)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def curves(name: str, r: dict) -> dict:
    """The readings of a row shown by position: xl at its training memory and the longest; norec at 0 and the
    longest; vanilla's windows."""
    if not r["sweep"]:
        return {f"{name} (windows)": r["window"]}
    mems = sorted(r["sweep"], key=int)
    first = str(r["train_memory"]) if str(r["train_memory"]) in r["sweep"] else mems[0]
    return {f"{name} mem {first}": r["sweep"][first], f"{name} mem {mems[-1]}": r["sweep"][mems[-1]]}


def verdict(results: dict, recls: dict) -> list[str]:
    """The goal's three points, computed from the numbers (never edited by hand)."""
    xl = results["xl"]
    mems = sorted(xl["sweep"], key=int)
    train, longest = xl["sweep"][str(xl["train_memory"])], xl["sweep"][mems[-1]]
    gain = 1 - longest["bpc"] / train["bpc"]
    late = [t - lng for t, lng in zip(train["positions"], longest["positions"], strict=True) if t is not None]
    lines = [
        f"- XL at the longest memory ({mems[-1]}) against its training memory ({xl['train_memory']}): "
        f"{longest['bpc']:.4f} vs {train['bpc']:.4f} bpc, {100 * gain:+.2f}% relative "
        f"({'reached' if gain >= 0.02 else 'NOT reached'}: the goal is at least 2% lower).",
        f"- Gain by position (training memory minus longest, bpc): {', '.join(f'{x:+.4f}' for x in late)} "
        f"(late positions {'gain more' if len(late) > 1 and late[-1] > max(late[0], 0) else 'do NOT gain more'}).",
    ]
    for r, rec in recls.items():
        ours = rec["recl"]["xl"]
        others = {k: v for k, v in rec["recl"].items() if k != "xl"}
        ok = all(ours > v for v in others.values())
        shown = ", ".join(f"{k} {v}{'' if rec['reached'][k] else '+'}" for k, v in rec["recl"].items())
        lines.append(f"- RECL r = {r}: {shown} ({'XL longest' if ok else 'XL NOT longer than both'}).")
    return lines


def report(args, budget: dict, results: dict, recls: dict, reach: dict, minutes: float, machine: str) -> str:
    mems = sorted(results["xl"]["sweep"], key=int)
    head = "| row | parameters | " + " | ".join(f"mem {m}" for m in mems) + " |"
    rows = [head, "|---|---|" + "---|" * len(mems)]
    for name, r in results.items():
        if r["sweep"]:
            cells = [f"{r['sweep'][m]['bpc']:.4f}" for m in mems]
        else:
            cells = [f"{r['window']['bpc']:.4f} (windows of {r['window_len']})"] + [""] * (len(mems) - 1)
        rows.append(f"| {name} | {r['params']:,} | " + " | ".join(cells) + " |")
    pos = ["| reading | " + " | ".join(f"{lo}-{hi or '...'}" for lo, hi in BUCKETS) + " |", "|---|" + "---|" * 5]
    for name, r in results.items():
        for tag, rec in curves(name, r).items():
            pos.append(f"| {tag} | " + " | ".join("" if x is None else f"{x:.4f}" for x in rec["positions"]) + " |")
    far = sorted(reach.items(), key=lambda kv: -kv[1]["beyond_512"])[:4]
    xl = results["xl"]
    lines = [
        HEADING_GPU if args.budget == "gpu" else HEADING,
        "",
        f"Command: `python experiments/long_range.py --budget {args.budget}"
        + (f" --device {args.device}" if args.device != "cpu" else "")
        + (" --write docs/paper.md`" if args.write else "`")
        + f". Machine: {machine}; wall time {minutes:.0f} minutes. Data: `txl data get sympy` (whole sympy 1.14.0 "
        f"source files); scored: the first {xl['docs']} {args.split} documents, in order "
        f"({xl['chars']:,} characters). Models: `configs/sympy_char.yaml`"
        + (f" with {json.dumps(budget['model'])}" if budget["model"] else "")
        + f", {args.steps or budget['steps']} steps of {xl['batch']} x {xl['tgt_len']} characters each, the same "
        f"seed; xl trains with a memory of {xl['train_memory']} (distances not clamped); evaluation: clamp_len "
        f"{xl['clamp_len']}, same_length; the vanilla model "
        f"(Al-Rfou et al.) learns absolute positions and reads windows of {results['vanilla']['window_len']} "
        "(stride half of it). The documents are read in their order as one stream (as training reads them: at a "
        "document's start the memory holds the end of the one before); positions count from each document's start.",
        "",
        *rows,
        "",
        "bpc by position inside a document (characters from its start):",
        "",
        *pos,
        "",
        "The goal (issue 41), computed from the numbers above:",
        "",
        *verdict(results, recls),
        "",
        "Heads of xl reaching furthest at the longest memory (`txl attention`: the share of each head's attention "
        "beyond 512 / 128 keys back): "
        + ", ".join(f"{k} {v['beyond_512']:.1%} / {v['beyond_128']:.1%}" for k, v in far)
        + ".",
        "",
        f"![long range](long_range{'_gpu' if args.budget == 'gpu' else ''}.png)",
    ]
    return "\n".join(lines) + "\n"


def write_section(path: Path, heading: str, text: str) -> None:
    doc = path.read_text(encoding="utf-8") if path.exists() else ""
    if f"\n{heading}\n" in doc:
        start = doc.index(f"\n{heading}\n") + 1
        nxt = doc.find("\n## ", start + len(heading))
        doc = doc[:start] + text + ("\n" + doc[nxt + 1 :] if nxt >= 0 else "")
    elif heading == HEADING and f"\n{HEADING_GPU}\n" in doc:  # (the CPU section first)
        at = doc.index(f"\n{HEADING_GPU}\n") + 1
        doc = doc[:at] + text + "\n" + doc[at:]
    else:
        doc = doc.rstrip("\n") + "\n\n" + text
    path.write_text(doc, encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", choices=sorted(BUDGETS), default="quick")
    ap.add_argument("--steps", type=int, help="training steps per row (default: the budget's)")
    ap.add_argument("--recipe", default=str(ROOT / "configs" / "sympy_char.yaml"))
    ap.add_argument("--data", type=Path, default=ROOT / "data" / "sympy")
    ap.add_argument("--split", default="test", help="valid while choosing settings; test for the report")
    ap.add_argument("--runs", type=Path, default=None, help="run folders (default: runs/long_range_BUDGET)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: the budget's)")
    ap.add_argument("--parallel", action="store_true", help="train the rows at once (a GPU has room for three)")
    ap.add_argument("--docs", type=int, help="documents scored (default: the budget's)")
    ap.add_argument("--memories", help="evaluation memories, e.g. 0,128,512 (default: the budget's)")
    ap.add_argument("--cache_dir", help="where the tokenized corpus is cached (default: txl's)")
    ap.add_argument("--write", type=Path, help="write the results section into this markdown file")
    args = ap.parse_args()
    budget = dict(BUDGETS[args.budget])
    if args.docs:
        budget["docs"] = args.docs
    if args.memories:
        budget["memories"] = [int(m) for m in args.memories.split(",")]
    args.device = args.device or budget["device"]
    runs = args.runs or ROOT / "runs" / f"long_range_{args.budget}"
    runs.mkdir(parents=True, exist_ok=True)
    if not (args.data / "train.txt").is_file():
        txl("data", "get", "sympy", "--out", str(args.data))
    sys.path.insert(0, str(ROOT / "src"))
    from txl.config import load_recipe

    t0 = time.time()
    steps = args.steps or budget["steps"]
    common = ["--data.path", str(args.data), "--data.dataset", "sympy", "--train.max_steps", str(steps),
              "--train.device", args.device]  # fmt: skip
    common += ["--data.cache_dir", args.cache_dir] if args.cache_dir else []
    plan = {name: row_options(name, args.recipe, budget, common) for name in ROWS}

    def train(name: str) -> None:
        txl("train", "--config", args.recipe, "--run_dir", str(runs / name), *plan[name][0])

    if args.parallel:
        with ThreadPoolExecutor(len(ROWS)) as pool:
            list(pool.map(train, ROWS))
    else:
        for name in ROWS:
            train(name)
    cfg = load_recipe(args.recipe, {"model": budget["model"], "train": budget["train"]})
    settings = {"tgt_len": cfg.train.tgt_len, "clamp_len": cfg.eval.clamp_len, "window": cfg.train.tgt_len}
    docs = documents(args.data, args.split, budget["docs"], budget["doc_chars"])
    results = {}
    for name in ROWS:
        cached = runs / name / "long_range.json"
        key = {"steps": steps, "split": args.split, "docs": len(docs), "memories": budget["memories"]}
        saved = json.loads(cached.read_text()) if cached.exists() else {}
        if saved.get("key") != key:
            saved = {"key": key, **evaluate_row(name, runs / name, docs, budget, settings, args.device)}
            cached.write_text(json.dumps(saved))
        mem = plan[name][2].get("mem_len", cfg.model.mem_len)
        results[name] = saved | {"params": plan[name][1], "train_memory": mem, "docs": len(docs),
                                 "window_len": settings["window"], "tgt_len": settings["tgt_len"],
                                 "clamp_len": settings["clamp_len"], "batch": cfg.train.batch_size}  # fmt: skip
    recls = recl_of({n: runs / n for n in ROWS}, docs, budget, settings, args.device)
    sample = runs / "attention_sample.txt"
    sample.write_text(docs[0], encoding="utf-8")
    longest = max(budget["memories"])
    reach = attention_reach(runs / "xl", sample, longest, budget["attention_tokens"], runs / "attention_xl")
    (runs / "long_range.json").write_text(json.dumps({"results": results, "recl": recls, "reach": reach}, indent=1))
    image = runs / f"long_range{'_gpu' if args.budget == 'gpu' else ''}.png"
    plot(results, image)
    import platform

    import torch

    machine = (
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    if args.device.startswith("cuda"):
        machine = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    text = report(args, budget, results, recls, reach, (time.time() - t0) / 60, machine)
    print(text)
    if args.write:
        write_section(args.write, HEADING_GPU if args.budget == "gpu" else HEADING, text)
        (args.write.parent / image.name).write_bytes(image.read_bytes())


if __name__ == "__main__":
    main()
