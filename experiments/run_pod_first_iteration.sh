#!/usr/bin/env bash
# Issue 12 on 4 GPUs (nvidia-h100-x4), one device call, after the train stage lost XLA's latency-hiding scheduler
# on multi-device GPU meshes (planner.stage_compiler_options). Carry .whl_env.
# 1. the train grad step's temp on d4f1t1 with the planner's options and with XLA's defaults (EARL_XLA_LHS=1);
# (SKIP_PROBE=1 skips step 1; the pod preset's --rollout-cache-growth 4 applies unless overridden after "$@")
# 2. command -> first finished RL iteration, `--preset pod --model qwen2.5-1.5b`, cold (empty compile cache),
#    then warm (the same cache).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source experiments/gpu_wheels.sh; install_wheels
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
if [[ "${SKIP_PROBE:-0}" != 1 ]]; then
echo "=== train grad step temp, 1.5B 4 layers, 16 rows x 2048 per device"
timeout 90 python3 experiments/probe_train_collectives.py d4f1t1 4 64 2048 > "$OUT/probe_planner.jsonl" 2>/dev/null
EARL_XLA_LHS=1 timeout 90 python3 experiments/probe_train_collectives.py d4f1t1 4 64 2048 > "$OUT/probe_xla_default.jsonl" 2>/dev/null
for f in probe_planner probe_xla_default; do python3 -c "import json,sys; d=json.loads(open(sys.argv[1]).readline()); print(sys.argv[2], d['mesh'], d['compiler_options'], 'temp GiB', round(d['temp_gib'], 2))" "$OUT/$f.jsonl" $f; done
fi
POD="--preset pod --model qwen2.5-1.5b --steps 2 --eval-games 16 --format-warmup-steps 0 --wandb-mode disabled --progress false --checkpoint-every 0 --keep-checkpoints 0"
for run in cold warm; do
  echo "=== first iteration, $run"
  EARL_COMPILE_CACHE=/tmp/cc_pod timeout 230 python3 experiments/connect4.py $POD "$@" --run-dir /tmp/pod_$run > "$OUT/pod_$run.log" 2>&1
  echo "rc=$?"; grep -E "first RL iteration|iteration [0-9]/|model:|out of memory|RESOURCE|Error" "$OUT/pod_$run.log" | tail -8
done
