"""The paper's models on one GPU, side by side: training and evaluation tok/s, MFU and peak memory of txl (its
default fast paths; the same without the compiled layers and half-precision logits, as before them; its reference
path) and of Hugging Face's TransfoXL 4.46.3 where it is installed, in one process.

    python benchmarks/gpu_paper.py --json benchmarks/results/gpu.json --write docs/benchmarks.md   # a CUDA machine
    python benchmarks/gpu_paper.py --device cpu --configs tiny --steps 3 --warmup 2              # a smoke run

Configurations (ids drawn from a Zipf law, so nothing is downloaded):
* ``wt103-base-nvidia``: NVIDIA DeepLearningExamples' WT103 base (16 layers, d_model 512, 8 heads x 64, d_inner
  2048, vocabulary 267,735 with their cutoffs 19,997 / 39,997 / 199,997, div_val 1, tied), tgt_len 192, mem_len 192,
  batch 32; NVIDIA published 59,961 tok/s (A100, AMP) for its training and 107,082 tok/s for its evaluation.
* ``wt103-large`` (18 layers, d_model 1024, div_val 4, tgt_len / mem_len 384, batch 16), ``enwik8-base`` (12 layers,
  d_model 512, tgt_len / mem_len 512, batch 22), ``enwik8-large`` (24 layers, d_model 1024, 8 heads x 128, tgt_len /
  mem_len 768, batch 8).

Training rows: forward, backward and a fused Adam step, the memory carried between segments, one host read of the
loss per step (as ``txl train``); medians over the timed steps after the warm-up (the compiler's first graphs are in
the warm-up). Evaluation rows: tgt_len 64, mem_len 640, clamp_len 400, same_length, no gradient (txl: its K/V
cache). MFU: FLOPs of the step's matrix products (``torch.utils.flop_counter``'s formulas, on the eager path:
_report.MatmulFlops) per second over the GEMM peak measured in the same run in the row's precision. ``--track`` runs
300 steps of the first configuration in bf16 (txl's default fast paths) and in fp32 (txl's reference path, or
``--track_reference``) from the same weights and data, and compares the 20-step moving averages of their losses;
``--track_deterministic`` with deterministic kernels (a run repeated gives the same losses), ``--track_text`` on a
real text's words instead of Zipf ids. Rows and tracks name the card, torch, and the code (``git describe`` and a
digest of the source tree: _report.code_version).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from _report import MatmulFlops, code_version, replace_section
from txl import TransformerXLLM
from txl.interop.convert import hf_config_to_txl, hf_state_dict_to_txl
from txl.kernels.backends import Backends, backends, use_backends
from txl.model.modeling import Dropout, KVCache, transposed_weights
from txl.model.pretrained import load_weights

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## The paper's models on one GPU (`benchmarks/gpu_paper.py`)"
COMMON = dict(
    pre_lnorm=False, same_length=False, clamp_len=-1, untie_r=False, tie_word_embeddings=True, attn_type=0,
    d_head=64, n_head=8, dropatt=0.0,
)  # fmt: skip
WORDS = dict(vocab_size=267_735, cutoffs=[19_997, 39_997, 199_997], tie_projs=[False, True, True, True])
CONFIGS = {
    "wt103-base-nvidia": dict(
        hf=dict(WORDS, n_layer=16, d_model=512, d_embed=512, d_inner=2048, div_val=1, dropout=0.1),
        batch=32, tgt=192, mem=192,
    ),
    "wt103-large": dict(
        hf=dict(WORDS, n_layer=18, d_model=1024, d_embed=1024, n_head=16, d_inner=4096, div_val=4, dropout=0.2,
                dropatt=0.2),
        batch=16, tgt=384, mem=384,
    ),
    "enwik8-base": dict(
        hf=dict(vocab_size=204, cutoffs=[], tie_projs=[False], n_layer=12, d_model=512, d_embed=512, d_inner=2048,
                div_val=1, dropout=0.1),
        batch=22, tgt=512, mem=512,
    ),
    "enwik8-large": dict(
        hf=dict(vocab_size=204, cutoffs=[], tie_projs=[False], n_layer=24, d_model=1024, d_embed=1024, d_head=128,
                d_inner=3072, div_val=1, dropout=0.15, dropatt=0.15),
        batch=8, tgt=768, mem=768,
    ),
    "tiny": dict(  # (a smoke run on the CPU)
        hf=dict(vocab_size=1000, cutoffs=[200, 500], tie_projs=[False, True, True], n_layer=2, d_model=64, d_embed=64,
                n_head=4, d_head=16, d_inner=128, div_val=2, dropout=0.1),
        batch=2, tgt=16, mem=16,
    ),
}  # fmt: skip
EVAL = dict(tgt=64, mem=640, clamp_len=400, same_length=True)
NVIDIA = {"train": 59_961, "eval": 107_082}  # A100 40GB, AMP, batch 32 (their README)
EVAL_IMPLS = ("txl", "txl-unfused", "txl-no-graphs", "txl-eager", "txl-fused", "hf")

FALSE = {f.name: (() if isinstance(f.default, tuple) else False) for f in dataclasses.fields(Backends)}
POLICIES = {
    "txl": Backends(),
    "txl-eager": dataclasses.replace(Backends(), compiled_layers=(), half_precision_logits=(), graph_segments=()),
    "txl-fp32-logits": dataclasses.replace(Backends(), half_precision_logits=()),
    "txl-half-logits": dataclasses.replace(Backends(), compiled_layers=()),
    "txl-no-graphs": dataclasses.replace(Backends(), graph_segments=()),
    "txl-reference": Backends(**FALSE),
    # the fused Triton attention (txl.kernels.fused_attention): on by default in inference (txl-unfused: off), off in
    # training; txl-fused: in training too, inside the compiled layers' graphs; txl-fused-eager: on the eager path
    "txl-unfused": dataclasses.replace(Backends(), fused_attention=()),
    "txl-fused": dataclasses.replace(Backends(), fused_attention_training=("cuda",)),
    "txl-fused-eager": dataclasses.replace(
        Backends(), compiled_layers=(), half_precision_logits=(), graph_segments=(), fused_attention_training=("cuda",)
    ),
    # issue 68's lever, off by default until measured: the compiled layers replayed as CUDA graphs (Inductor's
    # "reduce-overhead"), each step's start marked for them (Trainer.forward)
    "txl-layer-graphs": dataclasses.replace(Backends(), compiled_layers_graphs=("cuda",)),
}


def hf_config(name: str) -> dict:
    return {**COMMON, **CONFIGS[name]["hf"], "mem_len": CONFIGS[name]["mem"]}


def zipf_stream(n_token: int, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """[batch, length] ids: half of them drawn from a Zipf law (exponent 1.1), the other half a fixed function of the
    previous id (something to learn)."""
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, n_token + 1, dtype=torch.float64) ** 1.1
    draws = torch.multinomial(p.float(), batch * length, replacement=True, generator=g).view(batch, length)
    follow = torch.randperm(n_token, generator=g)
    coin = torch.rand(batch, length, generator=g) < 0.5
    out = draws.clone()
    for t in range(1, length):
        out[:, t] = torch.where(coin[:, t], follow[out[:, t - 1]], draws[:, t])
    return out


def text_stream(path: Path, n_token: int, batch: int) -> torch.Tensor:
    """[batch, length] ids of a text's whitespace-separated words, numbered by frequency (the most frequent 0, ties
    by first appearance, words past the vocabulary sharing its last id), cut into ``batch`` columns of equal length
    as the paper's batchify does (its tail dropped). A real text for ``--track`` where the Zipf stream's steep fall is
    too sensitive to noise; a Trainer wraps around a stream shorter than its steps."""
    words = path.read_text(encoding="utf-8", errors="replace").split()
    counts = collections.Counter(words)  # (first appearance order; the sort below is stable)
    rank = {w: min(i, n_token - 1) for i, (w, _) in enumerate(sorted(counts.items(), key=lambda kv: -kv[1]))}
    length = len(words) // batch
    if length < 2:
        raise SystemExit(f"{path}: {len(words)} words, too few for {batch} columns")
    return torch.tensor([rank[w] for w in words[: batch * length]], dtype=torch.long).view(batch, length)


def may_fail(impl: str, error: Exception) -> bool:
    """Whether a row's failure is logged and the run goes on: HF's runtime errors (its adaptive input under
    autocast), and any failure of the fused Triton attention (not yet proven on every card: one failing kernel must
    not cost the rest of a GPU session's one run)."""
    return impl.startswith(("txl-fused", "txl-layer-graphs")) or (impl == "hf" and isinstance(error, RuntimeError))


def first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [""])[0][:300]


def build(name: str, device: torch.device, with_hf: bool):
    """txl's model (and HF's, with the same weights, when transformers 4.46.3 is importable)."""
    cfg = hf_config(name)
    torch.manual_seed(0)
    hf = None
    if with_hf:
        from transformers import TransfoXLConfig
        from transformers.utils import logging

        from model_speed import patched_hf

        logging.set_verbosity_error()
        hf = patched_hf().TransfoXLLMHeadModel(TransfoXLConfig(**cfg, trainer_compatible=True))
        ours_cfg = hf_config_to_txl(cfg)
        ours = TransformerXLLM(ours_cfg, init=False)
        load_weights(ours, hf_state_dict_to_txl(hf.state_dict(), ours_cfg, "transformer.", "HF model"), "HF model")
        hf = hf.to(device)
    else:
        ours = TransformerXLLM(hf_config_to_txl(cfg))
    return ours.to(device), hf


def autocast(device: torch.device, precision: str):
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Trainer:
    """One implementation's training steps over a stream (the memory carried)."""

    def __init__(self, impl, model, stream, tgt, mem, precision, device):
        self.impl, self.model, self.stream, self.tgt, self.mem = impl, model, stream, tgt, mem
        self.precision, self.device, self.pos = precision, device, 0
        self.norms, self.first = [], {}
        model.train()
        fused = device.type == "cuda"
        self.opt = torch.optim.Adam(model.parameters(), lr=2.5e-4, fused=fused)
        if impl == "hf":
            model.reset_memory_length(mem)
            self.mems = [torch.zeros(0, stream.shape[0], model.config.d_model, device=device)] * model.config.n_layer
        else:
            self.mems = None

    def forward(self):
        if self.device.type in backends().compiled_layers_graphs:  # (the graphs' outputs of the last step are dead)
            torch.compiler.cudagraph_mark_step_begin()
        x = self.stream[:, self.pos : self.pos + self.tgt]
        y = self.stream[:, self.pos + 1 : self.pos + self.tgt + 1]
        self.pos = (self.pos + self.tgt) % (self.stream.shape[1] - self.tgt - 1)
        with autocast(self.device, self.precision):
            if self.impl == "hf":
                out = self.model(input_ids=x, labels=x, mems=self.mems)
            else:
                out = self.model(x, y, mems=self.mems, mem_len=self.mem)
        self.mems = out.mems
        return out.loss

    def step(self, clip: float = 0.0) -> float:
        loss = self.forward()
        loss.backward()
        if clip:
            self.norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)))
            if len(self.norms) == 1:  # (the first step's gradient norm of each parameter, to compare)
                self.first = {n: float(p.grad.norm()) for n, p in self.model.named_parameters() if p.grad is not None}
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss)  # (one host read per step, as txl train)


class Evaluator:
    def __init__(self, impl, model, stream, batch, precision, device):
        self.impl, self.model, self.stream, self.precision, self.device, self.pos = (
            impl, model, stream, precision, device, 0,
        )  # fmt: skip
        model.eval()
        self.losses: list[float] = []
        e = EVAL
        if impl == "hf":
            model.reset_memory_length(e["mem"])
            model.transformer.same_length, model.transformer.clamp_len = e["same_length"], e["clamp_len"]
            self.mems = [torch.zeros(0, batch, model.config.d_model, device=device)] * model.config.n_layer
        else:
            dtype = torch.bfloat16 if precision == "bf16" else torch.float32
            self.cache = KVCache(model.config, batch, e["mem"], e["tgt"], device=device, dtype=dtype)
        # (the inference scope that txl.evaluate opens for a whole evaluation: copies of fixed weights may be kept)
        self.scope = contextlib.ExitStack()
        self.scope.enter_context(transposed_weights())

    def step(self) -> float:
        t = EVAL["tgt"]
        x = self.stream[:, self.pos : self.pos + t]
        y = self.stream[:, self.pos + 1 : self.pos + t + 1]
        self.pos = (self.pos + t) % (self.stream.shape[1] - t - 1)
        with torch.no_grad(), autocast(self.device, self.precision):
            if self.impl == "hf":
                out = self.model(input_ids=x, labels=x, mems=self.mems)
                self.mems = out.mems
            else:
                e = EVAL
                out = self.model(
                    x, y, cache=self.cache, mem_len=e["mem"], clamp_len=e["clamp_len"], same_length=e["same_length"]
                )
        self.losses.append(float(out.loss))
        return self.losses[-1]


def timed(fn, warmup: int, steps: int, device: torch.device) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(steps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t)
    return out


def count_flops(fn) -> float:
    with use_backends(POLICIES["txl-eager"]), MatmulFlops() as counter:
        fn()
    return float(counter.flops)


def gemm_peak(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of the best of 10 n^3 products (n = 8192 on a GPU; on a CPU 2048, 512 in bf16: a CPU without bf16
    instructions multiplies bf16 ~100x slower, and 2048 took 4 minutes there for a figure the smoke runs only print)."""
    n = 8192 if device.type == "cuda" else 512 if dtype == torch.bfloat16 else 2048
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = min(timed(lambda: a @ b, 2, 10, device))
    return 2 * n**3 / best


def memory_reset(device):
    gc.collect()  # (what an earlier row left in a reference cycle: its peak must not count in the next row's)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def run_config(name, args, device, peaks, rows, log) -> None:
    c = CONFIGS[name]
    B, T, M = c["batch"], c["tgt"], c["mem"]
    need = max(T * (args.warmup + args.steps), EVAL["tgt"] * (args.eval_warmup + args.steps)) + 2 * max(T, 64) + 1
    stream = zipf_stream(c["hf"]["vocab_size"], B, need).to(device)
    base, hf = build(name, device, args.hf)
    impls = [(p, impl) for p in args.precisions for impl in args.impls if impl != "hf"]
    impls += [(p, "hf") for p in args.precisions if hf is not None and "hf" in args.impls]
    impls = impls if "train" in args.cases else []
    for precision, impl in impls:
        memory_reset(device)
        model = hf if impl == "hf" else copy.deepcopy(base)
        try:
            with use_backends(POLICIES.get(impl, POLICIES["txl"])):
                tr = Trainer("hf" if impl == "hf" else "txl", model, stream, T, M, precision, device)
                times = timed(tr.step, args.warmup, args.steps, device)
                flops = count_flops(lambda tr=tr: tr.forward().backward()) if impl != "hf" else None
                if args.profile and precision == "bf16" and impl in ("txl", "txl-eager", "txl-fused"):
                    profile(tr.step, device, f"{name}-{impl}", args.profile, log)
            tr.opt.zero_grad(set_to_none=True)
        except torch.OutOfMemoryError:
            log(f"{name} train-{precision} {impl}: out of memory")
            continue
        except Exception as e:  # (HF's adaptive input fails under autocast where div_val > 1)
            if not may_fail(impl, e):
                raise
            log(f"{name} train-{precision} {impl}: failed: {type(e).__name__}: {first_line(e)}")
            continue
        tok = B * T / statistics.median(times)
        mfu = flops / statistics.median(times) / peaks[precision] if flops else None
        row = dict(config=name, case=f"train-{precision}", impl=impl, tokens_per_s=tok, mfu=mfu,
                   peak_gib=peak_gib(device), min=B * T / max(times), max=B * T / min(times))  # fmt: skip
        rows.append(row)
        log(fmt_row(row))
        args.save(rows)
        del tr
        if impl != "hf":
            del model
    evals = [(p, i) for p in args.precisions for i in EVAL_IMPLS if i in args.impls and "eval" in args.cases]
    losses = {}
    for precision, impl in evals:
        if impl == "hf" and hf is None:
            continue
        memory_reset(device)
        model = hf if impl == "hf" else copy.deepcopy(base)
        try:
            with use_backends(POLICIES.get(impl, POLICIES["txl"])):
                ev = Evaluator(impl, model, stream, B, precision, device)
                times = timed(ev.step, args.eval_warmup, args.steps, device)
                losses[precision, impl] = ev.losses
                flops = count_flops(ev.step) if impl != "hf" else None
                if args.profile and precision == "bf16" and impl in ("txl", "txl-unfused", "txl-no-graphs"):
                    profile(ev.step, device, f"{name}-eval-{impl}", args.profile, log)
        except torch.OutOfMemoryError:
            log(f"{name} eval-{precision} {impl}: out of memory")
            continue
        except Exception as e:
            if not may_fail(impl, e):
                raise
            log(f"{name} eval-{precision} {impl}: failed: {type(e).__name__}: {first_line(e)}")
            continue
        tok = B * EVAL["tgt"] / statistics.median(times)
        n = B * EVAL["tgt"]
        row = dict(config=name, case=f"eval-{precision}", impl=impl, tokens_per_s=tok,
                   mfu=flops / statistics.median(times) / peaks[precision] if flops else None,
                   peak_gib=peak_gib(device), min=n / max(times), max=n / min(times))  # fmt: skip
        ev.scope.close()
        same = losses.get((precision, "txl"))  # (the graphs' losses against the eager path's, step by step)
        if impl != "txl" and impl != "hf" and same:
            n = min(len(same), len(ev.losses))
            row["max_dloss_vs_txl"] = max(abs(a - b) for a, b in zip(same[:n], ev.losses[:n], strict=True))
            log(f"{name} eval-{precision}: {impl} against txl, largest |loss difference| over {n} steps "
                f"{row['max_dloss_vs_txl']:.2e}")  # fmt: skip
        rows.append(row)
        log(fmt_row(row))
        args.save(rows)
        del ev, model
    if ("bf16", "txl") in losses and ("fp32", "txl") in losses:  # (the same segments in both precisions)
        a, b = losses["bf16", "txl"], losses["fp32", "txl"]
        n = min(len(a), len(b))
        gap = max(abs(x - y) / abs(y) for x, y in zip(a[:n], b[:n], strict=True))
        log(f"{name} eval: bf16 against fp32 (txl), largest relative loss difference over {n} steps {gap:.2e}")


NONDETERMINISTIC = " does not have a deterministic implementation"  # (torch's words, warn_only=True)


def deterministic(log) -> dict:
    """Deterministic kernels for the tracked runs, so that a run repeated gives the same losses and two variants
    differ by their arithmetic (and dropout masks) alone: Inductor's deterministic mode (its Triton reductions are
    otherwise tuned by timing them at their first call, and the block size chosen changes their sums' order: on an
    H200 two runs of the same code drifted 0.96% apart in 300 steps), torch's deterministic algorithms (an
    accumulating scatter sorts instead of adding atomically; warn only where an op has no deterministic version), and
    cuBLAS with a fixed workspace (CUBLAS_WORKSPACE_CONFIG, set before the first product)."""
    inductor = torch._inductor.config
    settings = {"on": True, "torch": True, "inductor": hasattr(inductor, "deterministic"),  # (Inductor's: torch 2.7+)
                "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}  # fmt: skip
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # (no NaN written into every new tensor)
    if settings["inductor"]:
        inductor.deterministic = True
    log(f"track: deterministic kernels {settings}")
    return settings


def track(name, args, device, log, save=None) -> dict:
    """``args.track`` steps of each of ``args.track_variants`` ("impl:precision") and of the reference
    ``args.track_reference`` from the same weights and data: for each, the largest relative gap of its 20-step moving
    average of the loss from the reference's. ``save`` is given the result so far after each variant."""
    c = CONFIGS[name]
    settings = deterministic(log) if args.track_deterministic else None
    text = getattr(args, "track_text", None)
    if text:
        stream = text_stream(text, c["hf"]["vocab_size"], c["batch"]).to(device)
        log(f"track: {text}, {stream.numel():,} words in {c['batch']} columns of {stream.shape[1]:,} "
            f"({stream.shape[1] / (c['tgt'] * args.track):.2f} of the {args.track} steps' length), "
            f"{int(stream.max()) + 1:,} ids")  # fmt: skip
    else:
        stream = zipf_stream(c["hf"]["vocab_size"], c["batch"], c["tgt"] * (args.track + 1) + 1, seed=1).to(device)
    base, _ = build(name, device, False)
    if args.track_dropout is not None:  # (without dropout the paths differ by their arithmetic alone)
        for m in base.modules():
            if isinstance(m, (torch.nn.Dropout, Dropout)):
                m.p = args.track_dropout
    curves, firsts = {}, {}

    def run(variant: str) -> None:
        impl, precision, *seed = variant.split(":")  # (a third field: the dropout's seed, 2 by default)
        model = copy.deepcopy(base)
        with use_backends(POLICIES[impl]), warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            torch.manual_seed(int(seed[0]) if seed else 2)
            tr = Trainer("txl", model, stream, c["tgt"], c["mem"], precision, device)
            t0 = time.perf_counter()
            curves[variant] = [tr.step(clip=0.25) for _ in range(args.track)]
            nondeterministic(variant, warned)
            log(f"track {variant}: {args.track} steps in {time.perf_counter() - t0:.1f} s; first losses "
                + " ".join(f"{x:.3f}" for x in curves[variant][:6]) + "; gradient norms "
                + " ".join(f"{x:.3g}" for x in tr.norms[:6]))  # fmt: skip
            firsts[variant] = tr.first

    def nondeterministic(variant: str, warned: list) -> None:
        """The ops that ran without a deterministic version (torch warns once per op and call site): where a repeat
        is not 0, they say why. The variant's other warnings go to the log, once each."""
        said = dict.fromkeys(str(w.message).splitlines()[0] for w in warned)
        ops = [m.split(NONDETERMINISTIC)[0] for m in said if NONDETERMINISTIC in m]
        if settings and settings["on"]:
            settings.setdefault("nondeterministic", {})[variant] = ops
            if ops:
                log(f"track {variant}: ran without a deterministic version: {', '.join(ops)}")
        for m in said:
            if NONDETERMINISTIC not in m:
                log(f"track {variant}: warning: {m}")

    w = min(20, args.track)

    def gap(curve: list[float], ref: list[float]) -> float:  # (largest relative gap of the w-step moving averages)
        ma = [statistics.fmean(curve[i - w : i]) for i in range(w, len(curve) + 1)]
        ma_ref = [statistics.fmean(ref[i - w : i]) for i in range(w, len(ref) + 1)]
        return max(abs(a - b) / b for a, b in zip(ma, ma_ref, strict=True))

    def result() -> dict:
        ref = curves.get(args.track_reference)
        gaps = {k: gap(v, ref) for k, v in curves.items()} if ref else {}
        # (a variant run twice, "impl:precision" and "impl:precision:2": how far a run is from itself)
        repeats = {
            k: gap(curves[k + ":2"], v) for k, v in curves.items() if len(k.split(":")) == 2 and k + ":2" in curves
        }
        return dict(config=name, steps=args.track, reference=args.track_reference, gaps=gaps, repeats=repeats,
                    deterministic=settings, data=str(text) if text else "zipf",
                    largest_gap=gaps.get(args.track_variants[0]), curves=curves)  # fmt: skip

    def attempt(variant: str) -> None:  # (a deterministic mode that fails on this torch must not cost the run)
        try:
            return run(variant)
        except Exception as e:
            if not (settings and settings["on"]):
                raise
            log(f"track {variant}: failed with deterministic kernels ({type(e).__name__}: {first_line(e)}); "
                "this and the following variants without them")  # fmt: skip
        # (again outside the except block: the failed attempt's model and optimizer, held by its traceback, are freed)
        settings.update(on=False, off_from=variant)
        torch.use_deterministic_algorithms(False)
        if settings["inductor"]:
            torch._inductor.config.deterministic = False
        torch._dynamo.reset()
        run(variant)

    for variant in [args.track_reference, *args.track_variants]:
        try:
            attempt(variant)
        except Exception as e:
            if variant == args.track_reference or not may_fail(variant.split(":")[0], e):
                raise
            log(f"track {variant}: failed: {type(e).__name__}: {first_line(e)}")
        if variant in curves and variant != args.track_reference:  # (as each ends: a run cut short keeps them)
            log(f"track {variant}: largest gap of the {w}-step moving averages from {args.track_reference} "
                f"{100 * gap(curves[variant], curves[args.track_reference]):.3f}%")  # fmt: skip
        if save:
            save(result())
    out = result()
    for k, g in out["repeats"].items():
        log(f"track {k}: run twice, largest gap of the {w}-step moving averages {100 * g:.3f}%")
    ref_first = firsts[args.track_reference]
    for k, f in firsts.items():
        ratios = sorted(((f[n] / (ref_first[n] + 1e-30), n) for n in f if n in ref_first), reverse=True)
        log(f"track {k}: first step's gradient norms over the reference's, largest: "
            + ", ".join(f"{n} {r:.3g} ({f[n]:.3g})" for r, n in ratios[:4]))  # fmt: skip
    return out


def profile(step, device: torch.device, label: str, folder: Path, log, steps: int = 3) -> None:
    """The kernels of ``steps`` calls of ``step`` by device time (``torch.profiler``), to folder/profile-label.txt."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync(device)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    text = prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"profile-{label}.txt").write_text(text)
    log(f"profile of {label} ({steps} steps):\n" + "\n".join(text.splitlines()[:18] + text.splitlines()[-3:]))


def fmt_row(r: dict) -> str:
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
    mem = f"{r['peak_gib']:.1f} GiB" if r.get("peak_gib") else "-"
    return f"{r['config']:18} {r['case']:11} {r['impl']:14} {r['tokens_per_s']:>11,.0f} tok/s  MFU {mfu:>6}  peak {mem}"


def table(rows: list[dict], peaks: dict, device_name: str) -> str:
    lines = [
        "| config | case | impl | tok/s median (min–max) | MFU | peak memory | vs txl-eager | vs HF |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        same = [o for o in rows if o["config"] == r["config"] and o["case"] == r["case"]]
        eager = next((o["tokens_per_s"] for o in same if o["impl"] == "txl-eager"), None)
        hf = next((o["tokens_per_s"] for o in same if o["impl"] == "hf"), None)
        rel = lambda x, r=r: f"{r['tokens_per_s'] / x:.2f}×" if x else ""  # noqa: E731
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else ""
        mem = f"{r['peak_gib']:.1f} GiB" if r.get("peak_gib") else ""
        lines.append(
            f"| {r['config']} | {r['case']} | {r['impl']} | {r['tokens_per_s']:,.0f} ({r['min']:,.0f}–{r['max']:,.0f})"
            f" | {mfu} | {mem} | {rel(eager) if r['impl'] != 'txl-eager' else ''} | "
            f"{rel(hf) if r['impl'] != 'hf' else ''} |"
        )
    peak = ", ".join(f"{k} {v / 1e12:,.0f} TFLOP/s" for k, v in peaks.items())
    return "\n".join(lines) + f"\n\nGEMM peaks measured in this run on {device_name}: {peak}.\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--configs", nargs="+", default=["wt103-base-nvidia", "wt103-large", "enwik8-base", "enwik8-large"])
    ap.add_argument("--impls", nargs="+", default=["txl", "txl-eager", "txl-reference", "hf"])
    ap.add_argument("--precisions", nargs="+", default=["bf16", "fp32"])
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument(
        "--eval_warmup",
        type=int,
        default=40,
        help="evaluation steps before the timed ones (the memory "
        "fills, then the graphs of the window's offsets are captured)",
    )
    ap.add_argument("--cases", nargs="+", default=["train", "eval"], choices=["train", "eval"])
    ap.add_argument("--track", type=int, default=0, help="steps of the bf16 / fp32 loss comparison (0: none)")
    ap.add_argument("--track_variants", nargs="+", default=["txl:bf16"], help="impl:precision[:seed]; first: headline")
    ap.add_argument("--track_dropout", type=float, help="dropout, dropatt of the tracked runs (default: the config)")
    ap.add_argument("--track_reference", default="txl-reference:fp32", help="impl:precision they are compared with")
    ap.add_argument("--track_text", type=Path, help="a text whose words the tracked runs learn (default: Zipf ids)")
    ap.add_argument(
        "--track_deterministic",
        action="store_true",
        help="the tracked runs with deterministic kernels (deterministic(): a repeated run gives the same losses)",
    )
    ap.add_argument("--budget", type=float, default=1e9, help="seconds: configurations after this are skipped")
    ap.add_argument("--json", type=Path, help="write the rows here (a list of objects)")
    ap.add_argument("--append", action="store_true", help="keep the --json file's rows of other configurations")
    ap.add_argument("--profile", type=Path, help="write profiles of txl's bf16 training steps to this folder")
    ap.add_argument("--write", type=Path, help="replace this script's section of docs/benchmarks.md")
    args = ap.parse_args()
    if args.track and args.track_deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # (before the first product: see deterministic())
    device = torch.device(args.device)
    try:
        import transformers  # noqa: F401

        from model_speed import patched_hf

        patched_hf()
        args.hf = "hf" in args.impls
    except (ImportError, SystemExit) as e:
        print(f"HF TransfoXL not available ({e}): txl rows only")
        args.hf = False
    t_start = time.perf_counter()
    log = lambda s: print(f"[{time.perf_counter() - t_start:6.1f} s] {s}", flush=True)  # noqa: E731
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    commit = code_version(ROOT)
    log(f"device {name}, torch {torch.__version__}, commit {commit}")
    peaks = {"bf16": gemm_peak(device, torch.bfloat16), "fp32": gemm_peak(device, torch.float32)}
    log(f"GEMM peaks: bf16 {peaks['bf16'] / 1e12:.0f} TFLOP/s, fp32 {peaks['fp32'] / 1e12:.1f} TFLOP/s")
    rows: list[dict] = []
    tracked = None

    kept = []  # (--append: the file's rows that this run does not measure again)
    if args.append and args.json and args.json.exists():
        kept = [r for r in json.loads(args.json.read_text()) if r.get("config") not in args.configs]

    def save(rows: list[dict]) -> None:  # (after every row: a run cut short keeps what it measured)
        for r in rows:
            r.update(device=name, torch=torch.__version__, commit=commit)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(kept + rows, indent=1) + "\n")

    args.save = save
    for cfg in args.configs:
        if time.perf_counter() - t_start > args.budget:
            log(f"{cfg}: skipped (budget)")
            continue
        run_config(cfg, args, device, peaks, rows, log)
    if args.track:

        def save_track(tracked: dict) -> None:  # (after every variant: a run cut short keeps what it measured)
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.with_name(args.json.stem + "_track.json").write_text(json.dumps(tracked) + "\n")

        tracked = track(args.configs[0], args, device, log, save_track)
    save(rows)
    print(table(rows, peaks, name))
    if args.write:
        gap = f"{100 * tracked['largest_gap']:.2f}%" if tracked and tracked["largest_gap"] is not None else "not run"
        section = (
            f"{HEADING}\n\nCommand: `python benchmarks/gpu_paper.py --track 300 --json benchmarks/results/gpu.json "
            f"--write docs/benchmarks.md`. Machine: {name}, torch {torch.__version__}, commit {commit}. "
            f"{__doc__.split(chr(10) + chr(10), 3)[2]}\n\n{table(rows, peaks, name)}\n"
            f"{args.track_variants[0]} against {args.track_reference}, {args.track} steps of {args.configs[0]}: "
            f"largest gap of the 20-step moving averages of the loss {gap} (target 1%).\n"
        )
        replace_section(args.write, HEADING, section)
    if not math.isfinite(sum(r["tokens_per_s"] for r in rows)):
        sys.exit(1)


if __name__ == "__main__":
    main()
