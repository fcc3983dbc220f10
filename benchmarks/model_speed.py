"""Model speed, side by side with Hugging Face TransfoXL, on the shared configurations (``BENCH.md``).

    make bench            # = .venv/bin/python benchmarks/model_speed.py --write docs/benchmarks.md

Both models get the same weights (HF's are converted with ``txl.convert``) and the same inputs: a random token
stream cut into consecutive segments (batch 8, tgt_len 128), memories carried. Per case: warm-up steps, then
timed steps that alternate between the implementations so that both see the same machine state; medians, min
and max. Train step = forward + backward + Adam (torch defaults, identical for both); eval = no_grad with
mem_len 640 (the memory is full after the warm-up). fp32, torch.set_num_threads(2). The first segment's memory
convention differs (HF: zeros, txl: empty) but every timed step has a full memory in both.

HF 4.46.3's forward raises a TypeError (huggingface/transformers#29650); its module is re-executed with the
one-expression fix ``.type_as(dtype=...)`` -> ``.to(dtype=...)``, nothing else changed.
"""

from __future__ import annotations

import argparse
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from _report import replace_section
from txl import TransformerXLLM
from txl.convert import hf_config_to_txl, hf_state_dict_to_txl
from txl.pretrained import load_weights

CASES = {
    "bench-char": dict(vocab_size=256, cutoffs=[], div_val=1, n_layer=6, tie_projs=[False]),
    "bench-word": dict(vocab_size=32000, cutoffs=[4000, 16000], div_val=4, n_layer=4, tie_projs=[False, True, True]),
}
COMMON = dict(
    d_model=256, d_embed=256, n_head=8, d_head=32, d_inner=1024, dropout=0.1, dropatt=0.0, pre_lnorm=False,
    same_length=False, clamp_len=-1, untie_r=False, tie_word_embeddings=True, attn_type=0, mem_len=128,
)  # fmt: skip


def patched_hf():
    """Import HF's TransfoXL module with the #29650 fix applied in memory."""
    from transformers.models.deprecated.transfo_xl import modeling_transfo_xl as module

    source = Path(module.__file__).read_text()
    fixed, n = re.subn(r"\.type_as\(\s*dtype=word_emb\.dtype\s*\)", ".to(dtype=word_emb.dtype)", source)
    if n != 1:
        raise SystemExit("unexpected transformers source: the #29650 expression was not found exactly once")
    exec(compile(fixed, module.__file__, "exec"), module.__dict__)
    return module


def build_pair(name: str):
    from transformers import TransfoXLConfig

    hf_mod = patched_hf()
    cfg = {**COMMON, **CASES[name]}
    torch.manual_seed(0)
    hf = hf_mod.TransfoXLLMHeadModel(TransfoXLConfig(**cfg, trainer_compatible=True))
    ours_cfg = hf_config_to_txl(cfg)
    ours = TransformerXLLM(ours_cfg, init=False)
    tensors = hf_state_dict_to_txl(hf.state_dict(), ours_cfg, "transformer.", "HF model")
    load_weights(ours, tensors, "HF model")
    return hf, ours


class Runner:
    """One implementation's state: optimizer, memory, position in the token stream."""

    def __init__(self, kind: str, model, stream: torch.Tensor, train: bool, mem_len: int):
        self.kind, self.model, self.stream, self.train, self.mem_len = kind, model, stream, train, mem_len
        self.opt = torch.optim.Adam(model.parameters(), lr=2.5e-4) if train else None
        self.mems, self.pos = None, 0
        model.train(train)
        if kind == "hf":
            model.reset_memory_length(mem_len)

    def step(self) -> float:
        x = self.stream[:, self.pos : self.pos + 128]
        y = self.stream[:, self.pos + 1 : self.pos + 129]
        self.pos += 128
        t0 = time.perf_counter()
        with torch.set_grad_enabled(self.train):
            if self.kind == "hf":
                out = self.model(input_ids=x, labels=x, mems=self.mems)
            else:
                out = self.model(x, y, mems=self.mems, mem_len=self.mem_len)
            self.mems = out.mems
            if self.train:
                out.loss.backward()
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
            out.loss.item()
        return time.perf_counter() - t0


def measure(name: str, train: bool, warmup: int, steps: int) -> dict:
    hf, ours = build_pair(name)
    mem_len = 128 if train else 640
    n_token = CASES[name]["vocab_size"]
    stream = torch.randint(0, n_token, (8, 128 * (warmup + steps) + 1), generator=torch.Generator().manual_seed(0))
    runners = [Runner("txl", ours, stream, train, mem_len), Runner("hf", hf, stream, train, mem_len)]
    times: dict[str, list[float]] = {"txl": [], "hf": []}
    for i in range(warmup + steps):
        for r in runners if i % 2 == 0 else runners[::-1]:
            dt = r.step()
            if i >= warmup:
                times[r.kind].append(dt)
    return {k: [8 * 128 / t for t in v] for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=11)
    ap.add_argument("--write", type=Path, help="write the table into this markdown file")
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = []
    for name in CASES:
        for train in (True, False):
            tps = measure(name, train, args.warmup, args.steps)
            med = {k: statistics.median(v) for k, v in tps.items()}
            rows.append(
                f"| {name} | {'train' if train else 'eval (mem 640)'} | {med['txl']:,.0f} "
                f"({min(tps['txl']):,.0f}–{max(tps['txl']):,.0f}) | {med['hf']:,.0f} "
                f"({min(tps['hf']):,.0f}–{max(tps['hf']):,.0f}) | {med['txl'] / med['hf']:.2f}× |"
            )
            print(rows[-1], flush=True)
    table = "\n".join(
        [
            "| config | step | txl tok/s median (min–max) | HF TransfoXL tok/s median (min–max) | txl / HF |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )
    if args.write:
        import transformers

        header = (
            "## Model speed vs Hugging Face TransfoXL (`benchmarks/model_speed.py`)\n\n"
            f"Command: `make bench` (= `python benchmarks/model_speed.py --warmup {args.warmup} --steps "
            f"{args.steps} --write docs/benchmarks.md`). Machine: {platform.machine()}, {torch.get_num_threads()} "
            f"threads, torch {torch.__version__}, transformers {transformers.__version__}, Python "
            f"{sys.version.split()[0]}. fp32, batch 8 × tgt_len 128, default torch settings for both; steps "
            "alternate between the implementations. Train = forward + backward + Adam; eval = no_grad, "
            "mem_len 640.\n\n"
        )
        replace_section(args.write, "## Model speed vs Hugging Face TransfoXL", header + table)
    print(table)


if __name__ == "__main__":
    main()
