"""txl.keras's fit() beside txl's PyTorch trainer: the same data (the recipe's training stream, in the trainer's
order), the same initial weights (the trainer's own initialisation for each seed), the same schedule (Adam with
PyTorch's update, txl's warm-up + cosine, the gradient norm clipped), the memory carried from batch to batch; then
both models scored by one evaluator (txl's ``evaluate`` on the valid split, the recipe's eval settings).

    KERAS_BACKEND=jax .venv-keras/bin/python experiments/keras_vs_torch.py --steps 400 --seeds 1,2,3

Writes runs/keras_vs_torch/results.json and prints the table of docs/keras.md (training loss per window of steps,
valid loss, steps/s of each).
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


def torch_run(recipe: str, run: Path, seed: int, common: list[str]) -> dict:
    """txl train (the CLI, in its own process); its metrics.jsonl and final model."""
    cmd = [sys.executable, "-m", "txl", "train", "--config", recipe, "--run_dir", str(run),
           "--train.seed", str(seed), *common]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env={**os.environ, "KERAS_BACKEND": ""})
    seconds = time.perf_counter() - start
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [(r["step"], r["loss"]) for r in rows if r.get("split", "train") == "train" and "loss" in r]
    return {"curve": train, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=str(ROOT / "configs" / "shakespeare_char.yaml"))
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "shakespeare"))
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--window", type=int, default=50, help="steps per point of the loss curve")
    ap.add_argument("--eval_batches", type=int, default=50)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "keras_vs_torch")
    args = ap.parse_args()

    import keras
    import numpy as np
    import torch

    from txl import TransformerXLLM
    from txl.config import load_recipe
    from txl.data.corpus import prepare_corpus
    from txl.infer.evaluate import evaluate
    from txl.keras import ResetMemory, TFTransfoXLLMHeadModel, TokenStream, TxlSchedule, txl_adam
    from txl.keras.weights import get_weights, set_weights

    steps, window = args.steps, args.window
    common = ["--data.path", args.data, "--train.max_steps", str(steps), "--train.max_time", "null",
              "--train.log_interval", str(window), "--train.eval_interval", "0",
              "--train.checkpoint_interval", str(steps), "--train.threads", "2"]  # fmt: skip
    cfg = load_recipe(args.recipe, {"data": {"path": args.data}, "train": {"max_steps": steps}})
    tc, ec = cfg.train, cfg.eval
    corpus = prepare_corpus(cfg.data)
    train_ids, valid_ids = np.asarray(corpus.splits["train"]), np.asarray(corpus.splits["valid"])
    torch.set_num_threads(2)
    eval_kw = dict(batch_size=ec.batch_size, tgt_len=ec.tgt_len, mem_len=ec.mem_len, clamp_len=ec.clamp_len,
                   same_length=ec.same_length, max_batches=args.eval_batches)  # fmt: skip
    results = {"backend": keras.backend.backend(), "steps": steps, "recipe": args.recipe, "seeds": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    for seed in [int(s) for s in args.seeds.split(",")]:
        run = args.out / f"torch-{seed}"
        t = torch_run(args.recipe, run, seed, common)
        trained = TransformerXLLM.from_pretrained(run)  # (its best/last checkpoint)
        t["valid"] = evaluate(trained, valid_ids, **eval_kw).loss

        torch.manual_seed(seed)  # the trainer's initialisation: torch.manual_seed(train.seed), then the model
        init = TransformerXLLM(cfg.model)
        lm = TFTransfoXLLMHeadModel(cfg.model, mem_init="empty")
        set_weights(lm, {k: v.detach().numpy() for k, v in init.state_dict().items()})
        schedule = TxlSchedule(tc.lr, tc.decay_steps or steps, tc.warmup_steps, tc.eta_min, tc.scheduler)
        lm.compile(optimizer=txl_adam(schedule, clip=tc.clip, betas=tuple(tc.betas), eps=tc.eps))
        lm.carry_memory(tc.batch_size)
        stream = TokenStream(train_ids, tc.batch_size, tc.tgt_len)
        losses: list[float] = []

        class Record(keras.callbacks.Callback):
            def __init__(self, into: list[float]) -> None:
                super().__init__()
                self.into = into

            def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
                self.into.append(float(logs["loss"]))  # (Keras's running mean of the epoch)

        epochs = -(-steps // len(stream))
        start = time.perf_counter()
        lm.fit(stream, epochs=epochs, steps_per_epoch=min(steps, len(stream)), verbose=0,
               callbacks=[ResetMemory(), Record(losses)])  # fmt: skip
        seconds = time.perf_counter() - start
        per_step = [m * (i + 1) - (losses[i - 1] * i if i else 0.0) for i, m in enumerate(losses)]  # (un-averaged)
        curve = [(min(s + window, steps), float(np.mean(per_step[s : s + window]))) for s in range(0, steps, window)]
        back = TransformerXLLM(cfg.model)
        back.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in get_weights(lm).items()})
        k = {"curve": curve, "seconds": seconds, "valid": evaluate(back.eval(), valid_ids, **eval_kw).loss}
        results["seeds"][seed] = {"torch": t, "keras": k}
        print(json.dumps({"seed": seed, "torch_valid": t["valid"], "keras_valid": k["valid"],
                          "torch_s": t["seconds"], "keras_s": seconds}), flush=True)  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    table(results)


def table(results: dict) -> None:
    import numpy as np

    seeds = results["seeds"]
    print(
        f"\n| step | txl (PyTorch) train loss, mean ± sd of {len(seeds)} seeds | txl.keras ({results['backend']}) fit |"
    )
    print("|---|---|---|")
    points = [s for s, _ in next(iter(seeds.values()))["keras"]["curve"]]
    for i, step in enumerate(points):
        t = [dict(v["torch"]["curve"]).get(step) for v in seeds.values()]
        k = [v["keras"]["curve"][i][1] for v in seeds.values()]
        t = [x for x in t if x is not None]
        ts = f"{np.mean(t):.4f} ± {np.std(t):.4f}" if t else "-"
        print(f"| {step} | {ts} | {np.mean(k):.4f} ± {np.std(k):.4f} |")
    tv = [v["torch"]["valid"] for v in seeds.values()]
    kv = [v["keras"]["valid"] for v in seeds.values()]
    print(f"| valid loss | {np.mean(tv):.4f} ± {np.std(tv):.4f} | {np.mean(kv):.4f} ± {np.std(kv):.4f} |")
    steps = results["steps"]
    ts = np.median([steps / v["torch"]["seconds"] for v in seeds.values()])
    ks = np.median([steps / v["keras"]["seconds"] for v in seeds.values()])
    print(f"| steps/s (whole run, median) | {ts:.2f} (process start, data, checkpoints included) | {ks:.2f} |")


if __name__ == "__main__":
    main()
