"""`txl serve` under load: total tokens/s and latency at 1, 8, 32 and 64 concurrent streaming clients, with the
engine's step-by-step batching (``--max_batch 16``) and without it (``--max_batch 1``: one request at a time), and the
same figures under the soak mix (:func:`soak_mix`: valid and invalid requests, streaming and not, clients that
vanish mid-stream, requests whose penalties leave no token, scores and completions, all at once).

    .venv/bin/python benchmarks/serve_load.py --write docs/benchmarks.md     # ~10 minutes on 2 cores

The server is a real ``txl serve`` process on 127.0.0.1 (1 torch thread, the default) serving the demo's model shape
(`configs/shakespeare_char.yaml`: 4 layers, d_model 128, mem_len 64; random weights and a byte tokenizer unless
``--model`` names a trained one). Each client streams ``--tokens`` new tokens (server-sent events) from its own
prompt and seed, sampling at temperature 1; clients run in threads of this process. Reported per setting: total
tokens/s (all clients' tokens over the wall time of the round), time to first token (p50 and p99 over all clients)
and time per later token, failed requests. Both servers run side by side and take turns round by round (so that a
change in the machine's speed hits both); rounds are repeated ``--repeats`` times and the median round is reported.
The soak mix runs ``--soak_seconds`` against the batched server at each client count; its figures are those of its
valid streaming requests, beside the count of each kind of outcome (no 5xx, every stream with its final event).
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
    from txl.model.modeling import TransformerXLLM

    cfg = load_recipe(ROOT / "configs" / "shakespeare_char.yaml").model
    cfg.n_token = 256
    TransformerXLLM(cfg).save_pretrained(folder)
    Tokenizer.bytes256().save(folder / "tokenizer.json")
    return folder


def start(model: Path, max_batch: int, *extra: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "txl", "serve", "--model", str(model), "--port", str(port)]
    proc = subprocess.Popen(cmd + ["--max_batch", str(max_batch), "--max_queue", "64", *extra], env=env)
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
                    if line.startswith("data: {") and json.loads(line[6:]).get("token_id") is not None:
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

    wall = run_clients(client, clients)
    return {
        "tokens_per_s": total / wall, "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99),
        "tpot_p50": pct(per_token, 0.5), "tpot_p99": pct(per_token, 0.99), "failures": failures,
    }  # fmt: skip


def run_clients(client, clients: int) -> float:
    """Run ``client(i)`` in ``clients`` threads at once; the wall time until the last one ends."""
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start_t = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start_t


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


SOAK_KINDS = ("stream", "json", "vanish", "invalid", "no_token_left", "score", "completion")


def soak_mix(url: str, clients: int, seconds: float, seed: int = 0, tokens: int = 100) -> dict:
    """``clients`` threads sending, for ``seconds``, a mix of requests (each thread its own seeded random choice):
    streamed and JSON generations, streams the client leaves after a few events, invalid requests (bad types,
    out-of-range values, unknown fields, an unknown model), generations whose penalties leave no token, scores and
    streamed completions with n = 2. Returns the counts of each kind and outcome, the problems (a 5xx, a stream
    without its final event and [DONE], an error body not in OpenAI's shape, a transport error), and tokens/s and
    first-token latencies of the valid streamed generations."""
    invalid = [
        {"prompt": "ab", "max_new_tokens": -1}, {"prompt": "ab", "temperature": "hot"}, {"prompt": 5},
        {"prompt": "ab", "what": 1}, {"prompt": "ab", "top_p": 0}, {"prompt_ids": [10**9]}, {},
        {"prompt": "ab", "max_new_tokens": 10**9}, {"prompt": "ab", "mem_len": 10**9},
    ]  # fmt: skip
    counts: dict[str, int] = {}
    problems: list[str] = []
    ttft: list[float] = []
    total = 0
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def count(key: str) -> None:
        with lock:
            counts[key] = counts.get(key, 0) + 1

    def check_error(kind: str, res: httpx.Response) -> None:
        body = res.json()
        if res.status_code >= 500 or set(body.get("error", {})) != {"message", "type", "param", "code"}:
            problems.append(f"{kind}: {res.status_code} {body}")
        count(f"{kind} {res.status_code}")

    def stream(kind: str, path: str, body: dict, leave_after: int | None = None) -> None:
        nonlocal total
        t0 = time.perf_counter()
        first, lines = None, []
        with httpx.stream("POST", url + path, json=body | {"stream": True}, timeout=300) as res:
            if res.status_code != 200:
                res.read()
                check_error(kind, res)
                return
            for line in res.iter_lines():
                if not line.startswith("data: "):
                    continue
                lines.append(line[6:])
                if first is None:
                    first = time.perf_counter() - t0
                if leave_after is not None and len(lines) >= leave_after:
                    count(f"{kind} left")
                    return
        if lines[-1:] != ["[DONE]"] or len(lines) < 2:
            problems.append(f"{kind}: a stream without its final event and [DONE]: {lines[-2:]}")
            return
        final = json.loads(lines[-2])
        reason = final.get("finish_reason") or (final.get("choices") or [{}])[0].get("finish_reason")
        if "error" in final and final["error"] is not None:
            reason = "error " + final["error"]["type"]
            if final["error"]["type"] == "server_error":
                problems.append(f"{kind}: {final['error']}")
        count(f"{kind} {reason}")
        if kind == "stream" and reason == "length":
            with lock:
                total += final["new_tokens"]
                ttft.append(first)

    def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() < deadline:
            kind = rng.choice(SOAK_KINDS)
            prompt = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 40))) + "a"  # (in any vocabulary)
            body = {"prompt": prompt, "max_new_tokens": rng.randint(1, tokens), "seed": rng.randint(0, 10**6)}
            try:
                if kind in ("stream", "vanish"):
                    stream(kind, "/v1/generate", body, rng.randint(1, 5) if kind == "vanish" else None)
                elif kind == "json":
                    res = httpx.post(url + "/v1/generate", json=body | {"temperature": 0}, timeout=300)
                    count(f"json {res.status_code}") if res.status_code == 200 else check_error(kind, res)
                elif kind == "invalid":
                    path, bad = rng.choice([("/v1/generate", rng.choice(invalid)),
                                            ("/v1/score", {"text": "ab", "tgt_len": 10**9}),
                                            ("/v1/completions", {"model": "gpt-4", "prompt": "ab"}),
                                            ("/v1/completions", {"prompt": "ab", "temperature": 5})])  # fmt: skip
                    check_error(kind, httpx.post(url + path, json=bad, timeout=300))
                elif kind == "no_token_left":
                    stream(kind, "/v1/generate", body | {"max_new_tokens": 300, "no_repeat_ngram_size": 1})
                elif kind == "score":
                    res = httpx.post(url + "/v1/score", json={"text": prompt * rng.randint(1, 20)}, timeout=300)
                    count(f"score {res.status_code}") if res.status_code == 200 else check_error(kind, res)
                else:
                    stream(kind, "/v1/completions", {"prompt": prompt, "max_tokens": body["max_new_tokens"], "n": 2})
            except Exception as e:  # (a transport error is a problem: the server must answer everything)
                with lock:
                    problems.append(f"{kind}: {type(e).__name__}: {e}")

    wall = run_clients(client, clients)
    return {
        "counts": dict(sorted(counts.items())), "problems": problems, "requests": sum(counts.values()),
        "tokens_per_s": total / wall, "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a model to serve (default: the demo's shape, random weights)")
    ap.add_argument("--clients", default="1,8,32,64")
    ap.add_argument("--tokens", type=int, default=100, help="new tokens per request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--soak_seconds", type=float, default=30, help="per client count (0: no soak rounds)")
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    counts = [int(x) for x in args.clients.split(",")]
    tmp = tempfile.TemporaryDirectory()
    model = args.model or demo_shaped_model(Path(tmp.name) / "model")
    print(f"machine: {cpu_description()}", flush=True)
    results, soaks = {}, {}
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
                      f"{r['ttft_p50'] * 1e3:.0f} ms p99 {r['ttft_p99'] * 1e3:.0f} ms, per token p50 "
                      f"{r['tpot_p50'] * 1e3:.1f} ms, failures {r['failures']}", flush=True)  # fmt: skip
            if args.soak_seconds > 0:
                soak = soaks[n] = soak_mix(servers["batched"][1], n, args.soak_seconds, tokens=args.tokens)
                print(f"soak mix  {n:2d} clients: {soak['tokens_per_s']:7.1f} tokens/s of valid streams, TTFT p50 "
                      f"{soak['ttft_p50'] * 1e3:.0f} ms p99 {soak['ttft_p99'] * 1e3:.0f} ms, {soak['requests']} "
                      f"requests, problems {len(soak['problems'])}: {soak['problems'][:3]}", flush=True)  # fmt: skip
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    if args.write:
        write(args, counts, results, soaks)


def write(args: argparse.Namespace, counts: list[int], results: dict, soaks: dict) -> None:
    ms = lambda r, k: f"{r[k + '_p50'] * 1e3:.0f} / {r[k + '_p99'] * 1e3:.0f}"  # noqa: E731
    lines = [
        HEADING,
        "",
        f"Command: `python benchmarks/serve_load.py --write docs/benchmarks.md`. Machine: {cpu_description()}. "
        f"A `txl serve` process (1 torch thread) with the demo's model shape; each client streams {args.tokens} "
        f"tokens; median of {args.repeats} rounds; latencies p50 / p99 over every client of the round.",
        "",
        "| clients | batched tokens/s | unbatched tokens/s | batched / unbatched | batched TTFT p50 / p99 (ms) | "
        "unbatched TTFT p50 / p99 (ms) | batched ms/token p50 / p99 | unbatched ms/token p50 / p99 | failures |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n in counts:
        b, u = results[("batched", n)], results[("unbatched", n)]
        lines.append(
            f"| {n} | {b['tokens_per_s']:.0f} | {u['tokens_per_s']:.0f} | "
            f"**{b['tokens_per_s'] / u['tokens_per_s']:.2f}×** | {ms(b, 'ttft')} | {ms(u, 'ttft')} | "
            f"{b['tpot_p50'] * 1e3:.1f} / {b['tpot_p99'] * 1e3:.1f} | {u['tpot_p50'] * 1e3:.1f} / "
            f"{u['tpot_p99'] * 1e3:.1f} | {b['failures'] + u['failures']} |"
        )
    if soaks:
        lines += [
            "",
            f"Under the soak mix ({args.soak_seconds:g} s per row against the batched server: streamed and JSON "
            "generations, streams left after 1-5 events, invalid requests, generations whose penalties leave no "
            "token, scores, streamed completions with n = 2, each client choosing at random). Tokens/s and TTFT are "
            "those of the valid streamed generations that ran to their length; problems counts 5xx answers, streams "
            "without their final event and [DONE], error bodies not in OpenAI's shape and transport errors.",
            "",
            "| clients | requests | valid-stream tokens/s | TTFT p50 / p99 (ms) | 429 (busy) | problems |",
            "|---|---|---|---|---|---|",
        ]
        for n, soak in soaks.items():
            busy = sum(v for k, v in soak["counts"].items() if k.endswith(" 429"))
            lines.append(
                f"| {n} | {soak['requests']} | {soak['tokens_per_s']:.0f} | {ms(soak, 'ttft')} | {busy} | "
                f"{len(soak['problems'])} |"
            )
    replace_section(args.write, HEADING, "\n".join(lines))


if __name__ == "__main__":
    main()
