#!/usr/bin/env bash
# The user's path on a GPU, end to end: `txl train --config configs/wt103_base.yaml` (300 steps; the recipe's
# precision: auto -> bf16 and the compiled layers on CUDA, as its log says), then `txl eval` of the checkpoint with
# the recipe's evaluation settings (tgt_len 64, mem_len 640, clamp_len 400, same_length) in bf16 and fp32, on a
# synthetic corpus in WikiText-103's layout (benchmarks/synthetic_corpus.py: nothing downloaded). ~2 minutes on an
# H200. What it printed goes to docs/benchmarks.md ("The user's path on a GPU").
#
#   bash benchmarks/gpu_e2e.sh            # E2E_SMALL=1: a CPU smoke run of the same commands (a small model)
#   E2E_FAST_PATHS='{fused_attention_training: [cuda]}' bash benchmarks/gpu_e2e.sh   # the run with a changed policy
#
# On a machine without network, carry the wheels of txl's pure-Python dependencies in .whl2/ (and tokenizers' in
# .whl/): they are installed to /tmp/site first when present.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! $PY -c "import jsonargparse, safetensors, tokenizers" 2>/dev/null && compgen -G ".whl2/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl2/*.whl .whl/tokenizers*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
WORK="${E2E_DIR:-/tmp/txl_e2e}"
if [ "${E2E_SMALL:-0}" = 1 ]; then
  $PY benchmarks/synthetic_corpus.py "$WORK/wt" --words 3000 --train 30000 --valid 5000
  EXTRA=(--model.n_layer 2 --model.d_model 32 --model.n_head 2 --model.d_head 16 --model.d_inner 64
         --model.cutoffs "[500,1000,2000]" --train.batch_size 4)
  STEPS=6
else
  $PY benchmarks/synthetic_corpus.py "$WORK/wt"
  EXTRA=()
  STEPS=300
fi
if [ -n "${E2E_FAST_PATHS:-}" ]; then EXTRA+=(--train.fast_paths "$E2E_FAST_PATHS"); fi
rm -rf "$WORK/run"
T0=$(date +%s)
timeout 300 $PY -m txl train --config configs/wt103_base.yaml --data.path "$WORK/wt" "${EXTRA[@]}" \
  --train.max_steps $STEPS --train.log_interval 50 --train.eval_interval $STEPS --train.eval_max_steps 20 \
  --train.checkpoint_interval $STEPS --run_dir "$WORK/run" 2>&1 | grep -v Warning | tail -30
echo "train: $(( $(date +%s) - T0 )) s"
for p in bf16 fp32; do
  T0=$(date +%s)
  timeout 120 $PY -m txl eval --model "$WORK/run" --split valid --precision $p 2>&1 | grep -v Warning | tail -3
  echo "eval $p: $(( $(date +%s) - T0 )) s (with the process's start)"
done
