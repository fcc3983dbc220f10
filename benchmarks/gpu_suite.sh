#!/usr/bin/env bash
# Every GPU check and benchmark of txl in one script, under 8 minutes on an H100 (run it whenever a GPU is at hand;
# what it printed goes to docs/benchmarks.md, "The paper's models on one GPU", and benchmarks/results/).
#
#   bash benchmarks/gpu_suite.sh [OUT]        # OUT: where logs and JSON go (default benchmarks/results)
#
# HF's TransfoXL rows need transformers 4.46.3 (with tokenizers 0.20.3 and huggingface_hub 0.26.5) importable: on a
# machine without network, carry their wheels in .whl/ (they are installed to /tmp/site first when present).
# 0. The fused Triton attention's tests on the GPU's compiled kernels (on the CPU they run under the interpreter).
# 1. The loss of 300 bf16 steps on the default path and with the fused attention against the fp32 reference path
#    (WT103 base, NVIDIA's configuration), in a fresh process: 20-step moving averages within 1%.
# 2. Training and evaluation tok/s, MFU and peak memory of the WT103 base model (bf16, fp32; txl's paths with and
#    without the fused attention, and HF's),
#    with profiles of txl's bf16 steps; evaluation with and without the graphs of segments, their losses compared.
# 3. The other paper models in bf16.
# 4. Generation as a CUDA graph against HF's generate().
# (The user's path, txl train and txl eval with the WT103 base recipe, is benchmarks/gpu_e2e.sh: ~2 more minutes.)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-benchmarks/results}"
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
cd benchmarks
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
(cd .. && TRITON_INTERPRET=0 TXL_TEST_DEVICE=cuda timeout 100 "$PY" -m pytest -q -p no:cacheprovider \
  tests/test_fused_attention.py 2>&1 | tail -25) | tee "$OUT/log_fused_tests.txt" || true
timeout 200 "$PY" gpu_paper.py --configs wt103-base-nvidia --budget 0 --track 300 \
  --track_variants txl:bf16 txl-fused:bf16 --json "$OUT/gpu_track_run.json" 2>&1 | tee "$OUT/log_track.txt"
# (then 40 steps of the loss comparison in the same process, after the rows: on 2026-11-26 such a comparison, run
# after the rows' variants had compiled their graphs, gave a 5.1% gap where a fresh process gives 0.5%: watch its
# "first losses" line; see docs/benchmarks.md)
timeout 240 "$PY" gpu_paper.py --configs wt103-base-nvidia --precisions bf16 fp32 \
  --impls txl txl-eager txl-reference txl-no-graphs txl-fused txl-fused-eager hf --profile "$OUT" --json "$OUT/gpu.json" \
  --track 40 --track_variants txl:bf16 2>&1 | tee "$OUT/log_base.txt"
timeout 120 "$PY" gpu_paper.py --configs wt103-large enwik8-base enwik8-large --precisions bf16 \
  --impls txl txl-fused hf --json "$OUT/gpu.json" --append 2>&1 | tee "$OUT/log_others.txt"
timeout 50 "$PY" gpu_generation.py --repeats 3 2>&1 | tee "$OUT/log_generation.txt" || true
