"""The fused Triton attention alone (``txl.kernels.fused_attention``) at the WT103 base model's shapes, beside the same
attention written out and compiled by Inductor (what the compiled layers run), in one process: forward, and forward
with backward, for each tile setting (BLOCK x BLOCK tiles, warps, pipeline stages), so that one GPU run says which
setting to make the default and how far the kernel is from the compiled path (medians of CUDA-event timings).

    python benchmarks/gpu_fused_attention.py                    # on a GPU (~2 minutes: each setting compiles)
    python benchmarks/gpu_fused_attention.py --device cpu --smoke   # the script's smoke run (Triton's interpreter)

On an H200 (2026-11-27) the model's training step was 0.72x as fast with the kernel as with the compiled layers, and
evaluation 1.10x (docs/benchmarks.md); this script is the next measurement: which part of the step, at which tiles.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

if "--smoke" in os.sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (before triton is imported)

import torch

from txl.kernels import fused_attention
from txl.model.positions import causal_mask

SHAPES = {  # (batch, queries, memory, heads, head size): WT103 base at NVIDIA's configuration
    "train": (32, 192, 192, 8, 64),
    "eval": (32, 64, 640, 8, 64),
}
SMOKE = {"train": (1, 17, 9, 2, 16), "eval": (1, 8, 24, 2, 16)}
TILES = [(64, 4, 3), (64, 8, 3), (64, 4, 2), (32, 4, 2), (128, 8, 2), (128, 4, 1)]  # (BLOCK, warps, stages); first:
# the library's setting today (BLOCK 64, Triton's defaults of 4 warps and 3 stages)


def operands(B, T, M, H, Dh, dtype, device, grad):
    g = torch.Generator().manual_seed(0)
    K = T + M
    make = lambda *shape: torch.randn(*shape, generator=g).to(device)  # noqa: E731
    q = make(B, T, H, Dh).to(dtype)
    u, v = make(H, Dh), make(H, Dh)
    k, vv = make(B, H, K, Dh).to(dtype), make(B, H, K, Dh).to(dtype)
    r = make(H, Dh, K).to(dtype)
    return [t.requires_grad_(grad) for t in (q, u, v, k, vv, r)]


def written_out(q, u, v, k, vv, r, mask, scale):
    """Sec. 3.3: (q+u).k + (q+v).W_kR R at distance M+i-j (column K-1-(M+i-j) of r), masked, softmax, value sum."""
    B, T, H, Dh = q.shape
    K = k.shape[2]
    qu = ((q.float() + u) * scale).to(k.dtype).transpose(1, 2)  # [B, H, T, Dh]
    qv = ((q.float() + v) * scale).to(k.dtype).transpose(1, 2)
    ac = qu @ k.transpose(-1, -2)  # [B, H, T, K]
    band = qv @ r  # [B, H, T, K], column c: distance K-1-c
    i = torch.arange(T, device=q.device)[:, None]
    j = torch.arange(K, device=q.device)[None, :]
    column = (K - 1 - (K - T + i - j)).clamp(0, K - 1)
    bd = band.gather(-1, column.expand(B, H, T, K))
    prob = (ac.float() + bd.float()).masked_fill(mask, float("-inf")).softmax(-1)
    return (prob.to(vv.dtype) @ vv).transpose(1, 2).reshape(B, T, H * Dh)


def one_step(fn, ops: list, mask, scale: float, grad):
    """The timed call: ``fn``'s output, and with ``grad`` every operand's gradient too (forward and backward)."""
    if grad is None:
        return lambda: fn(*ops, mask, scale)
    return lambda: torch.autograd.grad(fn(*ops, mask, scale), ops, grad)


def timed(fn, device, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return statistics.median(out)


def with_tiles(block: int, warps: int, stages: int):
    """``fused_attention._settings`` with this tile setting (the benchmark's override; the library's is fixed)."""
    base = fused_attention._settings

    def settings(q, v):
        cfg = base(q, v)
        if not fused_attention.INTERPRETED:
            cfg.update(BLOCK=block, num_warps=warps, num_stages=stages)
        return cfg

    return settings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one tile setting, 1 step (a CPU check)")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    shapes, tiles = (SMOKE, TILES[:1]) if args.smoke else (SHAPES, TILES)
    steps, warmup = (1, 0) if args.smoke else (args.steps, 3)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}, {args.dtype}; medians of {steps} steps", flush=True)
    compiled = torch.compile(written_out) if device.type == "cuda" else written_out
    for case, (B, T, M, H, Dh) in shapes.items():
        scale = 1 / math.sqrt(Dh)
        mask = causal_mask(T, M, case == "eval", M, device=device)
        ops = operands(B, T, M, H, Dh, dtype, device, grad=case == "train")
        grad = torch.randn(B, T, H * Dh, device=device, dtype=dtype)

        call = (ops, mask, scale, grad if case == "train" else None)
        base = timed(one_step(compiled, *call), device, warmup, steps)
        print(f"{case} (B {B}, T {T}, M {M}, H {H}, Dh {Dh}): written out, compiled: {1e3 * base:.3f} ms", flush=True)
        with torch.no_grad():
            want = written_out(*ops, mask, scale).float()
        settings = fused_attention._settings
        try:
            for block, warps, stages in tiles:
                fused_attention._settings = with_tiles(block, warps, stages)
                try:
                    with torch.no_grad():  # (each setting's output against the written-out attention's)
                        got = fused_attention.fused_rel_attention(*ops, mask, scale).float()
                        err = float((got - want).abs().max())
                    t = timed(one_step(fused_attention.fused_rel_attention, *call), device, warmup, steps)
                except Exception as e:  # (a setting whose tiles do not fit the card: reported, the next one runs)
                    print(f"  BLOCK {block:3} warps {warps} stages {stages}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                print(f"  BLOCK {block:3} warps {warps} stages {stages}: {1e3 * t:.3f} ms ({base / t:.2f}x), "
                      f"largest difference {err:.1e}", flush=True)  # fmt: skip
        finally:
            fused_attention._settings = settings


if __name__ == "__main__":
    main()
