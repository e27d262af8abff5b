#!/usr/bin/env bash
# XLA compile-time flags on the pod job's cold start (issue 12), four variants side by side on nvidia-h100-x4, one
# GPU each (`--preset pod --model qwen2.5-1.5b --devices 1`, empty compile caches), STEPS iterations, so the
# compile-free iterations show what a flag costs at run time. VARIANTS: space-separated name=flags, flags joined by
# commas (they become XLA_FLAGS). Carry .whl_env.
#   VARIANTS="default= noauto=--xla_gpu_autotune_level=0 notriton=--xla_gpu_enable_triton_gemm=false" bash experiments/run_compile_flags_gpu.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source experiments/gpu_wheels.sh; install_wheels
export PYTHONPATH=$PYTHONPATH:.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
POD="--preset pod --model qwen2.5-1.5b --devices 1 --steps ${STEPS:-5} --eval-games 16 --format-warmup-steps 0 --wandb-mode disabled --progress false --checkpoint-every 0 --keep-checkpoints 0"
gpu=0
for spec in ${VARIANTS:?}; do
  name=${spec%%=*}; flags=${spec#*=}; flags=${flags//,/ }
  CUDA_VISIBLE_DEVICES=$gpu XLA_FLAGS="$flags" EARL_COMPILE_CACHE=/tmp/cc_$name timeout ${JOB_S:-330} \
    python3 experiments/connect4.py $POD --run-dir /tmp/flags_$name > "$OUT/flags_$name.log" 2>&1 &
  gpu=$((gpu + 1))
done
wait
for spec in $VARIANTS; do
  name=${spec%%=*}
  echo "=== $name: ${spec#*=}"
  grep -E "first RL iteration|iteration [0-9]/|evaluation: .*s$|Error|Unknown" "$OUT/flags_$name.log" | tail -9
  cp /tmp/flags_$name/metrics.jsonl "$OUT/flags_$name.jsonl" 2>/dev/null
done
