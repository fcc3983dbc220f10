"""A CPU fast path's choice under load, then on the quiet machine: does the stored choice converge to the quiet one?

txl.kernels.measured times each CPU fast path against its reference where it is first used and keeps the choice per
machine. A first measurement made while another process hogs the CPU must not stick. This benchmark:

1. measures the quiet machine at length (41 paired rounds of the native attention against one SDPA call, in the
   model's inference forward): the answer the stored choice should reach;
2. starts CPU hogs (one busy process per core), and lets a fresh cache measure as a process would at first use;
3. stops the hogs and runs "later processes" (the choices read back from the file, as a new process does) until
   the stored choice is settled, printing each state: ratio, error, settled or not, the choice;
4. prints what the former rule (the median of 5 rounds, kept at once) would have kept from the loaded measurement.

    .venv/bin/python benchmarks/measured_noise.py [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
os.environ["TXL_NATIVE_CACHE"] = tempfile.mkdtemp(prefix="txl-noise-")  # (a fresh machine's cache: no choices)

import torch  # noqa: E402

from _report import replace_section  # noqa: E402
from model_speed import cpu_description  # noqa: E402
from txl import TransformerXLLM, use_backends  # noqa: E402
from txl.kernels import measured  # noqa: E402
from txl.model.modeling import TransformerXLConfig  # noqa: E402

torch.set_num_threads(2)
HEADING = "## A fast path's choice measured under load, then quiet (`benchmarks/measured_noise.py`)"


def hog() -> None:
    x = 0
    while True:
        x += 1


def model_and_input() -> tuple[TransformerXLLM, torch.Tensor]:
    torch.manual_seed(0)
    cfg = TransformerXLConfig(n_token=256, d_model=256, d_embed=256, n_head=8, d_head=32, d_inner=1024, n_layer=2,
                              tgt_len=64, mem_len=64)  # fmt: skip
    return TransformerXLLM(cfg).eval(), torch.randint(0, 256, (8, 64))


def attention_kind() -> str:
    kinds = [k for k in measured.choices() if k.startswith("native_attention ")]
    assert kinds, "the native attention was not measured (no C compiler?)"
    return kinds[0]


def first_use(model: TransformerXLLM, x: torch.Tensor) -> dict:
    """A process's first forward: the attention's choice measured (or read back), as the model runs it."""
    with torch.no_grad(), use_backends(measured=True):
        model(x)
    return measured.choices()[attention_kind()]


def row(stage: str, c: dict) -> str:
    spread = 100 * (2.718281828 ** (measured.Z * c["error"]) - 1)
    state = "settled" if c["settled"] else f"not settled ({len(c['samples'])} samples pooled)"
    return f"| {stage} | {c['ratio']:.2f}x | +-{spread:.0f}% | {state} | {'native' if c['use'] else 'PyTorch'} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", type=Path, help="put the table in this markdown file (docs/benchmarks.md)")
    ap.add_argument("--hogs", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    model, x = model_and_input()
    rows = []

    # 1. The quiet machine, at length.
    first_use(model, x)
    kind = attention_kind()
    with torch.no_grad(), use_backends(measured=True):
        quiet = measured.Paired(tuple(r for _ in range(3) for r in _attention_ratios(model, x)))
    rows.append(f"| quiet machine, {len(quiet.ratios)} rounds | {quiet.median:.2f}x | +-"
                f"{100 * (2.718281828 ** (measured.Z * quiet.error) - 1):.0f}% | reference | "
                f"{'native' if quiet.median >= 1 else 'PyTorch'} |")  # fmt: skip

    # 2. A fresh cache's first measurement, under load.
    measured.forget()
    measured._file().unlink(missing_ok=True)
    hogs = [mp.Process(target=hog, daemon=True) for _ in range(args.hogs)]
    for p in hogs:
        p.start()
    try:
        loaded = first_use(model, x)
        rows.append(row(f"first use, {args.hogs} CPU hogs beside it", loaded))
    finally:
        for p in hogs:
            p.terminate()
            p.join()
    old = measured.Paired(tuple(loaded["samples"][:5])) if loaded["samples"] else None
    old_rule = f"{old.median:.2f}x -> {'native' if old.median >= 1 else 'PyTorch'}" if old else "(settled at once)"

    # 3. Later processes on the quiet machine.
    for i in range(1, 6):
        measured.forget()  # (a new process: the choices read back from measured.json)
        c = first_use(model, x)
        rows.append(row(f"later process {i}, quiet", c))
        if c["settled"]:
            break
    final = measured.choices()[kind]
    converged = final["settled"] and final["use"] == (quiet.median >= 1.0)
    table = "\n".join(
        ["| stage | ratio (PyTorch time / native) | error (Z = 2) | state | stored choice |",
         "|---|---|---|---|---|", *rows]
    )  # fmt: skip
    text = (
        f"Kind: `{kind}`. Machine: {cpu_description()}, 2 threads.\n\n{table}\n\n"
        f"The former rule (5 rounds, kept at once) would have stored from the loaded measurement: {old_rule}. "
        f"Converged to the quiet machine's choice: {'yes' if converged else 'NO'}."
    )
    print(text)
    if args.write:
        command = "`.venv/bin/python benchmarks/measured_noise.py --write docs/benchmarks.md`"
        replace_section(args.write, HEADING, f"{HEADING}\n\n{__doc__.splitlines()[0]}\n\n{command}\n\n{text}\n")


def _attention_ratios(model: TransformerXLLM, x: torch.Tensor) -> tuple[float, ...]:
    """Paired rounds of the model's inference forward with the native attention against without it."""

    def with_native(on: bool):  # noqa: ANN202
        def run() -> None:
            with use_backends(native_attention=on, measured=False):
                model(x)

        return run

    return measured.paired(with_native(True), with_native(False), rounds=measured.ROUNDS * 2 - 1).ratios


if __name__ == "__main__":
    main()
