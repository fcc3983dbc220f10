"""CPU speed of two checkouts side by side (before/after a change): cached evaluation (batch 8, tgt_len 128,
mem_len 640, the memory full), greedy generation (256 tokens, mem_len 640) and a training step (batch 8, tgt_len 128,
the memory carried, 256 to 640 over the timed steps, dropout 0.1 and dropatt 0.1, forward and backward) of a
bench-char-sized model, 2 threads. Run it alternately for each tree and compare medians:

    git worktree add /tmp/old BASE
    for r in $(seq 8); do python benchmarks/ab_cpu_inference.py /tmp/old/src old
                          python benchmarks/ab_cpu_inference.py src new; done
"""

import statistics
import sys
import time

import torch

sys.path.insert(0, sys.argv[1])
from txl import TransformerXLConfig, TransformerXLLM
from txl.infer.generation import generate
from txl.model.modeling import KVCache, transposed_weights

torch.set_num_threads(2)
torch.manual_seed(0)
cfg = TransformerXLConfig(
    n_token=204,
    d_model=256,
    d_embed=256,
    n_head=8,
    d_head=32,
    d_inner=1024,
    n_layer=6,
    mem_len=640,
    cutoffs=[],
    div_val=1,
)
m = TransformerXLLM(cfg).eval()
x = torch.randint(0, 204, (8, 128 * 14 + 1))
ev = []
with torch.no_grad(), transposed_weights():
    c = KVCache(cfg, 8, 640, 128)
    for i in range(13):
        t = time.perf_counter()
        float(m(x[:, i * 128 : (i + 1) * 128], x[:, i * 128 + 1 : (i + 1) * 128 + 1], cache=c, mem_len=640).loss)
        if i >= 6:
            ev.append(time.perf_counter() - t)
p = torch.randint(0, 204, (1, 128))
t = time.perf_counter()
generate(m, p, 256, temperature=0.0, mem_len=640)
g = time.perf_counter() - t
m.train()
for layer in m.transformer.layers:
    layer.attn.dropatt.p = 0.1
tr, mems = [], None
for i in range(8):
    t = time.perf_counter()
    out = m(x[:, i * 128 : (i + 1) * 128], x[:, i * 128 + 1 : (i + 1) * 128 + 1], mems=mems)
    out.loss.backward()
    mems = out.mems
    if i >= 2:
        tr.append(time.perf_counter() - t)
print(
    f"{sys.argv[2]} eval {8 * 128 / statistics.median(ev):,.0f} tok/s  gen {256 / g:,.1f} tok/s  "
    f"train {8 * 128 / statistics.median(tr):,.0f} tok/s"
)
