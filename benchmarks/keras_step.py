"""Training steps per second: txl.keras's compiled fit step (JAX; TensorFlow with XLA and without) beside txl's
PyTorch step, the same model and batch on this CPU, one process per backend (Keras reads KERAS_BACKEND once).

    .venv-keras/bin/python benchmarks/keras_step.py            # prints the table of docs/benchmarks.md

Each row: the median of ``--rounds`` timings of ``--steps`` steps, after the compile/warm-up steps; 2 threads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = dict(n_token=84, n_layer=4, d_model=128, n_head=4, d_head=32, d_inner=512, mem_len=64, dropout=0.0)
BATCH, TGT = 16, 64


def keras_steps(jit: bool, steps: int, rounds: int) -> list[float]:
    import keras
    import numpy as np

    from txl.keras import TFTransfoXLLMHeadModel, TokenStream, txl_adam
    from txl.model.config import TransformerXLConfig

    keras.utils.set_random_seed(0)
    lm = TFTransfoXLLMHeadModel(TransformerXLConfig(**CONFIG))
    lm.carry_memory(BATCH)
    lm.compile(optimizer=txl_adam(2e-3, clip=1.0), jit_compile=jit)
    data = np.random.default_rng(0).integers(0, CONFIG["n_token"], BATCH * (TGT * (steps + 1) + 1))
    stream = TokenStream(data, BATCH, TGT)
    lm.fit(stream, epochs=1, steps_per_epoch=3, verbose=0)  # (compile, warm up)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        lm.fit(stream, epochs=1, steps_per_epoch=steps, verbose=0)
        times.append((time.perf_counter() - start) / steps)
    return times


def torch_steps(steps: int, rounds: int) -> list[float]:
    import torch

    from txl import TransformerXLLM
    from txl.model.config import TransformerXLConfig

    torch.manual_seed(0)
    model = TransformerXLLM(TransformerXLConfig(**CONFIG)).train()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    x = torch.randint(0, CONFIG["n_token"], (BATCH, TGT))
    y = torch.randint(0, CONFIG["n_token"], (BATCH, TGT))
    mems = None

    def step() -> None:
        nonlocal mems
        out = model(x, y, mems=mems)
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        mems = out.mems

    for _ in range(3):
        step()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        times.append((time.perf_counter() - start) / steps)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:  # (a child process: one backend)
        if args.one == "torch":
            import torch

            torch.set_num_threads(2)
            times = torch_steps(args.steps, args.rounds)
        else:
            times = keras_steps(args.one.endswith("xla"), args.steps, args.rounds)
        print(json.dumps(times))
        return
    flags = sorted({f for f in open("/proc/cpuinfo").read().split() if f.startswith(("avx", "fma", "amx"))})
    model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    print(f"CPU: {model}; flags: {' '.join(flags)}; 2 threads")
    rows = [("txl PyTorch (eager, txl's default fast paths)", "torch", ""),
            ("txl.keras on JAX (fit, jit)", "jax-xla", "jax"),
            ("txl.keras on TensorFlow with XLA (jit_compile=True)", "tf-xla", "tensorflow"),
            ("txl.keras on TensorFlow without XLA (tf.function)", "tf", "tensorflow")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TF_NUM_INTEROP_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "2",
           "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=true intra_op_parallelism_threads=2"}  # fmt: skip
    results = {}
    for name, key, backend in rows:
        out = subprocess.run([sys.executable, __file__, "--one", key, "--steps", str(args.steps), "--rounds",
                              str(args.rounds)], env={**env, "KERAS_BACKEND": backend or "jax"},
                             capture_output=True, text=True, check=True)  # fmt: skip
        times = sorted(json.loads(out.stdout.strip().splitlines()[-1]))
        results[name] = times[len(times) // 2]
    base = results[rows[0][0]]
    print(
        f"\nbatch {BATCH} x {TGT} tokens, memory {CONFIG['mem_len']}, 4 layers, d_model 128 (bench: shakespeare_char)"
    )
    print("| step | ms per step (median) | steps/s | vs txl PyTorch |")
    print("|---|---|---|---|")
    for name, t in results.items():
        print(f"| {name} | {1000 * t:.1f} | {1 / t:.2f} | {base / t:.2f}x |")


if __name__ == "__main__":
    main()
