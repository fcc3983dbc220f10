"""`txl serve` under load: total tokens/s and latency at 1, 4, 8 and 16 concurrent streaming clients, with the
engine's step-by-step batching (``--max_batch 16``) and without it (``--max_batch 1``: one request at a time).

    .venv/bin/python benchmarks/serve_load.py --write docs/benchmarks.md     # ~5 minutes on 2 cores

The server is a real ``txl serve`` process on 127.0.0.1 (1 torch thread, the default) serving the demo's model shape
(`configs/shakespeare_char.yaml`: 4 layers, d_model 128, mem_len 64; random weights and a byte tokenizer unless
``--model`` names a trained one). Each client streams ``--tokens`` new tokens (server-sent events) from its own
prompt and seed, sampling at temperature 1; clients run in threads of this process. Reported per setting: total
tokens/s (all clients' tokens over the wall time of the round), time to first token and time per later token (p50 and
p95 over all clients), failed requests. Both servers run side by side and take turns round by round (so that a
change in the machine's speed hits both); rounds are repeated ``--repeats`` times and the median round is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from _report import replace_section
from model_speed import cpu_description

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Serving under load (`benchmarks/serve_load.py`)"


def demo_shaped_model(folder: Path) -> Path:
    """A model folder of the demo's shape (random weights) with a byte tokenizer."""
    from txl.config import load_recipe
    from txl.data import Tokenizer
    from txl.modeling import TransformerXLLM

    cfg = load_recipe(ROOT / "configs" / "shakespeare_char.yaml").model
    cfg.n_token = 256
    TransformerXLLM(cfg).save_pretrained(folder)
    Tokenizer.bytes256().save(folder / "tokenizer.json")
    return folder


def start(model: Path, max_batch: int) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "txl", "serve", "--model", str(model), "--port", str(port)]
    proc = subprocess.Popen(cmd + ["--max_batch", str(max_batch), "--max_queue", "64"], env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("txl serve did not start")


def one_round(url: str, clients: int, tokens: int) -> dict:
    """``clients`` concurrent streaming requests; tokens/s over the round and per-request latencies."""
    ttft, per_token, failures, total = [], [], 0, 0
    lock = threading.Lock()

    def client(i: int) -> None:
        nonlocal failures, total
        body = {"prompt": f"Client {i}: once upon a time", "max_new_tokens": tokens, "seed": i, "stream": True}
        t0 = time.perf_counter()
        stamps = []
        try:
            with httpx.stream("POST", url + "/v1/generate", json=body, timeout=300) as res:
                if res.status_code != 200:
                    raise RuntimeError(res.status_code)
                for line in res.iter_lines():
                    if line.startswith("data: ") and json.loads(line[6:]).get("token_id") is not None:
                        stamps.append(time.perf_counter())
            if len(stamps) != tokens:
                raise RuntimeError(f"{len(stamps)} tokens")
        except Exception:
            with lock:
                failures += 1
            return
        with lock:
            total += len(stamps)
            ttft.append(stamps[0] - t0)
            per_token.extend(b - a for a, b in zip(stamps, stamps[1:], strict=False))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start_t = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start_t

    def pct(xs: list[float], q: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    return {
        "tokens_per_s": total / wall, "ttft_p50": pct(ttft, 0.5), "ttft_p95": pct(ttft, 0.95),
        "tpot_p50": pct(per_token, 0.5), "tpot_p95": pct(per_token, 0.95), "failures": failures,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a model to serve (default: the demo's shape, random weights)")
    ap.add_argument("--clients", default="1,4,8,16")
    ap.add_argument("--tokens", type=int, default=100, help="new tokens per request")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    counts = [int(x) for x in args.clients.split(",")]
    tmp = tempfile.TemporaryDirectory()
    model = args.model or demo_shaped_model(Path(tmp.name) / "model")
    print(f"machine: {cpu_description()}", flush=True)
    results = {}
    servers = {mode: start(model, max_batch) for mode, max_batch in (("batched", 16), ("unbatched", 1))}
    try:
        for _, url in servers.values():
            one_round(url, 2, 10)  # warm-up
        for n in counts:  # the two servers take turns, round by round (one at a time: the other is idle)
            rounds = {mode: [] for mode in servers}
            for _ in range(args.repeats):
                for mode, (_, url) in servers.items():
                    rounds[mode].append(one_round(url, n, args.tokens))
            for mode, rs in rounds.items():
                rs.sort(key=lambda r: r["tokens_per_s"])
                r = rs[len(rs) // 2]
                r["failures"] = sum(x["failures"] for x in rs)
                results[(mode, n)] = r
                print(f"{mode:9s} {n:2d} clients: {r['tokens_per_s']:7.1f} tokens/s, TTFT p50 "
                      f"{r['ttft_p50'] * 1e3:.0f} ms, per token p50 {r['tpot_p50'] * 1e3:.1f} ms, "
                      f"failures {r['failures']}", flush=True)  # fmt: skip
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)
    if args.write:
        lines = [
            HEADING,
            "",
            f"Command: `python benchmarks/serve_load.py --write docs/benchmarks.md`. Machine: {cpu_description()}. "
            f"A `txl serve` process (1 torch thread) with the demo's model shape; each client streams {args.tokens} "
            f"tokens; median of {args.repeats} rounds; latencies p50 / p95 over every client of the round.",
            "",
            "| clients | batched tokens/s | unbatched tokens/s | batched / unbatched | batched TTFT p50 / p95 (ms) | "
            "unbatched TTFT p50 / p95 (ms) | batched ms/token p50 / p95 | unbatched ms/token p50 / p95 | failures |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for n in counts:
            b, u = results[("batched", n)], results[("unbatched", n)]
            lines.append(
                f"| {n} | {b['tokens_per_s']:.0f} | {u['tokens_per_s']:.0f} | "
                f"**{b['tokens_per_s'] / u['tokens_per_s']:.2f}×** | {b['ttft_p50'] * 1e3:.0f} / "
                f"{b['ttft_p95'] * 1e3:.0f} | {u['ttft_p50'] * 1e3:.0f} / {u['ttft_p95'] * 1e3:.0f} | "
                f"{b['tpot_p50'] * 1e3:.1f} / {b['tpot_p95'] * 1e3:.1f} | {u['tpot_p50'] * 1e3:.1f} / "
                f"{u['tpot_p95'] * 1e3:.1f} | {b['failures'] + u['failures']} |"
            )
        replace_section(args.write, HEADING, "\n".join(lines))


if __name__ == "__main__":
    main()
