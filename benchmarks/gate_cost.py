"""What deciding the fast paths costs per generated token: the time of the one-token step's gates (the policy, the
stock check, the check against the reference, the measurement's lookup), before and after a change.

Greedy generation of a bench-char-sized model (6 layers, d_model 256; mem_len 640, a 128-token prompt, 256 new
tokens, 2 threads). The gates are timed as what the one-token step spends outside the work it chooses: the time of
``decode_step`` less the model's step or the native call it runs (before the model handed its segment to
kernels/decode.py: ``one_token_step`` less its loop, plus ``native_loop`` less its call; the plan's lookup in
``_decode`` was not counted then, and is now). Run it alternately for each tree and compare medians:

    git worktree add /tmp/old BASE
    for r in $(seq 8); do python benchmarks/gate_cost.py /tmp/old/src old; python benchmarks/gate_cost.py src new; done
"""

import statistics
import sys
import time

import torch

sys.path.insert(0, sys.argv[1])
from txl import TransformerXLConfig, TransformerXLLM  # noqa: E402
from txl.infer.generation import generate  # noqa: E402
from txl.kernels import decode, native  # noqa: E402
from txl.model import transformer  # noqa: E402

torch.set_num_threads(2)
torch.manual_seed(0)
cfg = TransformerXLConfig(n_token=204, d_model=256, d_embed=256, n_head=8, d_head=32, d_inner=1024, n_layer=6,
                          mem_len=640, cutoffs=[], div_val=1)  # fmt: skip
model = TransformerXLLM(cfg).eval()
spent: dict[str, float] = {}


def timed(fn, key: str):  # noqa: ANN001, ANN201
    def run(*a, **k):  # noqa: ANN002, ANN003, ANN202
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[key] = spent.get(key, 0.0) + time.perf_counter() - t

    return run


def timed_gate(fn, loop_at: int, key: str):  # noqa: ANN001, ANN201
    """``fn`` timed as a whole (``key``), its Python-loop argument (at position ``loop_at``) as ``key`` work."""

    def run(*a, **k):  # noqa: ANN002, ANN003, ANN202
        a = list(a)
        a[loop_at] = timed(a[loop_at], key + " work")
        return timed(fn, key)(*a, **k)

    return run


if hasattr(decode, "one_token_step"):  # (the tree before the model handed its segment to kernels/decode.py)
    transformer.one_token_step = timed_gate(decode.one_token_step, 3, "step")  # (layers, kind, reference, loop, ...)
    transformer.native_loop = timed_gate(decode.native_loop, 7, "native")  # (plan, biases, h, pos, mask, cache, ...)
else:  # decode_step(model, segment, ...): the gates, around the model's step or the native call (the work)
    transformer.decode_step = timed(decode.decode_step, "step")
    transformer.TransformerXL.step = timed(transformer.TransformerXL.step, "step work")
native.decode_step = timed(native.decode_step, "native work" if hasattr(decode, "one_token_step") else "step work")


def gate_seconds() -> float:
    return sum(spent.get(k, 0.0) - spent.get(k + " work", 0.0) for k in ("step", "native"))


prompt = torch.randint(0, 204, (1, 128))
generate(model, prompt, 16, temperature=0.0, mem_len=640)  # (first use: checks and measurements)
gates, rates = [], []
for _ in range(3):
    spent.clear()
    t = time.perf_counter()
    generate(model, prompt, 256, temperature=0.0, mem_len=640)
    rates.append(256 / (time.perf_counter() - t))
    gates.append(gate_seconds() / 256)
print(f"{sys.argv[2]} gates {1e6 * statistics.median(gates):.1f} us/token  gen {statistics.median(rates):,.1f} tok/s")
