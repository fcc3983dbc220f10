"""The WikiText-103-size model on a laptop, side by side with Hugging Face TransfoXL 4.46.3 on the same weights:
load time and peak memory, scoring from raw text at mem_len 1,600, and generation.

    .venv/bin/python benchmarks/wt103_model.py --write docs/benchmarks.md     # ~6 minutes on 2 cores

The model is HF's ``TransfoXLConfig()`` default, which is ``transfo-xl-wt103`` (18 layers, d_model 1024, 267,735
words, adaptive input/softmax with div_val 4): random weights made here by HF (seeded), saved by HF as
model.safetensors, and a tokenizer made by HF's own ``TransfoXLTokenizer`` (the Moses-tokenized words of
Shakespeare's train split, then filler symbols up to 267,735), saved as HF saves it (vocab.pkl). txl's folder is
made from it by the user's path, ``txl convert hf --trust-pickle``. Everything is kept under ``--work``.

* Load: each implementation in a fresh process, alternating, ``--repeats`` times: the time of ``from_pretrained``,
  the time to the first result (``from_pretrained`` + a forward of 64 tokens from an empty memory: HF's loading
  maps the file and reads it during that forward) and the peak RSS through it, over the weights' bytes. "Peak"
  counts the whole process; "model's" subtracts the process's RSS before loading (Python, torch, imports), which
  differs between the two.
* Scoring: one process holds both models; a paragraph of raw text is encoded by each tokenizer (the ids must be
  equal), and a 128-token segment is scored on top of a 1,600-position memory (the paper's WT103 evaluation
  setting; same random memory for both), alternating, medians. The NLLs must agree.
* Generation: greedy, 20 new tokens after the raw-text prompt, txl's K/V-cached ``generate`` against HF's
  ``generate()``. HF starts from mem_len zero vectors (``init_mems``); it is given the original code's empty memory
  instead, as txl has, so the new tokens must be equal. txl's text is printed detokenised.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

from _report import replace_section
from model_speed import cpu_description, patched_hf

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## The WikiText-103-size model: load, memory, raw-text scoring and generation (vs HF)"
VOCAB = 267_735
PROMPT = "It's 1,000-year-old history, don't you think? The king paid $3.50 for 23,000 horses."
PARAGRAPH = (
    "Once more unto the breach, dear friends, once more; or close the wall up with our English dead. In peace "
    "there's nothing so becomes a man as modest stillness and humility: but when the blast of war blows in our "
    "ears, then imitate the action of the tiger; stiffen the sinews, summon up the blood, disguise fair nature with "
    "hard-favour'd rage. It's 1,000-year-old advice, and 23,000 soldiers heard it."
)


def make_folders(work: Path, data: Path) -> tuple[Path, Path]:
    """HF's folder (weights + vocab.pkl, made by transformers) and txl's (converted by `txl convert hf`)."""
    hf_dir, txl_dir = work / "hf", work / "txl"
    if not (hf_dir / "model.safetensors").exists():
        from transformers import TransfoXLConfig, TransfoXLTokenizer

        hf_mod = patched_hf()
        torch.manual_seed(0)
        model = hf_mod.TransfoXLLMHeadModel(TransfoXLConfig())  # = transfo-xl-wt103's configuration
        tok = TransfoXLTokenizer(special=["<eos>", "<unk>"])
        tok.count_file(str(data / "train.txt"))
        tok.build_vocab()
        for i in range(VOCAB - len(tok.idx2sym)):
            tok.add_symbol(f"<filler-{i}>")
        tok._update_total_vocab_size()  # (HF caches len() at construction)
        assert len(tok.idx2sym) == VOCAB
        tok.save_pretrained(hf_dir)
        model.save_pretrained(hf_dir, safe_serialization=True)
        del model
    if not (txl_dir / "model.safetensors").exists():
        subprocess.run([sys.executable, "-m", "txl", "convert", "hf", "--trust-pickle", str(hf_dir), str(txl_dir)],
                       check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    return hf_dir, txl_dir


LOAD_SCRIPT = textwrap.dedent(r"""
    import json, logging, re, sys, time, torch
    torch.set_num_threads(2)
    which, folder, dtype = sys.argv[1], sys.argv[2], sys.argv[3]
    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096
    if which == "hf":
        sys.path.insert(0, "benchmarks")
        from model_speed import patched_hf
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
        cls = patched_hf().TransfoXLLMHeadModel
    else:
        from txl import TransformerXLLM as cls
    base = rss()
    t0 = time.perf_counter()
    kw = {"fp32": {}, "bf16": {"dtype": torch.bfloat16}, "mmap": {"mmap": True}}[dtype]
    model = cls.from_pretrained(folder, **kw)
    load_s = time.perf_counter() - t0
    x = torch.randint(0, 20000, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # both from an empty memory (HF's default would attend to mem_len zero vectors)
        model(input_ids=x, mems=[torch.zeros(0, 1, 1024)] * 18) if which == "hf" else model(x)
    first_s = time.perf_counter() - t0
    peak = int(re.search(r"VmHWM:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024  # own peak
    print(json.dumps({"load_s": load_s, "first_s": first_s, "peak": peak, "base": base}))
""")


def measure_load(which: str, folder: Path, dtype: str = "fp32") -> dict:
    out = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, which, str(folder), dtype], capture_output=True,
                         text=True, check=True, cwd=ROOT)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-wt103")
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "shakespeare")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new_tokens", type=int, default=20)
    ap.add_argument("--write", type=Path, help="replace this benchmark's section in this Markdown file")
    args = ap.parse_args()
    torch.set_num_threads(2)
    logging.getLogger("transformers").setLevel(logging.CRITICAL)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    args.work.mkdir(parents=True, exist_ok=True)
    hf_dir, txl_dir = make_folders(args.work, args.data)
    weights = (txl_dir / "model.safetensors").stat().st_size
    print(f"weights: {weights / 2**30:.2f} GiB ({weights / 4:,.0f} fp32 values)", flush=True)

    loads: dict[str, list[dict]] = {"hf": [], "txl": [], "txl-bf16": [], "txl-mmap": []}
    for _ in range(args.repeats):
        loads["txl"].append(measure_load("txl", txl_dir))
        loads["hf"].append(measure_load("hf", hf_dir))
        loads["txl-bf16"].append(measure_load("txl", txl_dir, "bf16"))
        loads["txl-mmap"].append(measure_load("txl", txl_dir, "mmap"))
    print(json.dumps(loads), flush=True)

    # ---- one process, both models: raw text in, scores and tokens out
    from transformers import TransfoXLTokenizer

    from txl import Tokenizer, TransformerXLLM
    from txl.infer.generation import generate

    hf = patched_hf().TransfoXLLMHeadModel.from_pretrained(hf_dir).eval()
    hf.transformer.init_mems = lambda bsz: [torch.zeros(0, bsz, 1024) for _ in range(18)]  # the empty memory
    ours = TransformerXLLM.from_pretrained(txl_dir)
    os.environ["TRUST_REMOTE_CODE"] = "True"  # HF reads its own vocab.pkl with pickle (the file was made above)
    hf_tok = TransfoXLTokenizer.from_pretrained(hf_dir)
    tok = Tokenizer.from_pretrained(txl_dir)
    ids = tok.encode(PARAGRAPH)
    assert ids == hf_tok.encode(PARAGRAPH), "the tokenizers disagree on the raw text"
    seg = torch.tensor([(ids * 4)[:128]])
    mem_len = 1600
    hf.reset_memory_length(mem_len)
    g = torch.Generator().manual_seed(0)
    mems = [torch.randn(1, mem_len, 1024, generator=g) * 0.5 for _ in range(18)]
    hf_mems = [m.transpose(0, 1).contiguous() for m in mems]  # HF's memory is [M, B, D]
    times: dict[str, list[float]] = {"hf": [], "txl": []}
    with torch.no_grad():
        for k in range(args.repeats + 1):
            t = time.perf_counter()
            a = ours(seg[:, :-1], seg[:, 1:], mems=mems, mem_len=mem_len).losses
            t_txl = time.perf_counter() - t
            t = time.perf_counter()
            b = hf(input_ids=seg[:, :-1], labels=seg[:, :-1], mems=hf_mems).losses
            t_hf = time.perf_counter() - t
            if k:  # the first round warms up
                times["txl"].append(t_txl)
                times["hf"].append(t_hf)
    nll_diff = float((a[:, :-1] - b).abs().max())
    score = {k: 127 / med(v) for k, v in times.items()}
    print(json.dumps({"score_tok_s": score, "nll_max_diff": nll_diff}), flush=True)

    prompt = torch.tensor([tok.encode(PROMPT)])
    assert prompt[0].tolist() == hf_tok.encode(PROMPT)
    gen_times: dict[str, list[float]] = {"hf": [], "txl": []}
    for _ in range(2):
        t = time.perf_counter()
        mine = generate(ours, prompt, args.new_tokens, temperature=0.0, mem_len=mem_len)[0, prompt.shape[1] :]
        gen_times["txl"].append(time.perf_counter() - t)
        t = time.perf_counter()
        with torch.no_grad():
            theirs = hf.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                 do_sample=False, pad_token_id=0)[0, prompt.shape[1] :]  # fmt: skip
        gen_times["hf"].append(time.perf_counter() - t)
    same = mine.tolist() == theirs.tolist()
    gen = {k: args.new_tokens / min(v) for k, v in gen_times.items()}
    text = tok.decode(prompt[0].tolist() + mine.tolist())
    print(json.dumps({"gen_tok_s": gen, "same_tokens": same, "text": text}), flush=True)

    def row(name: str, rs: list[dict]) -> str:
        load, first = med([r["load_s"] for r in rs]), med([r["first_s"] for r in rs])
        peak, model = med([r["peak"] for r in rs]), med([r["peak"] - r["base"] for r in rs])
        return (
            f"| {name} | {load:.2f} s | {first:.2f} s | {peak / 2**30:.2f} GiB ({peak / weights:.2f}x) | "
            f"{model / weights:.2f}x |"
        )

    hf_first, txl_first, mmap_first = (med([r["first_s"] for r in loads[k]]) for k in ("hf", "txl", "txl-mmap"))
    lines = [
        HEADING,
        "",
        f"`{' '.join(['.venv/bin/python', 'benchmarks/wt103_model.py', *sys.argv[1:]])}` on "
        f"{time.strftime('%Y-%m-%d')}, 2 threads; {cpu_description()}. transfo-xl-wt103's configuration with random "
        f"weights made by HF ({weights / 2**30:.2f} GiB of fp32), txl's folder made by "
        "`txl convert hf --trust-pickle`. "
        f"Medians of {args.repeats} fresh processes per row, alternating.",
        "",
        "| load | from_pretrained | + first forward (64 tokens) | peak RSS through it (/ weights) | model's share "
        "(/ weights) |",
        "|---|---|---|---|---|",
        row("HF TransfoXL 4.46.3", loads["hf"]),
        row("txl", loads["txl"]),
        row("txl, `dtype=torch.bfloat16`", loads["txl-bf16"]),
        row("txl, `mmap=True` (opt-in, not bit-exact)", loads["txl-mmap"]),
        "",
        f"To the first result txl takes {txl_first / hf_first:.2f}x HF's time by default, "
        f"{mmap_first / hf_first:.2f}x with `mmap=True`. By default txl builds the model on the meta device "
        "(no initialisation) and reads the file straight into the parameters, tensor by tensor (`readinto`): the "
        "weights are in memory once, and `from_pretrained` returns with every weight read and checked (NaN/inf). HF "
        "memory-maps the file: its `from_pretrained` returns before reading, and the first forward pages the "
        "weights in. txl does not assign memory-mapped tensors by default: they are not 64-byte aligned, the GEMM "
        "then takes another path, and results differ in the last bits from the model that was saved (measured: "
        "5e-7). `from_pretrained(..., mmap=True)` does it when asked (HF's way: no read at load, no NaN check).",
        "",
        f"Raw text, one process with both models: a paragraph of {len(ids)} tokens encoded by each tokenizer "
        "(identical ids), a 128-token segment scored on a 1,600-position memory:",
        "",
        "| | HF | txl | txl / HF |",
        "|---|---|---|---|",
        f"| scoring, tokens/s (mem_len 1,600) | {score['hf']:.1f} | {score['txl']:.1f} | "
        f"{score['txl'] / score['hf']:.2f}x |",
        f"| generation, new tokens/s (greedy, {args.new_tokens} tokens) | {gen['hf']:.2f} | {gen['txl']:.2f} | "
        f"{gen['txl'] / gen['hf']:.2f}x |",
        "",
        f"Per-token NLL max |difference| {nll_diff:.1e}; the same greedy tokens: {same}. txl's output, detokenised "
        f"(random weights): `{text[:160]}`",
        "",
    ]
    section = "\n".join(lines)
    print(section)
    if args.write:
        replace_section(args.write, HEADING, section)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
