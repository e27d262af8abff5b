#!/usr/bin/env bash
# Issue 12 fast start + issue 13 scaling on 4 GPUs (nvidia-h100-x4), one device call. Carry .whl_env.
# 1. random init of 0.5B and 7B shapes on d1f4t1 (bench_init, fresh processes, no compile cache);
# 2. command -> first finished RL iteration, `--preset pod --model qwen2.5-1.5b`, cold (empty compile cache) then
#    warm (the same cache), format warm-up off; 3. rollout of 2048 games on 4 GPUs and on 1 (current code).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source experiments/gpu_wheels.sh; install_wheels pgx svgwrite
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "=== init"; timeout 150 python3 experiments/bench_init.py --model qwen2.5-0.5b --model qwen2.5-7b --mesh d1f4t1 \
  --timeout 120 --out "$OUT/bench_init.json" 2>&1 | tail -8
POD="--preset pod --model qwen2.5-1.5b --steps 2 --eval-games 16 --format-warmup-steps 0 --wandb-mode disabled --progress false --checkpoint-every 0 --keep-checkpoints 0"
for run in cold warm; do
  echo "=== first iteration, $run"
  EARL_COMPILE_CACHE=/tmp/cc_pod timeout 200 python3 experiments/connect4.py $POD --run-dir /tmp/pod_$run > "$OUT/pod_$run.log" 2>&1
  grep -E "first RL iteration|iteration [0-9]/|model:|error|Error" "$OUT/pod_$run.log" | tail -8
done
echo "=== scaling"; export EARL_COMPILE_CACHE=/tmp/cc_scale
mkdir -p "$OUT/g4" "$OUT/g1"
timeout 130 python3 experiments/bench_agent_loop.py --gpu --cases gpu2048 --codes current --timeout 120 --out "$OUT/g4" 2>&1 | grep -E "gpu2048|speedup"
timeout 130 python3 experiments/bench_agent_loop.py --gpu --cases gpu2048 --codes current --timeout 120 --out "$OUT/g1" -- --devices 1 2>&1 | grep -E "gpu2048|speedup"
