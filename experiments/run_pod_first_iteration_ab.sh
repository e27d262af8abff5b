#!/usr/bin/env bash
# Issue 12's pod cold start on 4 GPUs (nvidia-h100-x4), versions side by side in one device call: each run is
# `connect4.py --preset pod --model qwen2.5-1.5b --steps 2` from its own empty compile cache, one after the other.
#   RUNS="base:.baseline:190 head:.:220 nocompact:.:150:--compact-finished=false" bash experiments/run_pod_first_iteration_ab.sh
# RUNS: space-separated name:dir:timeout_s[:extra flags, comma-separated[:env settings, comma-separated]]; STEPS
# iterations (2); EVAL_GAMES games in the evaluation before iteration 1 (64 by default, the preset's own: the batch of
# its first training rollout, whose decode programs the evaluation then compiles; calls 46-55 used 16);
# a baseline commit checked out at .baseline
# (git archive COMMIT | tar -x -C .baseline; carry it and .whl_env). Logs and metrics.jsonl come back under $OUT.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source experiments/gpu_wheels.sh; install_wheels
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
POD="--preset pod --model qwen2.5-1.5b --steps ${STEPS:-2} --eval-games ${EVAL_GAMES:-64} --format-warmup-steps 0 --wandb-mode disabled --progress false --checkpoint-every 0 --keep-checkpoints 0"
ROOT=$(pwd)
for spec in ${RUNS:?}; do
  IFS=: read -r name dir limit flags envs <<< "$spec"
  flags=${flags//,/ }; envs=${envs//,/ }
  echo "=== $name ($dir, ${limit}s, flags: ${flags:-none}, env: ${envs:-none})"
  start=$(date +%s)
  (cd "$dir" && EARL_COMPILE_CACHE=/tmp/cc_$name PYTHONPATH=/tmp/site:. env $envs timeout "$limit" python3 experiments/connect4.py \
     $POD $flags --run-dir /tmp/pod_$name) > "$OUT/pod_$name.log" 2>&1
  echo "rc=$? wall $(( $(date +%s) - start )) s"
  grep -E "first RL iteration|iteration [0-9]+/|out of memory|RESOURCE|Error" "$OUT/pod_$name.log" | tail -12
  cp /tmp/pod_$name/metrics.jsonl "$OUT/pod_$name.jsonl" 2>/dev/null
done
