"""What each speed lever of txl gives: every lever turned off alone, against txl with all of them, in one run.

    make bench-levers   # = .venv/bin/python benchmarks/levers.py --write docs/benchmarks.md

On the ``BENCH.md`` bench-char shapes (batch 8 x tgt_len 128, 2 threads, fp32), the same weights and inputs:

* train step (forward + backward + optimizer, mem_len 128): the attention's forward and backward as native calls
  per head (``txl.kernels.native``; off: the PyTorch kernels), the rel_shift's own backward and the mask as an added
  bias
  (levers of the PyTorch kernels' path: off with the native attention off too; off: autograd's generic backward of
  a strided view, masked_fill), the projections of [memory; segment] with one backward (off: ``F.linear`` per
  slice, with the memory's input gradient), the native one-pass dropout (``txl.kernels.native``; off: the PyTorch mask
  below), the feed-forward's relu and dropout as one native pass each way (off: relu, then the dropout), the CPU
  dropout mask from 24-bit halves of 64-bit random words (off, with the native one: ``F.dropout``), the fused Adam
  kernel (off: the foreach and the for-loop Adam), fp32 GEMMs routed through oneDNN (a lever txl turns on only
  where its start-up check finds it exact and >= 15% faster), and malloc kept from returning large blocks (off:
  glibc's defaults; measured in fresh processes, since it is process-wide);
* bf16 train step (autocast, where the CPU has native bf16): the attention scores summed and masked in bf16 (off:
  upcast to fp32 first; the softmax computes in fp32 either way) and the native dropout (off: the PyTorch mask);
* evaluation (mem_len 640): the cross-segment K/V cache (off: the memory's hidden states re-projected every
  segment), the attention as one native call per head (``txl.kernels.native``; off: the (b)+(d) product, the shift, the
  mask and SDPA as PyTorch kernels) and the padded shift whose view takes the mask in place (off together with the
  native attention, whose path it is: the unpadded shift, and the mask added into a copy of the scores);
* generation (batch 1, 128-token prompt, mem_len 640, greedy): K/V-cached decoding (off: the whole memory
  re-projected for every new token), the transposed-weight form of one-row products (off: ``F.linear``; with the
  native step on, only the prompt's products take it), the one-token step as one native call (``txl.kernels.native``;
  off: the PyTorch loop below) and the one-token step as one loop over the layers' weights
  (``TransformerXL._decode``, which runs the native call where it can; off: the layers' own path);
* bench-word (adaptive softmax) train step and evaluation: the adaptive softmax's NLL per cluster by
  ``txl.kernels.native`` (from the logits in training; in evaluation from the hidden states, no logits stored; off: the
  logits kernel, or log_softmax + gather), and in training the native attention (off: the PyTorch kernels).

Rounds alternate between the variants; medians (min-max) of tokens/s. gain = all levers / lever off.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

from _report import replace_section
from model_speed import build_pair, cpu_description, uncached_greedy
from txl.infer.generation import generate
from txl.kernels.backends import use_backends
from txl.kernels.runtime import choose_fp32_matmul, configure_allocator, fp32_route, native_bf16
from txl.model import adaptive, attention, modeling, positions
from txl.model.modeling import KVCache, TransformerXLConfig, TransformerXLLM

HEADING = "## What each speed lever gives"
BATCH, TGT = 8, 128
CFG = dict(n_token=256, n_layer=6, d_model=256, n_head=8, d_head=32, d_inner=1024, dropout=0.1, mem_len=128)


def generic_shift(bd_raw: torch.Tensor) -> torch.Tensor:
    """The same strided view as ``_RelShift``, left to autograd's generic as_strided backward."""
    *lead, qlen, klen = bd_raw.shape
    stride = (*bd_raw.stride()[:-2], klen - 1, 1)
    return bd_raw.as_strided((*lead, qlen, klen), stride, bd_raw.storage_offset() + qlen - 1)


def fill_mask(score: torch.Tensor, mask: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    return score.masked_fill_(mask, float("-inf")) if inplace else score.masked_fill(mask, float("-inf"))


def plain_dropout(self, x: torch.Tensor) -> torch.Tensor:
    return F.dropout(x, self.p, self.training)


@contextlib.contextmanager
def plain_dropouts():
    """Every dropout by ``F.dropout`` (the feed-forward's relu too: relu, then ``F.dropout``)."""
    with mock.patch.object(modeling.Dropout, "forward", plain_dropout):
        with use_backends(native_relu_dropout=False):
            yield


@contextlib.contextmanager
def torch_attention_without(owner, name: str, value):
    """The PyTorch kernels' attention (the native one off), with one of their levers off too."""
    with use_backends(native_attention=False), mock.patch.object(owner, name, value):
        yield


TRAIN_LEVERS = {  # lever -> (context manager that turns it off, optimizer options)
    "all levers": (contextlib.nullcontext, {"fused": True}),
    "attention forward + backward as native calls (txl.kernels.native)": (
        lambda: use_backends(native_attention=False),
        {"fused": True},
    ),
    "rel_shift backward (and the native attention)": (
        lambda: torch_attention_without(positions._RelShift, "apply", generic_shift),
        {"fused": True},
    ),
    "mask as an added bias (and the native attention)": (
        lambda: torch_attention_without(modeling, "mask_scores", fill_mask),
        {"fused": True},
    ),
    "projections' one backward": (lambda: use_backends(segment_projection=False), {"fused": True}),
    "native dropout (txl.kernels.native)": (lambda: use_backends(native_dropout=False), {"fused": True}),
    "feed-forward relu + dropout in one pass (txl.kernels.native)": (
        lambda: use_backends(native_relu_dropout=False),
        {"fused": True},
    ),
    "CPU dropout mask": (plain_dropouts, {"fused": True}),
    "fused Adam (off: foreach)": (contextlib.nullcontext, {"foreach": True}),
    "fused Adam (off: for-loop)": (contextlib.nullcontext, {"foreach": False}),
}


class TrainCase:
    def __init__(
        self, model: TransformerXLLM, stream: torch.Tensor, off, opt_kw: dict, route: bool = False, bf16: bool = False
    ):
        self.model, self.stream, self.off, self.route, self.bf16 = model, stream, off, route, bf16
        self.opt = torch.optim.Adam(model.parameters(), lr=2.5e-4, **opt_kw)
        self.mems, self.pos = None, 0

    def step(self) -> None:
        x = self.stream[:, self.pos : self.pos + TGT]
        y = self.stream[:, self.pos + 1 : self.pos + TGT + 1]
        self.pos = (self.pos + TGT) % (self.stream.shape[1] - TGT - 1)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()
        with self.off(), fp32_route(self.route), autocast:
            out = self.model(x, y, mems=self.mems)
            out.loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.mems = out.mems
        out.loss.item()


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def alternate(cases: dict, warmup: int, steps: int, tokens: int) -> dict[str, list[float]]:
    """tokens/s of every case, steps interleaved (the order reversed every other round)."""
    times: dict[str, list[float]] = {k: [] for k in cases}
    names = list(cases)
    for i in range(warmup + steps):
        for name in names if i % 2 == 0 else names[::-1]:
            dt = timed(cases[name])
            if i >= warmup:
                times[name].append(tokens / dt)
    return times


def train_levers(warmup: int, steps: int, route_ok: bool) -> dict[str, list[float]]:
    torch.manual_seed(0)
    base = TransformerXLLM(TransformerXLConfig(**CFG)).train()
    stream = torch.randint(0, 256, (BATCH, TGT * 16 + 1), generator=torch.Generator().manual_seed(0))
    cases = {name: TrainCase(copy.deepcopy(base), stream, off, kw).step for name, (off, kw) in TRAIN_LEVERS.items()}
    if route_ok:  # the route is off by default here; measured as a lever "on"
        cases["fp32 GEMMs via oneDNN (on)"] = TrainCase(
            copy.deepcopy(base), stream, contextlib.nullcontext, {}, True
        ).step
    return alternate(cases, warmup, steps, BATCH * TGT)


def bf16_train_levers(warmup: int, steps: int) -> dict[str, list[float]]:
    """bf16 autocast (where the CPU has native bf16): the scores kept in bf16 (off: upcast to fp32 first), the native
    dropout (off: the PyTorch mask)."""
    torch.manual_seed(0)
    base = TransformerXLLM(TransformerXLConfig(**CFG)).train()
    stream = torch.randint(0, 256, (BATCH, TGT * 16 + 1), generator=torch.Generator().manual_seed(0))
    fp32_scores = lambda: use_backends(half_precision_scores=False)  # noqa: E731
    torch_mask = lambda: use_backends(native_dropout=False)  # noqa: E731
    variants = (
        ("all levers", contextlib.nullcontext),
        ("half-precision scores", fp32_scores),
        ("native dropout (txl.kernels.native)", torch_mask),
    )
    cases = {
        name: TrainCase(copy.deepcopy(base), stream, off, {"fused": True}, bf16=True).step for name, off in variants
    }
    return alternate(cases, warmup, steps, BATCH * TGT)


def eval_levers(warmup: int, steps: int) -> dict[str, list[float]]:
    torch.manual_seed(0)
    model = TransformerXLLM(TransformerXLConfig(**CFG)).eval()
    stream = torch.randint(0, 256, (BATCH, TGT * (warmup + steps + 2)), generator=torch.Generator().manual_seed(0))

    def segments(off=contextlib.nullcontext, cached: bool = True):
        """One segment per call, its memory carried (as a K/V cache, or as hidden states re-projected)."""
        state = {"cache": KVCache(model.config, BATCH, 640, TGT) if cached else None, "mems": None, "pos": 0}

        @torch.no_grad()
        def step():
            x = stream[:, state["pos"] : state["pos"] + TGT]
            state["pos"] += TGT
            with off():
                out = model.transformer(x, state["mems"], cache=state["cache"], mem_len=640)
            state["mems"] = out.mems  # (None with a cache)
            out.last_hidden_state.sum().item()

        return step

    torch_attention = lambda: use_backends(native_attention=False)  # noqa: E731

    @contextlib.contextmanager
    def unpadded():  # (the padded shift is the PyTorch kernels' path: with the native attention off too)
        with torch_attention(), mock.patch.object(attention, "shift_padding", lambda klen: 0):
            yield

    cases = {
        "all levers": segments(),
        "K/V cache": segments(cached=False),
        "attention as one native call per head (txl.kernels.native)": segments(torch_attention),
        "padded shift, mask added in place (and the native attention)": segments(unpadded),
    }
    return alternate(cases, warmup, steps, BATCH * TGT)


def word_levers(warmup: int, steps: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """bench-word (adaptive input and softmax; random tokens, so 7 in 8 targets are in a tail cluster): the
    training step with the softmax NLL from the logits (off: log_softmax + gather and their backward) and the native
    attention forward and backward (off: the PyTorch kernels), and the
    evaluation step (inside ``transposed_weights()``, as ``txl.infer.evaluate`` runs it) with the NLL without logits
    (off:
    from the logits; both off: log_softmax + gather)."""
    _, base = build_pair("bench-word")
    stream = torch.randint(0, 32000, (BATCH, TGT * 16 + 1), generator=torch.Generator().manual_seed(0))
    no_nll = lambda: use_backends(native_nll=False)  # noqa: E731
    torch_attention = lambda: use_backends(native_attention=False)  # noqa: E731
    variants = (
        ("all levers", contextlib.nullcontext),
        ("softmax NLL from the logits (txl.kernels.native)", no_nll),
        ("attention forward + backward as native calls (txl.kernels.native)", torch_attention),
    )
    train = {name: TrainCase(copy.deepcopy(base).train(), stream, off, {"fused": True}).step for name, off in variants}
    model = base.eval()

    def segments(off=contextlib.nullcontext):
        state = {"cache": KVCache(model.config, BATCH, 640, TGT), "pos": 0}

        @torch.no_grad()
        def step():
            x = stream[:, state["pos"] : state["pos"] + TGT]
            y = stream[:, state["pos"] + 1 : state["pos"] + TGT + 1]
            state["pos"] = (state["pos"] + TGT) % (stream.shape[1] - TGT - 1)
            with off():
                model(x, y, cache=state["cache"], mem_len=640).loss.item()

        return step

    def with_logits():  # (the NLL kernel on logits: what runs outside transposed_weights())
        return mock.patch.object(adaptive, "weight_copies", lambda: None)

    evaluation = {
        "all levers": segments(),
        "softmax NLL without the logits (txl.kernels.native)": segments(with_logits),
        "softmax NLL, both kernels (off: log_softmax + gather)": segments(no_nll),
    }
    with modeling.transposed_weights():
        return alternate(train, warmup, steps, BATCH * TGT), alternate(evaluation, warmup, steps, BATCH * TGT)


def with_backends(fn, **changes):
    with use_backends(**changes):
        return fn()


def generation_levers(repeats: int, new_tokens: int) -> dict[str, list[float]]:
    torch.manual_seed(0)
    model = TransformerXLLM(TransformerXLConfig(**CFG)).eval()
    prompt = torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(1))

    def run():
        return generate(model, prompt, new_tokens, temperature=0.0, mem_len=640)

    cases = {
        "all levers": run,
        "K/V-cached decoding": lambda: uncached_greedy(model, prompt, new_tokens, 640),
        "transposed weights for one-row products": lambda: with_backends(run, transposed_weights=False),
        "one-token steps as one native call (txl.kernels.native)": lambda: with_backends(run, native_decode=False),
        "one-token steps as one loop over the weights": lambda: with_backends(run, fast_decode=False),
    }
    return alternate(cases, 1, repeats, new_tokens)


ALLOC_SCRIPT = """
import json, sys, torch
sys.path[:0] = {paths!r}
torch.set_num_threads(2)
from txl.kernels.runtime import configure_allocator
if {alloc}:
    configure_allocator()
import levers
print(json.dumps(levers.alternate({{"x": levers.TrainCase(*levers.fresh(), levers.contextlib.nullcontext,
    {{"fused": True}}).step}}, {warmup}, {steps}, levers.BATCH * levers.TGT)["x"]))
"""


def fresh():
    torch.manual_seed(0)
    model = TransformerXLLM(TransformerXLConfig(**CFG)).train()
    return model, torch.randint(0, 256, (BATCH, TGT * 16 + 1), generator=torch.Generator().manual_seed(0))


def allocator_lever(rounds: int, warmup: int, steps: int) -> dict[str, list[float]]:
    """Fresh processes with and without the malloc settings, alternating."""
    paths = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "src")]
    out: dict[str, list[float]] = {"all levers": [], "malloc settings": []}
    for i in range(2 * rounds):
        alloc = (i % 2 == 0) == (i // 2 % 2 == 0)
        code = ALLOC_SCRIPT.format(paths=paths, alloc=alloc, warmup=warmup, steps=steps)
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        out["all levers" if alloc else "malloc settings"] += json.loads(res.stdout.strip().splitlines()[-1])
    return out


def fmt(v: list[float]) -> str:
    return f"{statistics.median(v):,.0f} ({min(v):,.0f}–{max(v):,.0f})"


def rows(case: str, times: dict[str, list[float]]) -> list[str]:
    ref = statistics.median(times["all levers"])
    out = []
    for name, v in times.items():
        if name == "all levers":
            continue
        gain = ref / statistics.median(v)
        on = name.endswith("(on)")
        shown = f"**{1 / gain:.2f}×** (turning it on)" if on else f"**{gain:.2f}×**"
        out.append(f"| {case} | {name} | {fmt(times['all levers'])} | {fmt(v)} | {shown} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2, help="process pairs for the malloc lever")
    ap.add_argument("--gen_repeats", type=int, default=3)
    ap.add_argument("--write", type=Path, help="write the section into this markdown file")
    args = ap.parse_args()
    torch.set_num_threads(2)
    alloc_on = configure_allocator()
    route = choose_fp32_matmul()
    print(f"machine: {cpu_description()}; {route.describe()}", flush=True)
    table = []
    word_train, word_eval = word_levers(args.warmup, args.steps)
    for case, times in (
        ("train step", train_levers(args.warmup, args.steps, route.exact)),
        ("train step", allocator_lever(args.rounds, args.warmup, args.steps) if alloc_on else None),
        ("train step, bf16", bf16_train_levers(args.warmup, args.steps) if native_bf16(torch.device("cpu")) else None),
        ("eval, mem 640", eval_levers(args.warmup, args.steps)),
        ("generation (new tok/s)", generation_levers(args.gen_repeats, 128)),
        ("bench-word train step", word_train),
        ("bench-word eval, mem 640", word_eval),
    ):
        if times:
            table += rows(case, times)
            print("\n".join(rows(case, times)), flush=True)
    if args.write:
        header = (
            f"{HEADING} (`benchmarks/levers.py`)\n\n"
            f"Command: `make bench-levers` (= `python benchmarks/levers.py --warmup {args.warmup} --steps "
            f"{args.steps} --rounds {args.rounds} --gen_repeats {args.gen_repeats} --write docs/benchmarks.md`). "
            f"Machine: {cpu_description()}; 2 threads, torch {torch.__version__}. bench-char shapes (the last rows: "
            "bench-word), fp32 (the bf16 row: bf16 autocast); each "
            "row turns one lever off (or, for a lever txl leaves off here, on) and keeps the others; the variants "
            "alternate step by step in one process (malloc: fresh processes, alternating). gain = tokens/s with "
            "all levers / tokens/s with the lever off. The exactness of each lever is tested in `tests/` (the "
            "shift's gradient, the dropout distribution, cached = uncached evaluation and generation).\n\n"
            "| case | lever | all levers tok/s | lever off tok/s | gain |\n|---|---|---|---|---|\n"
        )
        replace_section(args.write, HEADING, header + "\n".join(table))


if __name__ == "__main__":
    main()
