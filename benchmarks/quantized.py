"""Quantized inference on the CPU (`--quantize`, txl.infer.quantize): what int8 Linear layers give in generation
speed and cost in test loss, against fp32, in one run, alternating.

Two models: the trained `make demo` model (runs/shakespeare_char: test NLL over the first --batches batches, and
greedy generation) and a larger random one of the shape where products dominate (d_model 512, 8 layers, d_inner
2048, 8 heads, 2,000 tokens: generation speed only). Each recipe ("none" = fp32, "int8" = PyTorch's dynamic
quantization, "int8-weight-only" = torchao's) generates --tokens tokens greedily after a 64-token prompt, 2 threads,
--rounds rounds with the recipes alternating; medians and the spread (min-max) are reported.

    python benchmarks/quantized.py [--model runs/shakespeare_char] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import code_version, replace_section  # noqa: E402
from model_speed import cpu_description  # noqa: E402
from txl import TransformerXLConfig, TransformerXLLM  # noqa: E402
from txl.infer.evaluate import eval_text, evaluate  # noqa: E402
from txl.infer.generation import generate  # noqa: E402
from txl.infer.load import load  # noqa: E402
from txl.infer.quantize import quantize  # noqa: E402

HEADING = "## Quantized inference on the CPU (`benchmarks/quantized.py`)"
RECIPES = ("none", "int8", "int8-weight-only")
ROOT = Path(__file__).resolve().parents[1]


def gen_seconds(model: TransformerXLLM, prompt: torch.Tensor, tokens: int, mem_len: int) -> float:
    t = time.perf_counter()
    generate(model, prompt, tokens, temperature=0.0, mem_len=mem_len)
    return time.perf_counter() - t


def models(trained: Path | None) -> dict[str, tuple[dict[str, TransformerXLLM], int, float | None]]:
    """name -> ({recipe: model}, mem_len, and the fp32 model's loaded folder for the NLL or None)."""
    out = {}
    if trained is not None:
        base = load(trained).model
        out["shakespeare_char (trained)"] = ({r: quantize(copy.deepcopy(base), r) for r in RECIPES}, 256, trained)
    torch.manual_seed(0)
    cfg = TransformerXLConfig(n_token=2000, n_layer=8, d_model=512, n_head=8, d_head=64, d_inner=2048, mem_len=256)
    big = TransformerXLLM(cfg).eval()
    out["d512 x 8 layers (random)"] = ({r: quantize(copy.deepcopy(big), r) for r in RECIPES}, 256, None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, default=ROOT / "runs" / "shakespeare_char")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--write", type=Path, default=None)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(2)
    trained = args.model if (args.model / "checkpoints").exists() or (args.model / "config.json").exists() else None
    if trained is None:
        print(f"{args.model}: no trained model (make demo trains it): the speed rows only", file=sys.stderr)
    rows = []
    for name, (by_recipe, mem_len, folder) in models(trained).items():
        prompt = torch.randint(0, by_recipe["none"].config.n_token, (1, 64), generator=torch.Generator().manual_seed(1))
        for r in RECIPES:  # (warm-up: first-use checks and measurements)
            gen_seconds(by_recipe[r], prompt, 8, mem_len)
        times = {r: [] for r in RECIPES}
        for _ in range(args.rounds):
            for r in RECIPES:
                times[r].append(gen_seconds(by_recipe[r], prompt, args.tokens, mem_len))
        nll = {}
        if folder is not None:
            loaded = load(folder)
            ids = eval_text(loaded.folder, loaded.run, "test").ids
            s = loaded.settings
            for r in RECIPES:
                nll[r] = evaluate(
                    by_recipe[r], ids, batch_size=s.batch_size, tgt_len=s.tgt_len, mem_len=s.mem_len,
                    clamp_len=s.clamp_len, same_length=s.same_length, max_batches=args.batches,
                ).loss  # fmt: skip
        base = statistics.median(times["none"])
        for r in RECIPES:
            med = statistics.median(times[r])
            d = f"{nll[r] - nll['none']:+.4f}" if nll else "-"
            rows.append(
                f"| {name} | {r} | {args.tokens / med:,.0f} | {min(times[r]) / med:.2f}-{max(times[r]) / med:.2f} | "
                f"{base / med:.2f}x | {nll[r]:.4f} | {d} |" if nll else
                f"| {name} | {r} | {args.tokens / med:,.0f} | {min(times[r]) / med:.2f}-{max(times[r]) / med:.2f} | "
                f"{base / med:.2f}x | - | - |"
            )  # fmt: skip
    section = "\n".join([
        HEADING, "",
        "What: `--quantize int8` (PyTorch's dynamic quantization of every `nn.Linear`: int8 weights, activations "
        "quantized per call) and `--quantize int8-weight-only` (torchao's) against fp32, for `txl generate`, "
        "`txl eval` and `txl serve`. Greedy generation of "
        f"{args.tokens} tokens after a 64-token prompt (tokens/s, median of {args.rounds} alternating rounds; the "
        "spread is min-max over the median), and the test NLL of the trained model (nats per character, the first "
        f"{args.batches} batches of `txl eval`'s reading) with its change against fp32.", "",
        "Command: `python benchmarks/quantized.py --write docs/benchmarks.md` (after `make demo`)", "",
        f"Machine: {cpu_description()}; 2 threads; torch {torch.__version__}; code {code_version(ROOT)}", "",
        "| model | --quantize | tokens/s | spread | vs fp32 | test NLL | ΔNLL |",
        "|---|---|---:|---|---:|---:|---:|",
        *rows, "",
        "Meaning: every quantized layer is declined by the fast paths (one log line each), so a quantized model runs "
        "the model's own code: the native decoding step and the packed-weight products that fp32 generation uses "
        "are not used for it. On a model this small the int8 products do not pay for that; the larger model shows "
        "what the int8 Linear layers themselves give. torchao's weight-only int8 dequantizes each weight in its "
        "product on the CPU: it saves the weights' memory (4x), not time. With dynamic quantization the activations' "
        "scale is computed "
        "per call, so a token's log-probabilities depend on what shares its product (the batch of a served "
        "request, the segment of a cached evaluation): up to the quantization's error, not exactly.",
    ])  # fmt: skip
    print(section)
    if args.write is not None:
        replace_section(args.write, HEADING, section)


if __name__ == "__main__":
    main()
