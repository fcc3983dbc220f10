"""Where the time of one txl step goes: torch.profiler's operator table for a bench config (a tool, not a benchmark).

.venv/bin/python benchmarks/profile_step.py --config bench-char --precision bf16 --case train
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from torch.profiler import ProfilerActivity, profile

from model_speed import BATCH, TGT, Runner, build_pair
from txl.kernels.runtime import configure_allocator


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="bench-char", choices=["bench-char", "bench-word"])
    ap.add_argument("--case", default="train", choices=["train", "eval"])
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=30)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(2)
    configure_allocator()
    _, model = build_pair(args.config, device)
    train = args.case == "train"
    stream = torch.randint(0, model.config.n_token, (BATCH, TGT * (args.steps + 4) + 1)).to(device)
    runner = Runner(
        "txl", model, stream, train=train, mem_len=128 if train else 640, precision=args.precision, route=False,
        device=device,
    )  # fmt: skip
    for _ in range(3):
        runner.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof, contextlib.nullcontext():
        for _ in range(args.steps):
            runner.step()
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=args.rows))


if __name__ == "__main__":
    main()
