"""txl's Compressive Transformer and Transformer-XL against the public PyTorch implementations, same size, same batches.

    .venv/bin/python benchmarks/peers_compressive.py --rounds 3 --steps 8      # ~5 minutes on 2 cores

Peers (the bench extra installs them): lucidrains' compressive-transformer-pytorch 0.4.0 (its Compressive
Transformer, with its attention-reconstruction loss; its GRU-gated residual and "enhanced recurrence" turned off,
the paper's layer) and x-transformers 2.31.10 (the library most researchers reach for; its Transformer-XL-style
recurrence, ``max_mem_len`` with returned ``mems``, with T5-style relative position bias: it has no Transformer-XL
relative encoding). Each model: 4 layers, d_model 256, 8 heads of 32, feed-forward 1024, 256 byte tokens, segments of
128 after a memory of 128 (and 32 compressed slots of c = 4 for the compressive models), batch 8 of the Shakespeare
corpus's bytes, Adam, fp32, 2 threads. Each configuration runs in its own process (peak RSS is its own),
alternating, one at a time; the table gives medians over the rounds.

Rows: a training step (forward, backward, the optimizer; the reconstruction loss where the model has one), tokens/s
and the process's peak RSS; greedy generation of 128 tokens after a 128-token prompt, tokens/s (txl: its K/V cache
with the memories; x-transformers: ``generate(cache_kv=True)``; lucidrains' has no cached generation).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
D, L, H, FF, V, T, M, CM, C, B = 256, 4, 8, 1024, 256, 128, 128, 32, 4, 8
IMPLS = ["txl-compressive", "lucidrains-compressive", "txl-xl", "x-transformers-xl"]


def batches(n: int):
    """``n`` batches [B, T + 1] of consecutive byte columns of the Shakespeare corpus (the same for every model)."""
    data = (ROOT / "data" / "shakespeare" / "train.txt").read_bytes()
    ids = torch.tensor(list(data[: B * (n * T + 1)]), dtype=torch.long).view(B, -1)
    return [ids[:, i * T : i * T + T + 1] for i in range(n)]


def build(impl: str):
    """(model, one training step(batch, state) -> state, generate(prompt, n) or None)."""
    torch.manual_seed(0)
    if impl.startswith("txl"):
        from txl import TransformerXLConfig, TransformerXLLM
        from txl.infer.generation import generate

        extra = dict(cmem_len=CM, cmem_ratio=C, compression="conv") if impl == "txl-compressive" else {}
        cfg = TransformerXLConfig(n_token=V, n_layer=L, d_model=D, n_head=H, d_head=D // H, d_inner=FF, mem_len=M,
                                  dropout=0.0, **extra)  # fmt: skip
        model = TransformerXLLM(cfg)

        def step(batch, mems):
            out = model(batch[:, :-1], batch[:, 1:], mems=mems)
            (out.loss if out.recon_loss is None else out.loss + out.recon_loss).backward()
            return out.mems

        return model, step, lambda p, n: generate(model.eval(), p, n, temperature=0.0)
    if impl == "lucidrains-compressive":
        from compressive_transformer_pytorch import CompressiveTransformer

        model = CompressiveTransformer(num_tokens=V, dim=D, seq_len=T, depth=L, mem_len=M, cmem_len=CM, cmem_ratio=C,
                                       heads=H, gru_gated_residual=False, enhanced_recurrence=False)  # fmt: skip

        def step(batch, mems):
            logits, mems, aux = model(batch[:, :-1], memories=mems)
            loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch[:, 1:]) + aux
            loss.backward()
            return mems

        return model, step, None
    from x_transformers import AutoregressiveWrapper, Decoder, TransformerWrapper

    net = TransformerWrapper(num_tokens=V, max_seq_len=T, max_mem_len=M,
                             attn_layers=Decoder(dim=D, depth=L, heads=H, attn_dim_head=D // H, ff_mult=FF // D,
                                                 rel_pos_bias=True))  # fmt: skip

    def step(batch, mems):
        logits, mems = net(batch[:, :-1], mems=mems, return_mems=True)
        torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch[:, 1:]).backward()
        return mems

    wrapper = AutoregressiveWrapper(net)
    return net, step, lambda p, n: wrapper.generate(p, n, temperature=0.0, cache_kv=True)


def measure(impl: str, steps: int) -> dict:
    """One process: ``steps`` training steps after 2 of warm-up, then greedy generation."""
    torch.set_num_threads(2)
    model, step, gen = build(impl)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    data, state, times = batches(steps + 2), None, []
    for i, batch in enumerate(data):
        t = time.perf_counter()
        opt.zero_grad()
        state = step(batch, state)
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - t)
    out = {"train_tok_s": B * T / statistics.median(times)}
    if gen is not None:
        prompt = data[0][:1, :T]
        with torch.no_grad():
            gen(prompt, 8)  # (warm-up)
            t = time.perf_counter()
            gen(prompt, T)
            out["gen_tok_s"] = T / (time.perf_counter() - t)
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--impl", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.impl:
        print(json.dumps(measure(args.impl, args.steps)))
        return
    results: dict[str, list[dict]] = {i: [] for i in IMPLS}
    for _ in range(args.rounds):
        for impl in IMPLS:
            cmd = [sys.executable, __file__, "--impl", impl, "--steps", str(args.steps)]
            res = subprocess.run(cmd, capture_output=True, text=True, check=True, env={"PYTHONPATH": str(ROOT / "src"),
                                 "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "2"})  # fmt: skip
            results[impl].append(json.loads(res.stdout.strip().splitlines()[-1]))
    flags = next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags")), [])
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"Machine: {cpu} ({' '.join(f for f in ('avx2', 'avx512f', 'amx_tile') if f in flags)}), torch "
          f"{torch.__version__}, 2 threads; {args.rounds} rounds of {args.steps} steps.\n")  # fmt: skip
    print("| implementation | train tok/s | peak RSS MiB | greedy generation tok/s |\n|---|---|---|---|")
    for impl, rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        gen = f"{med['gen_tok_s']:,.0f}" if "gen_tok_s" in med else "none (no cached generation)"
        print(f"| {impl} | {med['train_tok_s']:,.0f} | {med['peak_rss_mib']:,.0f} | {gen} |")


if __name__ == "__main__":
    main()
