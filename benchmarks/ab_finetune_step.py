"""CPU speed of a fine-tuning step (txl finetune's: forward and backward of a batch of documents read in segments,
the memory carried) in two checkouts side by side, for short documents: 8 of 20-60 tokens, tgt_len 128, a
bench-char-sized classifier, 2 threads. Run it alternately for each tree and compare medians:

    git worktree add /tmp/old BASE
    for r in $(seq 4); do python benchmarks/ab_finetune_step.py /tmp/old/src old
                          python benchmarks/ab_finetune_step.py $PWD/src new; done
"""

import random
import statistics
import sys
import time

import torch

sys.path.insert(0, sys.argv[1])
from txl.model.modeling import TransformerXLConfig, TransformerXLForSequenceClassification
from txl.train import finetune

torch.set_num_threads(2)
torch.manual_seed(0)
random.seed(0)
cfg = TransformerXLConfig(
    n_token=204, d_model=256, d_embed=256, n_head=8, d_head=32, d_inner=1024, n_layer=6, mem_len=128, num_labels=2,
    dropout=0.1,
)  # fmt: skip
model = TransformerXLForSequenceClassification(cfg).train()
docs = [[random.randrange(1, 200) for _ in range(random.randint(20, 60))] for _ in range(8)]
try:
    ids, pad = finetune.batch_ids(docs)
except TypeError:  # (before: padded to whole segments of tgt_len)
    ids, pad = finetune.batch_ids(docs, 128)
times = []
for _ in range(12):
    start = time.perf_counter()
    finetune.document_logits(model, ids, pad, tgt_len=128, mem_len=128).sum().backward()
    times.append(time.perf_counter() - start)
print(f"{sys.argv[2]} positions {ids.shape[1]}: {statistics.median(times[2:]) * 1000:.1f} ms per step (median of 10)")
