"""Training's attention on a GPU as one ``scaled_dot_product_attention`` call (``Backends.sdpa_training_devices``)
against the explicit kernels (scores, mask, softmax, value sum): the same loss and gradients, and txl's training step
with each, alternating step by step in one process (medians of 12 steps each after 4 warm-up pairs).

    python benchmarks/gpu_training_attention.py          # on a machine with CUDA

bench-char and bench-word at batch 8 (``BENCH.md``), the paper's WikiText-103 base model at batch 32; fp32 and bf16
autocast. The results (and the choice they made: fp32 only) are in docs/benchmarks.md.
"""

from __future__ import annotations

import statistics

import torch

import model_speed
from model_speed import CASES, PAPER_CASES, Runner, Timer, build_pair
from txl.kernels.backends import set_backends

FUSED, EXPLICIT = ("cuda",), ()


def same_gradients(name: str, device: torch.device) -> str:
    _, ours = build_pair(name, device)
    ours.train()
    x = torch.randint(0, CASES[name]["vocab_size"], (8, 257), device=device)
    out = []
    for devices in (EXPLICIT, FUSED):
        set_backends(sdpa_training_devices=devices)
        ours.zero_grad()
        torch.manual_seed(1)  # (the same dropout masks)
        a = ours(x[:, :128], x[:, 1:129])
        b = ours(x[:, 128:256], x[:, 129:257], mems=a.mems)
        (a.loss + b.loss).backward()
        out.append((float(a.loss + b.loss), {n: p.grad.clone() for n, p in ours.named_parameters()}))
    (loss_a, ga), (loss_b, gb) = out
    rel = max(float((gb[n] - ga[n]).abs().max() / (ga[n].abs().max() + 1e-12)) for n in ga)
    return f"{name}: loss {loss_a:.6f} explicit, {loss_b:.6f} fused; largest relative gradient difference {rel:.1e}"


def speed(name: str, batch: int, precision: str, device: torch.device) -> str:
    model_speed.BATCH = batch
    _, ours = build_pair(name, device)
    n_token = {**CASES, **PAPER_CASES}[name]["vocab_size"]
    stream = torch.randint(0, n_token, (batch, 128 * 40 + 1), device=device)
    runner = Runner("txl", ours, stream, train=True, mem_len=128, precision=precision, route=False, device=device)
    times: dict[tuple, list[float]] = {EXPLICIT: [], FUSED: []}
    timer = Timer(device)
    for i in range(16):
        for devices in (EXPLICIT, FUSED) if i % 2 == 0 else (FUSED, EXPLICIT):
            set_backends(sdpa_training_devices=devices)
            dt = timer(runner.step)
            if i >= 4:
                times[devices].append(dt)
    a, b = statistics.median(times[EXPLICIT]), statistics.median(times[FUSED])
    tokens = batch * 128
    return (
        f"{name} batch {batch} {precision}: explicit {tokens / a:,.0f} tok/s, fused {tokens / b:,.0f} tok/s, "
        f"{a / b:.2f}x"
    )


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("gpu_training_attention.py needs a CUDA device")
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for name in ("bench-char", "bench-word"):
        print(same_gradients(name, device), flush=True)
    for precision in ("fp32", "bf16"):
        for name, batch in (("bench-char", 8), ("bench-word", 8), ("wt103-base", 32)):
            print(speed(name, batch, precision, device), flush=True)


if __name__ == "__main__":
    main()
