"""Generation on a CUDA GPU, side by side in one run: txl's one-token step replayed as a CUDA graph
(``txl.infer.static_decode``, the default there), the same K/V-cached step launched kernel by kernel
(``txl.kernels.backends.set_backends(graph_decode=False)``), and Hugging Face TransfoXL's ``generate()``.

    python benchmarks/gpu_generation.py --write docs/benchmarks.md     # on a machine with CUDA

The bench-char model (``BENCH.md``, the weights of ``model_speed.py``), a 128-token prompt, mem_len 640, greedy, 512
new tokens, batch 1 and 8 (the same prompt in every row); the three alternate within each repeat; new tokens per
second over the whole call (prompt, graph capture and all), medians with min-max. Also timed: short generations
(where the capture has to pay for itself). Checked in the same run: the graph's greedy tokens equal the uncached
loop's (the memory re-projected every step) over a memory that fills and slides, its log-probabilities equal the
kernel-by-kernel step's, a batch of left-padded prompts equals each prompt alone, seeded sampling equals the
kernel-by-kernel step's; the same for the bench-word model (adaptive input and softmax).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from _report import replace_section
from model_speed import Timer, build_pair, uncached_greedy
from txl.infer import static_decode
from txl.infer.generation import generate, stream
from txl.kernels.backends import set_backends

HEADING = "## Generation on a GPU: the one-token step as a CUDA graph"
PROMPT, MEM = 128, 640


def txl_run(model, prompt, n: int, graph: bool, **kw):
    set_backends(graph_decode=graph)
    try:
        return generate(model, prompt, n, temperature=kw.pop("temperature", 0.0), mem_len=kw.pop("mem_len", MEM), **kw)
    finally:
        set_backends(graph_decode=True)


def log_probs(model, prompt, n: int, graph: bool, mem_len: int, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    set_backends(graph_decode=graph)
    seen: list[torch.Tensor] = []
    try:
        steps = stream(model, prompt, n, temperature=0.0, mem_len=mem_len, observe=lambda lp, _: seen.append(lp), **kw)
        return torch.cat(list(steps), dim=1), torch.stack(seen)
    finally:
        set_backends(graph_decode=True)


def checks(ours, device) -> list[str]:
    g = torch.Generator(device=device).manual_seed(0)
    prompt = torch.randint(0, 256, (1, PROMPT), device=device, generator=g)
    out = []
    graph, lp_graph = log_probs(ours, prompt, 300, True, 40)  # the memory of 40 fills and slides
    kernels, lp_kernels = log_probs(ours, prompt, 300, False, 40)
    same = graph.equal(uncached_greedy(ours, prompt, 300, 40)) and graph.equal(kernels)
    out.append(f"300 greedy tokens, mem_len 40: graph = uncached loop = kernel by kernel: {same}")
    out.append(f"largest |Δ log p| graph vs kernel by kernel: {float((lp_graph - lp_kernels).abs().max()):.1e}")
    lengths = [128, 50, 90, 7]
    batch = torch.zeros(len(lengths), PROMPT, dtype=torch.long, device=device)
    pad = torch.ones_like(batch, dtype=torch.bool)
    for row, n in enumerate(lengths):
        batch[row, PROMPT - n :] = torch.randint(0, 256, (n,), device=device, generator=g)
        pad[row, PROMPT - n :] = False
    together = txl_run(ours, batch, 200, True, mem_len=64, padding=pad)[:, PROMPT:]
    alone = all(
        txl_run(ours, batch[r : r + 1, PROMPT - n :], 200, True, mem_len=64)[0, n:].equal(together[r])
        for r, n in enumerate(lengths)
    )
    out.append(f"left-padded prompts of 128/50/90/7 tokens, 200 new: batch = each alone: {alone}")
    sampled = [
        txl_run(ours, batch, 100, graph, temperature=0.9, top_p=0.95, padding=pad,
                generator=torch.Generator(device=device).manual_seed(3))
        for graph in (True, False)
    ]  # fmt: skip
    out.append(
        f"seeded sampling (temperature 0.9, top_p 0.95): graph = kernel by kernel: {sampled[0].equal(sampled[1])}"
    )
    word = build_pair("bench-word", device)[1].eval()  # adaptive input and softmax
    prompt = torch.randint(0, word.config.n_token, (1, PROMPT), device=device, generator=g)
    graph, lp_graph = log_probs(word, prompt, 200, True, 64)
    kernels, lp_kernels = log_probs(word, prompt, 200, False, 64)
    same = graph.equal(uncached_greedy(word, prompt, 200, 64)) and graph.equal(kernels)
    out.append(
        f"bench-word (adaptive softmax), 200 greedy tokens, mem_len 64: graph = uncached loop = kernel by kernel: "
        f"{same}; largest |Δ log p| {float((lp_graph - lp_kernels).abs().max()):.1e}"
    )
    return out


def fmt(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}–{max(values):,.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new_tokens", type=int, default=512)
    parser.add_argument("--write", type=Path, help="write the section into this markdown file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_generation.py needs a CUDA device")
    device = torch.device("cuda")
    timed = Timer(device)
    hf, ours = build_pair("bench-char", device)
    hf.eval()
    ours.eval()
    hf.reset_memory_length(MEM)
    prompt = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(1)).to(device)
    n = args.new_tokens
    rows = []
    for batch in (1, 8):
        p = prompt.expand(batch, -1).contiguous()
        runs = {
            "txl, CUDA graph": lambda p=p: txl_run(ours, p, n, True),
            "txl, kernel by kernel": lambda p=p: txl_run(ours, p, n, False),
            "HF generate()": lambda p=p: hf.generate(
                p, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
            ),
        }
        with torch.no_grad():
            for fn in runs.values():  # warm-up
                fn()
            speeds: dict[str, list[float]] = {k: [] for k in runs}
            for _ in range(args.repeats):
                for name, fn in runs.items():
                    speeds[name].append(batch * n / timed(fn))
        graph = statistics.median(speeds["txl, CUDA graph"])
        for name, v in speeds.items():
            rows.append(f"| {batch} | {name} | {fmt(v)} | {graph / statistics.median(v):.2f}× |")
        print(rows[-3:], flush=True)
    short = []
    for new in (static_decode.MIN_NEW_TOKENS, 16, 64):
        t = {g: [] for g in (True, False)}
        for _ in range(args.repeats):
            for g in t:
                t[g].append(timed(lambda g=g, new=new: txl_run(ours, prompt, new, g)) * 1e3)
        short.append(
            f"| {new} | {statistics.median(t[True]):.1f} ms | {statistics.median(t[False]):.1f} ms | "
            f"{statistics.median(t[False]) / statistics.median(t[True]):.2f}× |"
        )
        print(short[-1], flush=True)
    checked = checks(ours, device)
    print("\n".join(checked), flush=True)
    import transformers

    section = (
        f"{HEADING} (`benchmarks/gpu_generation.py`)\n\n"
        f"Command: `python benchmarks/gpu_generation.py --repeats {args.repeats} --write docs/benchmarks.md`. "
        f"Machine: {torch.cuda.get_device_name()}; torch {torch.__version__}, transformers {transformers.__version__}. "
        f"bench-char model, prompt {PROMPT} tokens, mem_len {MEM}, greedy, {n} new tokens; new tokens/s over the whole "
        "call (prompt, graph capture), medians (min–max) of the repeats; the three alternate within each repeat.\n\n"
        "| batch | implementation | new tokens/s | CUDA graph's speed-up |\n|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n\nShort generations, batch 1 (the graph is captured once per call, after a warm-up step; "
        f"generations of fewer than {static_decode.MIN_NEW_TOKENS} new tokens are not captured):\n\n"
        "| new tokens | txl, CUDA graph | txl, kernel by kernel | speed-up |\n|---|---|---|---|\n"
        + "\n".join(short)
        + "\n\nChecked in the same run:\n\n"
        + "\n".join(f"- {c}" for c in checked)
        + "\n"
    )
    print(section)
    if args.write:
        replace_section(args.write, HEADING, section)


if __name__ == "__main__":
    main()
