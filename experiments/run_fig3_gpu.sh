#!/usr/bin/env bash
# Fig. 3 on two GPUs (nvidia-h100-x2 / nvidia-h200-x2), one device call: Qwen2.5-0.5B rollout, TP1 vs TP2,
# measured, then remeasured (the selector picks from the first table and is scored on the second).
# Results land in $OUT and are copied into experiments/results/ by hand.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
{
  nvidia-smi --query-gpu=name,memory.total --format=csv
  timeout 570 python3 experiments/fig3_selector_heatmap.py --gpu --remeasure --no-progress --out "$OUT" "$@" \
    --name fig3_qwen2.5-0.5b_rollout_tp1_tp2_gpu
} 2>&1 | grep -v -E "IOTA device assignment|not expected as JAX" | tee "$OUT/fig3_gpu.log"
