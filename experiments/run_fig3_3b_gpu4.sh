#!/usr/bin/env bash
# Fig. 3 at 3B on 4 GPUs (nvidia-h100-x4), one device call: does the best layout change with the context between
# the 1.5B shape (data parallel won every phase, fig_e2e_adaptivity) and the 7B shape (TP4 won every cell)?
# Rollout TP1 / TP2 / TP4, then the train stage, each measured and remeasured (the selector is scored on the second).
# A cell that runs longer than CELL_TIMEOUT seconds (a device out of memory can leave the other GPUs waiting in a
# collective forever: calls 57, 58, 61) ends its process with exit code 75; the script then goes on from the saved
# tables, the cell recorded "hung", until LIMIT seconds per stage are spent.
# CONTINUE=<table.json> (carried) goes on from a table an earlier call saved (t1_<stage>.json, or a figure JSON), for
# one stage; RETRY_HUNG=1 measures its hung cells once more (first run only: a cell that hangs again stays hung).
#   bash experiments/run_fig3_3b_gpu4.sh      # results (tables inside the JSON) and logs land in $OUT
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source experiments/gpu_wheels.sh; install_wheels
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
for stage in ${STAGES:-rollout train}; do
  budget=${BUDGET:-170}; [ "$stage" = train ] && budget=${TRAIN_BUDGET:-110}
  deadline=$(( SECONDS + ${LIMIT:-280} )); more=()
  if [ -n "${CONTINUE:-}" ]; then
    cp "$CONTINUE" "$OUT/t1_$stage.json"; more=(--continue-table "$OUT/t1_$stage.json")
    [ -n "${RETRY_HUNG:-}" ] && more+=(--retry-hung)
  fi
  while (( deadline - SECONDS > 30 )); do
    timeout "$(( deadline - SECONDS ))" python3 experiments/fig3_selector_heatmap.py --gpu4 --model qwen2.5-3b \
      --stage "$stage" --contexts "${CONTEXTS:-1K,32K,8K}" --responses 8 --remeasure --time-budget "$budget" \
      --remeasure-budget "$(( budget / 2 ))" --cell-timeout "${CELL_TIMEOUT:-240}" --no-progress --out "$OUT" \
      --save-table "$OUT/t1_$stage.json" --save-remeasure-table "$OUT/t2_$stage.json" "${more[@]}" 2>&1 \
      | grep -v -E "IOTA device assignment|not expected as JAX|Involuntary full rematerialization" \
      >> "$OUT/fig3_3b_$stage.log"
    rc=${PIPESTATUS[0]}; echo "$stage rc=$rc"
    (( rc == 75 )) || break  # 75: a cell hung and was left; anything else: done, cut by the limit, or an error
    more=(--continue-table "$OUT/t1_$stage.json")
  done
  tail -25 "$OUT/fig3_3b_$stage.log"
done
