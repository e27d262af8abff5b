#!/usr/bin/env bash
# Fig. 3 at 3B on 4 GPUs (nvidia-h100-x4), one device call: does the best layout change with the context between
# the 1.5B shape (data parallel won every phase, fig_e2e_adaptivity) and the 7B shape (TP4 won every cell)?
# Rollout TP1 / TP2 / TP4, then the train stage, each measured and remeasured (the selector is scored on the second).
#   bash experiments/run_fig3_3b_gpu4.sh      # results (tables inside the JSON) and logs land in $OUT
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source experiments/gpu_wheels.sh; install_wheels
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
for stage in ${STAGES:-rollout train}; do
  budget=${BUDGET:-170}; [ "$stage" = train ] && budget=${TRAIN_BUDGET:-110}
  timeout "${LIMIT:-280}" python3 experiments/fig3_selector_heatmap.py --gpu4 --model qwen2.5-3b --stage "$stage" \
    --contexts "${CONTEXTS:-1K,32K,8K}" --responses 8 --remeasure --time-budget "$budget" \
    --remeasure-budget "$(( budget / 2 ))" --no-progress --out "$OUT" \
    --save-table "$OUT/t1_$stage.json" 2>&1 \
    | grep -v -E "IOTA device assignment|not expected as JAX" > "$OUT/fig3_3b_$stage.log"
  echo "$stage rc=${PIPESTATUS[0]}"; tail -25 "$OUT/fig3_3b_$stage.log"
done
