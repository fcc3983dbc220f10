"""Speed side by side with Hugging Face TransfoXL on the shared configurations (``BENCH.md``), in one run:
training (fp32; bf16 where the CPU or GPU has native bf16), evaluation with a long memory, generation, MFU, and
the peak memory of an evaluation with the paper's longest memory.

    make bench            # = .venv/bin/python benchmarks/model_speed.py --write docs/benchmarks.md
    python benchmarks/model_speed.py --device cuda --cases wt103-base --batch 32   # the paper's base model, a GPU

Both models get the same weights (HF's are converted with ``txl.interop.convert``) and the same inputs: a random token
stream cut into consecutive segments (batch 8, tgt_len 128), memories carried. Per case: warm-up steps, then timed
steps that alternate between the implementations so that both see the same machine state; medians, min and max.

* Train step = forward + backward + optimizer step. HF: ``torch.optim.Adam`` with torch's defaults (what the
  reference code and HF's examples use); txl: its own optimizer (``txl.train.optim.build_optimizer``: fused Adam).
* Eval = no_grad, mem_len 640 (the memory is full after the warm-up). txl keeps the memory as cached keys/values
  (``KVCache``); HF re-projects it. Both start from an empty memory, so every per-token NLL must agree (reported).
  txl's steps run inside ``transposed_weights()``, the scope ``txl.infer.evaluate`` opens (its packed output layers for
  the NLL kernel are kept across segments, as in ``txl eval``); HF's steps are not affected by it.
* Generation = bench-char model, batch 1, a 128-token prompt, 512 new tokens, mem_len 640, greedy: txl's
  ``generate`` against HF's ``generate()``; new tokens per second over the whole call.
* MFU = FLOPs of the step (counted by ``torch.utils.flop_counter`` on the PyTorch path: the counter does not see
  txl's native kernels) per second, over the GEMM peak of this machine measured in the same run (the fastest of 7
  2048^3 matrix products, through each exact fp32 route, before and after the cases; the faster of the two).
* Process settings (``txl.kernels.runtime``): glibc's allocator tuning is process-wide, so HF gets it too; the fp32 GEMM
  route through oneDNN is switched on around txl's training steps only (as ``txl train`` and ``txl eval`` use it),
  and only if its start-up check found it exact and faster.

HF 4.46.3's forward raises a TypeError (huggingface/transformers#29650); its module is re-executed with the
one-expression fix ``.type_as(dtype=...)`` -> ``.to(dtype=...)``, nothing else changed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import re
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

from _report import MatmulFlops, replace_section
from txl import TransformerXLLM
from txl.config import TrainConfig
from txl.infer.generation import generate
from txl.interop.convert import hf_config_to_txl, hf_state_dict_to_txl
from txl.kernels.backends import use_backends
from txl.kernels.runtime import choose_fp32_matmul, configure_allocator, fp32_route, native_bf16
from txl.model.modeling import KVCache, transposed_weights
from txl.model.pretrained import load_weights
from txl.train.optim import build_optimizer

CASES = {
    "bench-char": dict(vocab_size=256, cutoffs=[], div_val=1, n_layer=6, tie_projs=[False]),
    "bench-word": dict(vocab_size=32000, cutoffs=[4000, 16000], div_val=4, n_layer=4, tie_projs=[False, True, True]),
}
# The paper's WikiText-103 base model (configs/wt103_base.yaml, 151M parameters) at the bench's batch 8 x 128: for a
# GPU, where the bench models' steps are bound by kernel launches (--cases wt103-base).
PAPER_CASES = {
    "wt103-base": dict(
        vocab_size=267735, cutoffs=[20000, 40000, 200000], div_val=1, n_layer=16, d_model=410, d_embed=410,
        n_head=10, d_head=41, d_inner=2100, tie_projs=[False, True, True, True],
    ),
}  # fmt: skip
COMMON = dict(
    d_model=256, d_embed=256, n_head=8, d_head=32, d_inner=1024, dropout=0.1, dropatt=0.0, pre_lnorm=False,
    same_length=False, clamp_len=-1, untie_r=False, tie_word_embeddings=True, attn_type=0, mem_len=128,
)  # fmt: skip
HEADING = "## Speed vs Hugging Face TransfoXL"
BATCH, TGT = 8, 128


def patched_hf():
    """Import HF's TransfoXL module with the #29650 fix applied in memory."""
    from transformers.models.deprecated.transfo_xl import modeling_transfo_xl as module

    source = Path(module.__file__).read_text()
    fixed, n = re.subn(r"\.type_as\(\s*dtype=word_emb\.dtype\s*\)", ".to(dtype=word_emb.dtype)", source)
    if n != 1:
        raise SystemExit("unexpected transformers source: the #29650 expression was not found exactly once")
    exec(compile(fixed, module.__file__, "exec"), module.__dict__)
    return module


def build_pair(name: str, device: torch.device | str = "cpu"):
    from transformers import TransfoXLConfig
    from transformers.utils import logging

    logging.set_verbosity_error()
    hf_mod = patched_hf()
    cfg = {**COMMON, **{**CASES, **PAPER_CASES}[name]}
    torch.manual_seed(0)
    hf = hf_mod.TransfoXLLMHeadModel(TransfoXLConfig(**cfg, trainer_compatible=True))
    ours_cfg = hf_config_to_txl(cfg)
    ours = TransformerXLLM(ours_cfg, init=False)
    load_weights(ours, hf_state_dict_to_txl(hf.state_dict(), ours_cfg, "transformer.", "HF model"), "HF model")
    return hf.to(device), ours.to(device)


def cpu_description() -> str:
    flags = set()
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        info = Path("/proc/cpuinfo").read_text()
        name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), name)
        flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []))
    shown = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile") if f in flags]
    capability = torch.backends.cpu.get_cpu_capability()
    return f"{name}; flags {' '.join(shown) or 'none of avx2/avx512/amx'}; torch CPU capability {capability}"


class Timer:
    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self, fn) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t


def empty_hf_mems(hf, device) -> list[torch.Tensor]:
    """The original code's empty first memory (HF would start from mem_len zero vectors)."""
    return [torch.zeros(0, BATCH, hf.config.d_model, device=device) for _ in range(hf.config.n_layer)]


class Runner:
    """One implementation's state for one case: optimizer, memory (or cache), position in the token stream."""

    def __init__(self, kind, model, stream, *, train: bool, mem_len: int, precision: str, route: bool, device):
        self.kind, self.model, self.stream, self.train, self.mem_len = kind, model, stream, train, mem_len
        self.precision, self.route, self.device = precision, route, device
        self.pos, self.nll = 0, []
        model.train(train)
        if kind == "hf":
            model.reset_memory_length(mem_len)
            model.crit.keep_order = True  # per-token NLL in input order, to compare
            self.mems = empty_hf_mems(model, device)
            self.opt = torch.optim.Adam(model.parameters(), lr=2.5e-4) if train else None
        else:
            self.mems = None
            self.cache = None if train else KVCache(model.config, BATCH, mem_len, TGT, device=device)
            cfg = TrainConfig(lr=2.5e-4)
            self.opt = build_optimizer(list(model.parameters()), cfg, device) if train else None

    def step(self) -> None:
        x = self.stream[:, self.pos : self.pos + TGT]
        y = self.stream[:, self.pos + 1 : self.pos + TGT + 1]
        self.pos += TGT
        autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if self.precision == "bf16"
            else contextlib.nullcontext()
        )
        with torch.set_grad_enabled(self.train), autocast, fp32_route(self.route):
            if self.kind == "hf":
                out = self.model(input_ids=x, labels=x, mems=self.mems)
                loss, nll = out.loss, out.losses
            else:
                out = self.model(x, y, mems=self.mems, cache=self.cache, mem_len=self.mem_len)
                loss, nll = out.loss, out.losses[:, :-1]  # HF scores T-1 positions
            self.mems = out.mems
            if self.train:
                loss.backward()
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
            else:
                self.nll.append(nll.float())
            loss.item()


def measure(name, *, train, warmup, steps, device, precision="fp32", route=False) -> dict:
    hf, ours = build_pair(name, device)
    mem_len = 128 if train else 640
    n_token = {**CASES, **PAPER_CASES}[name]["vocab_size"]
    g = torch.Generator().manual_seed(0)
    stream = torch.randint(0, n_token, (BATCH, TGT * (warmup + steps + 1) + 1), generator=g).to(device)
    runners = [
        Runner("txl", ours, stream, train=train, mem_len=mem_len, precision=precision, route=route, device=device),
        Runner("hf", hf, stream, train=train, mem_len=mem_len, precision="fp32", route=False, device=device),
    ]
    timer = Timer(device)
    times: dict[str, list[float]] = {"txl": [], "hf": []}
    # (evaluation: the scope txl.infer.evaluate opens, the weights being fixed; HF's steps are not affected by it)
    with contextlib.nullcontext() if train else transposed_weights():
        for i in range(warmup + steps):
            for r in runners if i % 2 == 0 else runners[::-1]:
                dt = timer(r.step)
                if i >= warmup:
                    times[r.kind].append(dt)
    out = {k: [BATCH * TGT / t for t in v] for k, v in times.items()}
    if not train:  # the same function: every per-token NLL agrees
        a, b = (torch.cat(r.nll, dim=1) for r in runners)
        out["max_nll_diff"] = float((a - b).abs().max())
    out["flops"] = {r.kind: count_flops(r) for r in runners}
    return out


def count_flops(runner: Runner) -> float:
    """FLOPs of one more step of ``runner`` (matrix products; the optimizer and element-wise ops add little),
    counted on the PyTorch path (the counter does not see txl's native kernels, which compute the same products)."""
    with use_backends(native_kernels=False), MatmulFlops() as counter:
        runner.step()
    return float(counter.flops)


def gemm_peak(device: torch.device, dtype: torch.dtype, routes: tuple[bool, ...] = (False,)) -> float:
    """The machine's GEMM peak: GFLOP/s of a 2048^3 matrix product, the best of 7 for each of txl's fp32 routes in
    ``routes`` (the default path, oneDNN) and of them (a median was not a peak on these VMs: the same product
    measured 100-205 GFLOP/s from one call to the next)."""
    a = torch.randn(2048, 2048, device=device, dtype=dtype)
    b = torch.randn(2048, 2048, device=device, dtype=dtype)
    timer = Timer(device)
    best = float("inf")
    for route in routes:
        with fp32_route(route):
            timer(lambda: a @ b)
            best = min(best, *(timer(lambda: a @ b) for _ in range(7)))
    return 2 * 2048**3 / best / 1e9


def measure_generation(device, repeats: int, new_tokens: int = 512) -> dict:
    hf, ours = build_pair("bench-char", device)
    hf.eval()
    ours.eval()
    hf.reset_memory_length(640)
    prompt = torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(1)).to(device)
    timer = Timer(device)
    times: dict[str, list[float]] = {"txl": [], "hf": []}

    def run_txl():
        generate(ours, prompt, new_tokens, temperature=0.0, mem_len=640)

    def run_hf():
        with torch.no_grad():
            hf.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

    run_txl()
    for _ in range(repeats):
        times["txl"].append(timer(run_txl))
        times["hf"].append(timer(run_hf))
    out = {k: [new_tokens / t for t in v] for k, v in times.items()}
    cached = generate(ours, prompt, 128, temperature=0.0, mem_len=640)[:, 128:]
    out["same_tokens"] = bool(cached.equal(uncached_greedy(ours, prompt, 128, 640)))
    return out


def uncached_greedy(model, prompt, n: int, mem_len: int) -> torch.Tensor:
    """The reference loop: the memory as hidden states, re-projected for every token."""
    tokens = []
    with torch.no_grad():
        out = model.transformer(prompt, None, mem_len=mem_len)
        for _ in range(n):
            nxt = model.crit(out.last_hidden_state[:, -1], return_log_probs=True)[1].argmax(-1, keepdim=True)
            tokens.append(nxt)
            out = model.transformer(nxt, out.mems, mem_len=mem_len)
    return torch.cat(tokens, dim=1)


PEAK_SCRIPT = textwrap.dedent(r"""
    import json, re, sys, torch
    torch.set_num_threads(2)
    from txl import TransformerXLConfig, TransformerXLLM
    from txl.infer.evaluate import evaluate
    cfg = TransformerXLConfig(n_token=256, n_layer=6, d_model=256, n_head=8, d_head=32, d_inner=1024, mem_len=128)
    model = TransformerXLLM(cfg)
    data = torch.randint(0, 256, (128 * 36 + 1,)).numpy()  # 36 segments: the memory of 3,800 fills and slides
    res = evaluate(model, data, batch_size=1, tgt_len=128, mem_len=3800, clamp_len=1000, same_length=True)
    # VmHWM, this process's own peak (ru_maxrss would keep the parent's peak across fork + exec)
    status = open("/proc/self/status").read()
    peak = int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024
    print(json.dumps({"peak_mib": peak, "tokens": res.tokens}))
""")


def eval_peak_memory() -> dict:
    """Peak RSS of a separate process evaluating bench-char with mem_len 3,800 (the paper's enwik8 setting)."""
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def fmt(v: list[float]) -> str:
    return f"{statistics.median(v):,.0f} ({min(v):,.0f}–{max(v):,.0f})"


def ratio(r: dict) -> float:
    return statistics.median(r["txl"]) / statistics.median(r["hf"])


def mfu(r: dict, who: str, peak: float) -> str:
    achieved = r["flops"][who] * statistics.median(r[who]) / (BATCH * TGT) / 1e9  # GFLOP/s
    pct = 100 * achieved / peak
    return f"{pct:.1f}%" if pct < 10 else f"{pct:.0f}%"


def main() -> None:
    global BATCH
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=11)
    ap.add_argument("--gen_repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--write", type=Path, help="write the section into this markdown file")
    ap.add_argument(
        "--cases",
        default=",".join(CASES),
        help=f"comma-separated configurations: {', '.join([*CASES, *PAPER_CASES])} (generation runs with bench-char)",
    )
    ap.add_argument("--batch", type=int, default=BATCH, help="rows per step (BENCH.md: 8)")
    args = ap.parse_args()
    BATCH = args.batch
    names = args.cases.split(",")
    if any(n not in {**CASES, **PAPER_CASES} for n in names):
        ap.error(f"--cases {args.cases}: the configurations are {', '.join([*CASES, *PAPER_CASES])}")
    device = torch.device(args.device)
    torch.set_num_threads(2) if device.type == "cpu" else None
    configure_allocator()
    route = choose_fp32_matmul() if device.type == "cpu" else None
    print(f"machine: {cpu_description()}; {route.describe() if route else torch.cuda.get_device_name()}", flush=True)
    use_route = bool(route and route.enabled)
    bf16 = native_bf16(device)
    fp32_routes = (False, True) if route and route.exact else (False,)
    peaks = [(gemm_peak(device, torch.float32, fp32_routes), gemm_peak(device, torch.bfloat16) if bf16 else None)]
    cases, results = [], {}
    for name in names:
        for case, train, precision in (
            ("train fp32", True, "fp32"),
            ("train bf16", True, "bf16"),
            ("eval", False, "fp32"),
        ):
            if precision == "bf16" and not bf16:
                continue
            r = measure(
                name,
                train=train,
                warmup=args.warmup,
                steps=args.steps,
                device=device,
                precision=precision,
                route=use_route and train,  # (as txl train and txl eval: the route for training only)
            )
            results[(name, case)] = r
            cases.append((name, case, train, precision))
            print(f"{name} {case}: txl {fmt(r['txl'])}, HF {fmt(r['hf'])} tok/s, {ratio(r):.2f}x", flush=True)
    # The peak again after the cases (one measurement at the start read 150 GFLOP/s where others read 208: the VM's
    # speed drifts), the faster of the two kept, so that a slow moment does not overstate the MFU.
    peaks.append((gemm_peak(device, torch.float32, fp32_routes), gemm_peak(device, torch.bfloat16) if bf16 else None))
    peak32 = max(p[0] for p in peaks)
    peak16 = max(p[1] for p in peaks) if bf16 else None
    rows = []
    for name, case, train, precision in cases:
        r = results[(name, case)]
        peak = peak16 if precision == "bf16" else peak32
        extra = f"max |ΔNLL| {r['max_nll_diff']:.1e}" if not train else ""
        rows.append(
            f"| {name} | {case}{' (mem 640)' if not train else ''} | {fmt(r['txl'])} | {fmt(r['hf'])} | "
            f"**{ratio(r):.2f}×** | {mfu(r, 'txl', peak)} / {mfu(r, 'hf', peak32)} | {extra} |"
        )
    if "bench-char" in names:
        gen = measure_generation(device, args.gen_repeats)
        rows.append(
            f"| bench-char | generation (new tok/s) | {fmt(gen['txl'])} | {fmt(gen['hf'])} | **{ratio(gen):.2f}×** | | "
            f"batch 1, prompt 128, 512 new tokens, mem 640, greedy; cached = uncached tokens: {gen['same_tokens']} |"
        )
        print(rows[-1], flush=True)
    peak_mem = eval_peak_memory() if device.type == "cpu" else None
    table = "\n".join(
        [
            "| config | case | txl tok/s median (min–max) | HF TransfoXL tok/s median (min–max) | txl / HF "
            "| MFU txl / HF | |",
            "|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    notes = [
        "GEMM peak measured in this run (the fastest of 7 2048^3 products, each exact fp32 route, before and after "
        f"the cases: the faster of the two): fp32 {peak32:,.0f} GFLOP/s ({' / '.join(f'{p[0]:,.0f}' for p in peaks)})"
        + (
            f", bf16 {peak16:,.0f} GFLOP/s ({' / '.join(f'{p[1]:,.0f}' for p in peaks)})"
            if peak16
            else "; no native bf16 here, so no bf16 rows"
        )
        + ".",
    ]
    if peak_mem:
        notes.append(
            f"Peak memory of `txl.infer.evaluate` on bench-char, batch 1, tgt_len 128, mem_len 3,800"
            f" (the paper's enwik8 "
            f"setting), K/V cache: {peak_mem['peak_mib']:,.0f} MiB (whole process)."
        )
    print(table, *notes, sep="\n")
    if args.write:
        import transformers

        header = (
            f"{HEADING} (`benchmarks/model_speed.py`)\n\n"
            f"Command: `make bench` (= `python benchmarks/model_speed.py --warmup {args.warmup} --steps {args.steps} "
            f"--gen_repeats {args.gen_repeats} --write docs/benchmarks.md`). Machine: {cpu_description()}; "
            f"{route.describe() if route else torch.cuda.get_device_name()}; {torch.get_num_threads()} threads, "
            f"torch {torch.__version__}, transformers {transformers.__version__}, Python {sys.version.split()[0]}. "
            f"Batch {BATCH} × tgt_len {TGT}; steps alternate between the implementations; the same weights and "
            "inputs. Train = forward + backward + optimizer (HF: torch's Adam; txl: fused Adam); eval = no_grad, "
            "mem_len 640 (txl: K/V cache; |ΔNLL| is the largest per-token difference from HF, both starting from an "
            "empty memory); MFU = counted FLOPs per second over the GEMM peak below.\n\n"
        )
        replace_section(args.write, HEADING, header + table + "\n\n" + " ".join(notes))


if __name__ == "__main__":
    main()
